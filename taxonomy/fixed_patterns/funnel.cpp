#include "taxonomy/fixed_patterns/funnel.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/online_attention_bf16.hpp"

namespace xfb {
namespace {

// The rows of q one pooled row averages: `count` (1 or 2) consecutive rows from `first`.
struct PoolSource {
  std::int64_t first = 0, count = 1;
};

// Length of the sequence the stride-2 window runs over: with separate_cls token 0 is repeated in
// front (so it pools with itself), and truncate_seq drops the last token.
std::int64_t pooled_length(std::int64_t n, const FunnelConfig& c) {
  if (!c.separate_cls) return n;
  return c.truncate_seq ? n : n + 1;
}

std::int64_t pooled_rows(std::int64_t n, const FunnelConfig& c) { return (pooled_length(n, c) + 1) / 2; }

PoolSource pool_source(std::int64_t n, const FunnelConfig& c, std::int64_t i) {
  if (!c.separate_cls) return {2 * i, std::min<std::int64_t>(2, n - 2 * i)};
  if (i == 0) return {0, 1};
  return {2 * i - 1, 2 * i + 1 < pooled_length(n, c) ? 2 : 1};
}

// Pooled rows with two sources (the ones that cost FLOPs: an add and a halving per feature).
std::int64_t paired_rows(std::int64_t n, const FunnelConfig& c) {
  std::int64_t pairs = 0;
  for (std::int64_t i = 0; i < pooled_rows(n, c); ++i) pairs += pool_source(n, c, i).count == 2;
  return pairs;
}

bool uses_tile_kernels(std::int64_t d) { return tiles::fits_head_dim(d); }

// Forward score strips on the tile kernels (as exact-tiled: the strip's scores stay in cache).
constexpr std::int64_t kStripRows = 32;
// Backward query strips on the tile kernels (as exact-tiled's backward).
constexpr std::int64_t kBackwardStripRows = 128;

std::int64_t score_rows(const FunnelConfig& c, std::int64_t d) {
  return uses_tile_kernels(d) ? std::min(c.block_q, kStripRows) : c.block_q;
}
std::int64_t backward_rows(const FunnelConfig& c, std::int64_t d) {
  return uses_tile_kernels(d) ? kBackwardStripRows : c.block_q;
}
// Columns a score product computes: whole panels on the tile kernels.
std::int64_t score_columns(std::int64_t cols, std::int64_t d) {
  return uses_tile_kernels(d) ? tiles::panels_for(cols) * tiles::kPanel : cols;
}
// Row stride of a score tile: whole 16-float vectors for the row softmax.
std::int64_t score_stride(std::int64_t block_k) { return tiles::panels_for(block_k) * tiles::kPanel; }

std::int64_t packed_key_floats(const Problem& p) {
  if (!uses_tile_kernels(p.head_dim)) return 0;
  return p.batch * p.heads * tiles::panels_for(p.seq_len) * tiles::kPanel * p.head_dim;
}
// One packed value block of the backward, per thread (tile kernels only).
std::int64_t value_panel_floats(const FunnelConfig& c, std::int64_t d) {
  return uses_tile_kernels(d) ? tiles::panels_for(c.backward_block_k) * tiles::kPanel * d : 0;
}

// Q̃ [B·H, M, D] of q [B·H, N, D] (T = float or bf16: the mean in fp32, stored as T). Returns its FLOPs.
template <class T>
std::int64_t pool_every_head(const Problem& p, const FunnelConfig& c, const T* q, T* pooled) {
  const std::int64_t n = p.seq_len, d = p.head_dim, heads = p.batch * p.heads, m = pooled_rows(n, c);
#pragma omp parallel for num_threads(p.threads) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head) {
    const T* src = q + head * n * d;
    T* dst = pooled + head * m * d;
    for (std::int64_t i = 0; i < m; ++i) {
      const PoolSource s = pool_source(n, c, i);
      const T* a = src + s.first * d;
      T* row = dst + i * d;
      if (s.count == 1) {
        std::copy(a, a + d, row);
        continue;
      }
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) row[j] = stored<T>((as_float(a[j]) + as_float(a[d + j])) * 0.5f);
    }
  }
  return heads * 2 * d * paired_rows(n, c);
}

