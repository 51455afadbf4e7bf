#pragma once
// `cluster-former`: the Cluster-Former layer's attention (Wang et al. 2021, arXiv 2009.06097), per
// head of [B, H, N, D]. Not causal (the survey: does not decode), so --causal is `unsupported`: the
// clusters are sorted and chunked over the whole sequence, and later tokens move earlier tokens' chunks.
//
// Centroids μ [H, p, D] ("centroids"): fitted in the untimed prepare() by `kmeans_iterations`
// Lloyd iterations of k-means on seeded fitting rows that stand in for the paper's memory bank of
// training hidden states — never the measured input, so batch elements stay independent. Head h
// fits on 2N rows of N(0, 1) entries (stream "cluster-former/fit", element e of head h: index
// h·2·N·D + e), starting from its first p rows; each iteration assigns every row to its nearest
// centroid (the rule below) and moves each centroid to the mean of its rows (a centroid with no
// rows stays). p = clusters clamped to [1, N]; c = chunk_len clamped to [1, N].
//
// Assignment (held fixed in the backward, no gradient through it, as in the paper): one cluster
// per token, from its key row k_j — in attention scope the stand-in for the paper's hidden state,
// so a token's query and key share the assignment. cluster(j) = nearest centroid in Euclidean
// distance, argmax_c (k_j·μ_c − ½‖μ_c‖²) (first maximum wins). Tokens are sorted by cluster with a
// stable counting sort (position order inside a cluster): order[s] is the token at sorted position
// s. The sorted order is cut into ⌈N/c⌉ chunks of c positions (the last one N − (⌈N/c⌉ − 1)·c);
// query i sees exactly the keys j whose sorted positions lie in its own chunk (itself included, no
// neighbouring chunk):  out_i = Σ_{j ∈ chunk(i)} softmax_j(q_i·k_j/√D) · v_j, scattered back to i.
//
// Choices where the paper's text could not be confirmed here (all unconfirmed in the paper; state
// them in any comparison): chunk_len = 256 and clusters = 512 by default; the Euclidean nearest
// centroid, computed as argmax(k·μ − ½‖μ‖²); 10 Lloyd iterations on 2N seeded rows per head in place
// of the paper's memory bank; the key row is clustered, so each token has one assignment shared by
// its query and its key; a query sees only its own chunk (no neighbouring chunk). The paper's
// Cluster-Former layers alternate with sliding-window layers; that stack is not modelled, since
// xfbench times one attention.
//
// FLOPs per head (exact, cluster_former_flops): 2·N·p·D + N·p (affinities k·μ and the −½‖μ‖²
// offsets) + Σ over chunks of r rows: 4·r²·D + kOnlineSoftmaxFlopsPerElement·r² + r·D (the two
// products, softmax, 1/Σ). Argmax and counting sort are comparisons and integer work, not counted.
// O(N·c·D + N·p·D): the survey's O(N log N) class with c, p fixed.
// Tracked workspace: centroids [H, p, D], ½‖μ‖² [H, p], per thread an affinity block [256, ld(p)];
// while fitting (before the pattern buffers exist) per thread fitting rows [2N, D], centroid sums
// [p, D], int32 counts [p] and nearest [2N]; afterwards int32 clusters and order [B·H, N], the dumped
// float copies "assignments" (cluster per token) and "permutation" (order) [B, H, N], per thread
// int32 counts [p + 1] and one tile: gathered q, k, v rows [3c, D], scores [c, ld(c)], output rows
// [c, D], row statistics [2c] and, when D is a multiple of 16, key panels (engines/pattern_common).
//
// bf16 (--dtype bf16, forward only; D % 16 == 0): q, k, v, out bf16; the assignment from each block of
// 256 key rows widened (the fp32 form's arithmetic on the same values); each chunk's bf16 rows gathered
// and attended on the bf16 gathered tile (gathered_tile_bf16.hpp: scores and softmax fp32, P rounded,
// the output rounded once); centroids stay fp32. Workspace: the tile's bf16 buffers instead of the
// fp32 rows and panels, plus the widened key block per thread.
//
// Backward (assignment and sort held fixed): the forward also saves each token's log-sum-exp L
// [B·H, N] (with the int32 order, saved_bytes). Every token lies in exactly one chunk, so chunks are
// independent tasks: each regathers its q, k, v, dO rows, recomputes its scores and runs
// gathered_tile_backward with δ_r = dO_r·O_r, writing dq, dk, dv rows straight to their tokens.
// FLOPs (cluster_former_backward_flops) per chunk of r rows: 10·r²·D (scores and four products) +
// kRecomputedSoftmaxBackwardFlopsPerElement·r² + 2·r·D (δ). Backward workspace: L [B·H, N] and per
// thread dO, dQ, dK, dV rows [4c, D] and a dS tile [c, ld(c)].
#include <cstdint>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/mechanism.hpp"
#include "taxonomy/engines/gathered_tile_bf16.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {

