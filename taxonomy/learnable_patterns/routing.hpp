#pragma once
// `routing`: Routing Transformer attention (Roy et al. 2020), per head of [B, H, N, D].
//
// Centroids μ [H, C, D] (unit rows, "centroids"): drawn N(0, 1) from the seed and normalised, then
// fitted in the untimed prepare() by `kmeans_updates` passes of the online spherical k-means
// update on seeded fitting rows that stand in for training data — never the measured input, so
// causal outputs depend on no later token and batch elements are independent. Head h fits on 2N
// rows of N(0, 1) entries (stream "routing/fit", element e of head h: index h·2·N·D + e; the first
// N rows play queries, the next N keys): every normalised row x̂ goes to its nearest centroid,
// μ_c ← λ·μ_c + (1−λ)/2·(Σ x̂ assigned to c), then μ_c ← μ_c/‖μ_c‖ (λ = ema_decay). C = clusters (0: round(√N)), clamped
// to [1, N]; w = ⌈N/C⌉. Scores are q_i·k_j/√D on the raw inputs; the routing affinities are q̂_i·μ_c and k̂_j·μ_c.
//
// Non-causal (the paper's balanced routing): cluster c takes the w queries and, separately, the
// w keys of largest affinity (ties: lower position first), listed in position order; its queries
// attend to its keys (one softmax per cluster). A query taken by several clusters merges their
// outputs by log-sum-exp weights (= one softmax over the concatenated key lists); a query no
// cluster takes outputs zero (the residual carries it in a full layer).
// Causal: balanced top-k over the whole sequence would let future tokens change which earlier
// tokens are routed, so causal mode uses the decoding form of the same routing: query i goes to
// its nearest centroid c, key j to its nearest centroid, and query i attends to the (up to) w most
// recent keys j ≤ i routed to c — the same per-query budget w. No visible key → zero output.
// local_heads: the first ⌊H/2⌋ heads instead use local attention, blocks of w tokens attending
// to their own and the previous block (causal: j ≤ i), as the paper mixes local and routing heads.
//
// FLOPs per routing head (exact, see routing_flops):
//   non-causal: 4·N·D (norms) + 2·2·C·N·D (affinities) + 2·C·N (scaling by 1/‖x‖) +
//               C·(4·w²·D + 4·w² + w·D) (cluster attention) + 2·C·w·D (merge);
//   causal:     2·2·C·N·D (affinities) + 2·(C−1)·N (argmax) + N·(4·w·D + 4·w + 2·D) (per query:
//               scale q, w scores, masked softmax, w-row weighted sum, 1/Σ).
// Top-k selection and sorting are comparisons, not counted. Local heads: per block of `rows`
// queries and `cols` keys 4·rows·cols·D + 4·rows·cols + rows·D.
// The affinities are computed a block of 256 tokens at a time ([C, 256], in L2) and consumed at once
// by the selection (TopPositions) or the argmax: the [C, N] matrix is never held.
// Tracked workspace: per thread an affinity block, token lists [N] and selection scratch; while
// fitting (before the pattern buffers exist) per thread fitting rows [2, N, D]; non-causal
// per thread candidate lists [C + 1, min(N, w + 128 + 256)] (int32 positions and values) and, when D is a
// multiple of 16, a cluster tile's key panels [⌈w/16⌉·16, D] (the 512-bit kernels' path), int32
// memberships [B·H, 2, C, w], slot lists, per-cluster outputs [B·H, C·w, D + 1]; causal int32
// clusters/orders [B·H, 5, N] and key-sorted copies of Kᵀ [B·H, D, N] and V [B·H, N, D].
//
// Backward (cluster assignments and top-w memberships held fixed, as the paper trains): the
// forward also saves each token's merged log-sum-exp L [B·H, N] and keeps its pattern (int32
// memberships and slot lists, or the causal clusters, orders and key-sorted K, V). With
// δ_i = dO_i·O_i and P = exp(S − L) — each cluster's share of the query's merged softmax — the
// backward recomputes every tile: non-causal, gathered_tile_backward per cluster with dQ, dK, dV
// added back to their tokens; causal, one query row against its w recent keys (dK, dV gathered
// in key-sorted order, then put back); local heads, per block. One task per head. Then the
// centroid update, the paper's EMA and not a gradient, timed as the stage `centroid_update`:
// every normalised query and key of head h (all batch elements) goes to its nearest centroid
// (non-causal: affinities recomputed; causal: the saved clusters), μ_c ← λ·μ_c + (1−λ)/2·Σ x̂,
// μ_c ← μ_c/‖μ_c‖, into `updated_centroids` (dumped with the gradients): the next step's centroids;
// the benchmark keeps routing with the current ones so that every repetition times the same step.
// FLOPs (routing_backward_flops), per routing head: non-causal C·(10·w²·D + 4·w² + 5·w·D) (tiles,
// δ of the gathered rows, adding back dQ, dK, dV); causal N·(10·w·D + 4·w + 4·D); per local head and block
// 10·rows·cols·D + 4·rows·cols + 2·rows·D + 2·cols·D; the update, per routing head: 8·N·D (norms,
// sums) [+ 2·2·C·N·D + 2·(C−1)·N non-causal: affinities, argmax], + 6·C·D per routed head index.
// Backward workspace: L [B·H, N], the updated centroids [H, C, D], per thread centroid sums [C, D]
// and dO, dQ [w, D], dK, dV [cols, D] rows and a dS tile; causal: key-sorted dK, dV [routed heads, N, D].
//
// bf16 (issue 31; forward, backward, decode; any D): q, k, v, the output, the causal key-sorted
// copies of K and V (saved) and the decode rings are bf16; everything is computed in fp32 from rows
// widened as they are read — an affinity block's rows [256, D] (the routing gemm and norms), a
// cluster's gathered q, k, v rows, a local tile's rows, the causal query row (the sorted Kᵀ, V are
// read as bf16 and widened in the dot products) — and each output row is rounded once. The
// centroids, affinities, P and the log-sum-exp stay fp32, so the routing is the fp32 form's on the
// same (rounded) values and the FLOPs are unchanged. The backward widens a head's q, k, v, out, dout
// (causal routing heads: not k, v, read from the sorted copies) into per-thread fp32 rows [8, N, D]
// with fp32 dQ, dK, dV, rounded once per head. Decode steps keep
// P in fp32 (as the forward) against the bf16 rings. Extra workspace per thread: forward
// max(256, 2w + 2·cols with local heads, 2)·D floats, backward 8·N·D floats.
#include <cstdint>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/pattern_common.hpp"
#include "taxonomy/engines/top_positions.hpp"

