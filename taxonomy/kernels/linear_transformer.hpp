#pragma once
// `linear-transformer` (Katharopoulos et al. 2020): φ(x) = elu(x) + 1 on the chunked
// linear-attention engine (taxonomy/kernels/linear_attention.hpp) with M = D:
//   out_i = φ(q_i)ᵀ S / φ(q_i)ᵀ z,  S = Σ_j φ(k_j) v_jᵀ,  z = Σ_j φ(k_j)   (j <= i when causal).
// Non-causal: the K–V summary [S | z] is built once per head. Causal: the running [D, D+1] state,
// chunk by chunk — never an N×D×D prefix tensor.
// φ is evaluated branch-free as exp(min(x, 0)) + max(x, 0): 4 FLOPs per element, so the feature
// cost is 4·D per query row and per key row; the rest is the engine's count.
// Default chunk C = 32: the causal in-chunk work, 2·C·(2D + 1) per row, then stays below the
// state work 4·D·(D + 1) per row at D = 64.
// Workspace: the engine's per-thread buffers, independent of N.
// Backward (kernels/linear_attention.hpp): φ'(x) = e^x for x < 0, 1 otherwise; the forward saves
// each row's normaliser, the features are recomputed.
// Decode: the recurrent state [S | z] per head, [D, D+1] (kernels/linear_attention.hpp), O(1)
// per token and constant in N.
// bf16 (--dtype bf16): the engine's bf16 form (kernels/linear_attention.hpp) — bf16 q, k, v, out,
// gradients and [S | z] state (half its bytes), elu + 1 and the products in fp32 on widened chunk rows.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct LinearTransformerConfig {
  std::int64_t chunk = 32;  // rows per chunk of the engine, tokens (causal: the masked block size)
};

template <>
Implementation implementation<LinearTransformerConfig>();

}  // namespace xfb
