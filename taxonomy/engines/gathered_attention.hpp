#pragma once
// Shared kernel of the block-sparse fixed-pattern + memory models (memory-compressed, longformer,
// etc, bigbird): exact softmax attention of one tile of query rows over a few runs of key rows.
//
// A tile is `rows` query rows (row r at q + r·q_ld) of one head. Its keys come in runs: run s is
// the rows first, first+step, …, first+(count−1)·step of that head's [n, D] key and value
// matrices (row stride D). Query row r may see the columns visible(r, s) = [lo, hi) of run s.
// The kernel computes, for every row,
//   out_r = Σ_s Σ_{c ∈ visible(r,s)} softmax_r(q_r·k_{s,c}/√D) · v_{s,c}
// with the softmax over all columns the row sees; a row that sees nothing gets zeros.
//
// Work: for each run only the union over rows of its visible columns, [c0, c1), is computed, as
// dense products S = Q·K[c0:c1]ᵀ/√D (scores stored run after run in one [rows, Σ widths] buffer)
// and O = P·V; entries outside a row's visible range are zeroed in P. So the work beyond the exact
// pattern is only where a row's range is narrower than its tile's union (band edges, causal
// diagonals, partial blocks). With `gather`, the union rows of all runs are first copied into
// contiguous [Σ widths, D] buffers and each product is one sgemm (worth it for many short runs);
// otherwise each run is multiplied in place (strided runs use ld = step·D).
//
// FLOPs of a tile (tile_flops): 4·rows·Σ widths·D (both products) + kSoftmaxFlopsPerElement per
// visible entry. Rows that see nothing cost nothing.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "lib/core/flop_counter.hpp"
#include "lib/core/tensor.hpp"

namespace xfb::fixed {

// Rows first + c·step of a key/value matrix pair, c < count.
struct KeyRun {
  std::int64_t first = 0;  // row of column 0
  std::int64_t step = 1;   // rows between consecutive columns
  std::int64_t count = 0;  // columns
};

// Columns [lo, hi) of one run; empty when lo >= hi.
struct ColumnRange {
  std::int64_t lo = 0, hi = 0;
  std::int64_t width() const { return hi > lo ? hi - lo : 0; }
};

// The pattern of one tile: its key runs and, per query row and run, the visible columns.
class TilePattern {
 public:
  // Starts a tile of `rows` query rows with no runs.
  void reset(std::int64_t rows);
  // Adds a run whose columns every row sees (set other ranges with visible()). Returns its index.
  std::size_t add_run(KeyRun run);
  ColumnRange& visible(std::int64_t row, std::size_t run) { return visible_[run * rows_ + row]; }
  const ColumnRange& visible(std::int64_t row, std::size_t run) const { return visible_[run * rows_ + row]; }

  std::int64_t rows() const { return rows_; }
  const std::vector<KeyRun>& runs() const { return runs_; }
  // Union over rows of the visible columns of a run, as a range (empty when nobody sees it).
  ColumnRange computed_columns(std::size_t run) const;
  // Σ over runs of the union widths: the score columns the tile computes.
  std::int64_t computed_width() const;
  // Visible (row, column) pairs over all runs.
  std::int64_t visible_entries() const;

