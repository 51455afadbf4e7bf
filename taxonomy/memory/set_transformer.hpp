#pragma once
// `set-transformer`: the induced set attention block ISAB_m of Lee et al. 2019 in head space.
//
// Paper: MAB(X, Y) = LN(H + rFF(H)), H = LN(X + MHA(X, Y, Y)); ISAB_m(X) = MAB(X, MAB(I, X)) with m
// learned inducing points I. In attention scope the mechanism receives the per-head Q, K, V
// ([B, H, N, D]), so each head runs its own single-head ISAB in the D-dimensional head space. In
// both MABs the query-side input is also the residual input (as X is in the paper's MAB):
//   MAB 1 (inducing points summarise the set):   queries and residual I_h [m, D], keys K, values V
//     A₁ = softmax(I_h·Kᵀ/√D)·V;  H₁ = LN_{h,0}(I_h + A₁);  S = LN_{h,1}(H₁ + rFF_{h,1}(H₁))   [m, D]
//   MAB 2 (the set reads the summary):            queries and residual Q, keys S·Wk_h, values S·Wv_h
//     A₂ = softmax(Q·(S·Wk_h)ᵀ/√D)·(S·Wv_h);  H₂ = LN_{h,2}(Q + A₂);  O = LN_{h,3}(H₂ + rFF_{h,2}(H₂))
// The first MAB's keys and values are the given K and V (the paper's X·W_K, X·W_V); the second
// MAB's keys and values are S projected by per-head Wk_h, Wv_h [D, D], since S has no given
// projection. rFF(x) = ReLU(x·W + b) with W [D, D], b [D] per head and MAB (the released code's
// row-wise feed-forward). LN normalises the D features of a row (eps 1e-5) with per-head gain and
// shift. Every parameter comes from the seed; dumped as inducing_points [H, m, D], kv_projections
// [2, H, D, D] (Wk, Wv), ff_weights [2, H, D, D] and ff_biases [2, H, D] (MAB 1, MAB 2), ln_gains
// and ln_shifts [4, H, D] (LN index 0 … 3). Not causal: every output depends on every token
// through S.
//
// Work O(N·m·D + N·D²) per head; workspace per thread one [m, N] score matrix (MAB 1) and
// [block_q, m], [block_q, D] tiles (MAB 2), plus S, S·Wk, S·Wv [m, D] per (batch, head).
// FLOPs (exact) per (batch, head):
//   MAB 1: 2·m·N·D (scores) + 2·m·N·D (values) + 5·m·N (softmax) + tail(m) + 2·2·m·D·D (Wk, Wv)
//   MAB 2: 2·N·m·D (scores) + 2·N·m·D (values) + 5·N·m (softmax) + tail(N)
//   tail(r) = 2·r·D·D (rFF product) + 18·r·D (residual 1 + LN 7, bias + ReLU 2, residual 1 + LN 7)
// bf16 (--dtype bf16; storage only): q, k, v, out and the gradients bf16; every product, softmax and LayerNorm in
// fp32 as above, on K and V widened 256 keys at a time and each query block widened, the output
// rounded once; parameters and S, S·Wk, S·Wv stay fp32. Its error is the fp32 form's plus the
// output's rounding; its speed about fp32's (storage halves, the compute does not change); per
// thread (min(N, 256) + 2·block_q)·D floats more. The backward widens a head's q, dO, k, v (7·N·D
// floats per thread with its fp32 dQ, dK, dV, each rounded once); saved activations stay fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct SetTransformerConfig {
  std::int64_t inducing_points = 32;  // m, learned inducing points per head
  std::int64_t block_q = 256;         // query rows per task in MAB 2, tokens
};

template <>
Implementation implementation<SetTransformerConfig>();

}  // namespace xfb
