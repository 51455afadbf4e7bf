#include "taxonomy/learnable_patterns/routing.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/tile_kernels.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {

std::int64_t routing_clusters(const Problem& p, const RoutingConfig& c) {
  const std::int64_t n = std::max<std::int64_t>(p.seq_len, 1);
  const std::int64_t wanted = c.clusters > 0 ? c.clusters : std::llround(std::sqrt(static_cast<double>(n)));
  return std::clamp<std::int64_t>(wanted, 1, n);
}

std::int64_t routing_window(const Problem& p, const RoutingConfig& c) {
  const std::int64_t clusters = routing_clusters(p, c);
  return (p.seq_len + clusters - 1) / clusters;
}

namespace {

std::int64_t local_head_count(const Problem& p, const RoutingConfig& c) { return c.local_heads ? p.heads / 2 : 0; }

// Tokens per block of the affinity matrix: a block's [C, block] affinities stay in L2 between
// their product and the selection (or argmax) that reads them.
constexpr std::int64_t kAffinityBlock = 256;
std::int64_t affinity_block(std::int64_t n) { return std::clamp<std::int64_t>(n, 1, kAffinityBlock); }

// Columns of a local-attention tile (own + previous block) or of a cluster tile.
std::int64_t score_cols(const Problem& p, const RoutingConfig& c) {
  const std::int64_t w = routing_window(p, c);
  return local_head_count(p, c) > 0 ? std::min(p.seq_len, 2 * w) : w;
}

std::int64_t score_rows(const Problem& p, const RoutingConfig& c) {
  return !p.causal || local_head_count(p, c) > 0 ? routing_window(p, c) : 1;
}

std::int64_t tile_flops(std::int64_t rows, std::int64_t cols, std::int64_t d) {
  return 2 * matmul_flops(rows, cols, d) + kOnlineSoftmaxFlopsPerElement * rows * cols + rows * d;
}

template <class T>
float inverse_norm(const T* x, std::int64_t d) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (std::int64_t j = 0; j < d; ++j) squares += as_float(x[j]) * as_float(x[j]);
  return squares > 0.0f ? 1.0f / std::sqrt(squares) : 0.0f;
}

// y[i] = Σ_r x[r] · a[r·lda + i] for i < m (a fp32 or bf16, widened as read): 2·rows·m FLOPs. Blocks
// of 32 outputs stay in registers.
template <class T>
void accumulate_rows(const float* x, std::int64_t rows, const T* a, std::int64_t lda, std::int64_t m, float* y) {
  constexpr std::int64_t kBlock = 32;
  std::int64_t i0 = 0;
  for (; i0 + kBlock <= m; i0 += kBlock) {
    float acc[kBlock] = {};
    for (std::int64_t r = 0; r < rows; ++r) {
      const float weight = x[r];
      const T* row = a + r * lda + i0;
#pragma omp simd
      for (std::int64_t i = 0; i < kBlock; ++i) acc[i] += weight * as_float(row[i]);
    }
    std::copy(acc, acc + kBlock, y + i0);
  }
  if (i0 == m) return;
  std::fill(y + i0, y + m, 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float weight = x[r];
    const T* row = a + r * lda;
#pragma omp simd
    for (std::int64_t i = i0; i < m; ++i) y[i] += weight * as_float(row[i]);
  }
}

// cluster[i] = argmax_c a[c·ld + i] (first maximum wins); best is [n] scratch.
void argmax_columns(const float* a, std::int64_t clusters, std::int64_t n, std::int64_t ld, float* best,
                    std::int32_t* cluster) {
  std::copy(a, a + n, best);
  std::fill(cluster, cluster + n, 0);
  for (std::int64_t c = 1; c < clusters; ++c) {
    const float* row = a + c * ld;
    for (std::int64_t i = 0; i < n; ++i)
      if (row[i] > best[i]) {
        best[i] = row[i];
        cluster[i] = static_cast<std::int32_t>(c);
      }
  }
}

// Per thread fp32 rows of the bf16 form's forward (none in fp32): an affinity block's rows
// [block, D]; with local heads a tile's q [w, D], k, v [cols, D] and output [w, D]; a query and an
// output row [2, D].
std::int64_t bf16_forward_floats(const Problem& p, const RoutingConfig& c) {
  if (p.dtype != DType::BF16) return 0;
  const std::int64_t local_tile = local_head_count(p, c) > 0 ? 2 * routing_window(p, c) + 2 * score_cols(p, c) : 0;
  return std::max({affinity_block(p.seq_len), local_tile, std::int64_t{2}}) * p.head_dim;
}

// Per thread fp32 rows of the bf16 backward: a head's q, k, v, out, dout and dq, dk, dv [8, N, D].
std::int64_t bf16_backward_floats(const Problem& p) { return p.dtype == DType::BF16 ? 8 * p.seq_len * p.head_dim : 0; }

}  // namespace

RoutingAttention::RoutingAttention(const Problem& problem, const RoutingConfig& config, std::uint64_t seed)
    : p_(problem),
      c_(config),
      seed_(seed),
      clusters_(routing_clusters(problem, config)),
      window_(routing_window(problem, config)),
      affinity_ld_(ops::padded_ld(affinity_block(problem.seq_len))),
      score_ld_(ops::padded_ld(score_cols(problem, config))) {
  const std::int64_t local = local_head_count(problem, config);
  for (std::int64_t b = 0; b < problem.batch; ++b)
    for (std::int64_t h = 0; h < problem.heads; ++h)
      (h < local ? local_heads_ : routed_heads_).push_back(b * problem.heads + h);
}

void RoutingAttention::prepare(const Tensor&, const Tensor&, const Tensor&) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, cl = clusters_, w = window_;
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  threads_ = p_.threads;
  centroids_ = Tensor(Shape{p_.heads, cl, d});
  CounterRng(seed_, "routing/centroids").fill_normal(centroids_);
  for (std::int64_t row = 0; row < p_.heads * cl; ++row) {
    float* mu = centroids_.data() + row * d;
    scale_row(mu, mu, inverse_norm(mu, d), d);
  }
  affinity_ = Tensor(Shape{threads_, cl, affinity_ld_});
  selection_ = Tensor(Shape{threads_, affinity_block(n)});
  candidates_ = IndexBuffer(threads_ * n);
  counts_ = IndexBuffer(threads_ * (cl + 1));
  fit_centroids();  // before the pattern buffers exist: its fitting rows are freed first
  if (bf16_form()) widened_ = Tensor(Shape{threads_, bf16_forward_floats(p_, c_)});
  gathered_ = Tensor(Shape{threads_, p_.causal ? 1 : 3 * w, d});
  scores_ = Tensor(Shape{threads_, score_rows(p_, c_), score_ld_});
  row_stats_ = Tensor(Shape{threads_, 2, w});
  if (!p_.causal) {
    const std::int64_t capacity = TopPositions::capacity(w, affinity_block(n), n);
    top_values_ = Tensor(Shape{threads_, cl + 1, capacity});
    top_positions_ = IndexBuffer(threads_ * (cl + 1) * capacity);
    tops_.assign(static_cast<std::size_t>(threads_ * cl), TopPositions{});
    members_ = IndexBuffer(routed * 2 * cl * w);
    panels_ = Tensor(Shape{threads_, tile_panel_floats(w, d)});
    slot_start_ = IndexBuffer(routed * (n + 1));
    slots_ = IndexBuffer(routed * cl * w);
    cluster_out_ = Tensor(Shape{routed, cl * w, d});
    cluster_lse_ = Tensor(Shape{routed, cl * w});
  } else {
    token_clusters_ = IndexBuffer(routed * 2 * n);
    key_order_ = IndexBuffer(routed * n);
    key_end_ = IndexBuffer(routed * n);
    query_order_ = IndexBuffer(routed * n);
    cluster_start_ = IndexBuffer(routed * (cl + 1));
    sorted_kt_ = Tensor(Shape{routed, d, n}, p_.dtype);
    sorted_v_ = Tensor(Shape{routed, n, d}, p_.dtype);
  }
}

