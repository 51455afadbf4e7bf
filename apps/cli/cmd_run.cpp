// `xfbench run`: one point in this process; `--json` prints the report row (the sweep's child
// protocol), `--dump DIR` writes inputs, output and parameters as .npy with a manifest.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <optional>

#include <spdlog/spdlog.h>

#include "apps/bench/point.hpp"
#include "apps/bench/system_info.hpp"
#include "apps/cli/commands.hpp"
#include "apps/report/json_fields.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {

struct RunOptions {
  std::shared_ptr<PointOptions> point = std::make_shared<PointOptions>();
  std::string point_json;        // --point: the whole point as JSON (the sweep's child protocol)
  double memory_limit_gib = -1;  // < 0: the memory available
  bool json = false;
  std::string dump_dir;
  Point resolved;  // resolved once, when the command line is parsed
};

// The point of the command line: --point's JSON, or --model, --seq-len and the other point options.
PointConfig point_config(const RunOptions& o) {
  if (o.point_json.empty()) {
    if (!o.point->given("model")) throw InputError("run needs --model (or --point)");
    if (!o.point->given("seq_len")) throw InputError("run needs --seq-len (or --point)");
    return point_of(*o.point);
  }
  if (!o.point->texts.empty())
    throw InputError("--point holds the whole point: give no other point option (" + o.point->texts.begin()->first +
                     ")");
  return point_from_json(parse_json_text(o.point_json, "--point"));
}

// The point's estimated tracked bytes against --memory-limit (default: the memory available), before
// anything is allocated.
void check_memory(const Point& point, double limit_gib) {
  const double limit = limit_gib < 0 ? static_cast<double>(available_memory_bytes()) : limit_gib * 1073741824.0;
  // describe_point's rule, the one sweep --memory-limit skips by: the estimate against the limit.
  const ResultRow row = describe_point(point, static_cast<std::int64_t>(std::min(limit, 9.0e18)));
  if (row.status == Status::Skipped)
    throw InputError("the point's " + row.reason +
                     (limit_gib < 0 ? " (the memory available; --memory-limit 0 runs it anyway)" : ""));
}

void print_human(const ResultRow& row) {
  std::printf("model      %s (%s, %s pass, %s%s)\n", row.model.c_str(), scope_name(row.scope).c_str(),
              pass_name(row.pass).c_str(), row.causal ? "causal" : "non-causal",
              row.params.empty() ? "" : (", " + row.params.dump()).c_str());
  std::printf("shape      B=%lld H=%lld N=%lld D=%lld", static_cast<long long>(row.batch),
              static_cast<long long>(row.heads), static_cast<long long>(row.seq_len),
              static_cast<long long>(row.head_dim));
  if (row.out_len > 0 && row.out_len != row.seq_len)  // a downsampling model
    std::printf(", output M=%lld rows", static_cast<long long>(row.out_len));
  std::printf("\n");
  std::printf("status     %s%s%s\n", status_name(row.status).c_str(), row.reason.empty() ? "" : ": ",
              row.reason.c_str());
  if (row.status == Status::Ok) {
    // Decode rows time one generated token: µs.
    const bool decode = row.pass == Pass::Decode;
    const double unit = decode ? 1e-3 : 1e-6;
    std::printf("median     %.3f %s%s  (min %.3f, max %.3f, MAD %.3f, CV %.1f%%%s, %zu samples)\n",
                row.median_ns * unit, decode ? "µs" : "ms", decode ? " per token" : "", row.min_ns * unit,
                row.max_ns * unit, row.mad_ns * unit, row.cv * 100, row.unstable ? ", UNSTABLE" : "",
                row.samples_ns.size());
    std::printf("contention %lld descheduled sample(s) re-measured, on-CPU ratio %.2f, host busy %.0f%%, load %.2f%s\n",
                static_cast<long long>(row.contended_samples), row.cpu_ratio, 100 * row.host_busy, row.load_average,
                row.contended ? ", CONTENDED" : "");
    std::printf("work       %.3f GFLOP executed, %.1f GFLOP/s, %.0f tokens/s\n", static_cast<double>(row.flops) * 1e-9,
                row.gflops_per_s, row.tokens_per_s);
    for (const auto& [stage, ns] : row.stage_median_ns)
      std::printf("stage      %-8s %.3f ms median (%.0f%% of the median call)\n", stage.c_str(), ns * 1e-6,
                  row.median_ns > 0 ? 100.0 * ns / row.median_ns : 0.0);
    std::printf("memory     peak tracked %.2f MiB (workspace %.2f MiB, estimate %.2f MiB), peak RSS %.1f MiB\n",
                static_cast<double>(row.peak_tensor_bytes) / 1048576.0,
                static_cast<double>(row.workspace_bytes) / 1048576.0,
                static_cast<double>(row.estimated_workspace_bytes) / 1048576.0,
                static_cast<double>(row.peak_rss_bytes) / 1048576.0);
    if (row.pass == Pass::Decode)
      std::printf(
          "decode     %lld tokens after the context: median is per token; prefill %.3f ms median; state %.3f MiB\n",
          static_cast<long long>(row.decode_tokens), row.prefill_ns * 1e-6,
          static_cast<double>(row.state_bytes) / 1048576.0);
    else if (row.pass != Pass::Forward)
      std::printf("saved      %.2f MiB kept by the forward for the backward\n",
                  static_cast<double>(row.saved_bytes) / 1048576.0);
    if (!row.gradient_note.empty()) std::printf("gradient   %s\n", row.gradient_note.c_str());
  }
  for (const auto& warning : row.warnings) std::printf("warning    %s\n", warning.c_str());
  std::printf("reproduce  %s\n", row.reproducer.c_str());
}

