#pragma once
// `tokenlearner` (Ryoo et al. 2021, TokenLearner V1.1 of google-research/scenic
// projects/token_learner/model.py) in attention scope, followed by full attention over the learned
// tokens.
//
// TokenLearner V1.1 maps X [N, C] to S tokens: α = softmax over the N positions of MLP(LN(X))
// (LN over C; MLP Dense(F) → GELU → Dense(S), with biases; α is [S, N], each row sums to 1), tokens
// = α·X [S, C]; the next block attends over the S tokens. In attention scope the mechanism gets
// the per-head q, k, v ([B, H, N, D]), not X, so per head h:
//   α_h = softmax_N( (GELU(LN_h(v_h)·W1_h + b1_h)·W2_h + b2_h)ᵀ )        [S, N]
//   Q̃ = α_h·q_h,  K̃ = α_h·k_h,  Ṽ = α_h·v_h                             [S, D] each
//   out = softmax(Q̃·K̃ᵀ/√D)·Ṽ                                            [S, D]  (M = S rows)
// Choices (the paper is on X; these are ours):
//   - one α per head pools q, k and v alike: the projections have no bias, so pooling q, k, v with
//     one α equals projecting the pooled X (α·X·W = α·(X·W)), as TokenLearner followed by
//     attention computes;
//   - α is computed from that head's values v_h (the content projection, as X is the content the
//     tokens sum): LN over the D features of a row, per-head parameters (the paper shares one MLP
//     over all C channels; the heads here are independent);
//   - GELU in the exact erf form (the project's FLOP convention; flax's default is the tanh
//     approximation), evaluated with an erf polynomial of absolute error < 2e-7;
//   - LN eps 1e-6 (flax's default);
//   - S is clamped to N (the output has M ≤ N rows by contract).
// V1 (sigmoid of four 3×3 convolutions over the h×w image grid, sum pooling) is not offered: the
// code requires a square h = √N grid and convolves in 2-D, which a 1-D sequence of any N has no
// counterpart of without inventing one.
// Not causal: α is a softmax over all N positions, so every output depends on every token: a
// causal point is `unsupported`.
// Parameters (from the seed, perturbed around the code's initialisation so a test sees each one):
//   ln_gains [H, D] ~ N(1, 0.1²), ln_shifts [H, D] ~ N(0, 0.1²),
//   w1 [H, D, F] ~ N(0, 2/(D+F)), b1 [H, F] ~ N(0, 0.1²), w2 [H, F, S] ~ N(0, 2/(F+S)), b2 [H, S] ~ N(0, 0.1²)
//   (the code: xavier-uniform kernels, biases N(0, 1e-12), LN 1 and 0).
// Never N×N: the MLP runs over chunks of 256 rows; α [S, N] per head is kept (it is the backward's).
// FLOPs (exact) per (batch, head):
//   7·N·D (LN) + 2·N·F·D + N·F (Dense 1) + 5·N·F (GELU) + 2·S·N·F + S·N (Dense 2) + 5·S·N (softmax)
//   + 3·2·S·N·D (pooling) + 2·S²·D + 5·S² + 2·S²·D (attention).
// Backward: the forward keeps α, Q̃, K̃, Ṽ and the attention probabilities (its workspace); LN and
// the MLP are recomputed chunk by chunk. Parameter gradients are summed over the batch (one task
// per head). FLOPs per (batch, head):
//   4·2·S²·D + 4·S² (attention) + 3·2·N·S·D (dq, dk, dv through α) + 3·2·S·N·D (dα) + 4·S·N
//   (softmax) + S·N (db2) + 7·N·D + 2·N·F·D + N·F + 5·N·F (recompute) + 2·F·S·N (dW2) + 2·N·F·S
//   (dG) + 11·N·F (GELU) + N·F (db1) + 2·D·F·N (dW1) + 2·N·D·F (dLN) + 19·N·D (LN backward)
//   + 2·D per 256-row chunk (LN gain and shift sums).
// bf16 (--dtype bf16, forward and backward): q, k, v, out, dq, dk, dv and the kept α, Q̃, K̃, Ṽ and
// token attention are bf16; the parameters, their gradients and every sum fp32. Roundings, each once:
// α (computed in fp32 from the bf16 v, a chunk of rows widened at a time); Q̃, K̃, Ṽ = bf16(α·x)
// (oneDNN's bf16 matmul, or its widening fallback below AVX-512: fp32 sums); the token attention's P
// (its scores and softmax fp32 on the widened tokens); out = bf16(P·Ṽ). The backward is the fp32
// form's on the widened kept tensors (α, the tokens, P, dO; x a 256-row chunk at a time), dq, dk and
// dv (with LN's input gradient) of a chunk rounded once. FLOPs are the fp32 form's; the workspace adds
// per thread fp32 α [S, ld] and a widened chunk of v, and in training the widened tokens, P, dO
// (4·S·D + S²) and a chunk's gradient rows.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct TokenLearnerConfig {
  std::int64_t tokens = 8;       // S, learned tokens per head (module default 8; 16 in the ImageNet config); ≤ N
  std::int64_t bottleneck = 64;  // F, hidden units of the weight MLP (the code's bottleneck_dim)
};

template <>
Implementation implementation<TokenLearnerConfig>();

}  // namespace xfb
