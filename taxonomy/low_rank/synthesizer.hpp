#pragma once
// `synthesizer` (Tay et al. 2020a): attention weights synthesised without (or besides) query–key
// dot products; O(N²) by design, so the [N, N] logit matrix per head is materialised.
//   out = softmax(L)·V,  L = (1 − α)·L_syn + α·Q·Kᵀ/√D   (α = vanilla_weight; α > 0 is the paper's
//   mixture "+ Vanilla"; α = 0 is the pure synthesizer and skips Q·Kᵀ).
// Variants of L_syn for head h (parameters from the seed, one set per head, shared by the batch):
//   dense:             L_syn[i] = W₂ᵀ·ReLU(W₁ᵀ·q_i + b₁) + b₂ — a 2-layer MLP of the head's query
//                      vector giving N logits; W₁ [H, D, D], b₁ [H, D], W₂ [H, D, N], b₂ [H, N];
//                      all entries N(0, 1/D).
//   random:            L_syn = R, R [H, N, N] fixed, entries N(0, 1).
//   factorized-random: L_syn = R₁·R₂ᵀ, R₁, R₂ [H, N, k] (k = factor_rank), entries N(0, k^(−1/2)).
// Parameters with a position axis (W₂, b₂, R, R₁, R₂) draw entry (h, a, b) by its coordinates, not
// its offset, so those of N tokens are a prefix of those of N + T (the model decodes past N).
// Causal (decoding): entries j > i of L are excluded by the masked softmax.
// FLOPs per (batch, head): softmax 5·(N² or N(N+1)/2 causal) + P·V 2·N²·D
//   + α > 0: 2·N²·D (Q·Kᵀ)
//   + dense: 2·N·D² + 2·N·D (bias b₁, ReLU) + 2·N²·(D+1) (b₂ rides in the product as a ones
//     column of the hidden layer times [W₂; b₂])
//   + random: 2·N² when α > 0 (scaled add), none otherwise (a copy)
//   + factorized-random: 2·N²·k.
// Workspace: logits [B·H, N, padded_ld(N)], the parameters, and for dense the hidden layer
// [B·H, N, D+1] and the stacked [W₂; b₂] [H, D+1, N].
// Backward: the forward saves P (and, dense, the hidden layer); softmax's backward gives dL, which
// flows to Q and K through α·Q·Kᵀ/√D and to the synthesiser's parameters (summed over the batch)
// through (1 − α)·L_syn: d[W₂; b₂] = hiddenᵀ·dL, the ReLU, dW₁ = Qᵀ·d(pre-activation), db₁, and dQ;
// dR = Σ dL; dR₁ = dL·R₂, dR₂ = dLᵀ·R₁. Workspace as much again as the forward's.
// Decode: the cached values (and keys when α > 0) of every token, and the parameters extended to
// N + T positions; a step synthesises its logit row over keys 0 … i (dense: the MLP of its query,
// 2·D² + 2·D + 2·(D+1)·(i+1) FLOPs; random: R's row; factorized: R₁[i]·R₂ᵀ, 2·k·(i+1)), adds
// α·q·Kᵀ/√D, softmaxes and multiplies by V: O(N) per token.
// What a step reads beyond parameters() (decode_parameters(), dumped as decode_<name>.npy), all the
// draws of a model built for N + T tokens: dense "w2_b2" [H, D+1, N+T] (rows 0 … D−1 W₂, row D b₂;
// with w1 and b1 of parameters()); random "r_decoded_rows" [H, T, N+T] (R's rows N … N+T−1);
// factorized "r1_decoded_rows" [H, T, k] (R₁'s rows N … N+T−1) and "r2" [H, N+T, k] (R₂ whole).
// bf16 (--dtype bf16; forward, backward, decode): q, k, v, out, the gradients and the caches bf16;
// α·Q·Kᵀ/√D on oneDNN's bf16 matmul into fp32 logits (dense rows, ld = N), the synthetic logits in
// fp32 from the fp32 parameters (dense: Q widened, [B·H, N, D] floats more), softmax in fp32 with P
// rounded to bf16 over the logits' own bytes, O = P·V on the bf16 matmul, rounded once. A step: the
// same logit row in fp32 on the bf16 cache, P rounded to bf16, P·V summed in fp32. Backward: dV =
// Pᵀ·dO and dP = dO·Vᵀ on the bf16 matmul from the saved bf16 P, dL = P·(dP − Σ P·dP) in fp32 for the
// synthesiser's (fp32) parameter gradients (dense: Q widened, dQ's part in an fp32 accumulator
// [B·H, N, D]), then dL rounded to bf16 in place for dQ, dK on the bf16 matmul. FLOPs as fp32; its
// error that of softmax attention in bf16 (tests/support/bf16_check.hpp) on the logits' fp32 error.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

enum class SynthesizerVariant { Dense, Random, FactorizedRandom };

struct SynthesizerConfig {
  SynthesizerVariant variant = SynthesizerVariant::Dense;
  std::int64_t factor_rank = 8;  // k of R₁·R₂ᵀ (factorized-random)
  double vanilla_weight = 0.0;   // α: weight of Q·Kᵀ/√D in the mixed logits, in [0, 1]
};

template <>
Implementation implementation<SynthesizerConfig>();

}  // namespace xfb