// Online spherical k-means (EMA) of each head's centroids on that head's fitting rows.
void RoutingAttention::fit_centroids() {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, cl = clusters_;
  const float decay = static_cast<float>(c_.ema_decay), step = 0.5f * (1.0f - decay);
  if (c_.kmeans_updates == 0) return;
  Tensor fit_rows(Shape{threads_, 2, n, d});
  const CounterRng fit_rng(seed_, "routing/fit");
#pragma omp parallel num_threads(threads_)
  {
    const int thread = omp_get_thread_num();
    std::int32_t* nearest = candidates_.data() + thread * n;
    float* fit = fit_rows.data() + thread * 2 * n * d;
    std::vector<float> sums(static_cast<std::size_t>(cl * d));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t h = 0; h < p_.heads; ++h) {
      float* mu = centroids_.data() + h * cl * d;
      for (std::int64_t e = 0; e < 2 * n * d; ++e)
        fit[e] = static_cast<float>(fit_rng.normal(static_cast<std::uint64_t>(h * 2 * n * d + e)));
      for (std::int64_t pass = 0; pass < c_.kmeans_updates; ++pass) {
        std::fill(sums.begin(), sums.end(), 0.0f);
        for (const float* rows : {fit, fit + n * d}) {
          assign_nearest(mu, rows, nearest, thread);
          for (std::int64_t i = 0; i < n; ++i) {
            const float scale = inverse_norm(rows + i * d, d);
            float* sum = sums.data() + nearest[i] * d;
#pragma omp simd
            for (std::int64_t j = 0; j < d; ++j) sum[j] += rows[i * d + j] * scale;
          }
        }
        for (std::int64_t c = 0; c < cl; ++c) {
          float* centroid = mu + c * d;
#pragma omp simd
          for (std::int64_t j = 0; j < d; ++j) centroid[j] = decay * centroid[j] + step * sums[c * d + j];
          scale_row(centroid, centroid, inverse_norm(centroid, d), d);
        }
      }
    }
  }
}

std::vector<std::int32_t> RoutingAttention::query_members(std::int64_t b, std::int64_t h, std::int64_t cluster) const {
  const auto r = std::find(routed_heads_.begin(), routed_heads_.end(), b * p_.heads + h) - routed_heads_.begin();
  const std::int32_t* first = members_.data() + ((r * 2) * clusters_ + cluster) * window_;
  return {first, first + window_};
}

std::vector<std::int32_t> RoutingAttention::key_members(std::int64_t b, std::int64_t h, std::int64_t cluster) const {
  const auto r = std::find(routed_heads_.begin(), routed_heads_.end(), b * p_.heads + h) - routed_heads_.begin();
  const std::int32_t* first = members_.data() + ((r * 2 + 1) * clusters_ + cluster) * window_;
  return {first, first + window_};
}

std::vector<std::int32_t> RoutingAttention::query_clusters(std::int64_t b, std::int64_t h) const {
  const auto r = std::find(routed_heads_.begin(), routed_heads_.end(), b * p_.heads + h) - routed_heads_.begin();
  const std::int32_t* first = token_clusters_.data() + r * 2 * p_.seq_len;
  return {first, first + p_.seq_len};
}

std::vector<std::int32_t> RoutingAttention::key_clusters(std::int64_t b, std::int64_t h) const {
  const auto r = std::find(routed_heads_.begin(), routed_heads_.end(), b * p_.heads + h) - routed_heads_.begin();
  const std::int32_t* first = token_clusters_.data() + (r * 2 + 1) * p_.seq_len;
  return {first, first + p_.seq_len};
}

void RoutingAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (bf16_form())
    forward_as<bf16>(q, k, v, out);
  else
    forward_as<float>(q, k, v, out);
}

template <class T>
void RoutingAttention::forward_as(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  const auto local = static_cast<std::int64_t>(local_heads_.size());
  const std::int64_t n = p_.seq_len, cl = clusters_, blocks = (n + window_ - 1) / window_;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
    if (!p_.causal) {
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t r = 0; r < routed; ++r) flops += route_balanced<T>(q, k, r, thread);
#pragma omp master
      stage_clock::lap("route");
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < routed * cl; ++task)
        flops += attend_cluster<T>(q, k, v, task / cl, task % cl, thread);
#pragma omp for schedule(static)
      for (std::int64_t task = 0; task < routed * n; ++task)
        flops += merge_clusters<T>(task / n, task % n, out, thread);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t r = 0; r < routed; ++r) flops += route_nearest<T>(q, k, v, r, thread);
#pragma omp master
      stage_clock::lap("route");
#pragma omp for schedule(dynamic, 64)
      for (std::int64_t task = 0; task < routed * n; ++task)
        flops += attend_recent<T>(q, task / n, query_order_.data()[task], out, thread);
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < local * blocks; ++task)
      flops += attend_local<T>(q, k, v, local_heads_[task / blocks], task % blocks, out, thread);
  }
  stage_clock::lap("attend");
  FlopCounter::add(flops);
  if (!decode_buffers_.empty()) load_decode_context<T>(k, v);
}

void RoutingAttention::prepare_decode(std::int64_t) {
  if (!p_.causal) throw std::logic_error("routing: decoding needs a causal problem");
  const std::int64_t d = p_.head_dim, cl = clusters_, w = window_;
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  const auto local = static_cast<std::int64_t>(local_heads_.size());
  cluster_cache_ = KvCache(routed * cl, w, d, p_.dtype);
  cluster_counts_ = IndexBuffer(routed * cl);
  step_clusters_ = IndexBuffer(routed);
  local_cache_ = KvCache(local, 2 * w, d, p_.dtype);
  decode_buffers_ = Tensor(Shape{p_.batch * p_.heads, 2, d});
}

