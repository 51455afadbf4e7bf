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
// normaliser unclamped, its map's gradient has no parameter gradient (σ), and the gate decays the
// state token by token. Here the features of a chunk of C rows are one ops::gemm (x̃·W̃ᵀ), the
// non-causal sums are ops::gemm, and the causal form is the recurrence itself, one rank-one update
// of the [M, D+1] state [S | z] per token (L1/L2-resident), which is also the decode step — so a
// step and the causal forward execute the same arithmetic.
//
// FLOPs per head, n = N, features per row F = 2·R·D (the gemm) + 4·D (norm, x̂, x̃) + 4·R (sin,
// cos, two scales); gate per key row Gt = 2·D + 5 (dot, bias, sigmoid 3, 1 − g):
//   non-causal: 2·n·F + 4·n·M·(D+1) + n·D
//   causal:     2·n·F + n·(4·M·(D+1) + D) + gated n·(Gt + M·(D+1) + M)
// Workspace: the parameters plus, per thread, for a chunk of C = min(chunk, N) rows: x̂ of q and k
// and x̃ [C, D] each, 1/‖x‖ [C] ×2, φ(Q), φ(K) [C, ld(M)], [V | 1] and the numerators
// [C, ld(D+1)], a_t, b_t [C], the state [M, ld(D+1)]: independent of N.
// Backward (σ and, gated, w_g, b_g learned; W̃ fixed): causal saves the state at each chunk start
// (B·H·⌈N/C⌉·M·ld(D+1) floats: O(N)); the backward walks the chunks in reverse, recomputes the
// chunk's features and its C + 1 states from the checkpoint, and runs the adjoint recurrence
//   dS_t = φ(q_t) G_tᵀ + a_{t+1}·dS_{t+1},  G_t = [dout_t/den, −(dout_t·out_t)/den] (0 in the z
//   column when clamped),  dφ(q_t) = S_t G_t,  dφ(k_t) = b_t·dS_t [v_t|1],  dv_t = b_t·dS_tᵀφ(k_t),
//   gated: dg_t = ⟨dS_t, S_{t−1}⟩ − φ(k_t)ᵀ dS_t [v_t|1].
// Non-causal saves nothing and recomputes S with gemms. See rfa_backward_flops for the count.
// Decode: the state [S | z] per head, [M, D+1] (2·R·(D+1) values; ld(D+1) floats a row): O(1) per
// token, constant in N; a step is one causal step.
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
