#pragma once
// `memory-compressed` (Liu et al. 2018, "Generating Wikipedia by Summarizing Long Sequences"):
// local attention within blocks and memory-compressed attention, split across heads.
//
// Heads: mode=local → every head local; mode=compressed → every head compressed; mode=split →
// heads 0 … ⌈H/2⌉−1 local, the rest compressed (H = 1: an `unsupported` row, not local alone).
// Per head (q, k, v: the head's [N, D] rows):
//   local: blocks of `block` tokens (the last may be partial); query i in block [s, e) sees keys
//     j ∈ [s, e) (causal: j ∈ [s, i]).
//   compressed: K and V are shortened by a strided 1-D convolution (kernel = stride = c,
//     no bias, zero padding after the last token), N_c = ⌈N/c⌉ slots:
//       K̂[t, o] = Σ_{u<c} Σ_{i<D} Wk[o, i, u] · k[c·t + u, i]   (k rows ≥ N read as 0), V̂ likewise;
//     query i sees every slot (causal: the slots that end at or before i, c·t + c − 1 ≤ i, i.e.
//     t < ⌊(i+1)/c⌋; the first c−1 queries see none and output 0).
//   out_i = softmax(q_i·K̂ᵀ/√D)·V̂ over the visible slots (local: over the visible keys).
// Parameters (from the seed, only for the compressed heads, head index minus the number of local
// heads): compress_wk, compress_wv, each [H_c, D_out = D, D_in = D, c], N(0, 1/(c·D)) entries.
// Computation: the convolution is one batched oneDNN matmul per batch element (rows of c·D
// consecutive floats times the repacked weights [c·D, D]) plus one row for a partial last window;
// attention runs in tiles of `tile` query rows (never crossing a local block) on the
// gathered-attention kernel. Compressed memory is kept as [B, H_c, N_c, D].
// FLOPs: 2·B·H_c·2·N_c·c·D·D (two convolutions) + Σ tiles tile_flops (engines/gathered_attention.hpp).
// Work: O(N·block) local, O(N·N/c) compressed (the survey's O(N_c²) class); memory O(N).
// Backward: the forward saves the log-sum-exp and keeps K̂, V̂; the backward recomputes the tiles,
// then runs the convolution backward (input rows and the weights' gradients, summed over the
// batch: one task per head index).
// Decode (the state): local heads a ring of their block; compressed heads the slots completed so far
// ([⌈(N+T)/c⌉, D] keys and values) and the open window's raw rows ([c, D]). The token that completes
// a window compresses it into the next slot (2·2·c·D² FLOPs); a token attends to the ⌊(i+1)/c⌋
// completed slots: O(N/c) per token (O(block) on local heads), state O(N/c).
// bf16 (--dtype bf16, forward, backward and decode; D % 16 == 0, the bf16 gathered kernel's): q, k, v,
// out, the gradients, K̂, V̂ and the decode state bf16, the weights and their gradients fp32. A slot is
// Σ packed·x over its window's bf16 rows in fp32, in one fixed order (the forward and decoding compute
// it bit for bit alike), rounded once; the tiles on the bf16 gathered kernel (P rounded to bf16, O
// rounded once); a step on bf16 rows (P rounded as the tiles round it). Backward: the tiles on the
// bf16 kernel's backward, a head's dK, dV accumulated in fp32 (compressed heads: dx = dK̂·packedᵀ from
// the fp32 dK̂, dV̂) and rounded once; d(packed) += Xᵀ·dK̂ in fp32 with X widened 256 windows at a time.
// FLOPs (forward and backward) as in fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct MemoryCompressedConfig {
  std::int64_t block = 256;      // local block size, tokens
  std::int64_t compression = 3;  // c: convolution kernel = stride, tokens per compressed slot
  std::string mode = "split";    // local | compressed | split (half the heads each)
  std::int64_t tile = 64;        // query rows per computed tile (implementation)
};

// For tests: the mechanism also implements this; the compressed memories of the last forward.
class MemoryCompressedMemories {
 public:
  virtual ~MemoryCompressedMemories() = default;
  virtual const Tensor& compressed_keys() const = 0;    // K̂: [B, H_c, N_c, D]
  virtual const Tensor& compressed_values() const = 0;  // V̂: [B, H_c, N_c, D]
};

template <>
Implementation implementation<MemoryCompressedConfig>();

}  // namespace xfb