// The centroid of head index h with the largest x·μ (first maximum wins, as argmax_columns).
template <class T>
std::int32_t RoutingAttention::nearest_centroid(const T* x, std::int64_t h) const {
  const std::int64_t d = p_.head_dim;
  const float* mu = centroids_.data() + h * clusters_ * d;
  float best = 0.0f;
  std::int32_t arg = 0;
  for (std::int64_t c = 0; c < clusters_; ++c) {
    float dot = 0.0f;
    for (std::int64_t j = 0; j < d; ++j) dot += as_float(x[j]) * mu[c * d + j];
    if (c == 0 || dot > best) {
      best = dot;
      arg = static_cast<std::int32_t>(c);
    }
  }
  return arg;
}

// Appends a key and value to cluster `cluster`'s ring of routed head r (the oldest of w drops out).
template <class T>
void RoutingAttention::append_routed(std::int64_t r, std::int32_t cluster, const T* key, const T* value) {
  std::int32_t& count = cluster_counts_.data()[r * clusters_ + cluster];
  cluster_cache_.store(r * clusters_ + cluster, count % window_, key, value, 1);
  ++count;
}

// The attention of one head's step (after routing): a routing head's query against its cluster's
// ring, a local head's against its own and previous block. Returns the FLOPs.
template <class T>
std::int64_t RoutingAttention::decode_head(std::int64_t bh, const T* q, const T* k, const T* v, T* out) {
  const std::int64_t d = p_.head_dim, w = window_, i = length_, h = bh % p_.heads;
  const std::int64_t local = local_head_count(p_, c_);
  float* query = decode_buffers_.data() + bh * 2 * d;
  RowSoftmax row = begin_row(query + d, d);
  row.fp32_probabilities = true;  // as the forward's: P stays fp32 against bf16 rows
  std::int64_t flops = scale_query(q, d, query);
  if (h < local) {
    const std::int64_t l = bh / p_.heads * local + h, first = std::max<std::int64_t>(0, (i / w - 1) * w);
    local_cache_.store(l, i % (2 * w), k, v, 1);
    flops += attend_ring(row, query, local_cache_.keys<T>(l), local_cache_.values<T>(l), 2 * w, first, i - first + 1);
  } else {
    const std::int64_t r = bh / p_.heads * (p_.heads - local) + h - local;
    const std::int32_t cluster = step_clusters_.data()[r];
    const std::int64_t ring = r * clusters_ + cluster;
    const std::int64_t visible = std::min<std::int64_t>(cluster_counts_.data()[ring], w);
    flops += attend_rows(row, query, cluster_cache_.keys<T>(ring), cluster_cache_.values<T>(ring), visible);
  }
  return flops + finish_row(row, out);
}

void RoutingAttention::decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (bf16_form())
    decode_as<bf16>(q, k, v, out);
  else
    decode_as<float>(q, k, v, out);
}

template <class T>
void RoutingAttention::decode_as(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t d = p_.head_dim, cl = clusters_;
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  std::int64_t flops = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < routed; ++r) {
      const std::int64_t bh = routed_heads_[r], h = bh % p_.heads;
      const T* key = elements<T>(k) + bh * d;
      step_clusters_.data()[r] = nearest_centroid(elements<T>(q) + bh * d, h);
      append_routed(r, nearest_centroid(key, h), key, elements<T>(v) + bh * d);
      flops += 2 * 2 * cl * d + 2 * (cl - 1);
    }
#pragma omp master
    stage_clock::lap("route");
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < p_.batch * p_.heads; ++bh)
      flops += decode_head(bh, elements<T>(q) + bh * d, elements<T>(k) + bh * d, elements<T>(v) + bh * d,
                           elements<T>(out) + bh * d);
#pragma omp master
    stage_clock::lap("attend");
  }
  FlopCounter::add(flops);
  ++length_;
}

// After a prefill: every context key joins its cluster's ring in position order (clusters as the
// forward routed them); local heads keep their last 2w tokens.
template <class T>
void RoutingAttention::load_decode_context(const Tensor& k, const Tensor& v) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, w = window_;
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  const auto local = static_cast<std::int64_t>(local_heads_.size());
  std::fill_n(cluster_counts_.data(), cluster_counts_.size(), 0);
#pragma omp parallel num_threads(threads_)
  {
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < routed; ++r) {
      const std::int64_t bh = routed_heads_[r];
      const std::int32_t* key_cluster = token_clusters_.data() + r * 2 * n + n;
      for (std::int64_t j = 0; j < n; ++j)
        append_routed(r, key_cluster[j], elements<T>(k) + (bh * n + j) * d, elements<T>(v) + (bh * n + j) * d);
    }
#pragma omp for schedule(static)
    for (std::int64_t l = 0; l < local; ++l) {
      const std::int64_t bh = local_heads_[l], kept = std::min(n, 2 * w), first = n - kept;
      local_cache_.store(l, first % (2 * w), elements<T>(k) + (bh * n + first) * d,
                         elements<T>(v) + (bh * n + first) * d, kept);
    }
  }
  length_ = n;
}

// The affinities μ·xᵀ [C, cols] of rows x [cols, D] (cols ≤ the affinity block) into the thread's
// block; 2·C·cols·D FLOPs (counted by the gemm).
float* RoutingAttention::affinity_block_of(const float* mu, const float* rows, std::int64_t cols, int thread) {
  const std::int64_t d = p_.head_dim, cl = clusters_;
  float* affinity = affinity_.data() + thread * cl * affinity_ld_;
  ops::gemm(false, true, cl, cols, d, 1.0f, mu, d, rows, d, 0.0f, affinity, affinity_ld_);
  return affinity;
}

// nearest[i] = argmax_c μ_c·x_i of a head's N rows x, a block of tokens at a time (bf16 rows
// widened a block at a time).
template <class T>
void RoutingAttention::assign_nearest(const float* mu, const T* rows, std::int32_t* nearest, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, block = affinity_block(n);
  float* best = selection_.data() + thread * block;
  for (std::int64_t first = 0; first < n; first += block) {
    const std::int64_t cols = std::min(block, n - first);
    const float* block_rows = fp32_rows(rows, first, cols, d, widened_rows_of(thread));
    const float* affinity = affinity_block_of(mu, block_rows, cols, thread);
    argmax_columns(affinity, clusters_, cols, affinity_ld_, best, nearest + first);
  }
}

