// `xfbench sweep`: models × sequence lengths, each point in a child process, JSON report
// rewritten atomically after every point, table printed at the end.
#include <cstdio>

#include <spdlog/spdlog.h>

#include "apps/commands.hpp"
#include "lib/errors.hpp"
#include "lib/sweep.hpp"
#include "lib/table.hpp"

namespace xfb::cli {
namespace {

struct SweepOptions {
  ProblemOptions problem;
  std::string models = "all";
  std::string seq_lens = "512:4096:x2";
  double memory_limit_gib = 0;
  SweepSettings settings;
  bool no_measure = false;
  bool no_table = false;
};

int run(SweepOptions& o) {
  finish_problem_options(o.problem);
  auto& s = o.settings;
  s.models = parse_model_selection(o.models);
  s.seq_lens = parse_seq_lens(o.seq_lens);
  s.base = o.problem.point;
  s.base.params.clear();
  s.params = o.problem.params;
  if (o.memory_limit_gib < 0) throw InputError("--memory-limit must not be negative");
  if (s.timeout_s <= 0) throw InputError("--timeout must be positive");
  s.memory_limit_bytes = static_cast<std::int64_t>(o.memory_limit_gib * 1024.0 * 1024.0 * 1024.0);
  s.measure_machine = !o.no_measure;
  if (!optimised_build()) spdlog::warn("this build is not optimised: times are not representative");
  const Report report = run_sweep(s, command_line());
  if (!o.no_table) std::printf("%s", render_table(report, {}).c_str());
  std::fprintf(stderr, "report written to %s\n", s.out_path.c_str());
  return kExitOk;
}

}  // namespace

void add_sweep(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("sweep", "run a sequence-length sweep over models into a JSON report");
  auto o = std::make_shared<SweepOptions>();
  command->add_option("--models", o->models, "all | class:<class> | a,b,c")->capture_default_str();
  command->add_option("--seq-lens", o->seq_lens, "a,b,c | lo:hi:xK | lo:hi:+K")->capture_default_str();
  add_problem_options(*command, o->problem);
  command->add_option("--timeout", o->settings.timeout_s, "seconds per point before it is killed")->capture_default_str();
  command->add_option("--memory-limit", o->memory_limit_gib,
                      "GiB; points whose estimated tracked memory exceeds it are skipped (0: none)");
  command->add_option("--out,-o", o->settings.out_path, "report file (JSON)")->required();
  command->add_flag("--resume", o->settings.resume, "keep the finished points of an existing --out report");
  command->add_flag("--no-measure", o->no_measure, "do not measure FMA peak and bandwidth for the context");
  command->add_flag("--no-table", o->no_table, "do not print the table at the end");
  command->callback([o, &action] { action = [o] { return run(*o); }; });
}

}  // namespace xfb::cli
