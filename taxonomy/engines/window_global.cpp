#include "taxonomy/engines/window_global.hpp"

#include <algorithm>

namespace xfb::fixed {
namespace {

// Length of residue ρ's subsequence, and its first non-global index.
std::int64_t subsequence_length(std::int64_t n, std::int64_t d, std::int64_t residue) {
  return residue < n ? (n - residue + d - 1) / d : 0;
}
std::int64_t first_local_index(std::int64_t globals, std::int64_t d, std::int64_t residue) {
  return globals > residue ? (globals - residue + d - 1) / d : 0;
}

void plan_window(const WindowGlobalShape& s, const WindowGlobalTask& t, TilePattern& tile) {
  const std::int64_t length = subsequence_length(s.tokens, t.dilation, t.residue);
  const std::int64_t local_begin = first_local_index(s.globals, t.dilation, t.residue);
  const std::int64_t lo = std::max(t.start - s.before, local_begin);
  const std::int64_t hi = std::min(t.start + t.rows - 1 + s.after, length - 1) + 1;
  const std::size_t band = tile.add_run({.first = t.residue + t.dilation * lo, .step = t.dilation, .count = hi - lo});
  for (std::int64_t r = 0; r < t.rows; ++r) {
    const std::int64_t m = t.start + r;
    tile.visible(r, band) = {std::max(m - s.before, local_begin) - lo, std::min(m + s.after, length - 1) + 1 - lo};
  }
  if (s.globals > 0) tile.add_run({.first = 0, .step = 1, .count = s.globals});
}

void plan_global(const WindowGlobalShape& s, const WindowGlobalTask& t, TilePattern& tile) {
  const std::size_t all = tile.add_run({.first = 0, .step = 1, .count = s.tokens});
  if (!s.causal) return;
  for (std::int64_t r = 0; r < t.rows; ++r) tile.visible(r, all) = {0, t.start + r + 1};
}

}  // namespace

std::vector<WindowGlobalTask> window_global_tasks(const WindowGlobalShape& s,
                                                  const std::vector<std::int64_t>& dilation) {
  std::vector<WindowGlobalTask> tasks;
  for (std::size_t h = 0; h < dilation.size(); ++h) {
    const auto head = static_cast<std::int64_t>(h);
    for (std::int64_t i = 0; i < s.globals; i += s.tile)
      tasks.push_back({.head = head, .global = true, .start = i, .rows = std::min(s.tile, s.globals - i)});
    const std::int64_t d = dilation[h];
    for (std::int64_t residue = 0; residue < d; ++residue) {
      const std::int64_t length = subsequence_length(s.tokens, d, residue);
      for (std::int64_t m = first_local_index(s.globals, d, residue); m < length; m += s.tile)
        tasks.push_back(
            {.head = head, .dilation = d, .residue = residue, .start = m, .rows = std::min(s.tile, length - m)});
    }
  }
  return tasks;
}

void plan_window_global(const WindowGlobalShape& shape, const WindowGlobalTask& task, TilePattern& tile) {
  tile.reset(task.rows);
  if (task.global)
    plan_global(shape, task, tile);
  else
    plan_window(shape, task, tile);
}

std::int64_t window_global_score_floats(const WindowGlobalShape& shape, const std::vector<WindowGlobalTask>& tasks) {
  return most_score_floats(
      tasks, [&](const WindowGlobalTask& task, TilePattern& tile) { plan_window_global(shape, task, tile); });
}

TileCapacity window_global_capacity(const WindowGlobalShape& shape, const std::vector<WindowGlobalTask>& tasks) {
  return most_tile_capacity(
      tasks, [&](const WindowGlobalTask& task, TilePattern& tile) { plan_window_global(shape, task, tile); });
}

}  // namespace xfb::fixed
