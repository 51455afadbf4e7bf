#pragma once
// The bf16 form of the gathered-attention kernel (engines/gathered_attention.hpp: longformer, etc,
// bigbird), on the bf16 tile kernels (lib/core/tile_kernels_bf16.hpp), and what a model needs to
// run either form from one template on its element type T (float or bf16).
//
// Layout: TileColumns::layout(tile, kPanel): each run's computed columns start on a whole key
// panel, so every run is packed on its own (its rows first, first + step, … read in place) and
// its products are whole panels; the padding columns are zero keys, outside every row's spans.
// Forward of one tile (rows m, runs s of widths w_s, columns W = Σ_s 16⌈w_s/16⌉):
//   K[run] in key pair panels;  S = scale·Q·Kᵀ (scores_bf16, fp32 [m, W])
//   per row: M = max over its spans, P_j = exp(S_j − M) on the spans (0 elsewhere), Σ = Σ_j P_j
//   P rounded to bf16 rows;  V[run] in row pairs;  A = Σ_s P[:, run s]·V[run s] (fp32 [m, D])
//   O = A / Σ, rounded to bf16 (or kept fp32 when the caller asks: longformer's global rows
//   multiply it by Wv first);  L = M + log Σ saved (fp32) when asked.
// Backward of one tile (FlashAttention-2 style, as TileAttention::backward), with δ and L fp32:
//   S = scale·Q·Kᵀ, dP = dO·Vᵀ (scores_bf16 on K and V pair panels);  P = exp(S − L),
//   dS = P ⊙ (dP − δ) in fp32 (TileColumns::softmax_grad); P and dS rounded to bf16 (row pairs,
//   and dS rows);  dV[run] += Pᵀ·dO, dK[run] += scale·dSᵀ·Q (accumulate_transposed_bf16, into the
//   head's fp32 accumulators, strided rows in place);  dQ = scale·Σ_s dS[:, run s]·K[run s]
//   (accumulate_pv_bf16, an fp32 [m, D] tile, rounded to bf16 once: every query row is in one task).
//   The head's dK, dV: fp32 [N, D] accumulators per thread (a head per task), rounded to bf16
//   when the head is done (HeadBackward<bf16>::finish), as global key rows get a sum from every tile.
// FLOPs: exactly the fp32 kernel's (tile_flops, tile_backward_flops, the same `gather` flag; the
// padding columns and the conversions are not counted).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tensor.hpp"
#include "lib/core/tile_kernels.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/gathered_attention.hpp"

namespace xfb::fixed {

// What a TileAttentionBf16 instance must hold: tiles of ≤ rows query rows and ≤ cols score
// columns (the panel layout's width, panel_width).
struct TileCapacity {
  std::int64_t rows = 0, cols = 0;
};
// Σ_s 16⌈w_s/16⌉ over the tile's runs: its score columns in the panel layout.
std::int64_t panel_width(const TilePattern& tile);
// The capacity the largest of `tasks` needs; plan(task, tile) fills the tile pattern of a task.
template <typename Task, typename Plan>
TileCapacity most_tile_capacity(const std::vector<Task>& tasks, Plan&& plan) {
  TilePattern tile;
  TileCapacity most;
  for (const Task& task : tasks) {
    plan(task, tile);
    most.rows = std::max(most.rows, tile.rows());
    most.cols = std::max(most.cols, panel_width(tile));
  }
  return most;
}

class TileAttentionBf16 {
 public:
  using Element = bf16;
  using Grads = TileGradsOf<bf16>;
  // Forward buffers: fp32 scores [R̄, C] (R̄ = rows rounded up to even), bf16 P rows [R̄, C], bf16 K
  // pair panels and V row pairs [C, D] each, the fp32 accumulator [R, D]. D % 16 == 0.
  TileAttentionBf16(TileCapacity capacity, std::int64_t d);
  static std::int64_t bytes(TileCapacity capacity, std::int64_t d);

