#pragma once
// `vanilla`: standard materialised attention, O = softmax(Q·Kᵀ/√D)·V, on oneDNN.
// Shapes: Q, K, V, O [B, H, N, D]; scores S [B·H, N, ld] with ld = padded_ld(N) ≥ N.
// Causal by masking: the full S is computed, entries j > i are zeroed by the masked softmax.
// FLOPs: 4·B·H·N²·D (both products, always full) + 5·B·H·(N² or N(N+1)/2 when causal).
// Backward: the forward saves the probabilities P [B·H, N, ld] (the score buffer itself); the
// backward computes dV = Pᵀ·dO, dP = dO·Vᵀ (into a second [B·H, N, ld] buffer, turned into dS in
// place), dQ = dS·K/√D, dK = dSᵀ·Q/√D. FLOPs 8·B·H·N²·D + 4·B·H·(softmax entries).
// Decode: a KV cache of every token, [B·H, N + T, D] for keys and values (the state); a step
// appends its key and value, materialises its score row against the n cached keys (one sgemm per
// head), softmaxes it and multiplies by the cached values: 4·n·D + 5·n FLOPs per head, O(N).
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {
struct VanillaConfig {};  // no parameters
template <>
Implementation implementation<VanillaConfig>();
}  // namespace xfb
