#pragma once
// `reformer`: LSH attention of the Reformer (Kitaev et al. 2020), per head of [B, H, N, D].
//
// Shared QK: the queries are the `q` input; the keys are the normalised queries
// k̂_j = q_j / ‖q_j‖ (the `k` input is not read); values are `v`. Scores are q_i·k̂_j / √D.
// Hashing, per round r < n_rounds: rotations R_r ∈ R^{D × n_buckets/2} drawn N(0, 1) from the seed
// (stored as one [D, n_rounds, n_buckets/2] tensor, "rotations"); x = k̂_i·R_r and
// bucket_r(i) = argmax([x ; −x]) (first maximum wins). n_buckets = 1 puts every token in bucket 0.
// Sorting: a stable counting sort by (bucket, position); s is a position in the sorted order,
// order_r[s] the token there, and rank(s) the token's index inside its bucket.
// Chunks of m = chunk_len tokens of the sorted order (m clamped to N; the last chunk may be short):
//   non-causal: query s in chunk c = ⌊s/m⌋ sees sorted keys t in chunks c−1 and c (no wrap-around)
//     with bucket(t) = bucket(s);
//   causal: the chunk grid restarts at every bucket — query s sees same-bucket keys t ≤ s with
//     ⌊rank(t)/m⌋ ≥ ⌊rank(s)/m⌋ − 1. (A grid over the whole sorted order would move chunk
//     boundaries whenever later tokens hash into lower buckets, so earlier outputs would depend on
//     future tokens; per-bucket chunks keep the output of token i a function of tokens ≤ i.)
//     Such keys lie in sorted chunks c−2..c, which is the key range each causal tile computes.
// A query never sees itself unless nothing else is visible in that round; then it sees only itself.
// Several rounds attend to the union of their visible sets, each key once (the paper's multi-round
// attention): in every round the score of a visible key j is lowered by log c(i, j), c the number
// of rounds in which j is visible to i. Round r gives o_r(i) = softmax over its visible keys of
// those scores and lse_r(i) = log Σ exp(scores); rounds combine as
// out(i) = Σ_r exp(lse_r(i) − L(i)) · o_r(i) with L(i) = log Σ_r exp(lse_r(i)), which equals
// softmax(q_i·k̂_jᵀ/√D) over the union. One round: c = 1, plain attention over its keys.
//
// FLOPs per head (exact, see reformer_flops): 3·N·D (normalise) + [n_buckets > 1]
// (2·N·D·n_rounds·n_buckets/2 (rotations) + n_rounds·N·n_buckets (argmax)) + per round and chunk
// with `rows` queries and `cols` candidate keys: 4·rows·cols·D (two products) + 4·rows·cols (masked
// softmax) + rows·D (1/Σ) + rows·D (the chunk's own keys k̂ = q·(1/‖q‖) from its gathered query
// rows) + 3·rows·D for rounds after the first (log-sum-exp merge) + rows·cols
// when n_rounds > 1 (the log c discount; counting rounds is integer work, not counted).
// Tracked workspace: k̂ [B·H·N, D], 1/‖q‖ [B·H·N], rotated [B·H·N, n_rounds·n_buckets/2], int32
// buckets, orders, sorted buckets and ranks [n_rounds, B·H, N] (and token positions when
// n_rounds > 1), running lse [B·H·N], and per thread one tile: gathered rows [m + 2·kc, D]
// (kc = 2m, or 3m causal), scores [m, kc], output [m, D] and, when D is a multiple of 16, the
// tile's key panels [⌈kc/16⌉·16, D] (its products on the 512-bit kernels, engines/pattern_common.hpp).
// Threads claim runs of consecutive chunks; a tile keeps the candidate rows it shares with the
// thread's previous tile, so each chunk gathers only its own query and value rows (its keys are
// those queries scaled by 1/‖q‖).
//
// Backward (buckets and sort order held fixed, as the paper trains): the forward saves the sort
// (buckets, orders, sorted buckets, ranks, positions: int32, part of saved_bytes), k̂, 1/‖q‖ and the
// merged log-sum-exp L of every token; the backward recomputes every round's chunk scores (and discount)
// and, with P = exp(S − log c − L) — each round's share of the union's softmax — and δ_i = dO_i·O_i,
// runs gathered_tile_backward per chunk, adding dQ, dK̂, dV back to their tokens. Gradients reach q
// twice: as queries and through the keys k̂ = q/‖q‖, dQ += (dK̂ − k̂·(k̂·dK̂))/‖q‖. dK = 0 (k unread).
// One task per head (a head's chunks write overlapping rows). FLOPs per head (reformer_backward_flops):
// 2·N·D (δ) + per round and chunk: [n_rounds > 1] rows·cols (discount) + 10·rows·cols·D (scores
// and four products) + 4·rows·cols (P, dS) + rows·D (own keys, as in the forward) + (rows + 2·cols)·D
// (adding back) + 8·N·D (normalisation).
// Backward workspace: dK̂ [B·H·N, D], δ [B·H·N], per thread dO and dQ rows [m, D], dK and dV rows
// [kc, D] and dS [m, kc].
//
// bf16 (Problem::dtype; reformer_bf16.cpp): q, v, out, dq, dk (zeros), dv bf16; k unread. A token's
// k̂ = q/‖q‖ and rotations x = k̂·R are computed in fp32 from its bf16 query row alone (one function
// for the forward and the decode step, so the buckets are the same bits in both); k̂ is stored bf16
// (a saved tensor, half the bytes); 1/‖q‖, the rotations and the log-sum-exp L stay fp32 (per-token
// statistics). The same hashing, sort, masks and discount as fp32, on bf16 tiles: gathered bf16
// rows, keys packed into pair panels, S = Q·K̂ᵀ/√D on tiles::scores_bf16 (fp32), masked softmax and
// lse in fp32, P = exp(S − max) rounded to bf16, O = P·V on accumulate_pv_bf16 (fp32). One round: O/Σ
// rounded to bf16 per token; several: the rounds merge in a head's fp32 accumulator [N, D] per
// thread (tasks per head), rounded to bf16 once. Backward (one task per head): recomputed S, P = exp(S
// − L), dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − δ) rounded to bf16, dQ = dS·K̂/√D, dK̂ = dSᵀ·Q/√D on the
// bf16 kernels, summed in the thread's fp32 dQ, dK̂, dV of the head [3, N, D], dQ += (dK̂ − k̂(k̂·dK̂))/‖q‖
// with k̂ recomputed in fp32, stored bf16. Decode: the rings' k̂ and v rows bf16 (positions and counts
// int32 as in fp32), scores and softmax in fp32, the weights rounded to bf16 as the forward rounds P.
// FLOPs are the fp32 form's; D % 16 != 0 is an unsupported row (the bf16 kernels tile D in 16s).
// Workspace (reformer_bf16_workspace): the fp32 form's without its fp32 tiles, k̂ in bf16, the
// transposed rotations, and per thread the bf16 tile (query rows [m, D], key and value rows [kc, D],
// key pair panels, value row pairs, P [m, ld]), scores [m, ld], output rows [m, D], row statistics
// [2m] and with several rounds the accumulator [N, D]. Backward: δ, per thread dQ rows [m, D], dK̂ and
// dV rows [kc, D], dP/dS [m, ld], the head's fp32 gradients [3, N, D] and the bf16 gradient tile (dO
// rows and row pairs, Q and K̂ row pairs, V pair panels, P row pairs, dS rows and row pairs).
#include <cstdint>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {

