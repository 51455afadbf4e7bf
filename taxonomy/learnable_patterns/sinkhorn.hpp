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
//
// Backward — gradients through the whole sorting network (the soft permutation is differentiable;
// nothing is held fixed): the forward also saves each query's log-sum-exp and the network's
// scores R [B·H, n_B, n_B], and keeps E, the hidden layer, P, K̃ and Ṽ. The backward, in order:
//   attention, per query block (FlashAttention-2 recomputation, gathered_tile_backward over the
//     block's keys [own; K̃_i], or the SortCut rows): dQ, dK and dV of the own block, dK̃, dṼ;
//   mixing: dP = dK̃·K_blocksᵀ + dṼ·V_blocksᵀ, dK += Pᵀ·dK̃, dV += Pᵀ·dṼ;
//   balance: causal, the row softmax's backward; non-causal, the 2·iters log-normalisation steps
//     are replayed from R (each step's output kept, per thread) and differentiated in reverse:
//     a row step y = x − lse_row(x) gives dx = dy − exp(y)·Σ_row dy, a column step likewise over
//     columns; dL = dP ⊙ P at the end, dR = dL/τ at the start;
//   network (shared by the heads, gradients summed over them): dw2 = Hᵀ·dR, db2 = Σ dR,
//     dZ = dR·w2ᵀ ⊙ [H > 0], db1 = Σ dZ, dw1 = Eᵀ·dZ, dE = dZ·w1ᵀ;
//   embeddings: dK_t += dE of t's block (causal: Σ of dE over the later blocks).
// Stages: backward_attend (attention and mixing), backward_route (the rest).
// FLOPs per head (sinkhorn_backward_flops): attention per query block 10·rows·cols·D + 4·rows·cols
// + 2·rows·D (δ) [+ 2·cols·D with SortCut: adding dK̃, dṼ]; mixing 4·2·n_r·N·D; balance non-causal
// n_B²·(3 + 18·iters), causal 5·n_B(n_B−1)/2; network per head 2·2·n_B·D·n_B + 2·2·n_B·D·D +
// n_B² + 2·n_B·D (db2, mask, db1); embeddings N·D [+ (n_B−1)·D causal].
// Backward workspace: lse [B·H·N], R [B·H, n_B, n_B], dP [B·H, n_B, n_B], dK̃ and dṼ, parameter
// gradients, dH and dE [B·H·n_B, D]; per thread gathered K, V, dK, dV rows [cols, D] and a dS tile
// [b, cols], plus the replayed steps [2·iters, n_B, n_B] when non-causal.
//
// bf16 (Problem::dtype, sinkhorn_bf16.cpp; D % 16 == 0, other D unsupported): q, k, v, out, K̃, Ṽ,
// dq, dk, dv and the decode state (block cache, E, the open block's K̃, Ṽ) bf16; the sorting part
// (E, the network, the balance, P, R, their gradients) fp32 from the bf16 keys. Roundings: causal E
// as E_{i+1} = bf16(E_i + Σ block i) (the decode state's recurrence; non-causal E unrounded);
// K̃ = bf16(Σ_j P_ij·K_j) (sgemm on a head's widened K, fp32 sums); per query block S on the bf16 tile kernels, the fp32
// masked softmax, P rounded to bf16, O = bf16(P·V/Σ). Backward: gathered_tile_backward_bf16 per block (P, dS rounded to
// bf16; dQ rounded once); dP from the bf16 blocks in fp32; per key block dK, dV = bf16(the attention's share, already
// rounded once + Σ_i P_ij·dK̃_i [+ dE]). FLOPs, saved lse and the sorting tensors as fp32's; K̃, Ṽ and the state half.
#include <cstdint>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"
#include "taxonomy/engines/gathered_tile_bf16.hpp"

namespace xfb {

struct SinkhornConfig {
  std::int64_t block = 50;          // tokens per block b
  std::int64_t sinkhorn_iters = 7;  // row+column normalisation rounds (non-causal)
  double temperature = 0.75;        // τ dividing the sorting scores
  std::int64_t sortcut_blocks = 0;  // SortCut n_k: attend only to the first n_k sorted blocks; 0: off
};

std::int64_t sinkhorn_block(const Problem& p, const SinkhornConfig& c);   // b clamped to [1, N]
std::int64_t sinkhorn_blocks(const Problem& p, const SinkhornConfig& c);  // n_B
// The bf16 form's fp32 mixing rows per thread: non-causal a head's widened x [N, D] and its sums
// [n_r, b·D]; causal one row [b·D].
std::int64_t sinkhorn_bf16_mixing_floats(const Problem& p, const SinkhornConfig& c);

class SinkhornAttention final : public Mechanism {
 public:
  SinkhornAttention(const Problem& problem, const SinkhornConfig& config, std::uint64_t seed);

  void prepare(const Tensor& q, const Tensor& k, const Tensor& v) override;
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> parameters() const override;

