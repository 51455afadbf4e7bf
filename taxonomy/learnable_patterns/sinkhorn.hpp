#pragma once
// `sinkhorn`: Sparse Sinkhorn attention (Tay et al. 2020b), per head of [B, H, N, D].
//
// Blocks of b = block tokens (clamped to N); n_B = ⌈N/b⌉, the last block may be short (the
// sequence is treated as zero-padded to n_B·b, as the reference implementations pad it).
// Block embeddings E [n_B, D]: non-causal E_i = Σ of the keys of block i; causal E_i = Σ of the
// keys of blocks j < i (E_0 = 0), so block i's sorting uses only tokens before it.
// Sorting network, weights from the seed, shared by heads ("w1" [D, D], "b1" [D], "w2" [D, n_B],
// "b2" [n_B], all N(0, 1/fan_in)): R = ReLU(E·w1 + b1)·w2 + b2, an [n_B, n_B] score matrix (row i:
// query block i, column j: key block j).
// Soft permutation P ("permutation", [B, H, n_B, n_B], of the last forward):
//   non-causal: L = R/τ, then sinkhorn_iters rounds of log-domain normalisation, each a row step
//     L_ij −= log Σ_j' exp L_ij' followed by a column step L_ij −= log Σ_i' exp L_i'j; P = exp(L).
//   causal: only past blocks may be sorted in, P_ij = 0 for j ≥ i. A column step would mix in the
//     scores of later rows (future blocks), so causal mode keeps the row step only:
//     P_i· = softmax_{j<i}(R_ij/τ); row 0 is all zero.
// Sorted blocks: K̃_i = Σ_j P_ij·K_j and Ṽ_i = Σ_j P_ij·V_j (each [b, D]).
// Attention, one softmax per query (scores q·k/√D):
//   default: query block i attends to its own block (causal: j ≤ i) and to the b rows of its sorted
//     block K̃_i (causal: none for block 0, which has no past);
//   SortCut (sortcut_blocks = n_k > 0, clamped to n_B; encoder only): every query attends to the
//     n_k·b rows of the first n_k sorted blocks, and nothing else.
// Defaults: b = 50 (LRA); τ = 0.75 and 7 iterations, the settings lucidrains' implementation
// reports as the paper's best (the survey marks both unconfirmed).
//
// FLOPs per head (exact, see sinkhorn_flops), n_r = n_k with SortCut, else n_B:
//   N·D (block sums) + [causal] (n_B−1)·D (prefix) + 2·n_B·D·D + 2·n_B·D (layer 1, bias, ReLU) +
//   2·n_B·D·n_B + n_B² (layer 2, bias) + Sinkhorn: non-causal n_B² (÷τ) + 10·n_B²·iters + n_B² (exp);
//   causal 7·n_B(n_B−1)/2 (÷τ, row log-normalisation, exp) + mixing 2·2·n_r·N·D + attention per query
//   block with `rows` queries and `cols` keys: 4·rows·cols·D + 4·rows·cols + rows·D.
// Tracked workspace: weights, E and hidden [B·H·n_B, D], P [B·H, n_B, n_B], sorted K̃ and Ṽ
// [B·H, n_r·b, D] each, per thread a score tile [b, cols] and row statistics.
#include <cstdint>
#include <vector>

#include "lib/core/mechanism.hpp"

namespace xfb {

struct SinkhornConfig {
  std::int64_t block = 50;          // tokens per block b
  std::int64_t sinkhorn_iters = 7;  // row+column normalisation rounds (non-causal)
  double temperature = 0.75;        // τ dividing the sorting scores
  std::int64_t sortcut_blocks = 0;  // SortCut n_k: attend only to the first n_k sorted blocks; 0: off
};

std::int64_t sinkhorn_block(const Problem& p, const SinkhornConfig& c);   // b clamped to [1, N]
std::int64_t sinkhorn_blocks(const Problem& p, const SinkhornConfig& c);  // n_B

class SinkhornAttention final : public Mechanism {
 public:
  SinkhornAttention(const Problem& problem, const SinkhornConfig& config, std::uint64_t seed);

  void prepare(const Tensor& q, const Tensor& k, const Tensor& v) override;
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> parameters() const override;

  // The pattern of the last forward, for tests: P of head (b, h), row-major [n_B, n_B].
  std::int64_t block() const { return block_; }
  std::int64_t blocks() const { return blocks_; }
  std::int64_t sortcut_blocks() const { return sortcut_; }
  std::vector<float> permutation(std::int64_t b, std::int64_t h) const;

 private:
  std::int64_t embed_blocks(const Tensor& k, std::int64_t head, int thread);
  std::int64_t sorting_network();
  std::int64_t balance(std::int64_t head, int thread);
  void mix_blocks(const Tensor& x, Tensor& sorted);
  std::int64_t attend_block(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head, std::int64_t block,
                            Tensor& out, int thread);

  Problem p_;
  SinkhornConfig c_;
  std::uint64_t seed_;
  std::int64_t block_, blocks_, sortcut_, sorted_rows_, score_cols_, score_ld_, threads_ = 1;
  Tensor w1_, b1_, w2_, b2_;
  Tensor embeddings_, hidden_, permutation_, sorted_k_, sorted_v_;
  Tensor running_, scratch_, scores_, row_stats_;  // per thread: prefix sums, column stats, tiles
};

Implementation sinkhorn_implementation();

}  // namespace xfb
