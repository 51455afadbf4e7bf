// `xfbench sweep`: models × sequence lengths, each point in a child process, JSON report
// rewritten atomically after every point, table printed at the end. `--shard i/n` runs one part
// of the points; `--preset NAME` fills in a published configuration (options given explicitly win).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <tuple>

#include <spdlog/spdlog.h>

#include "apps/bench/presets.hpp"
#include "apps/bench/sweep.hpp"
#include "apps/cli/commands.hpp"
#include "apps/report/table.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {

struct SweepOptions {
  std::shared_ptr<PointOptions> point = std::make_shared<PointOptions>();
  bool fail_on_error = false;
  SelectionOptions selection{.models = "all", .exclude = "", .seq_lens = "512:4096:x2"};
  double memory_limit_gib = 0;
  SweepSettings settings;
  bool no_measure = false;
  bool no_table = false;
  bool dry_run = false;
  std::string shard;
  std::string preset;
};

// A preset's values become the defaults (options given explicitly win); its parameters come before
// the user's.
void apply_preset(const CLI::App& command, SweepOptions& o, std::vector<std::string>& from_preset) {
  const SweepPreset* preset = find_preset(o.preset);
  if (preset == nullptr) throw InputError("unknown --preset '" + o.preset + "' (known: lra)");
  if (command.count("--models") == 0) {
    o.selection.models.clear();
    for (const auto& m : preset->models) o.selection.models += (o.selection.models.empty() ? "" : ",") + m;
  }
  if (command.count("--seq-lens") == 0) {
    o.selection.seq_lens.clear();
    for (auto n : preset->seq_lens)
      o.selection.seq_lens += (o.selection.seq_lens.empty() ? "" : ",") + std::to_string(n);
  }
  auto& defaults = o.point->defaults;
  defaults.scope = parse_scope(preset->scope);
  defaults.problem.batch = preset->batch;
  defaults.problem.heads = preset->heads;
  defaults.problem.head_dim = preset->head_dim;
  defaults.d_ff = preset->d_ff;
  // A parameter the user sets (model.key= or key=) replaces the preset's.
  const auto given = o.point->texts.count("params") ? o.point->texts.at("params") : std::vector<std::string>{};
  for (const auto& param : preset_params(*preset, parse_model_selection(o.selection.models, o.selection.exclude))) {
    const std::string qualified = param.substr(0, param.find('=') + 1);
    const std::string bare = qualified.substr(qualified.find('.') + 1);
    const bool overridden = std::any_of(given.begin(), given.end(), [&](const std::string& g) {
      return g.rfind(qualified, 0) == 0 || g.rfind(bare, 0) == 0;
    });
    if (!overridden) from_preset.push_back(param);
  }
  o.settings.preset = preset->name;
}

// Exit status of a finished sweep: 3 when no point ran to `ok` although some were to run, 1 with
// --fail-on-error when any point failed.
int sweep_status(const Report& report, bool fail_on_error) {
  std::size_t ok = 0, errors = 0;
  for (const auto& row : report.results) {
    ok += row.status == Status::Ok;
    errors += row.status == Status::Error;
  }
  if (ok == 0 && errors > 0) {
    std::fprintf(stderr, "xfbench: error: no point of the sweep succeeded (%zu failed)\n", errors);
    return kExitRuntime;
  }
  if (fail_on_error && errors > 0) {
    std::fprintf(stderr, "xfbench: error: %zu point(s) failed (--fail-on-error)\n", errors);
    return kExitCheckFailed;
  }
  return kExitOk;
}

int run(const CLI::App& command, SweepOptions& o) {
  std::vector<std::string> from_preset;
  if (!o.preset.empty()) apply_preset(command, o, from_preset);
  auto& s = o.settings;
  fill_point_grid(*o.point, o.selection, s);
  s.params.insert(s.params.begin(), from_preset.begin(), from_preset.end());
  if (!o.shard.empty()) std::tie(s.shard_index, s.shard_count) = parse_shard(o.shard);
  s.memory_limit_bytes = static_cast<std::int64_t>(o.memory_limit_gib * 1073741824.0);
  s.measure_machine = !o.no_measure;
  s.progress = spdlog::should_log(spdlog::level::info);  // -q silences it
  s.colour = isatty(fileno(stderr)) != 0 && std::getenv("NO_COLOR") == nullptr;
  if (o.dry_run) {
    std::printf("%s", render_dry_run(s).c_str());
    return kExitOk;
  }
  if (s.out_path.empty()) throw InputError("--out is required (or --dry-run)");
  if (!optimised_build()) spdlog::warn("this build is not optimised: times are not representative");
  const Report report = run_sweep(s, command_line());
  if (!o.no_table) std::printf("%s", render_table(report, {}).c_str());
  spdlog::info("report written to {}", s.out_path);
  return sweep_status(report, o.fail_on_error);
}

}  // namespace

void add_sweep(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("sweep", "run a sequence-length sweep over models into a JSON report");
  auto o = std::make_shared<SweepOptions>();
  add_selection_options(*command, o->selection);
  o->point->defaults.problem.threads = DnnlContext::default_threads();
  add_point_options(*command, o->point, FieldUse::Point);
  add_real_option(*command, "--timeout", o->settings.timeout_s, 0.001, 1e7, "seconds per point before it is killed");
  add_real_option(*command, "--memory-limit", o->memory_limit_gib, 0, 1 << 30,
                  "GiB; points whose estimated tracked memory exceeds it are skipped (0: none)");
  command->add_flag("--fail-on-error", o->fail_on_error, "exit 1 when any point failed (error rows), for CI");
  command->add_option("--out,-o", o->settings.out_path, "report file (JSON); required unless --dry-run");
  command->add_flag("--dry-run", o->dry_run,
                    "list the points, their estimated memory and FLOPs and which would be skipped; run none");
  command->add_flag("--resume", o->settings.resume, "keep the finished points of an existing --out report");
  command->add_flag("--retry-errors", o->settings.retry_errors,
                    "with --resume: run again the points that ended in an error (a timeout, a crash)");
  command->add_flag("--no-measure", o->no_measure, "do not measure FMA peak and bandwidth for the context");
  command->add_flag("--no-table", o->no_table, "do not print the table at the end");
  command->add_option("--shard", o->shard, "run shard i of n (1-based, e.g. 2/4); join the parts with `xfbench merge`");
  command->add_option("--preset", o->preset, "lra: Long Range Arena's efficiency configuration (see docs/lra.md)")
      ->check(kNonEmpty);
  command->callback([o, command, &action] { action = [o, command] { return run(*command, *o); }; });
}

}  // namespace xfb::cli