// dq of one head [N, D] from dQ̃ [M, D] (fp32): each source row gets dQ̃_i / count (stored as T, rounded
// once for bf16); rows in no pooled row get 0. Returns its FLOPs.
template <class T>
std::int64_t unpool_head(std::int64_t n, std::int64_t d, const FunnelConfig& c, const float* dqp, T* dqh) {
  std::fill(dqh, dqh + n * d, stored<T>(0.0f));
  for (std::int64_t i = 0; i < pooled_rows(n, c); ++i) {
    const PoolSource s = pool_source(n, c, i);
    const float* g = dqp + i * d;
    T* a = dqh + s.first * d;
    if (s.count == 1) {
      convert(g, a, d);
      continue;
    }
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) a[j] = a[d + j] = stored<T>(g[j] * 0.5f);
  }
  return d * paired_rows(n, c);
}

class Funnel final : public Mechanism {
 public:
  Funnel(const Problem& problem, const FunnelConfig& config)
      : p_(problem), c_(config), m_(pooled_rows(problem.seq_len, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t d = p_.head_dim, threads = p_.threads;
    pooled_ = Tensor(Shape{p_.batch * p_.heads, m_, d});
    if (uses_tile_kernels(d)) packed_keys_ = Tensor(Shape{packed_key_floats(p_)});
    scores_ = Tensor(Shape{threads, score_rows(c_, d), score_stride(c_.block_k)});
    accumulators_ = Tensor(Shape{threads, c_.block_q, d});
    row_stats_ = Tensor(Shape{threads, 2, c_.block_q});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads, blocks = (m_ + c_.block_q - 1) / c_.block_q;
    std::int64_t flops = pool_queries(q);
    if (uses_tile_kernels(p_.head_dim)) pack_keys(k);
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < heads * blocks; ++task)
        flops += query_block(task / blocks, (task % blocks) * c_.block_q, k, v, out, thread);
    }
    FlopCounter::add(flops);
  }

  void prepare_backward() override {
    const std::int64_t rows = p_.batch * p_.heads * m_, d = p_.head_dim;
    log_sum_exp_ = Tensor(Shape{rows});
    deltas_ = Tensor(Shape{rows});
    tile_grads_ = Tensor(Shape{p_.threads, 2, backward_rows(c_, d), score_stride(c_.backward_block_k)});
    pooled_grads_ = Tensor(Shape{p_.threads, m_, d});
    if (uses_tile_kernels(d)) value_panels_ = Tensor(Shape{p_.threads, value_panel_floats(c_, d)});
  }

  std::vector<NamedTensor> saved() const override {
    std::vector<NamedTensor> kept{{"log_sum_exp", &log_sum_exp_}, {"pooled_queries", &pooled_}};
    if (!packed_keys_.empty()) kept.push_back({"packed_keys", &packed_keys_});
    return kept;
  }

  void backward(const Tensor&, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t heads = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < heads; ++head)
      flops += head_backward(head, k, v, out, dout, dq, dk, dv, omp_get_thread_num());
    FlopCounter::add(flops);
  }

 private:
  // Q̃ of every head into pooled_. Returns its FLOPs.
  std::int64_t pool_queries(const Tensor& q) { return pool_every_head(p_, c_, q.data(), pooled_.data()); }

  // Packs every head's keys into panels once per call, shared by all query blocks (and the backward).
  void pack_keys(const Tensor& k) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, panels = tiles::panels_for(n);
    const std::int64_t heads = p_.batch * p_.heads;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t task = 0; task < heads * panels; ++task) {
      const std::int64_t head = task / panels, first = (task % panels) * tiles::kPanel;
      tiles::pack_key_panels(k.data() + (head * n + first) * d, d, std::min(tiles::kPanel, n - first), d,
                             packed_keys_.data() + (head * panels + task % panels) * d * tiles::kPanel);
    }
  }

  const float* key_panels(std::int64_t head, std::int64_t k0) const {
    return packed_keys_.data() +
           (head * tiles::panels_for(p_.seq_len) + k0 / tiles::kPanel) * p_.head_dim * tiles::kPanel;
  }

  // scores = scale·Q̃[rows]·K[k0, k0 + cols)ᵀ. Returns the FLOPs oneDNN does not count.
  std::int64_t compute_scores(std::int64_t head, const float* queries, std::int64_t rows, const Tensor& k,
                              std::int64_t k0, std::int64_t cols, float scale, float* scores, std::int64_t ld) {
    const std::int64_t d = p_.head_dim;
    if (!uses_tile_kernels(d)) {
      ops::gemm(false, true, rows, cols, d, scale, queries, d, k.data() + (head * p_.seq_len + k0) * d, d, 0.0f, scores,
                ld);
      return 0;
    }
    tiles::scores(queries, d, rows, key_panels(head, k0), tiles::panels_for(cols), d, scale, scores, ld);
    return matmul_flops(rows, score_columns(cols, d), d);
  }

  // Pooled rows [q0, q0 + block_q) of one head against every key, by online softmax over key tiles.
  // Returns the FLOPs it executed outside oneDNN.
  std::int64_t query_block(std::int64_t head, std::int64_t q0, const Tensor& k, const Tensor& v, Tensor& out,
                           int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, rows = std::min(c_.block_q, m_ - q0);
    const std::int64_t ld = scores_.dim(2), strip = score_rows(c_, d);
    float* scores = scores_.data() + thread * strip * ld;
    float* acc = accumulators_.data() + thread * c_.block_q * d;
    float* row_max = row_stats_.data() + thread * 2 * c_.block_q;
    float* row_sum = row_max + c_.block_q;
    std::fill(acc, acc + rows * d, 0.0f);
    std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
    std::fill(row_sum, row_sum + rows, 0.0f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const float* queries = pooled_.data() + (head * m_ + q0) * d;
    const float* values = v.data() + head * n * d;
    std::int64_t flops = 0;
    for (std::int64_t k0 = 0; k0 < n; k0 += c_.block_k) {
      const std::int64_t cols = std::min(c_.block_k, n - k0);
      for (std::int64_t s0 = 0; s0 < rows; s0 += strip) {
        const std::int64_t strip_rows = std::min(strip, rows - s0);
        flops += compute_scores(head, queries + s0 * d, strip_rows, k, k0, cols, scale, scores, ld);
        for (std::int64_t r = 0; r < strip_rows; ++r) {
          float* row = scores + r * ld;
          const std::int64_t i = s0 + r;
          ops::online_softmax_step(row, cols, cols, row_max[i], row_sum[i], acc + i * d, d);
        }
        flops += strip_rows * (kOnlineSoftmaxFlopsPerElement * cols + d);
        if (uses_tile_kernels(d)) {
          tiles::accumulate_pv(scores, ld, strip_rows, cols, values + k0 * d, d, d, acc + s0 * d, d);
          flops += matmul_flops(strip_rows, d, cols);
        } else {
          ops::gemm(false, false, strip_rows, d, cols, 1.0f, scores, ld, values + k0 * d, d, 1.0f, acc + s0 * d, d);
        }
      }
    }
    if (!log_sum_exp_.empty()) {
      float* lse = log_sum_exp_.data() + head * m_ + q0;
      for (std::int64_t r = 0; r < rows; ++r) lse[r] = row_max[r] + std::log(row_sum[r]);
    }
    float* dst = out.data() + (head * m_ + q0) * d;
    for (std::int64_t r = 0; r < rows; ++r) {
      const float inverse = 1.0f / row_sum[r];
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) dst[r * d + j] = acc[r * d + j] * inverse;
    }
    return flops + rows * d;
  }

  // The whole backward of one head. Returns the FLOPs it executed outside oneDNN.
  std::int64_t head_backward(std::int64_t head, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                             Tensor& dq, Tensor& dk, Tensor& dv, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bk = c_.backward_block_k, strip = backward_rows(c_, d);
    const float* o = out.data() + head * m_ * d;
    const float* go = dout.data() + head * m_ * d;
    float* delta = deltas_.data() + head * m_;
    for (std::int64_t i = 0; i < m_; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t j = 0; j < d; ++j) dot += go[i * d + j] * o[i * d + j];
      delta[i] = dot;
    }
    float* dqp = pooled_grads_.data() + thread * m_ * d;
    float* dkh = dk.data() + head * n * d;
    float* dvh = dv.data() + head * n * d;
    std::fill(dqp, dqp + m_ * d, 0.0f);
    std::fill(dkh, dkh + n * d, 0.0f);
    std::fill(dvh, dvh + n * d, 0.0f);
    std::int64_t flops = 2 * m_ * d;
    const TileHead t{head, k.data() + head * n * d, v.data() + head * n * d, go, dqp, dkh, dvh};
    for (std::int64_t k0 = 0; k0 < n; k0 += bk) {
      const std::int64_t cols = std::min(bk, n - k0);
      if (uses_tile_kernels(d))
        tiles::pack_key_panels(t.v + k0 * d, d, cols, d, value_panels_.data() + thread * value_panels_.dim(1));
      for (std::int64_t q0 = 0; q0 < m_; q0 += strip)
        flops += tile_backward(t, q0, std::min(strip, m_ - q0), k0, cols, thread);
    }
    return flops + unpool_head(n, d, c_, dqp, dq.data() + head * n * d);
  }

  struct TileHead {
    std::int64_t head;
    const float *k, *v, *dout;
    float *dqp, *dk, *dv;
  };

  // The backward of the [rows, cols] tile at (q0, k0): P and dS from the saved log-sum-exp, then
  // dV += Pᵀ·dO, dK += scale·dSᵀ·Q̃, dQ̃ += scale·dS·K. Returns the FLOPs outside oneDNN.
  std::int64_t tile_backward(const TileHead& t, std::int64_t q0, std::int64_t rows, std::int64_t k0, std::int64_t cols,
                             int thread) {
    const std::int64_t d = p_.head_dim, ld = tile_grads_.dim(3);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* probs = tile_grads_.data() + thread * 2 * tile_grads_.dim(2) * ld;
    float* grads = probs + tile_grads_.dim(2) * ld;
    const float* queries = pooled_.data() + (t.head * m_ + q0) * d;
    const float* go = t.dout + q0 * d;
    const float* lse = log_sum_exp_.data() + t.head * m_ + q0;
    const float* delta = deltas_.data() + t.head * m_ + q0;
    const bool tiled = uses_tile_kernels(d);
    std::int64_t flops = 0;
    if (tiled) {
      const std::int64_t panels = tiles::panels_for(cols);
      tiles::scores(queries, d, rows, key_panels(t.head, k0), panels, d, scale, probs, ld);
      tiles::scores(go, d, rows, value_panels_.data() + thread * value_panels_.dim(1), panels, d, 1.0f, grads, ld);
      flops += 2 * matmul_flops(rows, score_columns(cols, d), d);
    } else {
      ops::gemm(false, true, rows, cols, d, scale, queries, d, t.k + k0 * d, d, 0.0f, probs, ld);
      ops::gemm(false, true, rows, cols, d, 1.0f, go, d, t.v + k0 * d, d, 0.0f, grads, ld);
    }
    for (std::int64_t r = 0; r < rows; ++r)
      tiles::softmax_grad_interval(probs + r * ld, grads + r * ld, 0, cols, cols, lse[r], delta[r]);
    flops += kRecomputedSoftmaxBackwardFlopsPerElement * rows * cols;
    if (tiled) {
      tiles::accumulate_transposed(probs, ld, rows, cols, go, d, d, 1.0f, t.dv + k0 * d, d);
      tiles::accumulate_transposed(grads, ld, rows, cols, queries, d, d, scale, t.dk + k0 * d, d);
      tiles::accumulate_pv(grads, ld, rows, cols, t.k + k0 * d, d, d, t.dqp + q0 * d, d, scale);
      flops += 3 * matmul_flops(rows, cols, d);
    } else {
      ops::gemm(true, false, cols, d, rows, 1.0f, probs, ld, go, d, 1.0f, t.dv + k0 * d, d);
      ops::gemm(true, false, cols, d, rows, scale, grads, ld, queries, d, 1.0f, t.dk + k0 * d, d);
      ops::gemm(false, false, rows, d, cols, scale, grads, ld, t.k + k0 * d, d, 1.0f, t.dqp + q0 * d, d);
    }
    return flops;
  }

  Problem p_;
  FunnelConfig c_;
  std::int64_t m_;
  Tensor pooled_, packed_keys_, scores_, accumulators_, row_stats_;
  // Backward (prepare_backward): the pooled rows' log-sum-exp and δ, per thread P and dP tiles,
  // dQ̃ of the head and one packed value block.
  Tensor log_sum_exp_, deltas_, tile_grads_, pooled_grads_, value_panels_;
};

