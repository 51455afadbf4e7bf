#include "taxonomy/learnable_patterns/cluster_former.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "lib/core/bf16.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/gathered_tile_bf16.hpp"

namespace xfb {

std::int64_t cluster_former_clusters(const Problem& p, const ClusterFormerConfig& c) {
  return std::clamp<std::int64_t>(c.clusters, 1, std::max<std::int64_t>(p.seq_len, 1));
}

std::int64_t cluster_former_chunk(const Problem& p, const ClusterFormerConfig& c) {
  return std::clamp<std::int64_t>(c.chunk_len, 1, std::max<std::int64_t>(p.seq_len, 1));
}

namespace {

// Tokens per block of affinities: a block's [block, p] affinities stay in L2 between their product
// and the argmax that reads them.
constexpr std::int64_t kAffinityBlock = 256;
std::int64_t affinity_block(std::int64_t n) { return std::clamp<std::int64_t>(n, 1, kAffinityBlock); }

// Rows of chunk `chunk` of the sorted order.
std::int64_t chunk_rows(std::int64_t n, std::int64_t c, std::int64_t chunk) { return std::min(c, n - chunk * c); }

// Bytes of the workspace: kept through prepare, only while fitting, and after fitting (the peak is
// kept + the larger of the other two). Floats and int32 are 4 bytes.
struct ForwardBytes {
  std::int64_t kept, fitting, after;
};

ForwardBytes forward_bytes(const Problem& p, const ClusterFormerConfig& config) {
  constexpr std::int64_t kWord = 4, kHalf = sizeof(bf16);
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, threads = p.threads;
  const std::int64_t cl = cluster_former_clusters(p, config), c = cluster_former_chunk(p, config);
  const std::int64_t kept = p.heads * cl * (d + 1) + threads * affinity_block(n) * ops::padded_ld(cl);
  const std::int64_t fitting = threads * (2 * n * d + cl * d + cl + 2 * n);
  const std::int64_t pattern = 4 * heads * n + threads * (cl + 1);
  if (p.dtype == DType::BF16) {  // per thread: scores, acc, row statistics, widened keys; bf16 q and out rows
    const std::int64_t words = c * ops::padded_ld(c) + c * d + 2 * c + affinity_block(n) * d;
    const std::int64_t after = kWord * (pattern + threads * words) + kHalf * threads * 2 * c * d +
                               GatheredScratchBf16::bytes(threads, c, c, d, false);
    return {kWord * kept, kWord * fitting, after};
  }
  const std::int64_t tile = 3 * c * d + c * ops::padded_ld(c) + c * d + 2 * c + tile_panel_floats(c, d);
  return {kWord * kept, kWord * fitting, kWord * (pattern + threads * tile)};
}

// ½‖μ_c‖² of head h's centroids, the offsets that turn k·μ into the nearest-centroid score.
void centroid_offsets(const float* mu, std::int64_t clusters, std::int64_t d, float* half_norms) {
  for (std::int64_t c = 0; c < clusters; ++c) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (std::int64_t j = 0; j < d; ++j) squares += mu[c * d + j] * mu[c * d + j];
    half_norms[c] = 0.5f * squares;
  }
}

}  // namespace

ClusterFormerAttention::ClusterFormerAttention(const Problem& problem, const ClusterFormerConfig& config,
                                               std::uint64_t seed)
    : p_(problem),
      c_(config),
      seed_(seed),
      clusters_(cluster_former_clusters(problem, config)),
      chunk_(cluster_former_chunk(problem, config)),
      affinity_ld_(ops::padded_ld(clusters_)),
      score_ld_(ops::padded_ld(chunk_)) {}

