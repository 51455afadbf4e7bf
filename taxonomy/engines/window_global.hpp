#pragma once
// The tile plan shared by `longformer` and `etc`: a sliding window over a (possibly dilated)
// subsequence plus global tokens, for one head of N tokens.
//
// Positions 0 … g−1 are global. With dilation d, the head splits into d interleaved subsequences:
// residue ρ holds positions ρ + d·m, m = 0 … n_ρ−1. A non-global query at subsequence index m sees
//   window: the same subsequence's indices m' with m − before ≤ m' ≤ m + after, whose position is
//           not global (global keys are in the global run below, so nothing is counted twice);
//   globals: every position j < g.
// A global query i (i < g) sees every key j < N, or j ≤ i when causal.
// Tiles: the non-global rows of each subsequence are cut into tiles of `tile` consecutive
// subsequence rows (row stride d·D in memory); global rows into tiles of `tile` positions.
// A window tile computes the union of its rows' windows, so the work beyond the pattern is the
// two triangular band edges of each tile: about (tile − 1)/(tile + before + after) of its scores.
#include <cstdint>
#include <vector>

#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/gathered_attention_bf16.hpp"

namespace xfb::fixed {

struct WindowGlobalShape {
  std::int64_t tokens = 0;   // N
  std::int64_t globals = 0;  // g (already clamped to N)
  std::int64_t before = 0;   // window reach into the past, subsequence steps
  std::int64_t after = 0;    // window reach into the future, subsequence steps (0 when causal)
  std::int64_t tile = 64;    // query rows per tile
  bool causal = false;       // global queries see only j <= i
};

struct WindowGlobalTask {
  std::int64_t head = 0;      // head index within a batch element
  bool global = false;        // a tile of global query rows
  std::int64_t dilation = 1;  // d of the head (window tiles)
  std::int64_t residue = 0;   // ρ (window tiles)
  std::int64_t start = 0;     // first subsequence index (window) or position (global)
  std::int64_t rows = 0;      // query rows in the tile
};

// Every tile of every head; dilation[h] is head h's d (≥ 1).
std::vector<WindowGlobalTask> window_global_tasks(const WindowGlobalShape& shape,
                                                  const std::vector<std::int64_t>& dilation);

// The tile's key runs (rows of the head's K/V) and visible columns.
void plan_window_global(const WindowGlobalShape& shape, const WindowGlobalTask& task, TilePattern& tile);

// Memory offsets of a task's first query/output row, in rows of D floats, and the row step.
inline std::int64_t first_row(const WindowGlobalTask& t) {
  return t.global ? t.start : t.residue + t.dilation * t.start;
}
inline std::int64_t row_step(const WindowGlobalTask& t) { return t.global ? 1 : t.dilation; }

// A task's query-side rows in one head's tensors (engines/gathered_attention.hpp HeadRowsOf), for
// the kernels' backward.
using HeadRows = HeadRowsOf<float>;
template <class T>
TileGradsOf<T> task_grads(const WindowGlobalTask& task, const HeadRowsOf<T>& head, std::int64_t d) {
  return rows_grads(head, first_row(task), row_step(task), d);
}

// Largest TileAttention::score_floats over the tasks.
std::int64_t window_global_score_floats(const WindowGlobalShape& shape, const std::vector<WindowGlobalTask>& tasks);
// The TileAttentionBf16 capacity the tasks need (engines/gathered_attention_bf16.hpp).
TileCapacity window_global_capacity(const WindowGlobalShape& shape, const std::vector<WindowGlobalTask>& tasks);

}  // namespace xfb::fixed
