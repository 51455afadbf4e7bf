#pragma once
// One benchmark point: a model, a problem, a scope and the timing settings. `run_point` does the
// whole measurement in this process: untimed setup (inputs, parameters, primitives), warm-up,
// timed repetitions, counters. The sweep runs each point in a child process (lib/bench/sweep.hpp).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "lib/core/mechanism.hpp"
#include "lib/core/params.hpp"
#include "lib/core/timing.hpp"
#include "lib/report/report.hpp"
#include "taxonomy/registry.hpp"

namespace xfb {

enum class Scope { Attention, Layer };
std::string scope_name(Scope s);

// What a point times: the forward alone; the backward alone (after an untimed forward that saved
// what it needs); one training step, forward then backward; or incremental decoding: a prefill of
// the N-token context (its own stage), then decode_tokens steps of one token each, timed one by one
// (attention scope; always causal).
enum class Pass { Forward, Backward, Train, Decode };
std::string pass_name(Pass p);
Pass parse_pass(const std::string& name);  // InputError on an unknown name
// `forward`, `train` or a comma list `forward,train` (InputError on an unknown or repeated name).
std::vector<Pass> parse_passes(const std::string& list);
// The inverse: "forward,train".
std::string pass_list_name(const std::vector<Pass>& passes);

struct PointConfig {
  std::string model;
  Problem problem;
  Scope scope = Scope::Attention;
  Pass pass = Pass::Forward;
  std::int64_t d_ff = 0;     // layer scope FFN width; 0 means 4·H·D
  std::int64_t decode_tokens = 64;  // decode pass: tokens generated after the context
  std::uint64_t seed = 42;
  std::vector<std::string> params;  // `key=value` assignments
  TimingSettings timing;

  std::int64_t effective_d_ff() const { return d_ff > 0 ? d_ff : 4 * problem.heads * problem.head_dim; }
};

// A point expanded once: its model, the configuration as given (problem with its threads, scope,
// seed, timing), the parameter values as asked for (defaults filled in) and as they run (derived
// defaults computed, blocks clamped). Everything below that describes, estimates, runs or spells a
// point works from one of these.
struct Point {
  const ModelInfo* model = nullptr;
  PointConfig config;
  ParamValues requested;  // defaults filled in: the row's `params`, the reproducer's --param
  ParamValues running;    // as the mechanism runs them: the dump manifest's `params`
};

// Validates (model, shape, threads, timing, parameter names, types and ranges, and the model's own
// constraints) and resolves; a decode point is made causal. Throws InputError (ParamError for parameters) with a one-line message.
Point resolve_point(const PointConfig& config);
void validate_point(const PointConfig& config);

// The settings a point's problem, scope, pass, seed and timing contribute to a report (`settings` of
// a sweep) and a dump manifest: batch, heads, head_dim, causal, scope, pass, d_ff, threads, seed,
// warmup, min_reps, min_time_s.
nlohmann::json problem_settings(const PointConfig& config);

// A row filled with the point's identity (model, classes, shape, resolved params, reproducer)
// and, when the point cannot run here, status and reason (unsupported, skipped by memory limit).
ResultRow describe_point(const Point& point, std::int64_t memory_limit_bytes = 0);
ResultRow describe_point(const PointConfig& config, std::int64_t memory_limit_bytes = 0);

// Tracked bytes of the point's inputs and output: q, k, v, out (attention) or x, y (layer); for the
// backward and train passes also dout, dq, dk, dv; for the decode pass the context's q, k, v, out and
// every step's q, k, v, out ([B, H, 1, D] each).
std::int64_t point_io_bytes(const PointConfig& config);
// Analytic estimate of the tracked bytes of the point: inputs, output, workspace.
std::int64_t estimated_point_bytes(const Point& point);

// Runs the point here. `dump_dir`, when set, receives inputs, output, parameters and a manifest
// (the folder is created only when the point runs); for the backward and train passes also dout,
// dq, dk, dv and the parameter gradients (d<parameter>); for the decode pass q, k, v and out of the
// whole sequence ([B, H, N + T, D]: the context's rows, then the decoded tokens') and the final state.
ResultRow run_point(const Point& point, const std::optional<std::string>& dump_dir = std::nullopt);
ResultRow run_point(const PointConfig& config, const std::optional<std::string>& dump_dir = std::nullopt);

// The `xfbench run …` arguments that reproduce the point (the child process of a sweep runs them),
// and the same as one shell command.
std::vector<std::string> run_arguments(const Point& point);
std::string reproducer_command(const Point& point);

}  // namespace xfb