void ClusterFormerAttention::prepare(const Tensor&, const Tensor&, const Tensor&) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, cl = clusters_, c = chunk_;
  threads_ = p_.threads;
  centroids_ = Tensor(Shape{p_.heads, cl, d});
  half_norms_ = Tensor(Shape{p_.heads, cl});
  affinity_ = Tensor(Shape{threads_, affinity_block(n), affinity_ld_});
  fit_centroids();  // before the pattern buffers exist: its fitting rows are freed first
  token_clusters_ = IndexBuffer(heads * n);
  order_ = IndexBuffer(heads * n);
  counts_ = IndexBuffer(threads_ * (cl + 1));
  assignments_ = Tensor(Shape{p_.batch, p_.heads, n});
  permutation_ = Tensor(Shape{p_.batch, p_.heads, n});
  scores_ = Tensor(Shape{threads_, c, score_ld_});
  tile_out_ = Tensor(Shape{threads_, c, d});
  row_stats_ = Tensor(Shape{threads_, 2, c});
  if (p_.dtype == DType::BF16) {
    tiles16_ = GatheredScratchBf16(threads_, c, c, d, false);
    rows16_ = Tensor(Shape{threads_, 2, c, d}, DType::BF16);
    widened_keys_ = Tensor(Shape{threads_, affinity_block(n), d});
    return;
  }
  gathered_ = Tensor(Shape{threads_, 3 * c, d});
  panels_ = Tensor(Shape{threads_, tile_panel_floats(c, d)});
}

// Lloyd's k-means of each head's centroids on that head's 2N seeded fitting rows.
void ClusterFormerAttention::fit_centroids() {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, cl = clusters_, rows = 2 * n;
  Tensor fit_rows(Shape{threads_, rows, d});
  Tensor sums(Shape{threads_, cl, d});
  IndexBuffer members(threads_ * cl), nearest(threads_ * rows);
  const CounterRng fit_rng(seed_, "cluster-former/fit");
#pragma omp parallel num_threads(threads_)
  {
    const int thread = omp_get_thread_num();
    float* fit = fit_rows.data() + thread * rows * d;
    float* sum = sums.data() + thread * cl * d;
    std::int32_t* count = members.data() + thread * cl;
    std::int32_t* best = nearest.data() + thread * rows;
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t h = 0; h < p_.heads; ++h) {
      float* mu = centroids_.data() + h * cl * d;
      for (std::int64_t e = 0; e < rows * d; ++e)
        fit[e] = static_cast<float>(fit_rng.normal(static_cast<std::uint64_t>(h * rows * d + e)));
      std::copy_n(fit, cl * d, mu);
      for (std::int64_t iteration = 0; iteration < c_.kmeans_iterations; ++iteration) {
        centroid_offsets(mu, cl, d, half_norms_.data() + h * cl);
        nearest_centroids(fit, rows, h, best, thread);
        std::fill(sum, sum + cl * d, 0.0f);
        std::fill(count, count + cl, 0);
        for (std::int64_t i = 0; i < rows; ++i) {
          ++count[best[i]];
          add_row(sum + best[i] * d, fit + i * d, d);
        }
        for (std::int64_t c = 0; c < cl; ++c)
          if (count[c] > 0) scale_row(mu + c * d, sum + c * d, 1.0f / static_cast<float>(count[c]), d);
      }
      centroid_offsets(mu, cl, d, half_norms_.data() + h * cl);
    }
  }
}

// nearest[i] = argmax_c (x_i·μ_c − ½‖μ_c‖²) (first maximum wins) for `count` rows x of head index
// h, a block of ≤ 256 rows at a time: the products x·μᵀ into the thread's affinity block [block,
// ld(p)] (ops::gemm counts them), then per row the largest score (a vector max) and the first
// centroid reaching it. Returns the offsets' FLOPs, count·p.
std::int64_t ClusterFormerAttention::nearest_centroids(const float* rows, std::int64_t count, std::int64_t h,
                                                       std::int32_t* nearest, int thread) {
  const std::int64_t d = p_.head_dim, cl = clusters_, block = affinity_block(p_.seq_len);
  float* a = affinity_.data() + thread * block * affinity_ld_;
  const float* mu = centroids_.data() + h * cl * d;
  const float* offsets = half_norms_.data() + h * cl;
  for (std::int64_t first = 0; first < count; first += block) {
    const std::int64_t size = std::min(block, count - first);
    ops::gemm(false, true, size, cl, d, 1.0f, rows + first * d, d, mu, d, 0.0f, a, affinity_ld_);
    for (std::int64_t r = 0; r < size; ++r) {
      const float* row = a + r * affinity_ld_;
      float peak = row[0] - offsets[0];
#pragma omp simd reduction(max : peak)
      for (std::int64_t c = 0; c < cl; ++c) peak = std::max(peak, row[c] - offsets[c]);
      std::int64_t best = 0;
      while (best + 1 < cl && row[best] - offsets[best] != peak) ++best;
      nearest[first + r] = static_cast<std::int32_t>(best);
    }
  }
  return count * cl;
}