namespace xfb {

struct RoutingConfig {
  std::int64_t clusters = 0;         // k-means clusters C; 0: round(√N)
  std::int64_t kmeans_updates = 10;  // online k-means passes over the seeded fitting rows in prepare()
  double ema_decay = 0.999;          // λ of the centroid moving average
  bool local_heads = false;          // first ⌊H/2⌋ heads use local attention
};

std::int64_t routing_clusters(const Problem& p, const RoutingConfig& c);  // C used for a problem
std::int64_t routing_window(const Problem& p, const RoutingConfig& c);    // w = ⌈N / C⌉

class RoutingAttention final : public Mechanism {
 public:
  RoutingAttention(const Problem& problem, const RoutingConfig& config, std::uint64_t seed);

  void prepare(const Tensor& q, const Tensor& k, const Tensor& v) override;
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> parameters() const override { return {{"centroids", &centroids_}}; }

  void prepare_backward() override;
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
  std::vector<NamedTensor> saved() const override;
  std::int64_t saved_bytes() const override;
  std::string gradient_note() const override {
    return "cluster assignments held fixed; centroids by EMA (stage centroid_update), not gradients";
  }
  // No gradient: the centroids' EMA update of the step (see above).
  std::vector<NamedTensor> parameter_gradients() const override { return {{"updated_centroids", &updated_centroids_}}; }

  // Decode (causal): the model of the context — centroids as fitted for N (2N seeded rows) and
  // w = ⌈N/C⌉ — continued token by token. Routing heads keep per cluster a ring of the w most recent
  // keys routed to it (K and V rows) and the count; a step routes its key and query to their
  // nearest centroids (stage `route`: 2·2·C·D + 2·(C−1) FLOPs), appends the key to its cluster's
  // ring and attends the query to its cluster's ring (stage `attend`): O(C + w) per token, state
  // C·w rows. Local heads keep a ring of the last 2w tokens (own and previous block).
  void prepare_decode(std::int64_t tokens) override;
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> decode_state() const override {
    return {{"cluster_keys", &cluster_cache_.key_tensor()},
            {"cluster_values", &cluster_cache_.value_tensor()},
            {"local_keys", &local_cache_.key_tensor()},
            {"local_values", &local_cache_.value_tensor()}};
  }
  std::int64_t state_bytes() const override { return Mechanism::state_bytes() + cluster_counts_.bytes(); }

  // The pattern of the last forward, for tests (member/cluster lists exist for routing heads only,
  // i.e. heads that are not local).
  std::int64_t clusters() const { return clusters_; }
  std::int64_t window() const { return window_; }
  bool is_local_head(std::int64_t h) const { return c_.local_heads && h < p_.heads / 2; }
  // Non-causal: the w query (or key) positions cluster c took in head (b, h), ascending.
  std::vector<std::int32_t> query_members(std::int64_t b, std::int64_t h, std::int64_t cluster) const;
  std::vector<std::int32_t> key_members(std::int64_t b, std::int64_t h, std::int64_t cluster) const;
  // Causal: the cluster of every query (or key) in head (b, h).
  std::vector<std::int32_t> query_clusters(std::int64_t b, std::int64_t h) const;
  std::vector<std::int32_t> key_clusters(std::int64_t b, std::int64_t h) const;