// Balanced routing: each cluster takes its top-w queries and top-w keys by cosine affinity.
template <class T>
std::int64_t RoutingAttention::route_balanced(const Tensor& q, const Tensor& k, std::int64_t r, int thread) {
  const std::int64_t bh = routed_heads_[r], n = p_.seq_len, d = p_.head_dim, cl = clusters_, w = window_;
  const std::int64_t block = affinity_block(n), capacity = TopPositions::capacity(w, block, n);
  const float* mu = centroids_.data() + (bh % p_.heads) * cl * d;
  float* inverse = selection_.data() + thread * block;
  std::int32_t* positions = top_positions_.data() + thread * (cl + 1) * capacity;  // cluster c's, then scratch
  float* values = top_values_.data() + thread * (cl + 1) * capacity;
  TopPositions* tops = tops_.data() + thread * cl;
  for (std::int64_t role = 0; role < 2; ++role) {
    const T* rows = elements<T>(role == 0 ? q : k) + bh * n * d;
    for (std::int64_t c = 0; c < cl; ++c)
      tops[c].reset(w, positions + c * capacity, values + c * capacity, positions + cl * capacity,
                    values + cl * capacity);
    for (std::int64_t first = 0; first < n; first += block) {
      const std::int64_t cols = std::min(block, n - first);
      const float* block_rows = fp32_rows(rows, first, cols, d, widened_rows_of(thread));
      for (std::int64_t i = 0; i < cols; ++i) inverse[i] = inverse_norm(block_rows + i * d, d);
      float* affinity = affinity_block_of(mu, block_rows, cols, thread);
      // The next block's rows are requested while this block's selections run (they would
      // otherwise stream from memory at the next block's start, both threads at once).
      constexpr std::int64_t kLine = 64 / sizeof(T);  // elements per cache line
      const T* ahead = rows + (first + cols) * d;
      const std::int64_t ahead_lines = std::min(block, n - first - cols) * d / kLine;
      for (std::int64_t c = 0; c < cl; ++c) {
        for (std::int64_t line = c * ahead_lines / cl; line < (c + 1) * ahead_lines / cl; ++line)
          __builtin_prefetch(ahead + line * kLine);
        float* row = affinity + c * affinity_ld_;
#pragma omp simd
        for (std::int64_t i = 0; i < cols; ++i) row[i] *= inverse[i];
        tops[c].add(row, cols, first);
      }
    }
    for (std::int64_t c = 0; c < cl; ++c) tops[c].finish(members_.data() + ((r * 2 + role) * cl + c) * w);
  }
  // Slot lists: for every query, the (cluster · w + slot) entries that took it, in cluster order.
  std::int32_t* start = slot_start_.data() + r * (n + 1);
  std::int32_t* slots = slots_.data() + r * cl * w;
  const std::int32_t* taken = members_.data() + r * 2 * cl * w;
  std::fill(start, start + n + 1, 0);
  for (std::int64_t e = 0; e < cl * w; ++e) ++start[taken[e] + 1];
  std::partial_sum(start, start + n + 1, start);
  std::int32_t* candidates = candidates_.data() + thread * n;
  std::copy(start, start + n, candidates);
  for (std::int64_t e = 0; e < cl * w; ++e) slots[candidates[taken[e]]++] = static_cast<std::int32_t>(e);
  return 4 * n * d + 2 * cl * n;
}

template <class T>
std::int64_t RoutingAttention::attend_cluster(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t r,
                                              std::int64_t cluster, int thread) {
  const std::int64_t bh = routed_heads_[r], n = p_.seq_len, d = p_.head_dim, cl = clusters_, w = window_;
  const std::int32_t* query_ids = members_.data() + ((r * 2) * cl + cluster) * w;
  const std::int32_t* key_ids = members_.data() + ((r * 2 + 1) * cl + cluster) * w;
  float* q_rows = gathered_.data() + thread * 3 * w * d;
  float* k_rows = q_rows + w * d;
  float* v_rows = k_rows + w * d;
  gather_token_rows(elements<T>(q) + bh * n * d, query_ids, w, d, q_rows);
  gather_token_rows(elements<T>(k) + bh * n * d, key_ids, w, d, k_rows);
  gather_token_rows(elements<T>(v) + bh * n * d, key_ids, w, d, v_rows);
  float* scores = scores_.data() + thread * score_rows(p_, c_) * score_ld_;
  tile_scores(q_rows, w, k_rows, w, d, 1.0f / std::sqrt(static_cast<float>(d)),
              panels_.data() + thread * tile_panel_floats(w, d), scores, score_ld_);
  float* lse = cluster_lse_.data() + (r * cl + cluster) * w;
  float* inverse = row_stats_.data() + thread * 2 * w;
  std::int64_t flops = exp_rows_masked(
      scores, w, w, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, inverse);
  float* o = cluster_out_.data() + (r * cl + cluster) * w * d;
  tile_values(scores, score_ld_, w, w, v_rows, d, o);
  for (std::int64_t s = 0; s < w; ++s) scale_row(o + s * d, o + s * d, inverse[s], d);
  return flops + w * d;
}

// out(token) = Σ over the clusters that took it of exp(lse − L)·o, L = log Σ exp(lse).
template <class T>
std::int64_t RoutingAttention::merge_clusters(std::int64_t r, std::int64_t token, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  const std::int32_t* start = slot_start_.data() + r * (n + 1);
  const std::int32_t* slots = slots_.data() + r * clusters_ * window_;
  const float* lse = cluster_lse_.data() + r * clusters_ * window_;
  const float* rows = cluster_out_.data() + r * clusters_ * window_ * d;
  T* result = elements<T>(out);
  const std::int64_t row = routed_heads_[r] * n + token;
  float* dst = fp32_target(result, row, d, widened_rows_of(thread));
  if (token + kGatherAhead < n)  // the scattered rows of a later token, requested ahead
    for (std::int32_t e = start[token + kGatherAhead]; e < start[token + kGatherAhead + 1]; ++e) {
      __builtin_prefetch(lse + slots[e]);
      request_row(rows + slots[e] * d, d);
    }
  float peak = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  for (std::int32_t e = start[token]; e < start[token + 1]; ++e) peak = std::max(peak, lse[slots[e]]);
  const std::int32_t end = peak > -std::numeric_limits<float>::infinity() ? start[token + 1] : start[token];
  for (std::int32_t e = start[token]; e < end; ++e) sum += ops::fast_exp(lse[slots[e]] - peak);
  if (!token_lse_.empty())
    token_lse_.data()[routed_heads_[r] * n + token] =
        sum > 0.0f ? peak + std::log(sum) : -std::numeric_limits<float>::infinity();
  std::fill(dst, dst + d, 0.0f);
  for (std::int32_t e = start[token]; e < end; ++e) {
    const float weight = ops::fast_exp(lse[slots[e]] - peak) / sum;
    const float* src = rows + slots[e] * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) dst[j] += src[j] * weight;
  }
  store_rows(dst, result, row, 1, d);
  return 2 * d * (start[token + 1] - start[token]);
}