std::vector<std::int32_t> ClusterFormerAttention::token_clusters(std::int64_t b, std::int64_t h) const {
  const std::int32_t* first = token_clusters_.data() + (b * p_.heads + h) * p_.seq_len;
  return {first, first + p_.seq_len};
}

std::vector<std::int32_t> ClusterFormerAttention::sort_order(std::int64_t b, std::int64_t h) const {
  const std::int32_t* first = order_.data() + (b * p_.heads + h) * p_.seq_len;
  return {first, first + p_.seq_len};
}

// Head `head`'s clusters (nearest centroid of each key row) and their stable counting sort.
std::int64_t ClusterFormerAttention::assign_and_sort(const Tensor& k, std::int64_t head, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, cl = clusters_;
  std::int32_t* cluster = token_clusters_.data() + head * n;
  std::int32_t* order = order_.data() + head * n;
  std::int32_t* start = counts_.data() + thread * (cl + 1);
  std::int64_t flops = 0;
  if (p_.dtype != DType::BF16) {
    flops = nearest_centroids(k.data() + head * n * d, n, head % p_.heads, cluster, thread);
  } else {  // the same blocks of rows, widened first
    const std::int64_t block = affinity_block(n);
    float* rows = widened_keys_.data() + thread * block * d;
    for (std::int64_t first = 0; first < n; first += block) {
      const std::int64_t count = std::min(block, n - first);
      widen(k.bf16_data() + (head * n + first) * d, rows, count * d);
      flops += nearest_centroids(rows, count, head % p_.heads, cluster + first, thread);
    }
  }
  std::fill(start, start + cl + 1, 0);
  for (std::int64_t i = 0; i < n; ++i) ++start[cluster[i] + 1];
  for (std::int64_t c = 0; c < cl; ++c) start[c + 1] += start[c];
  for (std::int64_t i = 0; i < n; ++i) order[start[cluster[i]]++] = static_cast<std::int32_t>(i);
  float* assigned = assignments_.data() + head * n;
  float* permuted = permutation_.data() + head * n;
  for (std::int64_t i = 0; i < n; ++i) {
    assigned[i] = static_cast<float>(cluster[i]);
    permuted[i] = static_cast<float>(order[i]);
  }
  return flops;
}

void ClusterFormerAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads, chunks = (p_.seq_len + chunk_ - 1) / chunk_;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
#pragma omp for schedule(static)
    for (std::int64_t head = 0; head < heads; ++head) flops += assign_and_sort(k, head, thread);
#pragma omp master
    stage_clock::lap("route");
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < heads * chunks; ++task)
      flops += p_.dtype == DType::BF16 ? attend_chunk_bf16(q, k, v, task / chunks, task % chunks, out, thread)
                                       : attend_chunk(q, k, v, task / chunks, task % chunks, out, thread);
#pragma omp master
    stage_clock::lap("attend");
  }
  FlopCounter::add(flops);
}

// The q, k, v rows of sorted positions [first, first + rows) of head `head` into the thread's tile.
void ClusterFormerAttention::gather_chunk(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                                          std::int64_t first, std::int64_t rows, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, at = head * n * d;
  const std::int32_t* ids = order_.data() + head * n + first;
  float* q_rows = tile_rows(thread);
  gather_token_rows(q.data() + at, ids, rows, d, q_rows);
  gather_token_rows(k.data() + at, ids, rows, d, q_rows + chunk_ * d);
  gather_token_rows(v.data() + at, ids, rows, d, q_rows + 2 * chunk_ * d);
}

