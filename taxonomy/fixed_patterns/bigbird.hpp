#pragma once
// `bigbird` (Zaheer et al. 2020, the ITC form): block-sparse attention.
//
// The N tokens form nb = ⌈N/b⌉ blocks of b tokens (the last one may be partial). Blocks
// 0 … ⌈g/2⌉−1 and the last ⌊g/2⌋ blocks are global (g = global_blocks; all blocks when
// g ≥ nb). Per head:
//   a global query block sees every key;
//   another query block B sees the key blocks
//     global ∪ window(B) ∪ random(B), where
//     window(B) = the non-global blocks in [B − ⌊(w−1)/2⌋, B + ⌊w/2⌋] (w = window_blocks), and
//     random(B) = min(r, #candidates) distinct blocks drawn uniformly from the seed among the
//       candidates: full (b-token) blocks that are neither global nor in window(B); r = random_blocks.
//   out_i = softmax_j(q_i·k_jᵀ/√D) · v_j over the keys of i's block's pattern (disjoint sets, so
//   every key counts once).
// Random blocks are drawn per head (the same for every batch element) in prepare and exposed by
// parameters() as "random_blocks": a float tensor [H, nb, r] of block indices, −1 where a slot is
// unused (global query blocks, too few candidates).
// Not causal (the survey's Table 1).
// Computation: one tile per (batch, head, query block); non-global tiles gather their key blocks
// into contiguous buffers and run one pair of sgemms (engines/gathered_attention.hpp). Partial blocks are
// never random, so the FLOPs do not depend on the draw.
// FLOPs per tile: 4·rows·keys·D + 5·rows·keys (every gathered key is visible to every row).
// Backward: the forward saves each query token's log-sum-exp; the backward recomputes every tile
// with the same random blocks (held fixed, as the paper trains; one head per task).
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct BigBirdConfig {
  std::int64_t block = 64;         // b, tokens per block
  std::int64_t window_blocks = 3;  // w, sliding-window blocks (the query's block in the middle)
  std::int64_t random_blocks = 3;  // r, random key blocks per query block
  std::int64_t global_blocks = 2;  // g, global blocks: the first ⌈g/2⌉ and the last ⌊g/2⌋
};

template <>
Implementation implementation<BigBirdConfig>();

}  // namespace xfb
