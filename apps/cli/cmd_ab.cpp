// `xfbench ab`: interleaved A/B timing of two builds, two parameter sets or two models, point by
// point in alternating A B | B A rounds, decided on the paired per-round ratios (apps/bench/ab.hpp).
#include <cstdio>

#include "apps/bench/ab.hpp"
#include "apps/bench/child_process.hpp"
#include "apps/bench/sweep.hpp"
#include "apps/cli/commands.hpp"
#include "apps/report/compare.hpp"
#include "apps/report/files.hpp"
#include "apps/report/report.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {

struct AbOptions {
  std::shared_ptr<PointOptions> point = std::make_shared<PointOptions>();
  SelectionOptions selection{.models = "", .exclude = "", .seq_lens = "512,1024,2048"};
  std::string max_slowdown = "5%";
  std::string format = "text";
  std::string out;
  AbSettings settings;
};

int run(AbOptions& o) {
  auto& s = o.settings;
  fill_point_grid(*o.point, o.selection, s);
  s.max_slowdown = parse_fraction(o.max_slowdown, "--max-slowdown");
  if (!s.b.model.empty() && s.models.size() != 1) throw InputError("--b-model needs exactly one model in --models");
  if (o.out == "-") throw InputError("--out -: ab prints its table on standard output (--format json prints JSON)");
  // The binaries the sides run are inputs too: --out must not replace one of them.
  if (!o.out.empty())
    check_output_path(o.out, {self_path(), s.a.program.empty() ? self_path() : s.a.program,
                              s.b.program.empty() ? self_path() : s.b.program});
  const AbReport report = run_ab(s, command_line());
  const AbFormat format = o.format == "md"                 ? AbFormat::Markdown
                          : o.format == "json"             ? AbFormat::Json
                          : o.format == "github-benchmark" ? AbFormat::GithubBenchmark
                          : o.format == "bmf"              ? AbFormat::Bencher
                                                           : AbFormat::Text;
  if (!o.out.empty()) write_file_atomically(o.out, ab_to_json(report).dump(2) + "\n");
  std::printf("%s", render_ab(report, format).c_str());
  if (format == AbFormat::GithubBenchmark || format == AbFormat::Bencher) {
    AbDashboardOmissions omitted;
    ab_dashboard_entries(report, &omitted);
    if (omitted.noisy + omitted.error > 0)
      std::fprintf(stderr, "xfbench: note: %s\n", ab_omission_note(omitted).c_str());
  }
  return ab_regressions(report) > 0 ? kExitCheckFailed : kExitOk;
}

}  // namespace

void add_ab(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("ab", "interleaved A/B timing of two builds, parameter sets or models");
  auto o = std::make_shared<AbOptions>();
  o->point->defaults.timing.min_time_s = 0.1;
  o->point->defaults.problem.threads = DnnlContext::default_threads();
  o->settings.a.label = "A";
  o->settings.b.label = "B";
  add_selection_options(*command, o->selection);
  add_point_options(*command, o->point, FieldUse::Point);
  command->add_option("--a-bin", o->settings.a.program, "xfbench binary of side A (default: this one)");
  command->add_option("--b-bin", o->settings.b.program, "xfbench binary of side B (default: this one)");
  command->add_option("--a-param", o->settings.a.params, "key=value for side A only (repeatable)");
  command->add_option("--b-param", o->settings.b.params, "key=value for side B only (repeatable)");
  command->add_option("--b-model", o->settings.b.model, "model of side B (with one model in --models)");
  for (auto* side : {&o->settings.a, &o->settings.b})
    command
        ->add_option(side == &o->settings.a ? "--a-dtype" : "--b-dtype", side->dtype,
                     std::string("element type of side ") + (side == &o->settings.a ? "A" : "B") +
                         " only, f32 or bf16 (issue 31's interleaved f32-against-bf16 timing)")
        ->check(CLI::IsMember({"f32", "bf16"}));
  add_integer_option(*command, "--rounds", o->settings.rounds, 2, static_cast<std::int64_t>(kExactSignedRankMax),
                     "A B | B A rounds per point");
  add_real_option(*command, "--alpha", o->settings.alpha, 1e-9, 0.999, "1 − confidence of the ratio's interval");
  command->add_option("--max-slowdown", o->max_slowdown, "smallest ratio change that is a verdict (5% or 0.05)")
      ->capture_default_str();
  add_real_option(*command, "--timeout", o->settings.timeout_s, 0.001, 1e7, "seconds per child run");
  command->add_option("--format", o->format, "text | md | json | github-benchmark | bmf")
      ->check(CLI::IsMember({"text", "md", "json", "github-benchmark", "bmf"}))
      ->capture_default_str();
  command->add_option("--out,-o", o->out, "also write the JSON result here");
  command->callback([o, &action] { action = [o] { return run(*o); }; });
}

}  // namespace xfb::cli