// Full softmax attention inside one chunk of the sorted order, written back to the tokens' rows.
// Returns the elementwise FLOPs (the products count themselves).
std::int64_t ClusterFormerAttention::attend_chunk(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                                                  std::int64_t chunk, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, c = chunk_, first = chunk * c;
  const std::int64_t rows = chunk_rows(n, c, chunk);
  gather_chunk(q, k, v, head, first, rows, thread);
  const float* q_rows = tile_rows(thread);
  float* scores = scores_.data() + thread * c * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * c;
  float* inverse = lse + c;
  tile_scores(q_rows, rows, q_rows + c * d, rows, d, 1.0f / std::sqrt(static_cast<float>(d)),
              panels_.data() + thread * tile_panel_floats(c, d), scores, score_ld_);
  const std::int64_t flops = exp_rows_masked(
      scores, rows, rows, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, inverse);
  float* o = tile_out_.data() + thread * c * d;
  tile_values(scores, score_ld_, rows, rows, q_rows + 2 * c * d, d, o);
  const std::int32_t* ids = order_.data() + head * n + first;
  float* out_head = out.data() + head * n * d;
  for (std::int64_t r = 0; r < rows; ++r) scale_row(out_head + ids[r] * d, o + r * d, inverse[r], d);
  if (!lse_.empty())
    for (std::int64_t r = 0; r < rows; ++r) lse_.data()[head * n + ids[r]] = lse[r];
  return flops + rows * d;
}

// attend_chunk in bf16: the chunk's bf16 q, k, v rows gathered, S and the softmax in fp32 on the bf16
// tile kernels (gathered_tile_bf16.hpp), each output row rounded once and copied to its token.
std::int64_t ClusterFormerAttention::attend_chunk_bf16(const Tensor& q, const Tensor& k, const Tensor& v,
                                                       std::int64_t head, std::int64_t chunk, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, c = chunk_, first = chunk * c, at = head * n * d;
  const std::int64_t rows = chunk_rows(n, c, chunk);
  const std::int32_t* ids = order_.data() + head * n + first;
  const GatheredBf16Buffers b = tiles16_.buffers(thread);
  bf16* q_rows = rows16_.bf16_data() + thread * 2 * c * d;
  bf16* o_rows = q_rows + c * d;
  gather_token_rows(q.bf16_data() + at, ids, rows, d, q_rows);
  gather_token_rows(k.bf16_data() + at, ids, rows, d, b.keys);
  gather_token_rows(v.bf16_data() + at, ids, rows, d, b.values);
  float* scores = scores_.data() + thread * c * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * c;
  float* inverse = lse + c;
  std::int64_t flops = gathered_scores_bf16(q_rows, rows, b.keys, rows, d, 1.0f / std::sqrt(static_cast<float>(d)), b,
                                            scores, score_ld_);
  flops += exp_rows_masked(
      scores, rows, rows, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, inverse);
  flops += gathered_values_bf16(scores, score_ld_, rows, rows, b.values, d, inverse, b,
                                tile_out_.data() + thread * c * d, o_rows, d);
  for (std::int64_t r = 0; r < rows; ++r) std::copy_n(o_rows + r * d, d, out.bf16_data() + at + ids[r] * d);
  if (!lse_.empty())
    for (std::int64_t r = 0; r < rows; ++r) lse_.data()[head * n + ids[r]] = lse[r];
  return flops;
}

void ClusterFormerAttention::prepare_backward() {
  const std::int64_t c = chunk_, d = p_.head_dim;
  lse_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
  score_grads_ = Tensor(Shape{threads_, c, score_ld_});
  if (p_.dtype == DType::BF16) {
    grad_rows_ = Tensor(Shape{threads_, 3 * c, d});
    grad_rows16_ = Tensor(Shape{threads_, 2, c, d}, DType::BF16);
    grads16_ = GatheredScratchBf16(threads_, c, c, d, true);
    return;
  }
  grad_rows_ = Tensor(Shape{threads_, 4 * c, d});
}

void ClusterFormerAttention::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const std::int64_t heads = p_.batch * p_.heads, chunks = (p_.seq_len + chunk_ - 1) / chunk_;
  std::int64_t flops = 0;
  // Every token lies in one chunk: the chunks write disjoint rows of dq, dk, dv.
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t task = 0; task < heads * chunks; ++task)
    flops +=
        p_.dtype == DType::BF16
            ? chunk_backward_bf16(q, k, v, out, dout, task / chunks, task % chunks, dq, dk, dv, omp_get_thread_num())
            : chunk_backward(q, k, v, out, dout, task / chunks, task % chunks, dq, dk, dv, omp_get_thread_num());
  FlopCounter::add(flops);
}

