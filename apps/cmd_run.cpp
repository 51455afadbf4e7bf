// `xfbench run`: one point in this process; `--json` prints the report row (the sweep's child
// protocol), `--dump DIR` writes inputs, output and parameters as .npy with a manifest.
#include <cstdio>
#include <filesystem>
#include <optional>

#include <spdlog/spdlog.h>

#include "apps/commands.hpp"
#include "lib/bench/point.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {

struct RunOptions {
  ProblemOptions problem;
  bool json = false;
  std::string dump_dir;
};

void print_human(const ResultRow& row) {
  std::printf("model      %s (%s, %s pass, %s%s)\n", row.model.c_str(), row.scope.c_str(), row.pass.c_str(),
              row.causal ? "causal" : "non-causal",
              row.params.empty() ? "" : (", " + row.params.dump()).c_str());
  std::printf("shape      B=%lld H=%lld N=%lld D=%lld\n", static_cast<long long>(row.batch),
              static_cast<long long>(row.heads), static_cast<long long>(row.seq_len),
              static_cast<long long>(row.head_dim));
  std::printf("status     %s%s%s\n", status_name(row.status).c_str(), row.reason.empty() ? "" : ": ", row.reason.c_str());
  if (row.status == Status::Ok) {
    // Decode rows time one generated token: µs.
    const bool decode = row.pass == "decode";
    const double unit = decode ? 1e-3 : 1e-6;
    std::printf("median     %.3f %s%s  (min %.3f, max %.3f, MAD %.3f, CV %.1f%%%s, %zu samples)\n", row.median_ns * unit,
                decode ? "µs" : "ms", decode ? " per token" : "", row.min_ns * unit, row.max_ns * unit, row.mad_ns * unit,
                row.cv * 100, row.unstable ? ", UNSTABLE" : "", row.samples_ns.size());
    std::printf("contention %lld descheduled sample(s) re-measured, on-CPU ratio %.2f, host busy %.0f%%, load %.2f%s\n",
                static_cast<long long>(row.contended_samples), row.cpu_ratio, 100 * row.host_busy, row.load_average,
                row.contended ? ", CONTENDED" : "");
    std::printf("work       %.3f GFLOP executed, %.1f GFLOP/s, %.0f tokens/s\n", static_cast<double>(row.flops) * 1e-9,
                row.gflops_per_s, row.tokens_per_s);
    for (const auto& [stage, ns] : row.stage_median_ns)
      std::printf("stage      %-8s %.3f ms median (%.0f%% of the median call)\n", stage.c_str(), ns * 1e-6,
                  row.median_ns > 0 ? 100.0 * ns / row.median_ns : 0.0);
    std::printf("memory     peak tracked %.2f MiB (workspace %.2f MiB, estimate %.2f MiB), peak RSS %.1f MiB\n",
                static_cast<double>(row.peak_tensor_bytes) / 1048576.0, static_cast<double>(row.workspace_bytes) / 1048576.0,
                static_cast<double>(row.estimated_workspace_bytes) / 1048576.0,
                static_cast<double>(row.peak_rss_bytes) / 1048576.0);
    if (row.pass == "decode")
      std::printf("decode     %lld tokens after the context: median is per token; prefill %.3f ms median; state %.3f MiB\n",
                  static_cast<long long>(row.decode_tokens), row.prefill_ns * 1e-6,
                  static_cast<double>(row.state_bytes) / 1048576.0);
    else if (row.pass != "forward")
      std::printf("saved      %.2f MiB kept by the forward for the backward\n",
                  static_cast<double>(row.saved_bytes) / 1048576.0);
    if (!row.gradient_note.empty()) std::printf("gradient   %s\n", row.gradient_note.c_str());
  }
  for (const auto& warning : row.warnings) std::printf("warning    %s\n", warning.c_str());
  std::printf("reproduce  %s\n", row.reproducer.c_str());
}

int run(RunOptions& o) {
  finish_problem_options(o.problem);
  const Point point = resolve_point(o.problem.point);
  std::optional<std::string> dump;
  if (!o.dump_dir.empty()) {
    const auto parent = std::filesystem::absolute(o.dump_dir).parent_path();
    if (!std::filesystem::is_directory(parent))
      throw InputError("--dump folder's parent " + parent.string() + " does not exist");
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
  if (o.json)
    std::printf("%s\n", nlohmann::json(row).dump().c_str());
  else
    print_human(row);
  return row.status == Status::Error ? kExitRuntime : kExitOk;
}

}  // namespace

void add_run(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("run", "run one point and print its measurements");
  auto options = std::make_shared<RunOptions>();
  command->add_option("--model,-m", options->problem.point.model, "model name (see `xfbench list`)")->required();
  command->add_option("--seq-len,-n", options->problem.point.problem.seq_len, "tokens N")->required();
  add_problem_options(*command, options->problem);
  command->add_flag("--json", options->json, "print the report row as JSON");
  command->add_option("--dump", options->dump_dir, "write q/k/v/out/parameters .npy files and manifest.json here");
  command->callback([options, &action] { action = [options] { return run(*options); }; });
}

}  // namespace xfb::cli
