#pragma once
// Sequence-length sweeps: every (model, seq_len) point runs in a child process (`xfbench run
// --json`), so a crash, an out-of-memory kill or a timeout becomes a row with its reason. The
// report is rewritten atomically after every point; `resume` keeps finished points.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "apps/bench/point.hpp"
#include "apps/report/report.hpp"

namespace xfb {

struct SweepSettings {
  std::vector<std::string> models;             // registry names
  std::vector<std::int64_t> seq_lens;          // tokens
  PointConfig base;                            // everything but model, seq_len, params and pass
  std::vector<Pass> passes = {Pass::Forward};  // every point runs once per pass
  std::vector<std::string> params;             // `key=value` or `model.key=value`
  double timeout_s = 600;                      // per point, seconds
  std::int64_t memory_limit_bytes = 0;         // 0: no limit
  std::string out_path;
  bool resume = false;
  bool measure_machine = true;  // record FMA peak and bandwidth in the context
  bool progress = true;         // progress lines on stderr
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

// Parses `all`, `implemented`, `class:<class>` or `a,b,c` into registry names.
std::vector<std::string> parse_model_selection(const std::string& text);
// Parses `256,512,1024` or `256:16384:x2` (geometric) or `1000:4000:+1000` (arithmetic).
std::vector<std::int64_t> parse_seq_lens(const std::string& text);
// The parameters that apply to one model: `model.key=value` for it, `key=value` when it has key.
std::vector<std::string> params_for_model(const std::string& model, const std::vector<std::string>& params);

// Validates everything (throws InputError before any output is written), then runs.
Report run_sweep(const SweepSettings& settings, const std::string& command_line);

// Runs one point in a child process and returns its row (`described`, the point's describe_point
// row, with the error's reason on a crash or timeout). The child is this executable, which reads
// the point as JSON (`run --point`), or `program` (another xfbench build, perhaps older), which
// gets the reproducer's words.
ResultRow run_point_in_child(const Point& point, const ResultRow& described, double timeout_s,
                             const std::string& program = "");

}  // namespace xfb