// One chunk: recomputed scores, δ of its rows, gathered_tile_backward, rows written to their tokens.
std::int64_t ClusterFormerAttention::chunk_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& out, const Tensor& dout, std::int64_t head,
                                                    std::int64_t chunk, Tensor& dq, Tensor& dk, Tensor& dv,
                                                    int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, c = chunk_, first = chunk * c, at = head * n * d;
  const std::int64_t rows = chunk_rows(n, c, chunk);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  gather_chunk(q, k, v, head, first, rows, thread);
  const float* q_rows = tile_rows(thread);
  float* scores = scores_.data() + thread * c * score_ld_;
  tile_scores(q_rows, rows, q_rows + c * d, rows, d, scale, panels_.data() + thread * tile_panel_floats(c, d), scores,
              score_ld_);
  const std::int32_t* ids = order_.data() + head * n + first;
  float* dout_rows = grad_rows_.data() + thread * 4 * c * d;
  float* dq_rows = dout_rows + c * d;
  float* dk_rows = dq_rows + c * d;
  float* dv_rows = dk_rows + c * d;
  float* lse = row_stats_.data() + thread * 2 * c;
  float* delta = lse + c;
  gather_token_rows(dout.data() + at, ids, rows, d, dout_rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* o = out.data() + at + ids[r] * d;
    const float* g = dout_rows + r * d;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t j = 0; j < d; ++j) dot += o[j] * g[j];
    delta[r] = dot;
    lse[r] = lse_.data()[head * n + ids[r]];
  }
  const GatheredTile tile{.rows = rows,
                          .cols = rows,
                          .d = d,
                          .ld = score_ld_,
                          .q = q_rows,
                          .k = q_rows + c * d,
                          .v = q_rows + 2 * c * d,
                          .dout = dout_rows,
                          .lse = lse,
                          .delta = delta};
  const std::int64_t flops = gathered_tile_backward(tile, scale, scores, score_grads_.data() + thread * c * score_ld_,
                                                    dq_rows, dk_rows, dv_rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t row = at + ids[r] * d;
    std::memcpy(dq.data() + row, dq_rows + r * d, d * sizeof(float));
    std::memcpy(dk.data() + row, dk_rows + r * d, d * sizeof(float));
    std::memcpy(dv.data() + row, dv_rows + r * d, d * sizeof(float));
  }
  return flops + 2 * rows * d;
}

// chunk_backward in bf16: the chunk's bf16 q, k, v, dO and output rows gathered, scores recomputed and
// the tile's backward on the bf16 kernels (gathered_tile_backward_bf16: P and dS rounded to bf16 for the
// products, fp32 accumulation), each gradient row rounded once and written to its token.
std::int64_t ClusterFormerAttention::chunk_backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v,
                                                         const Tensor& out, const Tensor& dout, std::int64_t head,
                                                         std::int64_t chunk, Tensor& dq, Tensor& dk, Tensor& dv,
                                                         int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, c = chunk_, first = chunk * c, at = head * n * d;
  const std::int64_t rows = chunk_rows(n, c, chunk);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int32_t* ids = order_.data() + head * n + first;
  const GatheredBf16Buffers b = grads16_.buffers(thread);
  bf16* q_rows = rows16_.bf16_data() + thread * 2 * c * d;
  bf16* dout_rows = grad_rows16_.bf16_data() + thread * 2 * c * d;
  bf16* out_rows = dout_rows + c * d;
  gather_token_rows(q.bf16_data() + at, ids, rows, d, q_rows);
  gather_token_rows(k.bf16_data() + at, ids, rows, d, b.keys);
  gather_token_rows(v.bf16_data() + at, ids, rows, d, b.values);
  gather_token_rows(dout.bf16_data() + at, ids, rows, d, dout_rows);
  gather_token_rows(out.bf16_data() + at, ids, rows, d, out_rows);
  float* scores = scores_.data() + thread * c * score_ld_;
  std::int64_t flops = gathered_scores_bf16(q_rows, rows, b.keys, rows, d, scale, b, scores, score_ld_);
  float* lse = row_stats_.data() + thread * 2 * c;
  float* delta = lse + c;
  flops += row_dots_bf16(dout_rows, out_rows, rows, d, delta);
  for (std::int64_t r = 0; r < rows; ++r) lse[r] = lse_.data()[head * n + ids[r]];
  const GatheredTileBf16 tile{.rows = rows,
                              .cols = rows,
                              .d = d,
                              .ld = score_ld_,
                              .q = q_rows,
                              .k = b.keys,
                              .v = b.values,
                              .dout = dout_rows,
                              .lse = lse,
                              .delta = delta};
  float* dq_rows = grad_rows_.data() + thread * 3 * c * d;
  float* dk_rows = dq_rows + c * d;
  float* dv_rows = dk_rows + c * d;
  flops += gathered_tile_backward_bf16(tile, scale, scores, score_grads_.data() + thread * c * score_ld_, b, dq_rows,
                                       dk_rows, dv_rows);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t row = at + ids[r] * d;
    tiles::round_row(dq_rows + r * d, d, dq.bf16_data() + row);
    tiles::round_row(dk_rows + r * d, d, dk.bf16_data() + row);
    tiles::round_row(dv_rows + r * d, d, dv.bf16_data() + row);
  }
  return flops;
}