struct ReformerConfig {
  std::int64_t n_buckets = 10;  // hash buckets per round: 1, or an even number
  std::int64_t n_rounds = 1;    // independent hash rounds: 1, 2, 4 or 8
  std::int64_t chunk_len = 64;  // tokens per chunk of the sorted order; 0: ⌈N / n_buckets⌉ as in LRA's code
};

// The chunk length m used for a problem: chunk_len (or ⌈N / n_buckets⌉ when 0), clamped to [1, N].
std::int64_t reformer_chunk(const Problem& p, const ReformerConfig& c);

class ReformerAttention final : public Mechanism {
 public:
  ReformerAttention(const Problem& problem, const ReformerConfig& config, std::uint64_t seed);

  void prepare(const Tensor& q, const Tensor& k, const Tensor& v) override;
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> parameters() const override;

  void prepare_backward() override;
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
  std::vector<NamedTensor> saved() const override {
    return {{"keys", &keys_}, {"inverse_norms", &inverse_norms_}, {"running_lse", &running_lse_}};
  }
  std::int64_t saved_bytes() const override;
  std::string gradient_note() const override { return "hash buckets and sort order held fixed"; }

  // Decode (causal): per (head, round, bucket) a ring of the bucket's last 2m members (positions,
  // k̂ and v rows) and the member counts. A step normalises its query into k̂, hashes it in every
  // round (stage `route`), appends it to its buckets and attends to the union of its visible keys
  // — in each round the bucket members of ranks ⌊rank/m⌋·m − m … rank − 1 (itself only when it is
  // the bucket's first member) — each key once, one softmax (stage `attend`). FLOPs per head:
  // 3·D (k̂) + n_rounds·(2·D·n_buckets/2 + n_buckets) (hashing) + D (scale q) + attend_rows over
  // the union + D: O(n_rounds·m) per token, state constant in N.
  void prepare_decode(std::int64_t tokens) override;
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> decode_state() const override {
    return {{"ring_keys", &ring_keys_}, {"ring_values", &ring_values_}};
  }
  std::int64_t state_bytes() const override {
    return ring_keys_.bytes() + ring_values_.bytes() + ring_positions_.bytes() + member_counts_.bytes();
  }

