#pragma once
// `long-short`: the Long-Short Transformer (Zhu et al. 2021, arXiv 2107.02192; official code
// NVIDIA/transformer-ls: lra/attention_transformer_ls.py for the bidirectional form,
// autoregressive/model_lib/layer.py for the causal one), in head space.
//
// Per (batch, head), on q, k, v [N, D], with c = 1/√D and LN_long, LN_short two LayerNorms over the D
// features of a row (learned gain and shift per head, eps 1e-5: DualLN):
//   dynamic projection  P = softmax over a group's tokens of (K·W_P)               [tokens, R]
//   long (compressed)   K̄ = LN_long(Pᵀ·K),  V̄ = LN_long(Pᵀ·V)                     [R per group, D]
//   short (window)      K_s = LN_short(K),  V_s = LN_short(V)                      [N, D]
//   out_i = Σ_j a_ij·V̄_j + Σ_t a_it·V_s,t,  a_i = ONE softmax over [c·q_i·K̄ᵀ | c·q_i·K_s,winᵀ]
// The paper's projection is of the layer input X (W_P of X); in attention scope there is no X, so it
// is of the head's keys: W_P [D, R] per head, learned. DualLN as the autoregressive code and the
// paper: LN_long after the compression (the code's dual_ln_dproj), LN_short on the window's keys and
// values (dual_ln_win); queries are not normalised.
// Choices against the official codes (state them in any comparison): both codes LayerNorm over
// d_model = H·D, across the heads; xfbench's per-head LN over D is the attention-scope choice. The
// LRA code normalises K, V first and compresses the normalised rows, K̄ = LN_s(Pᵀ·LN_l(K)), with the
// window on LN_l(K); xfbench uses the autoregressive code's order (compress the raw K, V, then LN)
// for both forms. Left out: the autoregressive code's Transformer-XL relative-position terms
// (r_w_bias, r_r_bias and the positional projections of window and chunks) and the LRA code's
// optional depthwise convolution over V (conv_kernel_size).
//
// Non-causal (the LRA model): one group of all N tokens (P's softmax down each of its R = `rank`
// columns over the N tokens). Segments of w = `segment` queries; a query of segment s sees every
// compressed row and the window keys [s·w − e, s·w + w + e) ∩ [0, N), e = max(⌊w/2⌋, 1) (the code's
// ext_len); the last segment may be shorter (N not a multiple of w). Every query of a segment sees the
// same keys, so there is no mask: the compressed scores of all N queries are one product [N, R], each
// segment's window scores one tile [rows, window], into one score row per query.
// Causal (the enwik8 model): groups are chunks of l = `chunk` tokens, each compressed to R =
// `chunk_rank` rows (the softmax within the chunk); the incomplete last chunk is not compressed. A
// query in chunk g sees the compressed rows of chunks 0 … g−1 (the previous complete ones: the code's
// chunk_attn_mask) and the w = `window` most recent tokens, itself included (j ∈ [i − w + 1, i]: the
// code's get_diagonals). Queries run in blocks of one chunk: a tile [rows, g·R + rows + w − 1] of
// which the window part is masked to the band. The compressed memory grows with N (N/l·R rows), so
// the causal forward is O(N·(N·R/l + w + l)·D), as the paper's.
// Decoding keeps per (batch, head) the compressed rows ([⌊(N+T)/l⌋·R, D], LN'd), a ring of the last w
// LN'd keys and values (KvCache) and the raw keys and values of the current incomplete chunk ([l, D]);
// a step attends by online softmax to the compressed rows of complete chunks before its own and to
// the ring, then compresses its chunk when it completes: O((N/l)·R + w)·D per token.
//
// Parameters (learned; all drawn by coordinates, so every N and both forms share them):
//   projection  [H, D, R]   D^(−½)·normal_at(h, f, j) of "long-short/projection" (R = rank, causal chunk_rank)
//   long_gain, short_gain   [H, D]   1 + 0.02·normal (the code's LayerNorm init N(1, 0.02))
//   long_shift, short_shift [H, D]   0.02·normal (the code's init is 0; drawn so tests see the shift)
// Gradients "d" + each name.
//
// Backward: the forward saves only each query row's log-sum-exp ([B·H, N]: linear); the backward
// recomputes the projection, compression and LayerNorms, then per tile the probabilities from the
// saved log-sum-exp (Δ_i = dO_i·O_i), then the LayerNorms' backward and the projection's (the
// softmax over each group's tokens, W_P).
//
// FLOPs (exact) per (batch, head), with N' = G·L grouped tokens, C = G·R compressed rows and, per
// tile, `rows` queries and width = its compressed + window columns:
//   forward   2·R·N'·D (K·W_P) + 5·R·N' (softmaxes) + 4·R·N'·D (Pᵀ·K, Pᵀ·V) + 14·(C + N)·D (four LNs)
//             + Σ_tiles (4·rows·width·D + 5·rows·width + 2·rows)       (scores, softmax + lse, values)
//   backward  the forward's first line again + 12·R·N'·D + 4·R·N' + 40·(C + N)·D
//             + Σ_tiles (10·rows·width·D + 4·rows·width + 2·rows·D)
// Non-causal, width = R + w + 2e inside the sequence: ≈ 4·N·(r + 2w)·D (the survey's formula at even
// w) + 6·N·r·D for the projection. Causal, tile g's width = g·R + (window keys ≤ w + l − 1).
// Decode step per head: 14·D (LN of k, v) + the online softmax over ⌊t/l⌋·R + min(w, t + 1) rows
// (decode_common's counts; from 128 compressed rows those are one attend_block: 4·rows·D in its two
// sgemm calls + 4·rows + D + 2), and on a completed chunk 6·R·l·D + 5·R·l + 14·R·D.
// Workspace: the parameters and per thread Pᵀ [R, N'], the compressed rows raw and LN'd (4·C·D), the
// window's LN'd keys and values (2·N·D), the score rows of one span (non-causal all N queries,
// causal one chunk; R + w + 2e or C + w + l − 1 columns) and N log-sum-exps: linear in N.
// Backward adds the saved log-sum-exps, the parameter gradients and per thread dPᵀ, dK̄|dV̄, dK_s|dV_s,
// a tile of dP and the tile's Δ. Decoding adds the state above and the step's buffers (per head the
// query and accumulator [2, D] and the compressed rows' scores [⌊(N+T)/l⌋·R], per thread R·l chunk scores).
// bf16 (--dtype bf16; storage only, any D): q, k, v, the output, the gradients and the decode state
// (compressed rows, the window ring, the incomplete chunk) bf16. Each (batch, head) widens its q, k, v
// (and out, dO in training) into the thread's fp32 rows (4·N·D floats; as many again for dO, dQ, dK,
// dV), computes as fp32 and rounds the output and gradients once; the log-sum-exps and parameters stay
// fp32. The prefill's compressed rows and LN'd window rows are rounded once into the state; a step
// LNs its key and value in fp32 and rounds them into the ring, attends with fp32 P (attend_rows on the
// bf16 rows, also from 128 compressed rows, so its FLOPs count attend_rows' chunk rescales there
// instead of attend_block's one), and a completed chunk is compressed from its widened raw rows and
// rounded once (per thread 2·(l + R)·D more floats). The state is the rounded fp32 rows; a step is
// exact on it (tests/models/low_rank/test_long_short_bf16.cpp). Speed about fp32's.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct LongShortConfig {
  std::int64_t segment = 8;     // non-causal: w, queries per segment, which also sees max(w/2, 1) tokens either
                                // side (LRA w = 8); clamped to N
  std::int64_t rank = 32;       // non-causal: r, rows of the dynamic projection (LRA r = 32)
  std::int64_t window = 512;    // causal: w, the most recent tokens a query sees, itself included (enwik8 512)
  std::int64_t chunk = 16;      // causal: l, tokens per compressed chunk (enwik8 l = 16)
  std::int64_t chunk_rank = 1;  // causal: r, compressed rows per chunk (enwik8 r = 1)
};

template <>
Implementation implementation<LongShortConfig>();

}  // namespace xfb
