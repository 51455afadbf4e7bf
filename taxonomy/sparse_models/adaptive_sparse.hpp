#pragma once
// `adaptive-sparse`: the Adaptively Sparse Transformer (Correia et al. 2019, arXiv 1909.00015;
// deep-spin/entmax): α-entmax in place of softmax, α per head. Per head, on q, k, v [B, H, N, D]:
//   z_i = q_i·Kᵀ/√D;  p_i = entmax_α(z_i);  o_i = p_i·V,
//   entmax_α(z)_j = [(α−1)·(z_j − θ)]₊^(1/(α−1)), θ (the threshold, z units) making Σ_j p_j = 1,
// i.e. the library's τ = (α−1)·θ. α → 1 is softmax, α = 2 sparsemax; in between p is sparse.
// Causal: row i sees keys j ≤ i (the others are no candidates and get p = 0).
//
// The threshold (entmax_threshold). With y_j = z_j − max z and τ = (α−1)(θ − max z) in the
// library's units, τ ∈ [−1, −(1/n)^(α−1)], so only keys with (α−1)·y_j > −1 can be in the support:
// one pass collects these candidates (a few per cent of the row at α ≥ 1.5) and the solver reads
// only them — exact all the same:
//   sort (α = 1.5 and α = 2): a few bisection steps over the candidates while more than 32 remain
//     (each keeps only those above the lower bound), then the survivors sorted in descending order
//     and τ from running sums (α = 1.5: the library's mean/mean-of-squares formula, τ_k = μ_k −
//     √((1 − k·σ_k²)/k); α = 2: sparsemax's (Σ_k − 1)/k), the support the k with τ_k ≤ x_(k);
//   bisection (any α ∈ (1, 2]): the library's bracket halved over the candidates above the lower
//     bound until the support is settled (no candidate left inside the bracket), then Newton's
//     method from the lower bound (f convex and decreasing: monotone from the left). At α = 1.5
//     and 2 in double; at other α the powers t^(1/(α−1)) are float (a branch-free log and
//     ops::fast_exp, vectorised; ≈ 2·eps·(1 + |ln t|/(α−1)) relative) and the bracket stops at
//     1e-7: the threshold is then as exact as its float storage.
// `algorithm=auto` takes the sort at α exactly 1.5 or 2 and bisection otherwise (per head). Work
// per row on N(0, 1) scores, N = 4096 (a count of the solver's evaluations, not a timing): α = 1.5
// has ~266 candidates (6.5%), the sort ~470 evaluations of a square to narrow them to ~28 and a
// sort of those, bisection ~670 squares; α = 2: ~26 candidates, ~16 and ~66; α = 1.2: ~3600
// candidates and a support of ~1190, bisection ~26000 powers; as α → 1 every key is a candidate.
// Beside a row's products (4·N·D FLOPs at sgemm speed) this is small at α ≥ 1.5 and comparable to
// them or larger near α = 1.
//
// α per head: fixed (`alpha`: one value, the same for every head), or learned (`learn_alpha`):
// α = clamp(1 + sigmoid(a), 1.01, 2) as the paper's AlphaChooser, where the per-head parameter is
// the learned a [H], every head starting at the same `alpha` (a initialised to logit(alpha − 1),
// 0 for α = 1.5).
// Parameters (--dump): "alpha" [H] (the α each head ran), and with learn_alpha "alpha_logit" [H].
//
// Work: row blocks of block_q query rows per (batch, head) task; the block's scores [rows, cols]
// (cols = N, or the block's last row + 1 when causal) by sgemm, the entmax per row, P·V by sgemm.
// Memory O(threads·block_q·N), never N×N; time O(N²·D) by design.
// FLOPs (exact, data-independent): per block 4·rows·cols·D (the two products) + 5 per valid entry
// (max, subtract, multiply, clamp, power: the row max and p_j = [(α−1)(z_j − θ)]₊^(1/(α−1)), each
// executed on every valid entry). The threshold search is not counted: the candidate
// test and the sort are comparisons, and its arithmetic (O(candidates) per row for the sort,
// O(candidates · steps) for bisection) depends on the data, which an exact count cannot.
//
// Backward: the forward saves θ per row (B·H·N floats) and the backward recomputes the scores and
// p; per head (one task: its dK, dV rows are shared by the blocks), per block:
//   dP = dO·Vᵀ;  g = p^(2−α) on the support;  dZ = g⊙dP − g·(Σg⊙dP / Σg);
//   dV += Pᵀ·dO;  dQ = dZ·K/√D;  dK += dZᵀ·Q/√D;
// and with learn_alpha the library's ∂/∂α (S = p·log p, H = ΣS, p̃ = g/Σg):
//   ∂L/∂α = Σ_j dP_j·[(p_j − p̃_j)/(α−1)² − (S_j − p̃_j·H)/(α−1)],  da = ∂L/∂α·σ(a)(1 − σ(a))
// (0 where the clamp holds), summed over the batch and rows of the head. FLOPs: per block
// 10·rows·cols·D + (5 + 6) per valid entry (p again; g, Σg, Σg·dP, dZ) + 8 per valid entry for α
// when learned (log, S, H, and the two terms).
//
// Decode: a KV cache of every token ([B·H, N + T, D] each, the state); a step appends its key and
// value and computes one row of entmax over the cache: 4·L·D + 5·L FLOPs per head for L cached
// tokens (O(N) per token).
// bf16 (--dtype bf16; storage only, any D): q, k, v, out, the gradients and the KV cache bf16; each
// task widens its head's visible K and V rows and its block's q rows into the thread's fp32 rows
// (2·N·D + 2·block_q·D floats), computes as above in fp32 (the entmax on fp32 scores) and rounds
// the output once; the backward widens a head's q, k, v, dO (7·N·D floats per thread with its fp32
// dQ, dK, dV, rounded once); a step reads the bf16 cache in fp32 dot products. The error is the fp32
// form's on the bf16 inputs plus the output's rounding; its speed about fp32's.
#include <cstdint>