// Causal routing: nearest centroid per query and per key, keys sorted by (cluster, position).
template <class T>
std::int64_t RoutingAttention::route_nearest(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t r,
                                             int thread) {
  const std::int64_t bh = routed_heads_[r], n = p_.seq_len, d = p_.head_dim, cl = clusters_;
  const float* mu = centroids_.data() + (bh % p_.heads) * cl * d;
  std::int32_t* query_cluster = token_clusters_.data() + r * 2 * n;
  std::int32_t* key_cluster = query_cluster + n;
  assign_nearest(mu, elements<T>(q) + bh * n * d, query_cluster, thread);
  assign_nearest(mu, elements<T>(k) + bh * n * d, key_cluster, thread);
  std::int32_t* start = cluster_start_.data() + r * (cl + 1);
  std::int32_t* next = counts_.data() + thread * (cl + 1);
  std::int32_t* order = key_order_.data() + r * n;
  std::fill(start, start + cl + 1, 0);
  for (std::int64_t i = 0; i < n; ++i) ++start[key_cluster[i] + 1];
  std::partial_sum(start, start + cl + 1, start);
  std::copy(start, start + cl, next);
  for (std::int64_t i = 0; i < n; ++i) order[next[key_cluster[i]]++] = static_cast<std::int32_t>(i);
  T* keys_t = elements<T>(sorted_kt_) + r * d * n;
  for (std::int64_t s = 0; s < n; ++s) {
    const T* key = elements<T>(k) + (bh * n + order[s]) * d;
    for (std::int64_t j = 0; j < d; ++j) keys_t[j * n + s] = key[j];
    std::copy_n(elements<T>(v) + (bh * n + order[s]) * d, d, elements<T>(sorted_v_) + (r * n + s) * d);
  }
  // Query i's visible keys end where its cluster's keys at positions <= i end.
  std::int32_t* end = key_end_.data() + r * n;
  std::fill(next, next + cl, 0);
  for (std::int64_t i = 0; i < n; ++i) {
    ++next[key_cluster[i]];
    end[i] = start[query_cluster[i]] + next[query_cluster[i]];
  }
  // Queries in (cluster, position) order, so consecutive tasks reuse the same sorted keys.
  std::int32_t* queries = query_order_.data() + r * n;
  std::fill(next, next + cl + 1, 0);
  for (std::int64_t i = 0; i < n; ++i) ++next[query_cluster[i] + 1];
  std::partial_sum(next, next + cl + 1, next);
  for (std::int64_t i = 0; i < n; ++i) queries[next[query_cluster[i]]++] = static_cast<std::int32_t>(i);
  return 2 * (cl - 1) * n;
}

// Query `token` against the w sorted keys ending at its range end; visible: its cluster, <= token.
template <class T>
std::int64_t RoutingAttention::attend_recent(const Tensor& q, std::int64_t r, std::int64_t token, Tensor& out,
                                             int thread) {
  const std::int64_t bh = routed_heads_[r], n = p_.seq_len, d = p_.head_dim, w = window_;
  const std::int32_t cluster = token_clusters_.data()[r * 2 * n + token];
  const std::int64_t end = key_end_.data()[r * n + token], lo = cluster_start_.data()[r * (clusters_ + 1) + cluster];
  const std::int64_t s0 = std::max<std::int64_t>(0, end - w);
  float* query = gathered_.data() + thread * d;
  // bf16: the query row and the output row [2, D] in the thread's fp32 rows.
  const float* q_row = fp32_elements(elements<T>(q) + (bh * n + token) * d, d, widened_rows_of(thread));
  scale_row(query, q_row, 1.0f / std::sqrt(static_cast<float>(d)), d);
  float* scores = scores_.data() + thread * score_rows(p_, c_) * score_ld_;
  accumulate_rows(query, d, elements<T>(sorted_kt_) + r * d * n + s0, n, w, scores);
  auto visible = [&](std::int64_t, std::int64_t t) { return s0 + t >= lo && s0 + t < end; };
  float* lse = row_stats_.data() + thread * 2 * w;
  float* inverse = lse + w;
  const std::int64_t flops = exp_rows_masked(scores, 1, w, score_ld_, visible, lse, inverse);
  if (!token_lse_.empty()) token_lse_.data()[bh * n + token] = lse[0];
  T* result = elements<T>(out);
  float* dst = fp32_target(result, bh * n + token, d, widened_rows_of(thread, d));
  accumulate_rows(scores, w, elements<T>(sorted_v_) + (r * n + s0) * d, d, d, dst);
  scale_row(dst, dst, inverse[0], d);
  store_rows(dst, result, bh * n + token, 1, d);
  return flops + 4 * w * d + 2 * d;
}

template <class T>
std::int64_t RoutingAttention::attend_local(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t bh,
                                            std::int64_t block, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, w = window_;
  const std::int64_t q0 = block * w, rows = std::min(w, n - q0), k0 = std::max<std::int64_t>(0, q0 - w);
  const std::int64_t cols = q0 + rows - k0;
  // bf16: the tile's q [w, D], k, v [score_cols, D] and output [w, D] in the thread's fp32 rows.
  const std::int64_t most = score_cols(p_, c_);
  const float* q_rows = fp32_rows(elements<T>(q), bh * n + q0, rows, d, widened_rows_of(thread));
  const float* k_rows = fp32_rows(elements<T>(k), bh * n + k0, cols, d, widened_rows_of(thread, w * d));
  const float* v_rows = fp32_rows(elements<T>(v), bh * n + k0, cols, d, widened_rows_of(thread, (w + most) * d));
  float* scores = scores_.data() + thread * score_rows(p_, c_) * score_ld_;
  ops::gemm(false, true, rows, cols, d, 1.0f / std::sqrt(static_cast<float>(d)), q_rows, d, k_rows, d, 0.0f, scores,
            score_ld_);
  const bool causal = p_.causal;
  auto visible = [&](std::int64_t row, std::int64_t col) { return !causal || k0 + col <= q0 + row; };
  float* lse = row_stats_.data() + thread * 2 * w;
  float* inverse = lse + w;
  std::int64_t flops = exp_rows_masked(scores, rows, cols, score_ld_, visible, lse, inverse);
  if (!token_lse_.empty()) std::copy(lse, lse + rows, token_lse_.data() + bh * n + q0);
  T* result = elements<T>(out);
  float* dst = fp32_target(result, bh * n + q0, d, widened_rows_of(thread, (w + 2 * most) * d));
  ops::gemm(false, false, rows, d, cols, 1.0f, scores, score_ld_, v_rows, d, 0.0f, dst, d);
  for (std::int64_t row = 0; row < rows; ++row) scale_row(dst + row * d, dst + row * d, inverse[row], d);
  store_rows(dst, result, bh * n + q0, rows, d);
  return flops + rows * d;
}

void RoutingAttention::prepare_backward() {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, w = window_, cols = score_cols(p_, c_);
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  token_lse_ = Tensor(Shape{p_.batch * p_.heads, n});
  grad_rows_ = Tensor(Shape{threads_, 2 * w + 2 * cols, d});
  score_grads_ = Tensor(Shape{threads_, score_rows(p_, c_), score_ld_});
  centroid_sums_ = Tensor(Shape{threads_, clusters_, d});
  updated_centroids_ = Tensor(Shape{p_.heads, clusters_, d});
  if (bf16_form()) widened_grads_ = Tensor(Shape{threads_, bf16_backward_floats(p_)});
  if (p_.causal) {
    sorted_dk_ = Tensor(Shape{routed, n, d});
    sorted_dv_ = Tensor(Shape{routed, n, d});
  }
}

