#pragma once
// `performer`: FAVOR+ (Choromanski et al. 2020) on the chunked linear-attention engine
// (taxonomy/kernels/linear_attention.hpp), causal and not.
//
// Random features ω: [M, D], one set shared by all heads, drawn from the seed: ⌈M/D⌉ blocks of D
// rows, each block the Gram–Schmidt orthonormalisation of a D×D Gaussian matrix (the last block
// keeps its first M mod D rows); row i is then scaled by ‖g_i‖ for a fresh Gaussian g_i ∈ R^D, so
// row norms are chi(D)-distributed as for i.i.d. Gaussian rows.
//
// kernel=softmax (positive random features for exp(qᵀk/√D)), with x' = D^(−1/4)·x:
//   φ(x) = exp(ωx' − ‖x'‖²/2) / √M.
//   Stabilisers, all cancelling in out_i = φ(q_i)ᵀS / φ(q_i)ᵀz: for a query row the constant
//   exp(−‖q'‖²/2)/√M and the row max of ωq' are dropped (φ(q) = exp(ωq' − max ωq'), so its
//   largest entry is 1); key features are exp(ωk' − ‖k'‖²/2 − s) with s the running max of the
//   exponents seen so far (the engine rescales its state when s grows). Keys of one chunk share s,
//   so outputs before a chunk are bit-identical whatever follows; inside a chunk they agree to
//   rounding.
// kernel=relu (the paper's generalised ReLU kernel, as in its released code): no pre-scaling,
//   φ(x) = max(ωx/√M, 0) + 10⁻³ (the constant keeps the normaliser positive).
//
// FLOPs per row, gemm included (the engine adds its own, see kernels/linear_attention.hpp):
//   softmax: query 2·M·D + 3·M (max, subtract, exp); key 2·M·D + 2·D (‖k‖²) + 4·M
//   (subtract ‖k‖²/2, max, subtract, exp); the state rescale M·(D+1) per chunk after the first.
//   relu: 2·M·D + 2·M (max with 0, add) for queries and keys alike.
// Default chunk C = 64: the causal in-chunk work, 2·C·(M + D + 1) per row, is then ~30% of the
// rest at M = 256, D = 64.
// Workspace: ω (M·D floats) plus the engine's per-thread buffers; independent of N.
// Backward (kernels/linear_attention.hpp): ω held fixed (redrawn, not learned); dq, dk through
// ∂φ/∂x = φ·(α·ω − α²·x for keys) (softmax; the row max and key shift are constants that cancel) or
// [ωx > 0]·ω/√M (relu); per row M + 2·M·D (+ M + 2·D for softmax keys) FLOPs.
// bf16 (--dtype bf16): the engine's bf16 form (kernels/linear_attention.hpp) — bf16 q, k, v, out,
// gradients and decode state S', the features and products in fp32 on each chunk's widened rows.
// ω (and decoding's ωᵀ) stay fp32 as the model holds them (the dump's random_features): never rounded.
// Decode: the recurrent state [S | z] per head, [M, D+1], at the running key shift (a new key
// that raises the shift rescales it); O(1) per token and constant in N. A step projects its single
// q and k rows through a transposed copy of ω ([D, M], made by prepare_decode) rather than one-row
// sgemm calls.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

enum class PerformerKernel { Softmax, Relu };

struct PerformerConfig {
  std::int64_t features = 256;  // random features M
  PerformerKernel kernel = PerformerKernel::Softmax;
  std::int64_t chunk = 64;  // rows per chunk of the engine, tokens (causal: the masked block size)
};

inline constexpr float kPerformerReluStabiliser = 1e-3f;

template <>
Implementation implementation<PerformerConfig>();

}  // namespace xfb
