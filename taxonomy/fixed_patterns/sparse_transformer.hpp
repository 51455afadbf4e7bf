#pragma once
// `sparse-transformer`: the factorised attention patterns of the Sparse Transformer (Child et al.
// 2019), split across heads: heads h < ⌈H/2⌉ use A1, the others A2 (the paper's multi-head
// integration, each head one factor; with H = 1 the only head would use A1, so such a point is an
// `unsupported` row). Stride l (⌈√N⌉ unless given), summary width c (fixed pattern; clamped to l
// when l is automatic).
//   strided  A1(i) = {j : i − l ≤ j ≤ i}   (non-causal: |i − j| ≤ l)
//            A2(i) = {j : (i − j) mod l = 0}
//   fixed    A1(i) = {j : ⌊j/l⌋ = ⌊i/l⌋}
//            A2(i) = {j : j mod l ≥ l − c}  (the last c tokens of every block of l: "summaries")
// Causal keeps j ≤ i in every set. A row whose set is empty (causal fixed A2 before the first
// summary token) outputs zeros, as softmax attention over no keys.
// Work (block_sparse tiles of ≤ 64 query rows, one key block each):
//   strided A1: consecutive query tiles of min(64, l) rows, keys the band [q0 − l, q_last (+ l)]:
//               hull ≤ 2l (3l) columns for l + 1 (2l + 1) allowed;  A2: one residue class of l at a
//               time as strided views (query
//               and key row stride l·D), causal tiles end at their last row;
//   fixed   A1: local attention in blocks of l;  A2: the summary rows of K and V are gathered once
//               per head into contiguous [G, D] buffers (G = #summary tokens < N), queries in
//               consecutive tiles, causal hulls end at the last summary ≤ the tile's last row.
// Workspace: per thread a 64 × (hull) score tile; fixed also 2·G·D floats per A2 head.
// FLOPs: Σ over tiles of block_sparse::accumulate_flops (fresh) + finish_flops — 4·D per computed
// score + 4 per allowed entry + D per query row; O(N·l·D) = O(N√N·D) for strided and fixed A1,
// O(N·(N·c/l)·D) for fixed A2. The gather is a copy (0 FLOPs).
// Backward: the forward saves each query token's log-sum-exp (and, fixed, keeps the gathered summary
// rows); the backward recomputes every tile, and the A2 heads of the fixed pattern add their
// gathered dK, dV back to the summary positions.
// Decode (the state): A1 heads a ring of their band (strided: the last l + 1 tokens) or block
// (fixed: l); A2 heads every token (strided: each token is in a later token's residue class) or
// the summary tokens so far (fixed: G(N + T) rows). A step attends to its causal set from them:
// O(l) for A1, O(N/l) = O(√N) for A2; the A2 state grows as N (strided) or N·c/l (fixed).
// bf16 (--dtype bf16; engines/block_sparse_bf16.hpp, needs D % 16 == 0): the same tiles on the bf16
// tile kernels (strided views included) — S and P·V from bf16 operands with fp32 sums, fp32 softmax,
// P rounded to bf16, output rounded to bf16; the summary rows gathered in bf16; the backward's dQ, dK
// and dV summed in fp32 per head (a key row gets several tiles' sums) and rounded once; the caches in
// bf16 rows, a step rounding its P and output as the forward does (half the state bytes). FLOPs as
// in fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct SparseTransformerConfig {
  std::string pattern = "strided";  // "strided" or "fixed"
  std::int64_t stride = 0;          // l in tokens; 0 means ⌈√N⌉
  std::int64_t summary = 8;         // c: summary tokens per block of l (fixed pattern)
};

template <>
Implementation implementation<SparseTransformerConfig>();

}  // namespace xfb