  // Decode (causal, no SortCut): every token's keys and values in blocks ([B·H, n_B(N+T)·b, D]
  // each), E of the open block (the keys of the blocks before it) and its sorted block K̃, Ṽ
  // ([b, D] each). When a block opens (the step after the previous one completes: stage `route`)
  // its network row, P row and K̃, Ṽ are computed over the blocks before it (2·D² + 2·D + 2·D·β +
  // 7·β + 2·2·β·b·D FLOPs for block β); a token attends to its block so far and to K̃, Ṽ (stage
  // `attend`): O(b) per token plus O(N·D/b) amortised for the block openings, state O(N). The
  // network's w2 is drawn by coordinates, so its columns for n_B(N+T) blocks extend those of n_B.
  // The steps read w1, b1 of parameters() and, in decode_parameters(), "w2" [D, n_B(N+T)] and "b2"
  // [n_B(N+T)]: those of the model built for N + T tokens (dumped as decode_w2, decode_b2).
  void prepare_decode(std::int64_t tokens) override;
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> decode_parameters() const override { return {{"w2", &decode_w2_}, {"b2", &decode_b2_}}; }
  std::vector<NamedTensor> decode_state() const override {
    return {{"block_keys", &block_keys_},
            {"block_values", &block_values_},
            {"open_embedding", &decode_embeddings_},
            {"sorted_block", &decode_sorted_}};
  }

  void prepare_backward() override;
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
  std::vector<NamedTensor> saved() const override;
  std::vector<NamedTensor> parameter_gradients() const override {
    return {{"dw1", &dw1_}, {"db1", &db1_}, {"dw2", &dw2_}, {"db2", &db2_}};
  }

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
  std::int64_t attend_block_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                     const Tensor& dout, std::int64_t head, std::int64_t block, Tensor& dq, Tensor& dk,
                                     Tensor& dv, int thread);
  void mix_blocks_backward(const Tensor& k, const Tensor& v, Tensor& dk, Tensor& dv);
  std::int64_t balance_backward(std::int64_t head, int thread);
  std::int64_t sorting_network_backward();
  std::int64_t embed_blocks_backward(std::int64_t head, Tensor& dk, int thread);
  std::int64_t block_embedding_grads(std::int64_t head, int thread);
  std::int64_t attend_block(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head, std::int64_t block,
                            Tensor& out, int thread);
  template <class T>
  std::int64_t embed_blocks_as(const T* keys, std::int64_t head, int thread);
  std::int64_t route(const Tensor& k);

  // The bf16 form (sinkhorn_bf16.cpp).
  void prepare_bf16();
  void forward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  std::int64_t mix_blocks_bf16(const Tensor& x, Tensor& sorted);
  std::int64_t gather_block_bf16(const Tensor& k, const Tensor& v, std::int64_t head, std::int64_t block,
                                 const GatheredBf16Buffers& b, const bf16** keys, const bf16** values) const;
  std::int64_t attend_block_bf16(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                                 std::int64_t block, Tensor& out, int thread);
  void prepare_backward_bf16();
  void backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                     Tensor& dq, Tensor& dk, Tensor& dv);
  std::int64_t attend_block_backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                          const Tensor& dout, std::int64_t head, std::int64_t block, Tensor& dq,
                                          Tensor& dk, Tensor& dv, int thread);
  void mix_blocks_backward_bf16(const Tensor& k, const Tensor& v);
  std::int64_t spread_grads_bf16(std::int64_t head, std::int64_t block, Tensor& dk, Tensor& dv, int thread);
  void prepare_decode_bf16(std::int64_t blocks);
  std::int64_t mix_open_block_bf16(std::int64_t head, std::int64_t block, const float* weights);
  void load_decode_context_bf16(const Tensor& k, const Tensor& v);
  void decode_step_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  std::int64_t close_block_bf16(std::int64_t head, std::int64_t block);
  std::int64_t attend_step_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t head,
                                int thread);

  Problem p_;
  SinkhornConfig c_;
  std::uint64_t seed_;
  std::int64_t block_, blocks_, sortcut_, sorted_rows_, score_cols_, score_ld_, threads_ = 1;
  bool bf16_ = false;
  // bf16 form: per thread the gathered tile's bf16 buffers (forward; backward), an fp32 [b, D]
  // accumulator (the tile's output, the backward's dQ) and fp32 mixing rows: non-causal a head's
  // widened x [N, D] and its sums [n_r, b·D], causal one row [b·D] (the backward and decode use the
  // first b·D).
  GatheredScratchBf16 tiles16_, grads16_;
  Tensor tile_acc_, mix_rows_;
  Tensor w1_, b1_, w2_, b2_;
  Tensor embeddings_, hidden_, permutation_, sorted_k_, sorted_v_;
  Tensor running_, scratch_, scores_, row_stats_;  // per thread: prefix sums, column stats, tiles
  // Backward (prepare_backward): saved lse and R; gradients of P, K̃, Ṽ, the weights, H and E; per
  // thread the gathered rows, the dS tile and the replayed Sinkhorn steps.
  Tensor lse_, sort_scores_, permutation_grads_, sorted_k_grads_, sorted_v_grads_;
  Tensor dw1_, db1_, dw2_, db2_, hidden_grads_, embedding_grads_;
  Tensor key_rows_, score_grads_, steps_;
  // Decoding (prepare_decode): w2, b2 for n_B(N+T) blocks; the block cache; per head the sorted
  // block, E, the step's scaled query and accumulator [2, D] and the network's scratch [hidden, R
  // row]; the open block and its fill.
  Tensor decode_w2_, decode_b2_, block_keys_, block_values_, decode_sorted_, decode_embeddings_, decode_buffers_,
      decode_scratch_;
  std::int64_t open_block_ = 0, filled_ = 0;
  std::int64_t start_block(std::int64_t head, std::int64_t block);
  void load_decode_context(const Tensor& k, const Tensor& v);
};

template <>
Implementation implementation<SinkhornConfig>();

}  // namespace xfb
