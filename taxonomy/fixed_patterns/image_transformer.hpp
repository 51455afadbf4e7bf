#pragma once
// `image-transformer`: 1-D local attention of the Image Transformer (Parmar et al. 2018). The
// sequence is cut into non-overlapping query blocks of l_q tokens (the last one partial); the
// block starting at q0 attends to its memory block: the l_m tokens preceding it (the memory
// flange, fewer at the start of the sequence) followed by the query block itself:
//   allowed(i, j) = q0(i) − l_m ≤ j < q0(i) + l_q, with q0(i) = ⌊i/l_q⌋·l_q; and j ≤ i when causal.
// The non-causal form keeps the same memory block without the mask (the paper defines the block
// for decoding; only the causal mask differs).
// Work: every query block is split into tiles of ≤ 64 rows (block_sparse::kTaskRows); a tile is
// one block_sparse::attend over its memory block, whose hull ends at the tile's last row when
// causal. Workspace: per thread one 64 × (l_m + l_q) score tile — independent of N.
// FLOPs per head: Σ over tiles of block_sparse::accumulate_flops (fresh) + finish_flops, i.e.
// 4·D per computed score (two gemms) + 4 per allowed entry + D per row: O(N·(l_q + l_m)·D).
// Backward (block_sparse TileTraining): the forward saves each query token's log-sum-exp; the backward
// recomputes every tile's scores from it (one head per task).
// Decode: a ring of the last l_m + l_q tokens' keys and values (the state); token i attends to
// [max(0, q0 − l_m), i] (engines/decode_common.hpp WindowCache): O(l_m + l_q) per token, state
// constant in N.
// bf16 (--dtype bf16; engines/block_sparse_bf16.hpp, needs D % 16 == 0): the same tiles on the bf16
// tile kernels — S and P·V from bf16 operands with fp32 sums, fp32 softmax, P rounded to bf16, output
// rounded to bf16; the backward's dK/dV summed in an fp32 window and rounded once; a bf16 window ring
// (half the state bytes). FLOPs as in fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct ImageTransformerConfig {
  std::int64_t query_block = 256;    // l_q, tokens per query block
  std::int64_t memory_flange = 128;  // l_m, preceding tokens every query block also attends to
};

template <>
Implementation implementation<ImageTransformerConfig>();

}  // namespace xfb