struct ClusterFormerConfig {
  std::int64_t clusters = 512;          // k-means centroids p (paper sweeps 64, 256, 512); clamped to N
  std::int64_t chunk_len = 256;         // tokens per chunk of the cluster-sorted order; clamped to N
  std::int64_t kmeans_iterations = 10;  // Lloyd iterations over the seeded fitting rows in prepare()
};

std::int64_t cluster_former_clusters(const Problem& p, const ClusterFormerConfig& c);  // p used for a problem
std::int64_t cluster_former_chunk(const Problem& p, const ClusterFormerConfig& c);     // c used for a problem

class ClusterFormerAttention final : public Mechanism {
 public:
  ClusterFormerAttention(const Problem& problem, const ClusterFormerConfig& config, std::uint64_t seed);

  void prepare(const Tensor& q, const Tensor& k, const Tensor& v) override;
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override;
  std::vector<NamedTensor> parameters() const override {
    return {{"centroids", &centroids_}, {"assignments", &assignments_}, {"permutation", &permutation_}};
  }

  void prepare_backward() override;
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
  std::vector<NamedTensor> saved() const override { return {{"lse", &lse_}}; }
  std::int64_t saved_bytes() const override { return lse_.bytes() + order_.bytes(); }
  std::string gradient_note() const override { return "cluster assignment and sort held fixed"; }

  // The pattern of the last forward, for tests: cluster of every token and the sorted order
  // (sorted position → token) of head (b, h).
  std::int64_t clusters() const { return clusters_; }
  std::int64_t chunk() const { return chunk_; }
  std::vector<std::int32_t> token_clusters(std::int64_t b, std::int64_t h) const;
  std::vector<std::int32_t> sort_order(std::int64_t b, std::int64_t h) const;

 private:
  void fit_centroids();
  std::int64_t nearest_centroids(const float* rows, std::int64_t count, std::int64_t h, std::int32_t* nearest,
                                 int thread);
  std::int64_t assign_and_sort(const Tensor& k, std::int64_t head, int thread);
  void gather_chunk(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head, std::int64_t first,
                    std::int64_t rows, int thread);
  std::int64_t attend_chunk(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head, std::int64_t chunk,
                            Tensor& out, int thread);
  std::int64_t attend_chunk_bf16(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                                 std::int64_t chunk, Tensor& out, int thread);
  std::int64_t chunk_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                              std::int64_t head, std::int64_t chunk, Tensor& dq, Tensor& dk, Tensor& dv, int thread);
  std::int64_t chunk_backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& dout, std::int64_t head, std::int64_t chunk, Tensor& dq, Tensor& dk,
                                   Tensor& dv, int thread);
  float* tile_rows(int thread) { return gathered_.data() + thread * 3 * chunk_ * p_.head_dim; }

  Problem p_;
  ClusterFormerConfig c_;
  std::uint64_t seed_;
  std::int64_t clusters_, chunk_, affinity_ld_, score_ld_, threads_ = 1;
  Tensor centroids_, half_norms_, affinity_;
  // The pattern: int32 clusters and order per head [B·H, N], their float copies for --dump, per
  // thread cluster counts [p + 1].
  IndexBuffer token_clusters_, order_, counts_;
  Tensor assignments_, permutation_;
  // Per thread one chunk tile: q, k, v rows [3c, D], scores [c, ld], output rows [c, D], row
  // statistics [2c] (lse and 1/Σ, or lse and δ in the backward), key panels.
  Tensor gathered_, scores_, tile_out_, row_stats_, panels_;
  // bf16 form: the gathered bf16 keys, values and their panels (GatheredScratchBf16), per thread bf16 q
  // and output rows [2, c, D], and one block of key rows widened for the assignment [256, D].
  GatheredScratchBf16 tiles16_;
  Tensor rows16_, widened_keys_;
  // Backward: saved log-sum-exp [B·H, N]; per thread dO, dQ, dK, dV rows [4c, D] and dS [c, ld]. bf16
  // form: dQ, dK, dV rows [3c, D] fp32, bf16 dO and output rows [2, c, D], the tile's bf16 backward buffers.
  Tensor lse_, grad_rows_, score_grads_, grad_rows16_;
  GatheredScratchBf16 grads16_;
};

template <>
Implementation implementation<ClusterFormerConfig>();

}  // namespace xfb
