#pragma once
// One benchmark point: a model, a problem, a scope and the timing settings. `run_point` does the
// whole measurement in this process: untimed setup (inputs, parameters, primitives), warm-up,
// timed repetitions, counters. The sweep runs each point in a child process (apps/bench/sweep.hpp).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/report/report.hpp"
#include "lib/core/mechanism.hpp"
#include "lib/core/params.hpp"
#include "lib/core/point_config.hpp"
#include "lib/core/timing.hpp"
#include "taxonomy/registry.hpp"

namespace xfb {

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
// constraints) and resolves; a decode point is made causal. Throws InputError (ParamError for parameters) with a
// one-line message.
Point resolve_point(const PointConfig& config);

// Why a bf16 point of `model` cannot run ("" when it can, or the point is f32): the one place the
// harness checks the Implementation's bf16 flags, so no model computes a bf16 point in fp32 silently.
std::string bf16_unsupported(const ModelInfo& model, const PointConfig& config);
void validate_point(const PointConfig& config);

// M, the rows of the mechanism's output per (batch, head): N, or a downsampling model's own count.
std::int64_t point_output_rows(const Point& point);

// A row filled with the point's identity (model, classes, shape, resolved params, reproducer)
// and, when the point cannot run here, status and reason (unsupported, skipped by memory limit).
ResultRow describe_point(const Point& point, std::int64_t memory_limit_bytes = 0);
ResultRow describe_point(const PointConfig& config, std::int64_t memory_limit_bytes = 0);

// Tracked bytes of the point's inputs and output: q, k, v, out (attention) or x, y (layer); for the
// backward and train passes also dout, dq, dk, dv (dy, dx); for the decode pass the context's q, k, v,
// out and every step's q, k, v, out ([B, H, 1, D] each). out, dout, y and dy have M rows
// (point_output_rows), the others N.
std::int64_t point_io_bytes(const Point& point);
std::int64_t point_io_bytes(const PointConfig& config);  // of resolve_point(config)
// Analytic estimate of the tracked bytes of the point: inputs, output, workspace.
std::int64_t estimated_point_bytes(const Point& point);
// Analytic FLOPs of one timed call, as the row's `flops` counts them: the mechanism's forward
// (and backward: train and backward passes) plus, in layer scope, the layer's own work. nullopt for
// the decode pass (its steps have no analytic count), a mixture-of-experts layer (its count depends on the
// routing: EncoderLayer::flops_outside_mechanism with the routed pairs) and a point that cannot run.
std::optional<std::int64_t> estimated_point_flops(const Point& point);

// Runs the point here. `dump_dir`, when set, receives inputs, output, parameters and a manifest
// (the folder is created only when the point runs); for the backward and train passes also dout,
// dq, dk, dv and the parameter gradients (d<parameter>); for the decode pass q, k, v and out of the
// whole sequence ([B, H, N + T, D]: the context's rows, then the decoded tokens') and the final state.
ResultRow run_point(const Point& point, const std::optional<std::string>& dump_dir = std::nullopt);
ResultRow run_point(const PointConfig& config, const std::optional<std::string>& dump_dir = std::nullopt);

// The point as one shell command: `xfbench run …` (apps/report/point_fields.hpp spells it).
std::string reproducer_command(const Point& point);

}  // namespace xfb
