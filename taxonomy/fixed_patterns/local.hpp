#pragma once
// `local`: block-local attention, the "Local Attention" baseline of Long Range Arena (Tay et al.
// 2021, block 50). The sequence is cut into consecutive blocks of b tokens (b clamped to N, the
// last block partial) and each token attends to its own block only:
//   allowed(i, j) = ⌊i/b⌋ = ⌊j/b⌋, and j ≤ i when causal (within-block causal).
// Work: every block is split into query tiles of ≤ 64 rows (block_sparse::kTaskRows); a tile is one
// block_sparse::attend over its block's keys, whose hull ends at the tile's last row when causal.
// Workspace: per thread one 64 × b score tile and row statistics — independent of N.
// FLOPs per head: Σ over tiles of block_sparse::accumulate_flops (fresh) + finish_flops; for a
// block of L ≤ 64 tokens that is 4·L²·D + 4·L² + L·D (non-causal) or 4·L²·D + 2·L(L+1) + L·D
// (causal). Total O(N·b·D).
// Backward (block_sparse TileTraining): the forward saves each query token's log-sum-exp; the backward
// recomputes every tile's scores from it (one head per task).
// Decode: a window of the current block's keys and values ([B·H, b, D] each, a ring: the state);
// a step attends to its block's tokens so far (engines/decode_common.hpp WindowCache): O(b) per
// token, state constant in N.
// bf16 (--dtype bf16; engines/block_sparse_bf16.hpp, needs D % 16 == 0): the same tiles on the bf16
// tile kernels — S and P·V from bf16 operands with fp32 sums, fp32 softmax, P rounded to bf16, output
// rounded to bf16; the backward's dK/dV summed in an fp32 window and rounded once; a bf16 window ring
// (half the state bytes). FLOPs as in fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct LocalConfig {
  std::int64_t block = 50;  // tokens per block, b
};

template <>
Implementation implementation<LocalConfig>();

}  // namespace xfb