  // The pattern of the last forward, for tests: bucket of every token (original order) and the
  // sorted order (sorted position → token) of round r in head (b, h).
  std::int64_t chunk() const { return chunk_; }
  std::vector<std::int32_t> buckets(std::int64_t round, std::int64_t b, std::int64_t h) const;
  std::vector<std::int32_t> sort_order(std::int64_t round, std::int64_t b, std::int64_t h) const;

 private:
  std::int64_t head_index(std::int64_t b, std::int64_t h) const { return b * p_.heads + h; }
  std::int64_t key_start(std::int64_t q0) const;
  std::int64_t normalise_keys(const Tensor& q);
  std::int64_t hash_and_sort(std::int64_t round, std::int64_t head);
  struct ChunkRange {
    std::int64_t q0, rows, k0, cols;  // sorted positions of the chunk's queries and candidate keys
  };
  ChunkRange chunk_range(std::int64_t chunk) const;
  std::int64_t chunk_scores(std::int64_t round, std::int64_t head, const ChunkRange& c, const Tensor& q,
                            const Tensor& v, int thread);
  std::int64_t keep_held_rows(std::int64_t round, std::int64_t head, const ChunkRange& c, void* k_rows, void* v_rows,
                              std::size_t row_bytes, int thread);
  std::int64_t mask_scores(std::int64_t round, std::int64_t head, const ChunkRange& c, float* scores) const;
  void forget_held_rows();
  std::int64_t attend_chunk(std::int64_t round, std::int64_t head, std::int64_t chunk, const Tensor& q, const Tensor& v,
                            Tensor& out, int thread);
  std::int64_t backward_head(std::int64_t head, const Tensor& q, const Tensor& v, const Tensor& out, const Tensor& dout,
                             Tensor& dq, Tensor& dv, int thread);
  std::int64_t chunk_backward(std::int64_t round, std::int64_t head, const ChunkRange& c, const Tensor& q,
                              const Tensor& v, const Tensor& dout, Tensor& dq, Tensor& dv, int thread);
  bool alone(const std::int32_t* sorted, const std::int32_t* rank, std::int64_t s) const;
  bool sees(std::int64_t round, std::int64_t head, std::int64_t i, std::int64_t j) const;
  std::int64_t discount_repeats(std::int64_t head, const std::int32_t* order, std::int64_t q0, std::int64_t rows,
                                std::int64_t k0, std::int64_t cols, float* scores) const;
  // Decoding: the ring row of (head, round, bucket) slot; one token's bucket in a round; one head's
  // step (hash, append; then the union's rows gathered and attended).
  std::int64_t ring_row(std::int64_t head, std::int64_t round, std::int64_t bucket) const {
    return ((head * c_.n_rounds + round) * c_.n_buckets + bucket) * 2 * chunk_;
  }
  std::int32_t bucket_of(const float* key, std::int64_t round) const;
  void append_member(std::int64_t head, std::int64_t round, std::int32_t bucket, std::int64_t position,
                     const float* key, const float* value);
  std::int64_t decode_union(std::int64_t head, const float* q, float* out, int thread);
  void load_decode_context(const Tensor& v);