std::vector<NamedTensor> RoutingAttention::saved() const {
  if (p_.causal) return {{"token_lse", &token_lse_}, {"sorted_kt", &sorted_kt_}, {"sorted_v", &sorted_v_}};
  return {{"token_lse", &token_lse_}};
}

std::int64_t RoutingAttention::saved_bytes() const {
  std::int64_t bytes = Mechanism::saved_bytes();
  for (const IndexBuffer* pattern :
       {&members_, &slot_start_, &slots_, &token_clusters_, &key_order_, &key_end_, &query_order_, &cluster_start_})
    bytes += pattern->bytes();
  return bytes;
}

void RoutingAttention::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const auto routed = static_cast<std::int64_t>(routed_heads_.size());
  const auto local = static_cast<std::int64_t>(local_heads_.size());
  const std::int64_t nd = p_.seq_len * p_.head_dim;
  const bool widens = bf16_form();
  std::int64_t flops = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
    // bf16: head bh's q, k, v, out, dout widened into the thread's rows [8, N, D], its fp32 dq, dk,
    // dv after them and rounded once when the head is done. A causal routing head reads its keys and
    // values from the key-sorted copies (recent_backward): its k, v are not widened (keys false: nullptr).
    float* rows = widens ? widened_grads_.data() + thread * 8 * nd : nullptr;
    auto head_grads = [&](std::int64_t bh, bool keys) -> HeadGrads {
      const std::int64_t at = bh * nd;
      if (!widens)
        return {q.data() + at,    k.data() + at,  v.data() + at,  out.data() + at,
                dout.data() + at, dq.data() + at, dk.data() + at, dv.data() + at};
      const std::array<const Tensor*, 1> query{&q};
      const std::array<const Tensor*, 2> keys_and_values{&k, &v}, outputs{&out, &dout};
      widen_spans(query, at, nd, rows, nd);
      if (keys) widen_spans(keys_and_values, at, nd, rows + nd, nd);
      widen_spans(outputs, at, nd, rows + 3 * nd, nd);
      return {rows,
              keys ? rows + nd : nullptr,
              keys ? rows + 2 * nd : nullptr,
              rows + 3 * nd,
              rows + 4 * nd,
              rows + 5 * nd,
              rows + 6 * nd,
              rows + 7 * nd};
    };
    auto store_grads = [&](std::int64_t bh) {
      const std::array<Tensor*, 3> grads{&dq, &dk, &dv};
      if (widens) narrow_spans(rows + 5 * nd, nd, grads, bh * nd, nd);
    };
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t r = 0; r < routed; ++r) {
      const HeadGrads g = head_grads(routed_heads_[r], !p_.causal);
      if (!p_.causal)
        flops += clusters_backward(g, r, thread);
      else
        flops += widens ? recent_backward<bf16>(g, r, thread) : recent_backward<float>(g, r, thread);
      store_grads(routed_heads_[r]);
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < local; ++task) {
      flops += local_backward(head_grads(local_heads_[task], true), local_heads_[task], thread);
      store_grads(local_heads_[task]);
    }
  }
  stage_clock::lap("backward");
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t h = 0; h < p_.heads; ++h)
    flops += widens ? update_centroids<bf16>(q, k, h, omp_get_thread_num())
                    : update_centroids<float>(q, k, h, omp_get_thread_num());
  stage_clock::lap("centroid_update");
  FlopCounter::add(flops);
}

// δ = dO·O of one token of the head.
float RoutingAttention::token_delta(const HeadGrads& g, std::int64_t token) const {
  const std::int64_t at = token * p_.head_dim;
  float dot = 0.0f;
  block_sparse::row_dots(g.out + at, g.dout + at, 1, p_.head_dim, &dot);
  return dot;
}

// Non-causal routing head r: each cluster's tile (its w queries against its w keys) with the
// queries' merged L, dQ, dK, dV added back to their tokens.
std::int64_t RoutingAttention::clusters_backward(const HeadGrads& g, std::int64_t r, int thread) {
  const std::int64_t bh = routed_heads_[r], n = p_.seq_len, d = p_.head_dim, cl = clusters_, w = window_;
  std::fill(g.dq, g.dq + n * d, 0.0f);
  std::fill(g.dk, g.dk + n * d, 0.0f);
  std::fill(g.dv, g.dv + n * d, 0.0f);
  float* q_rows = gathered_.data() + thread * 3 * w * d;
  float* k_rows = q_rows + w * d;
  float* v_rows = k_rows + w * d;
  float* dout_rows = grad_rows_.data() + thread * (2 * w + 2 * score_cols(p_, c_)) * d;
  float* dq_rows = dout_rows + w * d;
  float* dk_rows = dq_rows + w * d;
  float* dv_rows = dk_rows + w * d;
  float* lse = row_stats_.data() + thread * 2 * w;
  float* delta = lse + w;
  float* scores = scores_.data() + thread * score_rows(p_, c_) * score_ld_;
  float* score_grads = score_grads_.data() + thread * score_rows(p_, c_) * score_ld_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::int64_t flops = 0;
  for (std::int64_t cluster = 0; cluster < cl; ++cluster) {
    const std::int32_t* query_ids = members_.data() + ((r * 2) * cl + cluster) * w;
    const std::int32_t* key_ids = members_.data() + ((r * 2 + 1) * cl + cluster) * w;
    gather_token_rows(g.q, query_ids, w, d, q_rows);
    gather_token_rows(g.dout, query_ids, w, d, dout_rows);
    gather_token_rows(g.k, key_ids, w, d, k_rows);
    gather_token_rows(g.v, key_ids, w, d, v_rows);
    for (std::int64_t s = 0; s < w; ++s) {
      lse[s] = token_lse_.data()[bh * n + query_ids[s]];
      delta[s] = token_delta(g, query_ids[s]);
    }
    ops::gemm(false, true, w, w, d, scale, q_rows, d, k_rows, d, 0.0f, scores, score_ld_);
    const GatheredTile tile{.rows = w,
                            .cols = w,
                            .d = d,
                            .ld = score_ld_,
                            .q = q_rows,
                            .k = k_rows,
                            .v = v_rows,
                            .dout = dout_rows,
                            .lse = lse,
                            .delta = delta};
    flops += gathered_tile_backward(tile, scale, scores, score_grads, dq_rows, dk_rows, dv_rows) + 5 * w * d;
    for (std::int64_t s = 0; s < w; ++s) {
      add_row(g.dq + query_ids[s] * d, dq_rows + s * d, d);
      add_row(g.dk + key_ids[s] * d, dk_rows + s * d, d);
      add_row(g.dv + key_ids[s] * d, dv_rows + s * d, d);
    }
  }
  return flops;
}

