#pragma once
// Sequence-length sweeps: every (model, seq_len) point runs in a child process (`xfbench run
// --json`), so a crash, an out-of-memory kill or a timeout becomes a row with its reason. The
// report is rewritten atomically after every point; `resume` keeps finished points.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "apps/bench/point.hpp"
#include "apps/bench/selection.hpp"
#include "apps/report/report.hpp"

namespace xfb {

struct SweepSettings {
  std::vector<std::string> models;             // registry names
  std::vector<std::int64_t> seq_lens;          // tokens
  PointConfig base;                            // everything but model, seq_len, params and pass
  std::vector<PointConfig> grid;               // every combination of the gridded fields (empty: {base})
  std::vector<std::string> gridded;            // keys of the fields given as lists (`threads`, `heads`)
  std::vector<Pass> passes = {Pass::Forward};  // every point runs once per pass
  std::vector<std::string> params;             // `key=value` or `model.key=value`; a value may be a list (block=32,64)
  double timeout_s = 600;                      // per point, seconds
  std::int64_t memory_limit_bytes = 0;         // 0: no limit
  std::string out_path;
  bool resume = false;
  bool retry_errors = false;    // with resume: run the error rows of the report again
  bool measure_machine = true;  // record FMA peak and bandwidth in the context
  bool progress = true;         // progress lines on stderr: each point as it starts, its figures as it lands
  bool colour = false;          // colour in the progress lines (a terminal without NO_COLOR)
  int shard_index = 1;          // run shard shard_index of shard_count (1-based), see assign_shards
  int shard_count = 1;
  std::string preset;  // recorded in the settings when the sweep came from a preset
};

// Parses "i/n" with 1 ≤ i ≤ n into (i, n); throws InputError.
std::pair<int, int> parse_shard(const std::string& text);
// Deals points to `shards` shards (0-based result per point) so that shards cost about the same:
// largest estimated cost first, each to the least-loaded shard (ties: lower point index, lower
// shard). Depends only on the costs, so every shard of a sweep computes the same partition.
std::vector<int> assign_shards(const std::vector<std::int64_t>& costs, int shards);

// The parameters that apply to one model: `model.key=value` for it, `key=value` when it has key
// and no `model.key=` is given (the qualified one wins).
std::vector<std::string> params_for_model(const std::string& model, const std::vector<std::string>& params);
// The parameter sets of a grid: `own` (params_for_model's) with every listed value (`block=32,64`)
// and every repeated key (`block=32`, `block=64`) expanded into the product, keys in first-given
// order, the first key varying slowest. {own} when nothing is listed or repeated. InputError for an
// empty or repeated value.
std::vector<std::vector<std::string>> param_grid(const std::vector<std::string>& own);

// Validates everything (throws InputError before any output is written), then runs.
Report run_sweep(const SweepSettings& settings, const std::string& command_line);

// `sweep --dry-run`: validates as run_sweep does and lists, without running any, the points this
// shard would run — model, N, pass, parameters, estimated tracked memory and FLOPs (point.hpp's
// analytic estimates), and whether each would run or is skipped or unsupported, with the reason —
// then a summary line.
std::string render_dry_run(const SweepSettings& settings);

// Runs one point in a child process and returns its row (`described`, the point's describe_point
// row, with the error's reason on a crash or timeout). The child is this executable, which reads
// the point as JSON (`run --point`), or `program` (another xfbench build, perhaps older), which
// gets the reproducer's words.
ResultRow run_point_in_child(const Point& point, const ResultRow& described, double timeout_s,
                             const std::string& program = "");

}  // namespace xfb
