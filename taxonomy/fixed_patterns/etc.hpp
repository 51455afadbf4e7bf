#pragma once
// `etc` (Ainslie et al. 2020, Extended Transformer Construction): global-local attention.
//
// The sequence is split into a global input and a long input: positions 0 … n_g−1 are the n_g
// global tokens (n_g = min(globals, N)), positions n_g … N−1 the long tokens. Per head:
//   global→global and global→long are full: a global query i < n_g sees every key j < N;
//   long→global is full and long→long is limited to the radius r: a long query i sees the
//     global keys j < n_g and the long keys j with |i − j| ≤ r.
//   out_i = softmax_j(q_i·k_jᵀ/√D) · v_j over the keys i sees (plain q, k, v; ETC's relative
//   position labels and structured-input masks are not part of this kernel).
// Not causal (the survey's Table 1). Defaults: radius 84 and 230 global tokens, ETC's Natural
// Questions setting as we recall it; the survey marks ETC's radius and global counts unconfirmed.
// Computation: engines/window_global.hpp with before = after = r and no dilation, on the
// gathered-attention kernel. FLOPs: Σ tiles tile_flops (engines/gathered_attention.hpp).
// Work and memory: O(N_g·N + N·r) — the survey's O(N_g² + N·N_g) plus the local band.
// Backward: the forward saves each query token's log-sum-exp; the backward recomputes every tile
// (one head per task).
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct EtcConfig {
  std::int64_t globals = 230;  // n_g, tokens: positions 0 … n_g−1 form the global input
  std::int64_t radius = 84;    // r, tokens: long→long reach on each side
  std::int64_t tile = 64;      // query rows per computed tile (implementation)
};

template <>
Implementation implementation<EtcConfig>();

}  // namespace xfb