// Funnel in bf16 (D % 16 == 0): q, k, v, out bf16; Q̃ = bf16 of the fp32 mean of its one or two bf16
// source rows ([B·H, M, D], kept); K in pair panels and V in row pairs (bf16, packed once per call);
// each block of block_q pooled rows against all N keys on attend_online_bf16 (exact-tiled's bf16 walk,
// not causal), keeping each pooled row's log-sum-exp when training. The backward is exact-tiled's bf16
// backward (OnlineBackwardBf16) of the M pooled rows against the N keys: dK, dV rounded once, dQ̃ in
// fp32 unpooled into dq (halved for a two-source row) and rounded once. FLOPs are the fp32 form's on the
// tile kernels.
class FunnelBf16 final : public Mechanism {
 public:
  FunnelBf16(const Problem& problem, const FunnelConfig& config)
      : p_(problem), c_(config), m_(pooled_rows(problem.seq_len, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads, threads = p_.threads;
    pooled_ = Tensor(Shape{heads, m_, d}, DType::BF16);
    packed_keys_ = Tensor(Shape{heads, head_panel_elements(n, d)}, DType::BF16);
    packed_values_ = Tensor(Shape{heads, head_pair_elements(n, d)}, DType::BF16);
    walk_ = OnlineBuffersBf16(threads, c_.block_q, c_.block_k, d);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads;
    const std::int64_t blocks = (m_ + c_.block_q - 1) / c_.block_q;
    std::int64_t flops = pool_every_head(p_, c_, q.bf16_data(), pooled_.bf16_data());
    pack_heads_bf16(k, v, p_.threads, packed_keys_, packed_values_);
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < heads * blocks; ++task)
        flops += query_block(task / blocks, (task % blocks) * c_.block_q, out, thread);
    }
    FlopCounter::add(flops);
  }

  void prepare_backward() override {
    const std::int64_t rows = p_.batch * p_.heads * m_;
    log_sum_exp_ = Tensor(Shape{rows});
    deltas_ = Tensor(Shape{rows});
    backward_ = OnlineBackwardBf16(p_.threads, m_, p_.seq_len, c_.backward_block_k, p_.head_dim);
  }

  void backward(const Tensor&, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t head = 0; head < heads; ++head) {
        const std::int64_t keys = head * n * d, rows = head * m_ * d;
        flops += backward_.head_backward(
            {pooled_.bf16_data() + rows, k.bf16_data() + keys, v.bf16_data() + keys, out.bf16_data() + rows,
             dout.bf16_data() + rows, dk.bf16_data() + keys, dv.bf16_data() + keys, log_sum_exp_.data() + head * m_,
             deltas_.data() + head * m_, m_, n, d, c_.backward_block_k, false},
            thread);
        flops += unpool_head(n, d, c_, backward_.query_grads(thread), dq.bf16_data() + keys);
      }
    }
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> saved() const override {
    std::vector<NamedTensor> kept{{"pooled_queries", &pooled_}};
    if (!log_sum_exp_.empty()) kept.push_back({"log_sum_exp", &log_sum_exp_});
    return kept;
  }

 private:
  // Pooled rows [q0, q0 + block_q) of one head against its N keys (with their log-sum-exp when
  // training). Returns the FLOPs.
  std::int64_t query_block(std::int64_t head, std::int64_t q0, Tensor& out, int thread) {
    const std::int64_t d = p_.head_dim;
    const OnlineBlockBf16 block{pooled_.bf16_data() + (head * m_ + q0) * d,
                                q0,
                                std::min(c_.block_q, m_ - q0),
                                packed_keys_.bf16_data() + head * packed_keys_.dim(1),
                                packed_values_.bf16_data() + head * packed_values_.dim(1),
                                p_.seq_len,
                                c_.block_k,
                                d,
                                false};
    float* lse = log_sum_exp_.empty() ? nullptr : log_sum_exp_.data() + head * m_ + q0;
    return attend_online_bf16(block, walk_.scratch(thread), out.bf16_data() + (head * m_ + q0) * d, lse);
  }

  Problem p_;
  FunnelConfig c_;
  std::int64_t m_;
  Tensor pooled_;                       // Q̃ bf16 [B·H, M, D]
  Tensor packed_keys_, packed_values_;  // per head: K pair panels, V row pairs (bf16)
  OnlineBuffersBf16 walk_;              // per thread: the walk's strip, accumulator and row statistics
  // Training (prepare_backward): the pooled rows' log-sum-exp and δ (fp32), the backward's buffers.
  Tensor log_sum_exp_, deltas_;
  OnlineBackwardBf16 backward_;
};

}  // namespace