 private:
  std::int64_t rows_ = 0;
  std::vector<KeyRun> runs_;
  std::vector<ColumnRange> visible_;  // [runs][rows]
};

// Executed FLOPs of TileAttention::run on this tile (formula above).
std::int64_t tile_flops(const TilePattern& tile, std::int64_t d);

// Backward (FlashAttention-2 style): run() saves each row's log-sum-exp L_r when given `lse`; the
// backward recomputes the tile's scores and, with δ_r = dO_r·O_r,
//   P = exp(S − L) on the visible columns, 0 elsewhere;  dV[cols] += Pᵀ·dO;  dP = dO·V[cols]ᵀ;
//   dS = P ⊙ (dP − δ);  dK[cols] += dSᵀ·Q/√D;  dQ += dS·K[cols]/√D.
// Gathered tiles accumulate dK, dV of the union rows in contiguous buffers and add them back to
// their rows. Tiles that write the same key rows must not run concurrently (the models run one head
// per task). FLOPs (tile_backward_flops): 10·rows·Σ widths·D (five products) +
// kRecomputedSoftmaxBackwardFlopsPerElement per visible entry, + 2·Σ widths·D when gathered (adding
// dK and dV back); 0 for a tile that computes nothing.
std::int64_t tile_backward_flops(const TilePattern& tile, std::int64_t d, bool gather);

// A tile's query-side rows for the backward: row r of q/dout/dq at + r·ld; its L and δ at
// lse[r·stats_step] and delta[r·stats_step]. dk, dv: the head's [n, D] gradients (the layout of k,
// v) in fp32 — the gradients themselves for T = float, per-head fp32 accumulators for T = bf16
// (engines/gathered_attention_bf16.hpp).
template <class T>
struct TileGradsOf {
  const T* q = nullptr;
  const T* dout = nullptr;
  T* dq = nullptr;
  std::int64_t ld = 0;
  const float* lse = nullptr;
  const float* delta = nullptr;
  std::int64_t stats_step = 1;
  float* dk = nullptr;
  float* dv = nullptr;
};
using TileGrads = TileGradsOf<float>;

// One head's query-side rows ([N, D] of the head's q, dout, dq; lse and δ [N]) and its fp32
// key-side gradients (the gradient tensors for T = float, accumulators for bf16).
template <class T>
struct HeadRowsOf {
  const T* q;
  const T* dout;
  T* dq;
  const float* lse;
  float* delta;  // δ of the head's rows (a model may overwrite its global rows')
  float* dk;
  float* dv;
};

// A task's TileGradsOf<T> from its head's rows: rows first·D, step·D apart (stats: first, step).
template <class T>
TileGradsOf<T> rows_grads(const HeadRowsOf<T>& head, std::int64_t first, std::int64_t step, std::int64_t d) {
  return {.q = head.q + first * d,
          .dout = head.dout + first * d,
          .dq = head.dq + first * d,
          .ld = step * d,
          .lse = head.lse + first,
          .delta = head.delta + first,
          .stats_step = step,
          .dk = head.dk,
          .dv = head.dv};
}

// What the fp32 and bf16 kernels share: a tile's score-column layout and its rows' softmax.
// layout() places run s's computed columns at score column offset(s), each run's start rounded up
// to a multiple of `align` (1: packed; 16: whole key panels per run); returns the columns used.
class TileColumns {
 public:
  std::int64_t layout(const TilePattern& tile, std::int64_t align);
  const ColumnRange& columns(std::size_t run) const { return columns_[run]; }
  std::int64_t offset(std::size_t run) const { return offsets_[run]; }
  // First row of the run's computed columns (row stride d) in base.
  template <class T>
  const T* first_computed(const TilePattern& tile, const T* base, std::size_t run, std::int64_t d) const {
    const KeyRun& r = tile.runs()[run];
    return base + (r.first + columns_[run].lo * r.step) * d;
  }
  // The row's visible spans as score columns (first column, length), in column order.
  const std::vector<std::pair<std::int64_t, std::int64_t>>& spans(const TilePattern& tile, std::int64_t row);

  struct RowStats {
    float max = 0, sum = 0;
    std::int64_t visible = 0;
  };
  // row[j] := exp(row[j] − M) on the row's spans (M their max), 0 on the other columns of
  // [0, width); returns M, Σ and the visible count (M = −inf, Σ = 0 for a row that sees nothing).
  RowStats exponentials(const TilePattern& tile, std::int64_t r, float* row, std::int64_t width);
  // The backward's row: p[j] := exp(p[j] − shift), g[j] := p[j]·(g[j] − dot) on the spans, both 0
  // elsewhere in [0, width). Returns the visible count.
  std::int64_t softmax_grad(const TilePattern& tile, std::int64_t r, float* p, float* g, std::int64_t width,
                            float shift, float dot);

 private:
  std::vector<ColumnRange> columns_;                          // per run: computed union
  std::vector<std::int64_t> offsets_;                         // per run: first score column
  std::vector<std::pair<std::int64_t, std::int64_t>> spans_;  // one row's visible (first column, length)
};

// Per-thread buffers and the kernel. `score_capacity` bounds rows·padded_ld(computed_width) over
// the tiles this instance will run; `gather_capacity` bounds computed_width of gathered tiles.
class TileAttention {
 public:
  using Element = float;
  using Grads = TileGrads;
  TileAttention(std::int64_t score_capacity, std::int64_t gather_capacity, std::int64_t d);
  // Tracked bytes of one instance.
  static std::int64_t bytes(std::int64_t score_capacity, std::int64_t gather_capacity, std::int64_t d);
  // Score floats a tile of `rows` rows and `width` computed columns needs.
  static std::int64_t score_floats(std::int64_t rows, std::int64_t width);