// Causal routing head r: every query row against its w recent keys of its cluster (key-sorted
// order, as the forward); dK, dV gathered in that order and put back to their tokens at the end.
template <class T>
std::int64_t RoutingAttention::recent_backward(const HeadGrads& g, std::int64_t r, int thread) {
  const std::int64_t bh = routed_heads_[r], n = p_.seq_len, d = p_.head_dim, w = window_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const T* keys_t = elements<T>(sorted_kt_) + r * d * n;
  const T* values = elements<T>(sorted_v_) + r * n * d;
  float* key_grads = sorted_dk_.data() + r * n * d;
  float* value_grads = sorted_dv_.data() + r * n * d;
  std::fill(key_grads, key_grads + n * d, 0.0f);
  std::fill(value_grads, value_grads + n * d, 0.0f);
  float* query = grad_rows_.data() + thread * (2 * w + 2 * score_cols(p_, c_)) * d;
  float* p = scores_.data() + thread * score_rows(p_, c_) * score_ld_;
  float* ds = score_grads_.data() + thread * score_rows(p_, c_) * score_ld_;
  for (std::int64_t index = 0; index < n; ++index) {
    const std::int64_t token = query_order_.data()[r * n + index];
    const std::int32_t cluster = token_clusters_.data()[r * 2 * n + token];
    const std::int64_t end = key_end_.data()[r * n + token], lo = cluster_start_.data()[r * (clusters_ + 1) + cluster];
    const std::int64_t s0 = std::max<std::int64_t>(0, end - w);
    const float* grad = g.dout + token * d;
    scale_row(query, g.q + token * d, scale, d);
    accumulate_rows(query, d, keys_t + s0, n, w, p);
    const float total = token_lse_.data()[bh * n + token], delta = token_delta(g, token);
    for (std::int64_t t = 0; t < w; ++t) {
      const bool visible = s0 + t >= lo && s0 + t < end;
      const T* value = values + (s0 + t) * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t j = 0; j < d; ++j) dot += as_float(value[j]) * grad[j];
      p[t] = visible ? ops::fast_exp(p[t] - total) : 0.0f;
      ds[t] = p[t] * (dot - delta);
      float* value_grad = value_grads + (s0 + t) * d;
      float* key_grad = key_grads + (s0 + t) * d;
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) {
        value_grad[j] += p[t] * grad[j];
        key_grad[j] += ds[t] * query[j];
      }
    }
    float* dq = g.dq + token * d;
    for (std::int64_t j = 0; j < d; ++j) {
      const T* key_feature = keys_t + j * n + s0;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t t = 0; t < w; ++t) dot += ds[t] * as_float(key_feature[t]);
      dq[j] = dot * scale;
    }
  }
  const std::int32_t* order = key_order_.data() + r * n;
  for (std::int64_t s = 0; s < n; ++s) {
    std::copy(key_grads + s * d, key_grads + (s + 1) * d, g.dk + order[s] * d);
    std::copy(value_grads + s * d, value_grads + (s + 1) * d, g.dv + order[s] * d);
  }
  return n * (10 * w * d + kRecomputedSoftmaxBackwardFlopsPerElement * w + 4 * d);
}

// Local head: blocks of w queries against their own and the previous block, as attend_local.
std::int64_t RoutingAttention::local_backward(const HeadGrads& g, std::int64_t bh, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, w = window_;
  std::fill(g.dk, g.dk + n * d, 0.0f);
  std::fill(g.dv, g.dv + n * d, 0.0f);
  float* dk_rows = grad_rows_.data() + thread * (2 * w + 2 * score_cols(p_, c_)) * d + 2 * w * d;
  float* dv_rows = dk_rows + score_cols(p_, c_) * d;
  float* delta = row_stats_.data() + thread * 2 * w + w;
  float* scores = scores_.data() + thread * score_rows(p_, c_) * score_ld_;
  float* score_grads = score_grads_.data() + thread * score_rows(p_, c_) * score_ld_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::int64_t flops = 0;
  for (std::int64_t q0 = 0; q0 < n; q0 += w) {
    const std::int64_t rows = std::min(w, n - q0), k0 = std::max<std::int64_t>(0, q0 - w), cols = q0 + rows - k0;
    ops::gemm(false, true, rows, cols, d, scale, g.q + q0 * d, d, g.k + k0 * d, d, 0.0f, scores, score_ld_);
    for (std::int64_t row = 0; row < rows && p_.causal; ++row)
      std::fill(scores + row * score_ld_ + (q0 + row - k0) + 1, scores + row * score_ld_ + cols,
                -std::numeric_limits<float>::infinity());
    for (std::int64_t row = 0; row < rows; ++row) delta[row] = token_delta(g, q0 + row);
    const GatheredTile tile{.rows = rows,
                            .cols = cols,
                            .d = d,
                            .ld = score_ld_,
                            .q = g.q + q0 * d,
                            .k = g.k + k0 * d,
                            .v = g.v + k0 * d,
                            .dout = g.dout + q0 * d,
                            .lse = token_lse_.data() + bh * n + q0,
                            .delta = delta};
    flops += gathered_tile_backward(tile, scale, scores, score_grads, g.dq + q0 * d, dk_rows, dv_rows) + 2 * rows * d +
             2 * cols * d;
    add_row(g.dk + k0 * d, dk_rows, cols * d);
    add_row(g.dv + k0 * d, dv_rows, cols * d);
  }
  return flops;
}

// The EMA step of head index h's centroids over every batch element's queries and keys, into
// updated_centroids_ (local heads' centroids are copied unchanged: they route nothing).
template <class T>
std::int64_t RoutingAttention::update_centroids(const Tensor& q, const Tensor& k, std::int64_t h, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, cl = clusters_;
  const float* mu = centroids_.data() + h * cl * d;
  float* next = updated_centroids_.data() + h * cl * d;
  if (is_local_head(h)) {
    std::copy(mu, mu + cl * d, next);
    return 0;
  }
  const float decay = static_cast<float>(c_.ema_decay), step = 0.5f * (1.0f - decay);
  const std::int64_t local = local_head_count(p_, c_), routed_per_batch = p_.heads - local;
  float* sums = centroid_sums_.data() + thread * cl * d;
  std::fill(sums, sums + cl * d, 0.0f);
  std::int64_t flops = 0;
  for (std::int64_t b = 0; b < p_.batch; ++b) {
    const std::int64_t r = b * routed_per_batch + (h - local), bh = routed_heads_[r];
    for (std::int64_t role = 0; role < 2; ++role) {
      // Causal: the clusters the forward saved; non-causal: the argmax of fresh affinities.
      const T* rows = elements<T>(role == 0 ? q : k) + bh * n * d;
      std::int32_t* assigned = candidates_.data() + thread * n;
      if (!p_.causal) assign_nearest(mu, rows, assigned, thread);
      const std::int32_t* nearest = p_.causal ? token_clusters_.data() + (r * 2 + role) * n : assigned;
      for (std::int64_t i = 0; i < n; ++i) {
        const float factor = inverse_norm(rows + i * d, d);
        float* sum = sums + nearest[i] * d;
#pragma omp simd
        for (std::int64_t j = 0; j < d; ++j) sum[j] += as_float(rows[i * d + j]) * factor;
      }
    }
    flops += 8 * n * d + (p_.causal ? 0 : 2 * (cl - 1) * n);
  }
  for (std::int64_t c = 0; c < cl; ++c) {
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) next[c * d + j] = decay * mu[c * d + j] + step * sums[c * d + j];
    scale_row(next + c * d, next + c * d, inverse_norm(next + c * d, d), d);
  }
  return flops + 6 * cl * d;
}