  // The tile's output rows (out + r·out_ld): bf16 (rounded) or fp32 (A/Σ unrounded) — from the bf16
  // q (q + r·q_ld) and the head's k, v ([n, D], row stride D); row r's log-sum-exp at
  // lse[r·lse_step] when lse is given (−inf for a row that sees nothing; its output is 0). Returns
  // the tile's FLOPs (tile_flops).
  template <class Out>
  std::int64_t attend(const TilePattern& tile, const bf16* q, std::int64_t q_ld, const bf16* k, const bf16* v, Out* out,
                      std::int64_t out_ld, float* lse = nullptr, std::int64_t lse_step = 1);
  // attend with bf16 rows, in the fp32 kernel's argument list (gather is the fp32 kernel's choice;
  // the panel layout always packs each run).
  std::int64_t run(const TilePattern& tile, const bf16* q, std::int64_t q_ld, const bf16* k, const bf16* v, bf16* out,
                   std::int64_t out_ld, bool, float* lse = nullptr, std::int64_t lse_step = 1) {
    return attend(tile, q, q_ld, k, v, out, out_ld, lse, lse_step);
  }

  // Backward buffers besides the forward's: fp32 dP/dS [R̄, C], bf16 P and dS in row pairs and dS
  // rows ([R̄, C] each), V pair panels and K row pairs ([C, D] each), Q and dO row pairs ([R̄, D]
  // each), the fp32 dQ tile [R, D].
  void enable_backward();
  static std::int64_t backward_bytes(TileCapacity capacity, std::int64_t d);
  // The backward of a tile run() computed: dK, dV added into g.dk, g.dv (fp32), dQ into the fp32
  // tile dq_tile() and, when g.dq is set, rounded into its rows. Returns the FLOPs the fp32 kernel
  // counts for the same tile and `gather` (tile_backward_flops).
  std::int64_t backward(const TilePattern& tile, const Grads& g, const bf16* k, const bf16* v, bool gather);
  // The fp32 dQ of the last backward's tile, [rows, D].
  const float* dq_tile() const { return dq_.data(); }

 private:
  // S = alpha·X·Yᵀ over every run (Y: k or v of the head), through the panels.
  void products(const TilePattern& tile, const bf16* x, std::int64_t x_ld, const bf16* y, float alpha, bf16* panels,
                float* s, std::int64_t ld);
  // out += alpha·Σ_s P[:, run s]·Y[run s], P bf16 rows (stride ld), Y packed into row pairs.
  void weighted_rows(const TilePattern& tile, const bf16* p, std::int64_t ld, const bf16* y, float alpha, float* out,
                     bf16* pairs);

  std::int64_t d_;
  TileCapacity capacity_;
  Tensor floats_, halves_;      // forward: scores, acc | probs, key panels, value pairs
  Tensor grads_, pairs_, dq_;   // backward (enable_backward): dP/dS | bf16 pairs and panels | dQ
  std::vector<float> row_sum_;  // Σ of the tile's rows
  TileColumns cols_;
};

// The per-head part of a gathered model's backward, one head per task: begin() gives the head's
// rows with δ = dO·O of each row (fp32) and its gradients zeroed; finish() writes dK, dV (bf16:
// the thread's fp32 accumulators rounded). Tracked: δ per thread [threads, N] and, for bf16, the
// accumulators [threads, 2, N, D] (fp32).
template <class T>
class HeadBackward {
 public:
  HeadBackward() = default;
  HeadBackward(std::int64_t threads, std::int64_t tokens, std::int64_t d);
  static std::int64_t bytes(std::int64_t threads, std::int64_t tokens, std::int64_t d);
  // Head at element offset `offset` of the [B, H, N, D] tensors, lse its [N] log-sum-exp; adds the
  // FLOPs of δ (2·N·D) to flops.
  HeadRowsOf<T> begin(const block_sparse::BackwardTensors& t, std::int64_t offset, const float* lse, int thread,
                      std::int64_t& flops);
  void finish(const block_sparse::BackwardTensors& t, std::int64_t offset, int thread);

 private:
  std::int64_t tokens_ = 0, d_ = 0;
  Tensor deltas_, accumulators_;
};

extern template class HeadBackward<float>;
extern template class HeadBackward<bf16>;

// The kernel of an element type.
template <class T>
using GatheredKernel = std::conditional_t<std::is_same_v<T, bf16>, TileAttentionBf16, TileAttention>;

// Why the bf16 form cannot run a problem ("" when it can, or the problem is fp32).
std::string gathered_bf16_unsupported(const Problem& p);

}  // namespace xfb::fixed
