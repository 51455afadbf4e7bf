#pragma once
// One benchmark point: a model, a problem, a scope and the timing settings. `run_point` does the
// whole measurement in this process: untimed setup (inputs, parameters, primitives), warm-up,
// timed repetitions, counters. The sweep runs each point in a child process (lib/sweep.hpp).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lib/mechanism.hpp"
#include "lib/report.hpp"
#include "lib/timing.hpp"

namespace xfb {

enum class Scope { Attention, Layer };
std::string scope_name(Scope s);

struct PointConfig {
  std::string model;
  Problem problem;
  Scope scope = Scope::Attention;
  std::int64_t d_ff = 0;     // layer scope FFN width; 0 means 4·H·D
  std::uint64_t seed = 42;
  std::vector<std::string> params;  // `key=value` assignments
  TimingSettings timing;

  std::int64_t effective_d_ff() const { return d_ff > 0 ? d_ff : 4 * problem.heads * problem.head_dim; }
};

// Throws InputError for an unknown model, a bad shape or a bad parameter.
void validate_point(const PointConfig& config);

// A row filled with the point's identity (model, classes, shape, resolved params, reproducer)
// and, when the point cannot run here, status and reason (unsupported, skipped by memory limit).
ResultRow describe_point(const PointConfig& config, std::int64_t memory_limit_bytes = 0);

// Tracked bytes of the point's inputs and output: q, k, v, out (attention) or x, y (layer).
std::int64_t point_io_bytes(const PointConfig& config);
// Analytic estimate of the tracked bytes of the point: inputs, output, workspace.
std::int64_t estimated_point_bytes(const PointConfig& config);

// Runs the point here. `dump_dir`, when set, receives inputs, output, parameters and a manifest
// (the folder is created only when the point runs).
ResultRow run_point(const PointConfig& config, const std::optional<std::string>& dump_dir = std::nullopt);

// The `xfbench run …` command line that reproduces the point.
std::string reproducer_command(const PointConfig& config);
std::vector<std::string> run_arguments(const PointConfig& config);

}  // namespace xfb
