#pragma once
// `poolingformer` (Zhang et al. 2021, "Poolingformer: Long Document Modeling with Pooling
// Attention", arXiv 2105.04371): a two-level attention, a sliding window plus pooled keys and
// values over a larger window, the two outputs summed.
//
// Per head (q, k, v: that head's [N, D] rows; s₁ = ⌊w₁/2⌋, s₂ = ⌊w₂/2⌋; windows clipped at the
// sequence ends, never wrapped or padded):
//   level 1: y_i = softmax_j(q_i·k_jᵀ/√D)·v_j over j ∈ [i − s₁, i + s₁] ∩ [0, N).
//   pooling: M = ⌈N/ξ⌉ pooled rows; row m is the mean of the token rows [m·ξ, m·ξ + κ) ∩ [0, N)
//     (the last rows average fewer tokens; count excludes the padding):
//       K̄_m = (1/c_m)·Σ_{t ∈ row m} k_t,  V̄_m likewise,  c_m = min(κ, N − m·ξ).
//   level 2: z_i = softmax_m(q_i·K̄_mᵀ/√D)·V̄_m over the pooled rows that start in i's level-2
//     window, m·ξ ∈ [i − s₂, i + s₂]: the band m ∈ [⌈(i − s₂)/ξ⌉, ⌊(i + s₂)/ξ⌋] ∩ [0, M), about
//     w₂/ξ rows. validate() asks s₂ + 1 ≥ ξ, so every query's band holds at least one row.
//   out_i = y_i + z_i (levels=both; levels=window gives y alone, levels=pooled z alone: the
//   paper's ablations and the tests' view of each level).
//   pooled_query=window_output stacks the levels: level 2's query is y_i instead of q_i (the same
//   K̄, V̄ and band), out_i = y_i + softmax_m(y_i·K̄_mᵀ/√D)·V̄_m; levels=both only.
// Choices where the paper's text could not be read here (state them in any comparison): mean
// pooling (the paper compares pooling kinds; its lightweight dynamic convolution is not
// implemented); by default both levels read the same q, k, v and are summed in parallel (the
// issue's and the survey sheet's "summed"); whether the paper's level 2 reads level 1's output is
// unconfirmed, so that reading is the pooled_query option, without any level-2 projection; no
// parameters. Not causal (no incremental form in the paper; the survey marks it as not decoding):
// a causal point is `unsupported`.
// Computation: K̄ and V̄ once per head per forward ([B, H, M, D], tracked); then tiles of `tile`
// query rows, both levels of a tile in one task on the gathered-attention kernel
// (engines/gathered_attention.hpp), each level a band of one run.
// FLOPs: B·H·2·D·Σ_m c_m (pooling: adds and the 1/c_m scale) + Σ tiles tile_flops of each level
// + B·H·N·D (the sum, levels=both): O(N·(w₁ + w₂/ξ)·D). Memory O(N): K̄, V̄ and per-thread tiles.
// Backward: the forward saves each level's log-sum-exp and y (levels=both; z = out − y is never
// formed: δ₂ = dO·out − dO·y); the backward recomputes the tiles, accumulates dK̄, dV̄ of a head in a
// per-thread [2, M, D] buffer and spreads them back, dk_t += dK̄_m / c_m for every t in row m.
// Stacked, a tile's level-2 backward runs first: its query gradient plus dO is level 1's output
// gradient dY (δ₁ = dY·y), then level 1's backward. Backward FLOPs: 2·N·D (δ) per head, + 2·N·D + N
// (δ₁, δ₂) with both levels, + 3·N·D stacked, + 4·D·Σ_m c_m (spreading back) + Σ tiles
// tile_backward_flops of each level.
// bf16 (--dtype bf16, forward and backward; D % 16 == 0, the bf16 gathered kernel's): q, k, v, K̄, V̄,
// out and the gradients bf16. K̄, V̄ = bf16(the fp32 means of the bf16 rows); each level on the bf16
// gathered kernel (engines/gathered_attention_bf16.hpp: fp32 scores and softmax, P rounded to bf16);
// one level alone rounds its output once, both levels keep y and z in fp32 and round y + z once
// (stacked: level 2's query is bf16(y)). Training keeps each level's log-sum-exp (fp32) and, with both
// levels, bf16(y) [B, H, N, D]. Backward as in fp32 on the bf16 kernel's backward (dS from the fp32 P,
// P and dS rounded for the products): δ = dO·out, δ₁ = dO·bf16(y), δ₂ = δ − δ₁; a head's dK, dV and
// dK̄, dV̄ accumulate in fp32 (dK̄_m / c_m spread into dK) and are rounded once; a query row's dq₁ + dq₂
// is summed in fp32 and rounded once; stacked, dY = bf16(dO + dq₂) and δ₁ = dY·bf16(y). FLOPs (forward
// and backward) as in fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct PoolingformerConfig {
  std::int64_t window = 128;           // w₁, tokens: level 1 sees ⌊w₁/2⌋ keys each side
  std::int64_t pool_window = 512;      // w₂, tokens: level 2 sees pooled rows starting within ⌊w₂/2⌋ each side
  std::int64_t kernel = 5;             // κ, tokens averaged into one pooled row
  std::int64_t stride = 4;             // ξ, tokens between the starts of consecutive pooled rows
  std::string levels = "both";         // both | window (level 1 only) | pooled (level 2 only)
  std::string pooled_query = "input";  // input (q) | window_output (y: level 2 stacked on level 1)
  std::int64_t tile = 64;              // query rows per computed tile (implementation)
};

template <>
Implementation implementation<PoolingformerConfig>();

}  // namespace xfb
