// `xfbench sweep`: models × sequence lengths, each point in a child process, JSON report
// rewritten atomically after every point, table printed at the end. `--shard i/n` runs one part
// of the points; `--preset NAME` fills in a published configuration (options given explicitly win).
#include <cstdio>
#include <tuple>

#include <spdlog/spdlog.h>

#include "apps/commands.hpp"
#include "lib/bench/presets.hpp"
#include "lib/bench/sweep.hpp"
#include "lib/core/errors.hpp"
#include "lib/report/table.hpp"

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
  std::string shard;
  std::string preset;
};

// Fills every preset value the user did not give on the command line.
void apply_preset(const CLI::App& command, SweepOptions& o) {
  const SweepPreset* preset = find_preset(o.preset);
  if (preset == nullptr) throw InputError("unknown --preset '" + o.preset + "' (known: lra)");
  auto given = [&](const char* name) { return command.count(name) > 0; };
  auto& point = o.problem.point;
  if (!given("--models")) {
    o.models.clear();
    for (const auto& m : preset->models) o.models += (o.models.empty() ? "" : ",") + m;
  }
  if (!given("--seq-lens")) {
    o.seq_lens.clear();
    for (auto n : preset->seq_lens) o.seq_lens += (o.seq_lens.empty() ? "" : ",") + std::to_string(n);
  }
  if (!given("--scope")) o.problem.scope = preset->scope;
  if (!given("--batch")) point.problem.batch = preset->batch;
  if (!given("--heads")) point.problem.heads = preset->heads;
  if (!given("--head-dim")) point.problem.head_dim = preset->head_dim;
  if (!given("--d-ff")) point.d_ff = preset->d_ff;
  auto params = preset_params(*preset, parse_model_selection(o.models));
  params.insert(params.end(), o.problem.params.begin(), o.problem.params.end());
  o.problem.params = params;
  o.settings.preset = preset->name;
}

int run(const CLI::App& command, SweepOptions& o) {
  if (!o.preset.empty()) apply_preset(command, o);
  auto& s = o.settings;
  fill_point_grid(o.problem, o.models, o.seq_lens, s);
  if (!o.shard.empty()) std::tie(s.shard_index, s.shard_count) = parse_shard(o.shard);
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
  command->add_option("--shard", o->shard, "run shard i of n (1-based, e.g. 2/4); join the parts with `xfbench merge`");
  command->add_option("--preset", o->preset, "lra: Long Range Arena's efficiency configuration (see docs/lra.md)");
  command->callback([o, command, &action] { action = [o, command] { return run(*command, *o); }; });
}

}  // namespace xfb::cli
