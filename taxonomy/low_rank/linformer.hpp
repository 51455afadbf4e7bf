#pragma once
// `linformer` (Wang et al. 2020): keys and values projected along the sequence,
//   out = softmax(Q·(E·K)ᵀ/√D)·(F·V),   E, F: [k, N];  E·K, F·V: [k, D] per head.
// k is clamped to N (with N <= k there is nothing to compress). E and F come from the seed,
// entries N(0, 1/k); projection=identity sets E = F = I (only when k >= N), which makes the model
// exact softmax attention (tests use it).
// Sharing: per-head — each head h has its own E_h, F_h (parameters [H, k, N]); headwise — one E and
// one F for all heads ([k, N] each); key-value — one E = F for all heads and for K and V.
// Every batch element uses the same projections. Not causal (survey Table 1).
// Shapes: E·K, F·V [B·H, k, D]; scores [B·H, N, ld] with ld = padded_ld(k); products are oneDNN
// matmuls batched over B·H, except a shared projection: one matmul per (batch, head).
// FLOPs: B·H·(8·N·k·D + 5·N·k)   (E·K, F·V, Q·K̃ᵀ, P·Ṽ: 2·N·k·D each; softmax 5 per score).
// Workspace: projections (2·H, 2 or 1 × k·N floats) + E·K, F·V (2·B·H·k·D) + scores (B·H·N·ld).
// Backward: the forward saves P [B·H, N, ld] (linear in N for a fixed k), E·K and F·V; the backward
// runs softmax attention's backward over the k projected rows, then dK = Eᵀ·d(E·K) and
// dE = Σ d(E·K)·Kᵀ over the (batch, head) pairs sharing E (V, F likewise; key-value sharing sums
// both into dE). FLOPs B·H·(16·N·k·D + 4·N·k); workspace as much again as the forward's.
// bf16 (--dtype bf16): q, k, v, out, K̄, V̄ and P bf16, E and F fp32; E·K summed in fp32 over widened
// chunks of K and rounded once; the scores fp32 [B·H, N, k] on the bf16 matmul, P rounded in place;
// workspace: projections + scores (B·H·N·k floats) + per thread (c + max(c, k))·D floats (c =
// min(N, 256)) + K̄, V̄ at 2 bytes. Backward: dP and dK̄, dV̄ in fp32, dS rounded to bf16 in place, dq,
// dk, dv rounded once, dE and dF fp32 (tasks of 256 columns of a projection); workspace: dE, dF, dP
// (B·H·N·k floats) and dK̄, dV̄ (2·B·H·k·D floats).
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

enum class LinformerSharing { PerHead, Headwise, KeyValue };

struct LinformerConfig {
  std::int64_t k = 256;  // projected length (rows of E and F), tokens; clamped to N
  LinformerSharing sharing = LinformerSharing::PerHead;
  bool identity = false;  // E = F = I (requires k >= N)
};

template <>
Implementation implementation<LinformerConfig>();

}  // namespace xfb