  // The bf16 form (reformer_bf16.cpp): the same pattern (hash_and_sort, mask_scores) on bf16 tiles.
  struct Bf16Tile;
  struct Bf16Grads;
  Bf16Tile bf16_tile(int thread);
  Bf16Grads bf16_grads(int thread);
  void prepare_bf16();
  void forward_bf16(const Tensor& q, const Tensor& v, Tensor& out);
  std::int64_t normalise_keys_bf16(const Tensor& q);
  std::int64_t chunk_scores_bf16(std::int64_t round, std::int64_t head, const ChunkRange& c, const Tensor& q,
                                 const Tensor& v, int thread);
  std::int64_t attend_chunk_bf16(std::int64_t round, std::int64_t head, std::int64_t chunk, const Tensor& q,
                                 const Tensor& v, Tensor& out, float* accumulator, int thread);
  void prepare_backward_bf16();
  void backward_bf16(const Tensor& q, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk,
                     Tensor& dv);
  std::int64_t backward_head_bf16(std::int64_t head, const Tensor& q, const Tensor& v, const Tensor& out,
                                  const Tensor& dout, Tensor& dq, Tensor& dv, int thread);
  std::int64_t chunk_backward_bf16(std::int64_t round, std::int64_t head, const ChunkRange& c, const Tensor& q,
                                   const Tensor& v, const Tensor& dout, float* accumulators, int thread);
  void prepare_decode_bf16();
  void decode_step_bf16(const Tensor& q, const Tensor& v, Tensor& out);
  std::int64_t decode_union_bf16(std::int64_t head, const bf16* q, bf16* out, int thread);
  void append_member_bf16(std::int64_t head, std::int64_t round, std::int32_t bucket, std::int64_t position,
                          const bf16* key, const bf16* value);
  void load_decode_context_bf16(const Tensor& v);
  std::int64_t step_floats() const;  // bf16 decode: fp32 step buffer per head

  Problem p_;
  ReformerConfig c_;
  std::uint64_t seed_;
  std::int64_t chunk_, half_, key_cols_, score_ld_, threads_ = 1;
  Tensor rotations_, keys_, inverse_norms_, rotated_, running_lse_;
  // Per round and head: buckets (token order), sort order, buckets and in-bucket ranks (sorted
  // order), token → sorted position (several rounds only).
  IndexBuffer buckets_, orders_, sorted_buckets_, ranks_, positions_, bucket_counts_;
  Tensor gathered_, scores_, tile_out_, row_stats_, panels_;
  // Per thread: the round, head and sorted positions [begin, end) of the key and value rows its
  // gathered tile holds (head −1: none; reset by every forward and backward, whose inputs may differ).
  struct HeldRows {
    std::int64_t round = -1, head = -1, begin = 0, end = 0;
  };
  std::vector<HeldRows> held_rows_;
  // Backward: dK̂ [B·H·N, D], δ [B·H, N]; per thread dO, dQ rows [m, D] and dK, dV rows [kc, D], dS [m, ld].
  Tensor key_grads_, deltas_, grad_rows_, score_grads_;
  // Decoding (prepare_decode): rings [heads, rounds, n_buckets, 2m] of positions (int32), k̂ and v
  // rows; member counts [heads, rounds, n_buckets]; per head the step's k̂, its buckets and the
  // union's gathered k̂ and v rows [rounds·2m, D] each, the scaled query and accumulator; per thread
  // the union's (position, ring row) pairs to sort (≤ rounds·2m int64, untracked scratch).
  IndexBuffer ring_positions_, member_counts_, step_buckets_;
  Tensor ring_keys_, ring_values_, union_keys_, union_values_, step_buffers_;
  std::vector<std::vector<std::int64_t>> union_pairs_;
  std::int64_t length_ = 0;
  // bf16 (Problem::dtype): per thread the bf16 tile (tile16_: gathered rows, key pair panels, value
  // row pairs, bf16 P), with several rounds the fp32 output accumulator of a head (accumulators_
  // [threads, N, D]); backward: the bf16 gradient tile (grads16_) and the fp32 dQ, dK̂, dV of a head
  // (grad_accumulators_ [threads, 3, N, D]).
  bool bf16_ = false;
  // Decode: the step's k̂ rounded to bf16 [heads, D] (the fp32 step buffers: step_floats()).
  // rotation_rows_: the rotations transposed, [n_rounds·n_buckets/2, D] (the hashing's rows).
  Tensor tile16_, accumulators_, grads16_, grad_accumulators_, step_keys_, rotation_rows_;
};

// The bf16 form's workspace, backward workspace and decode workspace (reformer_bf16.cpp).
std::int64_t reformer_bf16_workspace(const Problem& p, const ReformerConfig& c);
std::int64_t reformer_bf16_backward_workspace(const Problem& p, const ReformerConfig& c);
std::int64_t reformer_bf16_decode_workspace(const Problem& p, const ReformerConfig& c);

template <>
Implementation implementation<ReformerConfig>();

}  // namespace xfb