std::int64_t output_rows(const Problem& p, const FunnelConfig& c) { return pooled_rows(p.seq_len, c); }

void validate(const Problem&, const FunnelConfig& c) {
  if (c.truncate_seq && !c.separate_cls)
    throw ParamError("funnel: truncate_seq drops the last token only with separate_cls (as the official code)");
}

std::string unsupported(const Problem& p, const FunnelConfig&) {
  if (const std::string why = tiles::bf16_head_dim_unsupported("funnel's bf16 form", p.dtype, p.head_dim); !why.empty())
    return why;
  if (p.causal)
    return "the Funnel paper gives no causal form of pooled-query attention (a pooled query averages two "
           "positions and attends to every key)";
  return "";
}

FunnelConfig resolve(const Problem& p, FunnelConfig c) {
  const std::int64_t m = pooled_rows(p.seq_len, c);
  c.block_q = std::min(c.block_q, m);
  c.block_k = std::min(c.block_k, p.seq_len);
  c.backward_block_k = std::min(c.backward_block_k, p.seq_len);
  if (uses_tile_kernels(p.head_dim)) {
    c.block_k = tiles::panels_for(c.block_k) * tiles::kPanel;
    c.backward_block_k = tiles::panels_for(c.backward_block_k) * tiles::kPanel;
  }
  return c;
}

