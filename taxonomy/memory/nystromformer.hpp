#pragma once
// `nystromformer` (Xiong et al. 2021, arXiv 2102.03902; official code mlpen/Nystromformer,
// LRA/code/attention_nystrom.py): softmax attention approximated by the Nyström method on m
// segment-mean landmarks, plus a depthwise convolution of V along the sequence.
//
// Per head, on q, k, v [N, D] (the Q/K/V/O projections are outside the mechanism), with
// m = min(landmarks, N) and s = 1/√D (the code scales Q and K each by D^(−1/4)):
//   segments: m runs of consecutive rows; with N = m·L + r (0 ≤ r < m) the first r segments
//     have L + 1 rows and the others L (segment j starts at j·L + min(j, r)). The code requires
//     m | N (then every segment has N/m rows, as here); for other N this rule keeps every
//     segment non-empty and their lengths within one of each other.
//   landmarks Q̃, K̃ [m, D]: the mean of each segment's q rows, k rows.
//   F = softmax(s·q·K̃ᵀ) [N, m],  A = softmax(s·Q̃·K̃ᵀ) [m, m],  B = softmax(s·Q̃·kᵀ) [m, N].
//   Z = the iterative Moore–Penrose pseudo-inverse of A: Z₀ = α·Aᵀ, α = 1/max_j Σ_i A_ij
//     (1/‖A‖₁; the paper's 1/(‖A‖₁‖A‖∞) with ‖A‖∞ = 1, A's rows being softmax rows, which is
//     what the code computes), then `iterations` times (6, the code's n_iter)
//       Z ← ¼·Z·(13I − AZ·(15I − AZ·(7I − AZ))).
//     α is taken per (batch, head): the code's default ("original") takes one maximum over every
//     batch element and head, which makes a sequence's output depend on the other sequences of
//     its batch and on the other heads; its alternative option (whose config key is misspelt
//     there, so it cannot be selected) is the per-(batch, head) one chosen here.
//   out = F·(Z·(B·v)) + conv(v), where conv(v)_i = Σ_{t<k} w_h[t]·v_{i+t−⌊k/2⌋} (zero outside
//     [0, N); the same k taps for every feature of head h; no bias): the code's grouped
//     Conv2d(H, H, (k, 1), padding ⌊k/2⌋, bias=False) on v. The paper's product (F·Z)·(B·v) is
//     associated as F·(Z·(B·v)), the same value without the 2·N·m² product.
//   m = N (landmarks ≥ N): the code's fallback, made explicit: exact attention softmax(s·q·kᵀ)·v
//     plus the convolution, F [N, N] with N ≤ m. (With m = N every segment is one row, so Q̃ = q,
//     K̃ = k and F = A = B: F·Z·(B·v) would equal A·v, exact attention, only up to the
//     iteration's accuracy; the code, too, switches to exact attention there.)
// Not causal: every landmark averages its segment, so every output depends on every token; a
// causal point is `unsupported`. No decode.
// Parameters (from the seed): conv_weights [H, k], U(−1/√k, 1/√k) (PyTorch's default init of that
// Conv2d, fan-in k), stream "nystromformer/conv_weights"; none when conv_kernel = 0.
// Work per (batch, head) task on one thread (per-thread buffers F, B, the landmarks, A and the
// iteration's matrices); O(N·m·D + m³ + N·k·D), nothing N×N unless N ≤ m.
// FLOPs (exact) per (batch, head), m < N, I = iterations, P = Σ_{|o| ≤ ⌊k/2⌋} max(0, N − |o|)
// (the convolution's in-range taps):
//   2·(N·D + m·D) (landmark sums and scales) + 2m²D + 5m² (A) + 2m² + m + I·(8m³ + m²) (Z₀ and
//   the iterations) + 2mND + 5mN (B) + 2mND (B·v) + 2m²D (Z·B·v) + 2NmD + 5Nm (F) + 2NmD (F·…)
//   + 2·D·P (conv); m = N: 4N²D + 5N² + 2·D·P.
// Backward: the forward saves F, B, Q̃, K̃, A, B·v and Z·B·v per (batch, head); the backward
// recomputes the iterations from A (keeping every iterate and product in per-thread buffers) and
// differentiates through all of them, through α (its maximising column) and through the
// convolution taps (dconv_weights, summed over the batch). FLOPs per (batch, head), m < N:
//   2NmD (d(Z·B·v)) + 2NmD + 4Nm (dF, dS_F) + 4NmD (dq, dK̃) + the iterations again + 4m²D (dZ, d(Bv))
//   + 4mND + 4mN (dB, dv, dS_B) + 4mND (dQ̃, dk) + I·(16m³ + m²) + 4m² + m (dA) + 4m² (dS_A)
//   + 4m²D (dQ̃, dK̃ from A) + 2·(N·D + m·D) (landmarks) + 4·D·P (conv: dv and dw);
//   m = N: 8N²D + 4N² + 4·D·P.
// bf16 (--dtype bf16; storage only): q, k, v, out and the gradients bf16; each (batch, head) widened
// whole into its thread's fp32 rows [4, N·D] (q, k, v, out), computed exactly as above, the output
// rounded once: the fp32 error plus the output's rounding, about fp32's speed, 4·N·D floats per
// thread more. The backward likewise on [7, N·D] (q, k, v, dO and fp32 dQ, dK, dV, each rounded once);
// the saved kernels and dconv_weights stay fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct NystromformerConfig {
  std::int64_t landmarks = 64;    // m, landmarks per head (segment means; LRA configs 32–256); ≥ N: exact attention
  std::int64_t conv_kernel = 35;  // k, taps of the depthwise convolution of v along the sequence (odd); 0: none
  std::int64_t iterations = 6;    // iterations of the pseudo-inverse of A (the code's n_iter)
};

template <>
Implementation implementation<NystromformerConfig>();

}  // namespace xfb
