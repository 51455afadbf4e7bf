#pragma once
// `exact-tiled`: exact softmax attention without the N×N matrix — blocked online softmax in the
// style of FlashAttention (Dao et al. 2022). Each task is one (batch, head, query block of bq
// rows); it walks key blocks of bk columns, keeping a running row max m, row sum l and an
// unnormalised accumulator [bq, D]:
//   S = Q_blk·K_blkᵀ/√D;  m' = max(m, rowmax S);  P = exp(S − m');  l = l·e^(m−m') + rowsum P;
//   acc = acc·e^(m−m') + P·V_blk;  finally O_blk = acc / l.
// Causal: key blocks entirely above the diagonal are skipped; inside a diagonal block entries
// j > i are excluded. When D is a multiple of 16 (the register-blocked tile kernels) a block's tile
// is done in strips of 32 rows (S, softmax, P·V per strip, the strip's scores staying in L2), and
// K is packed into panels once per call, shared by all query blocks: B·H·⌈N/16⌉·16·D floats.
// Workspace: per thread S [min(bq, 32) on the tile kernels, else bq; ⌈bk/16⌉·16], acc [bq, D], m,
// l: O(bq·(bk+D)), not O(N²); plus the packed K.
// FLOPs (exact, see exact_tiled_flops): per executed tile 4·rows·cols·D (two products; on the
// tile kernels S counts whole 16-key panels) + 4·valid (max, subtract+exp, sum) + D per row with
// valid > 0 (rescale); plus N·D per head (1/l).
//
// Backward (FlashAttention-2's): the forward saves only the row log-sum-exp L = m + log l, B·H·N
// floats; nothing N×N is saved or materialised. The backward first forms δ_i = Σ_c dO[i,c]·O[i,c],
// then, per head (one task; dQ rows are shared by its key blocks), walks key blocks of bk' keys
// (backward_block_k, its own: 1024 keys suit the forward, 512 the backward on AVX2),
// and for each the query strips that see them (128 rows on the tile kernels, with the block's K
// and V packed into panels; bq rows on sgemm), recomputing the tile:
//   S = Q_blk·K_blkᵀ/√D;  P = exp(S − L);  dV_blk += Pᵀ·dO_blk;  dP = dO_blk·V_blkᵀ;
//   dS = P ⊙ (dP − δ);  dK_blk += dSᵀ·Q_blk/√D;  dQ_blk += dS·K_blk/√D.
// Causal: strips from the one holding the block's first key, each tile cut at the strip's last
// row; entries j > i have P = 0. Workspace: L and δ (B·H·N each) and per thread the P and dP tiles
// [strip, ⌈bk'/16⌉·16] and the packed K and V blocks (2·⌈bk'/16⌉·16·D on the tile kernels).
// FLOPs: per executed tile 10·rows·cols·D (S and dP over whole panels on the tile kernels) +
// 4·valid; plus 2·N·D per head (δ).
//
// Decode (split-K, as FlashDecoding): a KV cache of every token ([B·H, N + T, D] each, the state).
// A step's query is split over S key ranges per head, S = clamp(⌈threads / (B·H)⌉, 1, (N+T)/bk), so
// one query still uses every core; each split takes its keys as one block (its score row by sgemm,
// max, exponentials, sgemm with V: engines/decode_common.hpp attend_block) and each head merges
// its S partial states by log-sum-exp. FLOPs per head: S·D + Σ over non-empty splits (4·r·D + 4·r
// + D + 2) + (S − 1)·(3·D + 7) + D: O(N) per token.
//
// bf16 (--dtype bf16, D a multiple of 16; other D are `unsupported`): the same walks on the bf16
// tile kernels (lib/core/tile_kernels_bf16.hpp). Forward: K in key pair panels and V in row pairs
// (B·H·(⌈N/16⌉·16 + ⌈N/2⌉·2)·D bf16, packed per call), per thread a strip's fp32 scores and their
// bf16 probabilities [32, ⌈bk/16⌉·16] each, acc, m, l fp32; P = exp(S − m') rounded to bf16 for
// P·V, l summed from the fp32 values; O = acc / l rounded to bf16. Saved: L in fp32. Backward:
// per thread the head's Q, dO, K in row pairs and K, V in panels, the fp32 P and dS tiles and
// their bf16 forms (P in row pairs; dS in rows and row pairs), dQ [N, D] and a key block's dK, dV
// [bk', D] in fp32, each rounded to bf16 once. Decode: the KV cache in the kernels' layouts
// (engines/decode_common.hpp Bf16KvCache: per head key pair panels of N + T tokens and value row
// pairs — the dumped state is in those layouts), split boundaries on multiples of 16 tokens, each
// split one attend_block_bf16. FLOP counts are the fp32 form's throughout.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct ExactTiledConfig {
  std::int64_t block_q = 64;            // query rows per task, tokens
  std::int64_t block_k = 1024;          // key columns per forward tile, tokens (AVX-512 class: 3% faster than 512,
                                        // AVX2: 1.5%)
  std::int64_t backward_block_k = 512;  // key columns per backward block, tokens (AVX2 class: 1024 is
                                        // 10% slower; AVX-512: the same)
};

template <>
Implementation implementation<ExactTiledConfig>();

}  // namespace xfb
