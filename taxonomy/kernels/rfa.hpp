#pragma once
// `rfa`: Random Feature Attention (Peng et al. 2021, arXiv 2103.02143), causal and not, with the
// optional gated recurrence (RFA-Gate).
//
// Per head h, with R random features (φ has M = 2R entries) and each row x of q and k normalised,
//   x̂ = x / max(‖x‖, 10⁻¹²),   x̃ = σ_h ⊙ x̂,   p = W̃_h·x̃ ∈ R^R,
//   φ(x) = √(1/R)·[sin p ; cos p]                       (φ(q)·φ(k) ≈ exp(−‖σ⊙(q̂ − k̂)‖²/2))
// Parameters, per head (no head shares them):
//   random_features W̃ [H, R, D]: i.i.d. N(0, 1), stream "rfa/random_features"; drawn, not learned.
//   sigma σ [H, D]: the paper's learned per-dimension scale (W = σ ∘ W̃ scales W̃'s columns, i.e.
//     each input dimension, as the paper's reparametrisation w = σ ∘ w̃), initialised to 1.
//   gate=1 only — gate_weight w_g [H, D]: N(0, 1/D), stream "rfa/gate_weight"; gate_bias b_g [H]: 0.
// Non-causal:   out_i = φ(q_i)ᵀ S / den(φ(q_i)·z),   S = Σ_j φ(k_j) v_jᵀ,  z = Σ_j φ(k_j).
// Causal, the recurrence over t (a_t = b_t = 1; gated: a_t = g_t, b_t = 1 − g_t):
//   S_t = a_t·S_{t−1} + b_t·φ(k_t) v_tᵀ,   z_t likewise,   out_t = φ(q_t)ᵀ S_t / den(φ(q_t)·z_t).
//   The gate reads the head's raw key row (attention scope has no token x):
//   g_t = sigmoid(w_g·k_t + b_g). The gate is a recurrence over past tokens, so gate=1 is causal
//   only (the paper's RFA-Gate is its recurrent form): a non-causal point with it is `unsupported`.
// Denominator: sin/cos features make φ(q)·z signed; den(z) = max(z, floor) (default 10⁻³; the
// authors' causal code uses 1: floor=1). A clamped row's output is numerator/floor and its
// gradient through z is 0.
//
// Why not the chunked engine (kernels/linear_attention.hpp): its features are positive and its
// normaliser unclamped, its map's gradient has no parameter gradient (σ), and it has no decay.
// Here the features of a chunk of C rows are one ops::gemm (x̃·W̃ᵀ) and every sum is an ops::gemm:
// non-causal S = Σ φ(K_c)ᵀ[V_c | 1], out'_c = φ(Q_c)·S; causal, the chunkwise recurrence with
// L_i = Σ_{l≤i} log a_l inside the chunk (0 ungated) and S the state before it:
//   A = tril(φ(Q)φ(K)ᵀ) ⊙ [b_j·exp(L_i − L_j)],  out'_c = A·[V | 1] + diag(exp(L))·φ(Q)·S,
//   S ← exp(L_last)·S + (diag(b_j·exp(L_last − L_j))·φ(K))ᵀ·[V | 1]     (every exponent ≤ 0).
// A decode step is the token recurrence itself, one rank-one update of the [M, D+1] state [S | z];
// it equals the chunked forward up to rounding.
//
// FLOPs per head, n = N, features per row F = 2·R·D (the gemm) + 4·D (norm, x̂, x̃) + 4·R (sin,
// cos, two scales); gate per key row Gt = 2·D + 5 (dot, bias, sigmoid 3, 1 − g):
//   non-causal: 2·n·F + 4·n·M·(D+1) + n·D
//   causal:     2·n·F + n·D + Σ_chunks [2·n_c²·M + 4·n_c·M·(D+1) + 2·n_c²·(D+1)]
//               gated + n·Gt + Σ_chunks [n_c·(D + M + 7) + 2·n_c·(n_c + 1) + M·(D+1)]
//   O(N·C·(M + D) + N·M·D): linear in N at a fixed chunk C.
// Workspace: the parameters plus, per thread, for a chunk of C = min(chunk, N) rows: x̂ of q and k
// and x̃ [C, D] each, 1/‖x‖ [C] ×2, φ(Q), φ(K) [C, ld(M)], [V | 1] and the numerators
// [C, ld(D+1)], a_t, b_t [C], the state [M, ld(D+1)], causal A [C, ld(C)]: independent of N.
// Backward (σ and, gated, w_g, b_g learned; W̃ fixed): causal saves the state at each chunk start
// (B·H·⌈N/C⌉·M·ld(D+1) floats: O(N)); the backward walks the chunks in reverse with the state's
// adjoint R carried, recomputes the chunk's features and out', and differentiates the chunkwise
// form above with gemms only (the gate through L, W and the carried decays; the formulas are at
// head_backward_causal in rfa.cpp). Non-causal saves S per head (B·H·M·ld(D+1) floats) and
// recomputes the features. A clamped row's z gets no gradient. FLOPs: backward_flops in rfa.cpp.
// Decode: the state [S | z] per head, [M, D+1] (2·R·(D+1) values; ld(D+1) floats a row): O(1) per
// token, constant in N; a step is one token of the recurrence: features 2·F, gated Gt, the update
// 2·M·(D+1) (gated 3·M·(D+1) + M), the output 2·M·(D+1), D to normalise.
//
// bf16 (Problem::dtype == DType::BF16, issue 31): q, k, v, out, dout, dq, dk, dv, the saved states
// (chunk starts or S) and the decode state [S | z] are bf16; the parameters (W̃, σ, w_g, b_g) and
// their gradients stay fp32, and everything in between is the fp32 computation above: a chunk's q
// and k rows are widened into per-thread fp32 rows [C, D] (v straight into [V | 1]), the features,
// the gate, every ops::gemm (oneDNN sgemm on small cache-resident chunk products, as the linear-
// attention engine's bf16 form) and the walk's running state are fp32. Rounding points, each once:
// the output (≤ u·|o|, u = 2⁻⁸); the gradients (a chunk's rows through a per-thread fp32 [C, D]
// buffer); each saved state when saved, except its z column, kept beside it in fp32 (B·H·slots·M
// floats), so the backward's recomputed denominators are the forward's (z sums signed sin/cos
// features: a rounded z would move row i's G by u·Σ_j |w_ij| / z_i); the rounded S entries reach
// only φ(Q)·S0ᵀ (dq, dσ) and the gate's ⟨R, S0⟩;
// the decode state after the prefill and after every step (a step widens each state element,
// updates it in fp32, answers the query from the fp32 value and stores it rounded), so after r
// roundings an entry is within r·u of its (decayed) magnitude sum Σ |φ(k)|·|[v | 1]|. The bounds
// the tests derive from these are in tests/models/kernels/test_rfa_bf16.cpp. FLOPs are the fp32
// form's; the workspace adds, per thread, the widened rows 2·C·D floats (and C·D for the gradient
// rows in training) and the saved z columns, and the saved and decode states take 2 bytes an element.
#include <cstdint>

#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct RfaConfig {
  std::int64_t features = 64;  // random features R per head (φ has 2·R entries)
  bool gate = false;           // RFA-Gate: the gated recurrence (causal only); off as the paper's main model
  double floor = 1e-3;         // lower clamp of the denominator φ(q)·z (dimensionless)
  std::int64_t chunk = 64;     // rows per chunk (tokens): feature gemms, non-causal sums, backward checkpoints
};

template <>
Implementation implementation<RfaConfig>();

}  // namespace xfb
