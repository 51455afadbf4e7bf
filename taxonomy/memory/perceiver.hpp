#pragma once
// `perceiver`: the latent bottleneck of the Perceiver (Jaegle et al. 2021) in head space, and its
// causal form Perceiver AR (Hawthorne et al. 2022). A downsampling model: the output has
// M = min(latents, N) rows per (batch, head) (output_rows).
//
// Per head, on the given q, k, v ([B, H, N, D]; the model's Q/K/V/O projections are outside the
// mechanism), with s = 1/√D:
//   queries Qc [M, D]:  non-causal: the learned latents Z_h (the encoder's latent array, which the
//                       paper projects to queries: in head space the array is learned directly as
//                       the queries); causal: the q rows of the last M positions p_i = N − M + i.
//   cross-attention:    C_i = Σ_j softmax_j(s·Qc_i·k_j) v_j over j ∈ R(i), C [M, D], where
//                       R(i) = [0, N) non-causal; causal R(i) = [0, p_i] (cross_window = 0, the
//                       training form) or [max(0, p_i − w + 1), p_i] (cross_window = w > 0, the
//                       fixed-size rolling cache of generation; the forward uses the same rule,
//                       so decoding equals it).
//   latent layer:       Lq, Lk, Lv = C·Wq_h, C·Wk_h, C·Wv_h [M, D];
//                       O_i = Σ_l softmax_l(s·Lq_i·Lk_l) Lv_l over l < M (causal: l ≤ i).
// Exactly one latent self-attention layer: a latent's Lk, Lv depend only on its own C row, and C_i
// depends only on its position and the inputs before it (not on N or on which window it is in),
// so a decoder can cache the latent keys and values of the last M positions exactly. A second
// latent layer would read rows of the first that change as the window slides: not cacheable.
// Choices where the papers' code does more: the official blocks wrap each attention in
// LayerNorms of its inputs, a query residual and an MLP (perceiver.py CrossAttention,
// SelfAttention); those act at model width around the Q/K/V/O projections and belong to the
// layer, so the mechanism is the two attentions and the latent layer's own projections Wq, Wk, Wv
// (its output projection is the model's O). One cross-attention "head" per head and one latent
// head per head (v1's 1 cross head / 8 latent heads sharing is a model-width choice). N < latents:
// M clamps to N (the first N latents; causal: every position is a latent).
//
// Parameters, from the seed: latents [H, M, D] (non-causal only) truncated normal, std 0.02 cut at
// ±2σ (the encoder code's TrainablePositionEncoding, init_scale 0.02; drawn by coordinates and
// redrawn beyond 2σ, so M latents are a prefix of more); latent_projections [H, 3, D, D] (Wq, Wk,
// Wv) N(0, 1/D) (the code's VarianceScaling(1) fan-in scale, untruncated).
//
// Backward: saves C [B·H, M, D] and the cross-attention row log-sum-exp [B·H, M]; recomputes the
// latent layer and the cross tiles. Gradients dq (causal: the last M rows, others 0), dk, dv,
// dlatents (non-causal), dlatent_projections.
// Decode (causal): the cross keys and values (the whole sequence, or a ring of w), the ring of the
// latent Lk, Lv of the last `latents` positions; a step costs O((N or w)·D + latents·D + D²).
//
// FLOPs (exact) per (batch, head), V(i) = |R(i)|, tiles(i) = key tiles of row i's block that meet R(i):
//   cross: Σ over computed tiles 2·2·rows·cols·D  +  Σ_i (4·V(i) + D·tiles(i) + D)
//   latent: 3·2·M·D² + 2·2·M²·D + 5·Σ_i valid(i)      (valid(i) = M, causal i + 1)
// Backward FLOPs (exact) per (batch, head): cross: Σ over tiles 5·2·rows·cols·D (S again, dV, dP, dQc,
// dK) + 4·Σ_i V(i) (P from the log-sum-exp, dS) + 2·M·D (the rows' dC·C); latent: 3·2·M·D² (rows
// again) + 5·2·M²·D (scores, dLv, dP, dLq, dLk) + 6·2·M·D² (dW, dC) + 9·Σ_i valid(i) (softmax again
// and its backward).
// Work O(M·N·D + M²·D + M·D²); never an N×N matrix; workspace O(M·(D + block) + M²) per thread.
// bf16 (--dtype bf16; storage only, any D): q, k, v, the output, the gradients and the decode state
// (cross keys and values, the latent ring) bf16. Each (batch, head) widens its k, v and causal q's
// last M rows into the thread's fp32 rows ((2N + 2M)·D floats causal, (2N + M)·D non-causal; the
// backward as many more for dK, dV, dO, dQc), computes as fp32 and rounds its output and gradients
// once; C, the log-sum-exp and the parameters stay fp32 (the saved C is M·D per head, against the
// inputs' 3·N·D). A decode step keeps P in fp32 and rounds the latent key and value it adds to the
// ring, so the ring holds the rounded rows of the forward's fp32 Lk, Lv; the step is exact on that
// state (tests/models/memory/test_perceiver_bf16.cpp). FLOPs as fp32; speed about fp32's.
// `latents` is recorded as given (resolve does not clamp it: a decoder's latent window grows to it
// as tokens arrive); cross_window resolves to 0 in the non-causal form, where it has no meaning.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct PerceiverConfig {
  std::int64_t latents = 512;     // M, latent rows per head (the encoder code's z_index_dim); M = min(latents, N)
  std::int64_t cross_window = 0;  // causal: inputs a latent cross-attends to, tokens (0 = every earlier input)
  std::int64_t block_rows = 128;  // latent rows per cross-attention tile, rows (implementation)
  std::int64_t block_keys = 256;  // input keys per cross-attention tile, tokens (implementation)
};

template <>
Implementation implementation<PerceiverConfig>();

}  // namespace xfb