// --dump names a new folder, or an empty one, in a folder that exists.
void check_dump_folder(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code error;
  const auto parent = fs::absolute(dir, error).lexically_normal().parent_path();
  if (error || !fs::is_directory(parent, error))
    throw InputError("--dump " + dir + ": the folder " + parent.string() + " does not exist");
  const auto status = fs::symlink_status(dir, error);
  if (!fs::exists(status)) return;
  if (fs::is_symlink(status))  // the finished dump is renamed onto the path, which a link is not
    throw InputError("--dump " + dir + " is a symbolic link; name a new folder");
  if (!fs::is_directory(status) || !fs::is_empty(dir, error) || error)
    throw InputError("--dump " + dir + " exists and is not an empty folder; name a new one");
}

int run(RunOptions& o) {
  const Point& point = o.resolved;
  check_memory(point, o.memory_limit_gib);
  std::optional<std::string> dump;
  if (!o.dump_dir.empty()) {
    check_dump_folder(o.dump_dir);
    dump = o.dump_dir;  // created by run_point when the point runs: an unsupported one writes nothing
  }
  ResultRow row;
  try {
    row = run_point(point, dump);
  } catch (const InputError&) {
    throw;
  } catch (const std::bad_alloc&) {
    row = describe_point(point);
    row.status = Status::Error;
    row.reason = "out of memory: an allocation failed";
  } catch (const std::exception& e) {
    row = describe_point(point);
    row.status = Status::Error;
    row.reason = e.what();
  }
  if (!optimised_build()) spdlog::warn("this build is not optimised: times are not representative");
  if (row.contended) spdlog::warn("{}", contended_warning(row));
  if (o.json) {
    std::printf("%s\n", nlohmann::json(row).dump().c_str());
  } else {
    print_human(row);
    // The row holds the reason; stderr says it too, on one line (the JSON protocol's caller reads the row).
    if (row.status == Status::Error) {
      std::string reason = row.reason;
      std::replace(reason.begin(), reason.end(), '\n', ' ');
      std::fprintf(stderr, "xfbench: runtime error: %s\n", reason.c_str());
    }
  }
  return row.status == Status::Error ? kExitRuntime : kExitOk;
}

}  // namespace

void add_run(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("run", "run one point and print its measurements");
  auto options = std::make_shared<RunOptions>();
  options->point->defaults.problem.threads = DnnlContext::default_threads();
  add_point_options(*command, options->point, FieldUse::RunOnly);
  command->add_option("--point", options->point_json,
                      "the whole point as JSON, the sweep's child protocol "
                      "(docs/cli.md#run)");
  add_real_option(*command, "--memory-limit", options->memory_limit_gib, 0, 1 << 30,
                  "GiB; refuse the point when its estimated tracked memory exceeds it (0: no check; "
                  "default: the memory available)");
  command->add_flag("--json", options->json, "print the report row as JSON");
  command->add_option("--dump", options->dump_dir, "write q/k/v/out/parameters .npy files and manifest.json here")
      ->check(kNonEmpty);
  command->callback([options, &action] {
    options->resolved = resolve_point(point_config(*options));
    action = [options] { return run(*options); };
  });
}

}  // namespace xfb::cli