#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"

namespace xfb {

enum class EntmaxAlgorithm { Auto, Bisect };

struct AdaptiveSparseConfig {
  double alpha = 1.5;                                 // entmax α of every head (the initial α when learned)
  bool learn_alpha = false;                           // α = clamp(1 + sigmoid(a), 1.01, 2) from a learned a [H]
  EntmaxAlgorithm algorithm = EntmaxAlgorithm::Auto;  // auto: sort at α = 1.5 or 2, else bisection
  std::int64_t block_q = 64;                          // query rows per task, tokens
};

// FLOPs per valid score entry of the forward's entmax (max, subtract, multiply, clamp, power).
inline constexpr std::int64_t kEntmaxFlopsPerElement = 5;
// Backward per valid entry beyond recomputing p: g, Σg, Σg·dP (2), dZ (2).
inline constexpr std::int64_t kEntmaxBackwardFlopsPerElement = 6;
// ∂/∂α per valid entry: log p, S = p·log p, H, p̃, and the two terms' multiply-adds.
inline constexpr std::int64_t kEntmaxAlphaGradFlopsPerElement = 8;

// The threshold θ (z units) of entmax_α over z[0..n), n ≥ 1: p_j = [(α−1)(z_j − θ)]₊^(1/(α−1))
// sums to 1. `sort` picks the sort solver (α must be 1.5 or 2), else bisection. scratch: n floats.
float entmax_threshold(const float* z, std::int64_t n, double alpha, bool sort, float* scratch);
// p[j] = [(α−1)(z_j − θ)]₊^(1/(α−1)) for j < n (p may alias z).
void entmax_probabilities(const float* z, std::int64_t n, double alpha, float theta, float* p);

template <>
Implementation implementation<AdaptiveSparseConfig>();

}  // namespace xfb