  // Computes the tile's output rows (out + r·out_ld) from q (q + r·q_ld) and the head's k, v
  // ([n, D], row stride D). Adds gemm FLOPs to FlopCounter itself; returns the softmax FLOPs.
  // With `lse`, also saves row r's log-sum-exp at lse[r·lse_step] (−inf for a row that sees nothing).
  std::int64_t run(const TilePattern& tile, const float* q, std::int64_t q_ld, const float* k, const float* v,
                   float* out, std::int64_t out_ld, bool gather, float* lse = nullptr, std::int64_t lse_step = 1);

  // Allocates the backward's buffers (dS tile, gathered dK and dV): bytes() + backward_bytes().
  void enable_backward();
  static std::int64_t backward_bytes(std::int64_t score_capacity, std::int64_t gather_capacity, std::int64_t d);
  // The backward of a tile run() computed (same pattern, inputs and `gather`). Adds gemm FLOPs to
  // FlopCounter itself; returns the elementwise FLOPs.
  std::int64_t backward(const TilePattern& tile, const TileGrads& g, const float* k, const float* v, bool gather);

 private:
  const float* first_computed(const TilePattern& tile, const float* base, std::size_t run) const {
    return cols_.first_computed(tile, base, run, d_);
  }
  void scores(const TilePattern& tile, const float* q, std::int64_t q_ld, const float* k, std::int64_t width,
              std::int64_t ld, bool gather);
  std::int64_t softmax_rows(const TilePattern& tile, std::int64_t width, std::int64_t ld, float* lse,
                            std::int64_t lse_step);
  void gather_union(const TilePattern& tile, const float* k, const float* v);
  // C (+)= op(A)·B over each run's computed columns (see backward in the .cpp).
  // width: the computed columns (TileColumns::layout's result).
  void per_run_products(const TilePattern& tile, const TileGrads& g, const float* k, std::int64_t width,
                        std::int64_t ld, bool gather);
  void weighted_values(const TilePattern& tile, const float* v, float* out, std::int64_t out_ld, std::int64_t width,
                       std::int64_t ld, bool gather);

  std::int64_t d_;
  Tensor scores_, keys_, values_;
  Tensor grads_, key_grads_, value_grads_;  // backward only (enable_backward)
  TileColumns cols_;
};

// The score floats the largest of `tasks` needs (TileAttention's score capacity); plan(task, tile)
// fills the tile pattern of a task.
template <typename Task, typename Plan>
std::int64_t most_score_floats(const std::vector<Task>& tasks, Plan&& plan) {
  TilePattern tile;
  std::int64_t most = 0;
  for (const Task& task : tasks) {
    plan(task, tile);
    most = std::max(most, TileAttention::score_floats(task.rows, tile.computed_width()));
  }
  return most;
}

// Tasks of head h are [ranges[h], ranges[h + 1]) of a task list sorted by `head` (heads < `heads`).
template <typename Task>
std::vector<std::size_t> task_ranges_by_head(const std::vector<Task>& tasks, std::int64_t heads) {
  std::vector<std::size_t> ranges(static_cast<std::size_t>(heads + 1), tasks.size());
  for (std::size_t t = tasks.size(); t-- > 0;) ranges[static_cast<std::size_t>(tasks[t].head)] = t;
  for (std::int64_t h = heads; h-- > 0;)  // a head without tasks starts where the next one does
    ranges[static_cast<std::size_t>(h)] =
        std::min(ranges[static_cast<std::size_t>(h)], ranges[static_cast<std::size_t>(h + 1)]);
  return ranges;
}

// Runs tasks of one tile each (Kernel: TileAttention or TileAttentionBf16) on kernels.size() OpenMP threads,
// dynamically scheduled: for every batch entry b and task t, run_task(b, tasks[t], kernel, tile) with the calling
// thread's kernel and a reused TilePattern. Adds the returned softmax FLOPs (the kernel adds its gemm FLOPs itself) to
// the FlopCounter.
template <typename Task, typename Kernel, typename RunTask>
void run_tile_tasks(std::int64_t batch, const std::vector<Task>& tasks, std::vector<Kernel>& kernels,
                    RunTask&& run_task) {
  const auto count = static_cast<std::int64_t>(tasks.size());
  std::int64_t softmax_flops = 0;
#pragma omp parallel num_threads(static_cast <int>(kernels.size())) reduction(+ : softmax_flops)
  {
    Kernel& kernel = kernels[static_cast<std::size_t>(omp_get_thread_num())];
    TilePattern tile;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t index = 0; index < batch * count; ++index)
      softmax_flops += run_task(index / count, tasks[static_cast<std::size_t>(index % count)], kernel, tile);
  }
  FlopCounter::add(softmax_flops);
}

}  // namespace xfb::fixed