std::unique_ptr<Mechanism> create(const Problem& problem, const RoutingConfig& c, std::uint64_t seed) {
  return std::make_unique<RoutingAttention>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const RoutingConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, cl = routing_clusters(p, c), w = routing_window(p, c);
  const std::int64_t local = local_head_count(p, c);
  const std::int64_t routed_head =
      p.causal ? 2 * matmul_flops(cl, n, d) + 2 * (cl - 1) * n + n * (4 * w * d + 4 * w + 2 * d)
               : 4 * n * d + 2 * matmul_flops(cl, n, d) + 2 * cl * n + cl * tile_flops(w, w, d) + 2 * cl * w * d;
  std::int64_t local_head = 0;
  for (std::int64_t q0 = 0; q0 < n; q0 += w) {
    const std::int64_t rows = std::min(w, n - q0), k0 = std::max<std::int64_t>(0, q0 - w);
    local_head += tile_flops(rows, q0 + rows - k0, d);
  }
  return p.batch * ((p.heads - local) * routed_head + local * local_head);
}

namespace {

// Bytes of the forward's workspace: held throughout, then either the fitting rows or the buffers
// allocated after fitting (4-byte floats and int32 but the key-sorted copies, in the input's dtype).
struct ForwardBytes {
  std::int64_t kept, fitting, after;
};

ForwardBytes forward_bytes(const Problem& p, const RoutingConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, cl = routing_clusters(p, c), w = routing_window(p, c);
  const std::int64_t threads = p.threads, routed = p.batch * (p.heads - local_head_count(p, c));
  const std::int64_t block = affinity_block(n);
  const std::int64_t kept = p.heads * cl * d + threads * (cl * ops::padded_ld(block) + block + n + cl + 1);
  const std::int64_t fitting = c.kmeans_updates > 0 ? threads * 2 * n * d : 0;
  std::int64_t after = threads * ((p.causal ? 1 : 3 * w) * d + score_rows(p, c) * ops::padded_ld(score_cols(p, c)) +
                                  2 * w + bf16_forward_floats(p, c));
  std::int64_t sorted_bytes = 0;
  if (p.causal) {
    after += routed * (5 * n + cl + 1);
    sorted_bytes = routed * 2 * n * d * element_bytes(p.dtype);
  } else {
    after += threads * (2 * (cl + 1) * TopPositions::capacity(w, block, n) + tile_panel_floats(w, d)) +
             routed * (3 * cl * w + n + 1) + routed * cl * w * (d + 1);
  }
  return {4 * kept, 4 * fitting, 4 * after + sorted_bytes};
}

}  // namespace

std::int64_t workspace(const Problem& p, const RoutingConfig& c) {
  const ForwardBytes e = forward_bytes(p, c);
  return e.kept + std::max(e.fitting, e.after);
}

std::int64_t decode_workspace(const Problem& p, const RoutingConfig& c, std::int64_t) {
  const std::int64_t d = p.head_dim, cl = routing_clusters(p, c), w = routing_window(p, c);
  const std::int64_t local = p.batch * local_head_count(p, c), routed = p.batch * p.heads - local;
  const std::int64_t bytes = KvCache::bytes(routed * cl, w, d, p.dtype) + KvCache::bytes(local, 2 * w, d, p.dtype) +
                             4 * (p.batch * p.heads * 2 * d + routed * cl + routed);
  // prepare_decode runs after the fitting rows are freed: its buffers may fit under their peak.
  const ForwardBytes e = forward_bytes(p, c);
  return std::max(e.fitting, e.after + bytes) - std::max(e.fitting, e.after);
}

std::int64_t backward_flops(const Problem& p, const RoutingConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, cl = routing_clusters(p, c), w = routing_window(p, c);
  const std::int64_t local = local_head_count(p, c);
  const std::int64_t softmax = kRecomputedSoftmaxBackwardFlopsPerElement;
  const std::int64_t routed_head = p.causal ? n * (10 * w * d + softmax * w + 4 * d) + 8 * n * d
                                            : cl * (5 * matmul_flops(w, w, d) + softmax * w * w + 5 * w * d) +
                                                  8 * n * d + 2 * matmul_flops(cl, n, d) + 2 * (cl - 1) * n;
  std::int64_t local_head = 0;
  for (std::int64_t q0 = 0; q0 < n; q0 += w) {
    const std::int64_t rows = std::min(w, n - q0), cols = q0 + rows - std::max<std::int64_t>(0, q0 - w);
    local_head += 5 * matmul_flops(rows, cols, d) + softmax * rows * cols + 2 * rows * d + 2 * cols * d;
  }
  return p.batch * ((p.heads - local) * routed_head + local * local_head) + (p.heads - local) * 6 * cl * d;
}

std::int64_t backward_workspace(const Problem& p, const RoutingConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, cl = routing_clusters(p, c), w = routing_window(p, c);
  const std::int64_t routed = p.batch * (p.heads - local_head_count(p, c)), cols = score_cols(p, c);
  const std::int64_t floats = p.batch * p.heads * n + p.heads * cl * d +
                              p.threads * (cl * d + (2 * w + 2 * cols) * d + score_rows(p, c) * ops::padded_ld(cols)) +
                              (p.causal ? 2 * routed * n * d : 0) + p.threads * bf16_backward_floats(p);
  // prepare_backward runs after the fitting rows are freed: its buffers may fit under their peak.
  const ForwardBytes e = forward_bytes(p, c);
  return std::max(e.fitting, e.after + 4 * floats) - std::max(e.fitting, e.after);
}

FieldTable<RoutingConfig> config_fields(const RoutingConfig*) {
  return {
      int_field("clusters", &RoutingConfig::clusters, 0, 65536, "k-means clusters C; 0 = round(sqrt(N)); clamped to N"),
      int_field("kmeans_updates", &RoutingConfig::kmeans_updates, 0, 1000,
                "online k-means (EMA) passes over seeded fitting rows (not the input) in the untimed setup"),
      real_field("ema_decay", &RoutingConfig::ema_decay, 0, 1, "centroid moving-average decay lambda"),
      flag_field("local_heads", &RoutingConfig::local_heads,
                 "first floor(H/2) heads use local attention (blocks of N/C tokens: own + previous)")};
}

RoutingConfig resolve(const Problem& p, RoutingConfig c) {
  c.clusters = routing_clusters(p, c);
  return c;
}

template <>
Implementation implementation<RoutingConfig>() {
  Implementation impl = implement<RoutingConfig>();
  impl.bf16_forward = true;  // forward, decode and backward (routing.hpp)
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
