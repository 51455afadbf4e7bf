#pragma once
// `axial`: axial attention (Ho et al. 2019) on the sequence laid out row-major on a grid of
// C columns (⌈√N⌉ unless given; clamped to N) and R = ⌈N/C⌉ rows, the last row partial (padding
// positions do not exist: they are neither queries nor keys). Token p sits at row ρ(p) = ⌊p/C⌋,
// column γ(p) = p mod C. One mechanism, no parameters: attention along rows, then along columns
// over the row outputs, so every output depends on the whole (visible) grid.
//   row stage     U_p = Σ_{q: ρ(q)=ρ(p)} softmax_q(s_pq)·V_q                   (never masked)
//   non-causal    O_p = Σ_{q: γ(q)=γ(p)} softmax_q(s_pq)·U_q
//   causal        O_p = softmax over the union of two key sets, one normalisation:
//                   column keys q with γ(q) = γ(p), ρ(q) < ρ(p), value U_q  (rows strictly above:
//                     the paper's shift, so U_q — which saw q's whole row — is entirely in p's past)
//                   row keys    q with ρ(q) = ρ(p), q ≤ p,            value V_q  (masked row)
// with s_pq = Q_p·K_qᵀ/√D. Causal output p therefore depends only on tokens ≤ p.
// Work, on block_sparse tiles of ≤ 64 rows with strided views (no copies): rows are blocks of C
// tokens; columns are the residue classes of stride C (row stride C·D). The causal union is one
// online softmax: the column pass starts the state of every token (max, sum in a [N] buffer, the
// unnormalised output in `out`), the masked row pass continues it and normalises.
// Workspace: U ([B, H, N, D]), a 64 × max(C, R) score tile per thread, causal: max and sum per
// token. FLOPs: Σ over tiles of block_sparse::accumulate_flops (+ finish_flops where a pass
// normalises): row pass fresh + finish; column pass fresh (+ finish when non-causal); causal row
// pass not fresh (D per row rescale) + finish. O(N·(C + R)·D) = O(N√N·D).
// Backward: the forward saves U, the row stage's and (non-causal) the column stage's log-sum-exp,
// or (causal) the union's running max and sum; the backward recomputes the second stage's tiles
// (dU as their value gradient), then the row stage's with dU as its output gradient.
// Decode (the state): the completed rows' keys and U ([B·H, N + T, D] each) and the open row's q,
// k, v; a row's U is computed when it completes (stage `row_complete` of the next step: 4·C²·D +
// 4·C² + C·D FLOPs per head), and a token attends to its column above (values U) and its row so
// far (values V) in one softmax: O(√N) per token, state O(N).
// bf16 (--dtype bf16; engines/block_sparse_bf16.hpp, needs D % 16 == 0): q, k, v, U, out, the
// gradients and the decode state in bf16. The stages on the bf16 tile kernels (fp32 sums and
// softmax, P rounded to bf16, U and O rounded to bf16); the causal union through the bf16 engine's
// online form, its unnormalised output in an fp32 [N, D] buffer per thread (one head per task);
// the backward's dQ, dK, dV and dU summed in fp32 per head, dU rounded to bf16 once as the row
// stage's output gradient; a completed row's U in decode by the forward's row tiles. FLOPs as in fp32.
#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

struct AxialConfig {
  std::int64_t cols = 0;  // grid width C in tokens; 0 means ⌈√N⌉
};

template <>
Implementation implementation<AxialConfig>();

}  // namespace xfb
