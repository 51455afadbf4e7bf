#pragma once
// `longformer` (Beltagy et al. 2020): sliding-window attention, optionally dilated on some heads,
// plus symmetric global attention of the first `globals` positions with their own projections.
//
// Per head h (q, k, v: that head's [N, D] rows; s = ⌊window/2⌋; d_h = dilation on the last
// `dilated_heads` heads, 1 on the others; g = min(globals, N)):
//   non-global query i ≥ g: keys W(i) ∪ {0 … g−1}, with
//     W(i) = {j = i + d_h·t : −s ≤ t ≤ s} (non-causal) or {j = i − d_h·t : 0 ≤ t ≤ s} (causal),
//     out_i = softmax_j(q_i·k_jᵀ/√D) · v_j  over those keys, the plain q, k, v.
//   global query i < g: every key j (causal: j ≤ i), through the global projections
//     Wq_h, Wk_h, Wv_h ∈ R^{D×D} (row vector times matrix):
//     out_i = Σ_j softmax_j((q_i·Wq_h)·(k_j·Wk_h)ᵀ/√D) · (v_j·Wv_h).
//   This is computed as q̃_i = (q_i·Wq_h)·Wk_hᵀ, a = Σ_j softmax_j(q̃_i·k_jᵀ/√D)·v_j, out_i = a·Wv_h
//   (the same value by associativity; no projected copy of K or V is made).
// Causal: the window is one-sided (the past half, s keys plus i itself) and global queries see
// only j ≤ i; globals are the first positions, so every other token sees them without seeing the
// future.
// Parameters (from the seed): global_wq, global_wk, global_wv, each [H, D, D], N(0, 1/D) entries.
// Computation: tiles of `tile` query rows (engines/window_global.hpp) on the gathered-attention kernel.
// FLOPs: Σ tiles tile_flops (engines/gathered_attention.hpp) + per global tile 3·2·rows·D·D (projections).
// Backward: the forward saves the log-sum-exp and, for global rows, q·Wq, q̃ and the attention's
// output; the backward recomputes every tile and forms dWq, dWk, dWv (one task per head index,
// summed over the batch).
// Decode (causal; the state): the g global tokens' keys and values and a ring of the last
// s·d_max + 1 tokens (every head's one-sided window). A decoded token is never global (g ≤ N: g is
// clamped to the context), so it attends with its plain q to the globals and to the window tokens
// i − d_h·t ≥ g: O(g + s) per token, state constant in N.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct LongformerConfig {
  std::int64_t window = 512;       // w, tokens: w/2 keys on each side (causal: w/2 before)
  std::int64_t dilation = 1;       // gap between window keys on the dilated heads, tokens
  std::int64_t dilated_heads = 2;  // how many of the last heads use the dilation
  std::int64_t globals = 1;        // g: positions 0 … g−1 are global (clamped to N)
  std::int64_t tile = 64;          // query rows per computed tile (implementation)
};

template <>
Implementation implementation<LongformerConfig>();

}  // namespace xfb
