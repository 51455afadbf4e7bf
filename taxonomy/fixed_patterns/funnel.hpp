#pragma once
// `funnel` (Dai et al. 2020, Funnel-Transformer): the first layer of a Funnel block, whose queries
// are the mean-pooled sequence and whose keys and values are the unpooled one ("pool-query-only").
//
// Per head (q, k, v: that head's [N, D] rows):
//   Q̃ [M, D], row i = mean of its source rows of q (window 2, stride 2);
//   out = softmax(Q̃·Kᵀ/√D)·V, [M, D]: every pooled query sees all N keys (no mask).
// The pooling is taken in head space: the official code pools the hidden states before the query
// projection, which has no bias, so pooling q is the same value.
// Sources of pooled row i (the official code's pool_tensor with ceil_mode: a window that runs past
// the end averages the rows it holds):
//   default:                          rows 2i, 2i+1; M = ⌈N/2⌉; for odd N the last row is q_{N−1} alone.
//   separate_cls:                     row 0 is q_0 alone (the [CLS] kept apart), row i ≥ 1 averages
//                                     q_{2i−1}, q_{2i}; M = ⌊N/2⌋ + 1 (for even N the last row is
//                                     q_{N−1} alone).
//   separate_cls + truncate_seq:      the same with the last token dropped first: M = ⌈N/2⌉, q_{N−1} is
//                                     in no pooled row (its dq is 0); for odd N the last row is q_{N−2}
//                                     alone.
// truncate_seq without separate_cls is rejected (the official code ignores it there). Defaults are
// the paper's plain stride-2 pooling (the PyTorch code's argparse defaults); the TF code defaults to
// separate_cls = truncate_seq = true. The official code skips pooling for sequences of ≤ 2 tokens
// (≤ 1 without separate_cls); this mechanism is the pooling layer itself and always pools.
// Left out: the relative positional attention of Transformer-XL (position bias, segment bias and
// the [CLS] function mask, which only touches those biases) — content attention only, as every
// other model here sees only q, k, v. No parameters.
// Not causal: the paper gives no causal form of the pooled-query attention (the survey's Decode mark
// notwithstanding), so a causal point is `unsupported`.
// Computation: Q̃ into a buffer, then the blocked online softmax of exact-tiled on Q̃ against the N
// keys: tasks of block_q pooled rows, key tiles of block_k; when D is a multiple of 16 on the
// register-blocked tile kernels (K packed into panels once per call, strips of 32 rows), else on
// sgemm. Nothing M×N is kept: workspace Q̃ (B·H·M·D), the packed K (B·H·⌈N/16⌉·16·D on the kernels)
// and per thread one score strip and one accumulator.
// FLOPs (exact) per (batch, head): 2·D per pooled row with two sources; per key tile of c keys
//   2·M·c'·D (scores; c' = c rounded up to whole 16-key panels on the kernels, else c) + 2·M·c·D
//   (P·V) + M·(4·c + D) (online softmax and rescale); + M·D (1/l). About half of vanilla's 4·N²·D.
// Backward (FlashAttention-2 style): the forward saves the row log-sum-exp of the M pooled rows (and
// keeps Q̃ and the packed K, its workspace); per head, key blocks of backward_block_k, query strips
// of 128 pooled rows (block_q on sgemm), P and dS recomputed:
//   dV += Pᵀ·dO;  dS = P ⊙ (dO·Vᵀ − δ), δ_i = dO_i·O_i;  dK += dSᵀ·Q̃/√D;  dQ̃ += dS·K/√D;
// then dq of each source row = dQ̃_i / (its row count). FLOPs per head: 2·M·D (δ) + per key block
// of c keys 2·2·M·c'·D + 3·2·M·c·D + 4·M·c, + D per pooled row with two sources.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct FunnelConfig {
  bool separate_cls = false;            // token 0 is its own pooled row, pairs from token 1 (official separate_cls)
  bool truncate_seq = false;            // with separate_cls: drop the last token before pooling (official truncate_seq)
  std::int64_t block_q = 64;            // pooled query rows per forward task, tokens (clamped to M)
  std::int64_t block_k = 1024;          // key columns per forward tile, tokens (clamped to N; whole 16-key panels
                                        // when D is a multiple of 16)
  std::int64_t backward_block_k = 512;  // key columns per backward block, tokens (rounded like block_k)
};

template <>
Implementation implementation<FunnelConfig>();

}  // namespace xfb
