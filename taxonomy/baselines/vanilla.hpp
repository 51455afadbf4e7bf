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
// bf16 (--dtype bf16, issue 31): q, k, v, out and the KV cache in bf16 (the cache half the bytes);
// S on oneDNN's bf16 matmul with fp32 output into the same score buffer, softmax in fp32, P rounded
// to bf16 in place over each score row's first half, P·V on the bf16 matmul (fp32 accumulation,
// output rounded to bf16); the decode step on convert-and-FMA loops, P rounded as the forward does.
// The backward likewise: dS = P·(dP − Σ P·dP) in fp32 from the saved bf16 P, rounded to bf16 for
// dQ and dK; dq, dk, dv stored bf16. FLOPs are the fp32 form's; the score buffers are dense rows
// of N in bf16 (oneDNN's bf16 kernels take no padded output).
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {
struct VanillaConfig {};  // no parameters
template <>
Implementation implementation<VanillaConfig>();
}  // namespace xfb