std::unique_ptr<Mechanism> create(const Problem& problem, const FunnelConfig& c, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<FunnelBf16>(problem, c);
  return std::make_unique<Funnel>(problem, c);
}

std::int64_t flops(const Problem& p, const FunnelConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = pooled_rows(n, c);
  std::int64_t per_head = 2 * d * paired_rows(n, c) + m * d;
  for (std::int64_t k0 = 0; k0 < n; k0 += c.block_k) {
    const std::int64_t cols = std::min(c.block_k, n - k0);
    per_head += matmul_flops(m, score_columns(cols, d), d) + matmul_flops(m, d, cols) +
                m * (kOnlineSoftmaxFlopsPerElement * cols + d);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const FunnelConfig& c) {
  const std::int64_t d = p.head_dim, m = pooled_rows(p.seq_len, c);
  if (p.dtype == DType::BF16) {  // Q̃ and the packed K, V in bf16; per thread as exact-tiled's bf16 walk
    const std::int64_t per_head = m * d + head_panel_elements(p.seq_len, d) + head_pair_elements(p.seq_len, d);
    return p.batch * p.heads * per_head * static_cast<std::int64_t>(sizeof(bf16)) +
           OnlineBuffersBf16::bytes(p.threads, c.block_q, c.block_k, d);
  }
  const std::int64_t per_thread = score_rows(c, d) * score_stride(c.block_k) + c.block_q * d + 2 * c.block_q;
  const std::int64_t floats = p.batch * p.heads * m * d + packed_key_floats(p) + p.threads * per_thread;
  return floats * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_flops(const Problem& p, const FunnelConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = pooled_rows(n, c);
  std::int64_t per_head = 2 * m * d + d * paired_rows(n, c);
  for (std::int64_t k0 = 0; k0 < n; k0 += c.backward_block_k) {
    const std::int64_t cols = std::min(c.backward_block_k, n - k0);
    per_head += 2 * matmul_flops(m, score_columns(cols, d), d) + 3 * matmul_flops(m, cols, d) +
                kRecomputedSoftmaxBackwardFlopsPerElement * m * cols;
  }
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const FunnelConfig& c) {
  const std::int64_t d = p.head_dim, m = pooled_rows(p.seq_len, c);
  if (p.dtype == DType::BF16)
    return 2 * p.batch * p.heads * m * static_cast<std::int64_t>(sizeof(float)) +
           OnlineBackwardBf16::bytes(p.threads, m, p.seq_len, c.backward_block_k, d);
  const std::int64_t per_thread =
      2 * backward_rows(c, d) * score_stride(c.backward_block_k) + m * d + value_panel_floats(c, d);
  return (2 * p.batch * p.heads * m + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<FunnelConfig> config_fields(const FunnelConfig*) {
  return {flag_field("separate_cls", &FunnelConfig::separate_cls,
                     "token 0 ([CLS]) is its own pooled row and pairs start at token 1 (M = floor(N/2) + 1)"),
          flag_field("truncate_seq", &FunnelConfig::truncate_seq,
                     "with separate_cls, drop the last token before pooling (M = ceil(N/2))"),
          int_field("block_q", &FunnelConfig::block_q, 1, 4096,
                    "pooled query rows per forward task (tokens, clamped to the pooled rows)"),
          int_field("block_k", &FunnelConfig::block_k, 1, 8192,
                    "key columns per forward tile (tokens, clamped to N; then whole 16-key panels when head_dim is a "
                    "multiple of 16)"),
          int_field("backward_block_k", &FunnelConfig::backward_block_k, 1, 8192,
                    "key columns per backward block (tokens; clamped and rounded like block_k)")};
}

template <>
Implementation implementation<FunnelConfig>() {
  Implementation impl = implement<FunnelConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