 private:
  bool bf16_form() const { return p_.dtype == DType::BF16; }
  // The bf16 form's fp32 rows of a thread, from float `offset` on (fp32 form: none, nullptr).
  float* widened_rows_of(int thread, std::int64_t offset = 0) {
    return widened_.empty() ? nullptr : widened_.data() + thread * widened_.dim(1) + offset;
  }
  // T: the element type of q, k, v, out and the key-sorted copies (float or bf16).
  template <class T>
  void forward_as(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  void fit_centroids();
  float* affinity_block_of(const float* mu, const float* rows, std::int64_t cols, int thread);
  template <class T>
  void assign_nearest(const float* mu, const T* rows, std::int32_t* nearest, int thread);
  template <class T>
  std::int64_t route_balanced(const Tensor& q, const Tensor& k, std::int64_t head, int thread);
  template <class T>
  std::int64_t attend_cluster(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                              std::int64_t cluster, int thread);
  template <class T>
  std::int64_t merge_clusters(std::int64_t head, std::int64_t token, Tensor& out, int thread);
  template <class T>
  std::int64_t route_nearest(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head, int thread);
  template <class T>
  std::int64_t attend_recent(const Tensor& q, std::int64_t head, std::int64_t token, Tensor& out, int thread);
  template <class T>
  std::int64_t attend_local(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head, std::int64_t block,
                            Tensor& out, int thread);
  // One head's rows [N, D] of the backward's tensors: the tensors' own (fp32) or the thread's
  // widened rows (bf16).
  struct HeadGrads {
    const float *q, *k, *v, *out, *dout;
    float *dq, *dk, *dv;
  };
  float token_delta(const HeadGrads& g, std::int64_t token) const;
  std::int64_t clusters_backward(const HeadGrads& g, std::int64_t r, int thread);
  template <class T>
  std::int64_t recent_backward(const HeadGrads& g, std::int64_t r, int thread);
  std::int64_t local_backward(const HeadGrads& g, std::int64_t head, int thread);
  template <class T>
  std::int64_t update_centroids(const Tensor& q, const Tensor& k, std::int64_t h, int thread);

  Problem p_;
  RoutingConfig c_;
  std::uint64_t seed_;
  std::int64_t clusters_, window_, affinity_ld_, score_ld_, threads_ = 1;
  std::vector<std::int64_t> routed_heads_, local_heads_;
  Tensor centroids_;
  // Per thread: a block of affinities [C, ld], its inverse norms or argmax values [block], gathered
  // rows, scores, row stats; token lists [N] and cluster counts [C + 1]; non-causal: each cluster's
  // selection (TopPositions, candidate positions and values [C + 1, capacity], the last its scratch)
  // and a cluster tile's key panels (tile_scores).
  Tensor affinity_, selection_, gathered_, scores_, row_stats_, top_values_, panels_;
  IndexBuffer candidates_, counts_, top_positions_;
  std::vector<TopPositions> tops_;
  // Non-causal pattern and per-cluster results.
  IndexBuffer members_, slot_start_, slots_;
  Tensor cluster_out_, cluster_lse_;
  // Causal pattern: clusters per token, key order, end of each query's key range, query order,
  // cluster starts.
  IndexBuffer token_clusters_, key_order_, key_end_, query_order_, cluster_start_;
  Tensor sorted_kt_, sorted_v_;     // keys transposed [D, N] per head, values [N, D] (the input's dtype)
  Tensor widened_, widened_grads_;  // bf16 form: per thread fp32 rows (see the contract above)
  // Backward: merged log-sum-exp per token [B·H, N]; per thread gradient rows, dS tile and centroid
  // sums; causal: key-sorted dK, dV; the updated centroids.
  Tensor token_lse_, grad_rows_, score_grads_, centroid_sums_, sorted_dk_, sorted_dv_, updated_centroids_;
  // Decoding (prepare_decode): routing heads' cluster rings (routed·C rings of w rows) and counts
  // [routed, C]; local heads' rings of 2w rows; per head the scaled query and accumulator.
  KvCache cluster_cache_, local_cache_;
  Tensor decode_buffers_;
  IndexBuffer cluster_counts_, step_clusters_;
  std::int64_t length_ = 0;
  template <class T>
  std::int32_t nearest_centroid(const T* x, std::int64_t h) const;
  template <class T>
  void append_routed(std::int64_t r, std::int32_t cluster, const T* key, const T* value);
  template <class T>
  void decode_as(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  template <class T>
  std::int64_t decode_head(std::int64_t bh, const T* q, const T* k, const T* v, T* out);
  template <class T>
  void load_decode_context(const Tensor& k, const Tensor& v);
};

template <>
Implementation implementation<RoutingConfig>();

}  // namespace xfb