std::string unsupported(const Problem& p, const ClusterFormerConfig&) {
  return tiles::bf16_head_dim_unsupported("cluster-former's bf16 form", p.dtype, p.head_dim);
}

std::unique_ptr<Mechanism> create(const Problem& problem, const ClusterFormerConfig& c, std::uint64_t seed) {
  return std::make_unique<ClusterFormerAttention>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const ClusterFormerConfig& config) {
  const std::int64_t n = p.seq_len, d = p.head_dim, cl = cluster_former_clusters(p, config);
  const std::int64_t c = cluster_former_chunk(p, config);
  std::int64_t per_head = matmul_flops(n, cl, d) + n * cl;
  for (std::int64_t first = 0; first < n; first += c) {
    const std::int64_t r = std::min(c, n - first);
    per_head += 2 * matmul_flops(r, r, d) + kOnlineSoftmaxFlopsPerElement * r * r + r * d;
  }
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const ClusterFormerConfig& c) {
  const ForwardBytes e = forward_bytes(p, c);
  return e.kept + std::max(e.fitting, e.after);
}

std::int64_t backward_flops(const Problem& p, const ClusterFormerConfig& config) {
  const std::int64_t n = p.seq_len, d = p.head_dim, c = cluster_former_chunk(p, config);
  std::int64_t per_head = 0;
  for (std::int64_t first = 0; first < n; first += c) {
    const std::int64_t r = std::min(c, n - first);
    per_head += 5 * matmul_flops(r, r, d) + kRecomputedSoftmaxBackwardFlopsPerElement * r * r + 2 * r * d;
  }
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const ClusterFormerConfig& config) {
  const std::int64_t c = cluster_former_chunk(p, config), d = p.head_dim;
  if (p.dtype == DType::BF16)  // lse, per thread dQ, dK, dV rows and dS (fp32), dO and output rows (bf16), buffers
    return 4 * (p.batch * p.heads * p.seq_len + p.threads * (3 * c * d + c * ops::padded_ld(c))) +
           static_cast<std::int64_t>(sizeof(bf16)) * p.threads * 2 * c * d +
           GatheredScratchBf16::bytes(p.threads, c, c, d, true);
  return 4 * (p.batch * p.heads * p.seq_len + p.threads * (4 * c * d + c * ops::padded_ld(c)));
}

FieldTable<ClusterFormerConfig> config_fields(const ClusterFormerConfig*) {
  return {int_field("clusters", &ClusterFormerConfig::clusters, 1, 65536,
                    "k-means centroids p, clamped to N (paper sweeps 64, 256, 512)"),
          int_field("chunk_len", &ClusterFormerConfig::chunk_len, 1, 65536,
                    "tokens per chunk of the cluster-sorted sequence, clamped to N"),
          int_field("kmeans_iterations", &ClusterFormerConfig::kmeans_iterations, 0, 1000,
                    "Lloyd k-means iterations over seeded fitting rows (2N per head) in the untimed prepare")};
}

ClusterFormerConfig resolve(const Problem& p, ClusterFormerConfig c) {
  c.clusters = cluster_former_clusters(p, c);
  c.chunk_len = cluster_former_chunk(p, c);
  return c;
}

template <>
Implementation implementation<ClusterFormerConfig>() {
  Implementation impl = implement<ClusterFormerConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
