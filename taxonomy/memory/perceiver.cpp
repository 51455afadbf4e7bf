#include "taxonomy/memory/perceiver.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {
namespace {

constexpr float kLatentStd = 0.02f;    // the encoder code's z_pos_enc_init_scale
constexpr double kTruncation = 2.0;    // Haiku's TruncatedNormal bounds, in standard deviations
constexpr std::int64_t kStepRows = 8;  // per head in a decode step: q, acc, C, Lq, Lk, Lv, Lq·s, acc

std::int64_t latent_rows(const Problem& p, const PerceiverConfig& c) { return std::min(c.latents, p.seq_len); }
std::int64_t tile_rows(const Problem& p, const PerceiverConfig& c) { return std::min(c.block_rows, latent_rows(p, c)); }
std::int64_t tile_cols(const Problem& p, const PerceiverConfig& c) { return std::min(c.block_keys, p.seq_len); }

// The inputs [first, last] latent i cross-attends to.
struct KeyRange {
  std::int64_t first, last;
};
KeyRange cross_range(const Problem& p, const PerceiverConfig& c, std::int64_t i) {
  if (!p.causal) return {0, p.seq_len - 1};
  const std::int64_t position = p.seq_len - latent_rows(p, c) + i;
  return {c.cross_window > 0 ? std::max<std::int64_t>(0, position - c.cross_window + 1) : 0, position};
}

// The keys a row block [r0, r0 + rows) spans: from its first row's first key to its last row's
// last key (both ends grow with the row); its key tiles start at `first`, block_keys apart.
KeyRange block_range(const Problem& p, const PerceiverConfig& c, std::int64_t r0, std::int64_t rows) {
  return {cross_range(p, c, r0).first, cross_range(p, c, r0 + rows - 1).last};
}

// The part [a, b) of tile [j0, j0 + cols) that latent i sees (a >= b: none).
struct Span {
  std::int64_t a, b;
};
Span visible(const KeyRange& range, std::int64_t j0, std::int64_t cols) {
  return {std::max(range.first, j0) - j0, std::min(range.last + 1, j0 + cols) - j0};
}

// Valid entries of latent row r of the latent layer's score matrix.
std::int64_t latent_valid(const Problem& p, std::int64_t m, std::int64_t r) { return p.causal ? r + 1 : m; }

// In-place softmax over the first `valid` of n values, zeros beyond.
void softmax_prefix(float* row, std::int64_t valid, std::int64_t n) {
  const float inverse = 1.0f / ops::exp_and_sum(row, valid, ops::row_max(row, valid, row[0]));
#pragma omp simd
  for (std::int64_t j = 0; j < valid; ++j) row[j] *= inverse;
  std::fill(row + valid, row + n, 0.0f);
}

// FLOPs of the latent layer of one (batch, head) outside its products: the softmax.
std::int64_t latent_softmax_flops(const Problem& p, std::int64_t m) {
  return kSoftmaxFlopsPerElement * (p.causal ? m * (m + 1) / 2 : m * m);
}

// The bf16 form's fp32 rows per thread (perceiver.hpp): forward k, v [N, D] each, causal q's last M
// rows and the output [M, D]; backward dK, dV [N, D] each, dO and causal dQc [M, D].
std::int64_t bf16_forward_floats(const Problem& p, const PerceiverConfig& c) {
  const std::int64_t m = latent_rows(p, c);
  return (2 * p.seq_len + (p.causal ? 2 * m : m)) * p.head_dim;
}
std::int64_t bf16_backward_floats(const Problem& p, const PerceiverConfig& c) { return bf16_forward_floats(p, c); }

class Perceiver final : public Mechanism {
 public:
  Perceiver(const Problem& problem, const PerceiverConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed), m_(latent_rows(problem, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, d = p_.head_dim, threads = p_.threads;
    if (!p_.causal) {
      latents_ = Tensor(Shape{h, m_, d});
      draw_latents();
    }
    projections_ = Tensor(Shape{h, 3, d, d});
    CounterRng(seed_, "perceiver/latent_projections")
        .fill_normal(projections_, 0.0f, 1.0f / std::sqrt(static_cast<float>(d)));
    cross_out_ = Tensor(Shape{threads, m_, d});
    stats_ = Tensor(Shape{threads, 2, m_});
    tile_ = Tensor(Shape{threads, tile_rows(p_, c_), ops::padded_ld(tile_cols(p_, c_))});
    latent_rows_ = Tensor(Shape{threads, 3, m_, d});
    latent_scores_ = Tensor(Shape{threads, m_, ops::padded_ld(m_)});
    if (bf16_form()) widened_ = Tensor(Shape{threads, bf16_forward_floats(p_, c_)});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t bh_count = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < bh_count; ++bh) {
      const int thread = omp_get_thread_num();
      const std::int64_t at = bh * m_ * p_.head_dim;
      if (!bf16_form()) {
        flops += forward_head(bh, fp32_inputs(bh, q, k, v), out.data() + at, thread);
        continue;
      }
      float* rows = thread_rows(widened_, thread);
      float* result = rows + bf16_forward_floats(p_, c_) - m_ * p_.head_dim;
      flops += forward_head(bh, widened_inputs(bh, q, k, v, rows), result, thread);
      narrow(result, out.bf16_data() + at, m_ * p_.head_dim);
    }
    FlopCounter::add(flops);
    if (cross_cache_.capacity() > 0) {
      cross_cache_.load_context(k, v, p_.threads);
      length_ = p_.seq_len;
    }
  }

  std::vector<NamedTensor> parameters() const override {
    if (p_.causal) return {{"latent_projections", &projections_}};
    return {{"latents", &latents_}, {"latent_projections", &projections_}};
  }

  void prepare_backward() override {
    const std::int64_t bh = p_.batch * p_.heads, d = p_.head_dim, threads = p_.threads;
    saved_cross_ = Tensor(Shape{bh, m_, d});
    saved_lse_ = Tensor(Shape{bh, m_});
    if (!p_.causal) d_latents_ = Tensor(latents_.shape());
    d_projections_ = Tensor(projections_.shape());
    cross_grads_ = Tensor(Shape{threads, m_, d});
    latent_grads_ = Tensor(Shape{threads, 3, m_, d});
    latent_score_grads_ = Tensor(Shape{threads, m_, latent_scores_.dim(2)});
    tile_grads_ = Tensor(Shape{threads, tile_.dim(1), tile_.dim(2)});
    deltas_ = Tensor(Shape{threads, m_});
    if (bf16_form()) widened_grads_ = Tensor(Shape{threads, bf16_backward_floats(p_, c_)});
  }

  std::vector<NamedTensor> saved() const override {
    return {{"cross_outputs", &saved_cross_}, {"cross_lse", &saved_lse_}};
  }

  std::vector<NamedTensor> parameter_gradients() const override {
    if (p_.causal) return {{"dlatent_projections", &d_projections_}};
    return {{"dlatents", &d_latents_}, {"dlatent_projections", &d_projections_}};
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < p_.heads; ++head) {
      const int thread = omp_get_thread_num();
      zero_head_gradients(head);
      for (std::int64_t b = 0; b < p_.batch; ++b)
        flops += bf16_form() ? widened_backward(b * p_.heads + head, q, k, v, dout, dq, dk, dv, thread)
                             : fp32_backward(b * p_.heads + head, q, k, v, dout, dq, dk, dv, thread);
    }
    FlopCounter::add(flops);
  }

  void prepare_decode(std::int64_t tokens) override {
    if (!p_.causal) throw std::logic_error("perceiver decodes in its causal form (Perceiver AR) only");
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim;
    cross_cache_ = KvCache(heads, cross_capacity(p_, c_, tokens), d, p_.dtype);
    latent_cache_ = KvCache(heads, latent_capacity(p_, c_, tokens), d, p_.dtype);
    step_ = Tensor(Shape{heads, kStepRows, d});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads;
    const std::int64_t span = c_.cross_window > 0 ? std::min(c_.cross_window, length_ + 1) : length_ + 1;
    const bool parallel = 2 * heads * (span + c_.latents) * p_.head_dim >= kParallelStepFloats;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops) if (parallel)
    for (std::int64_t head = 0; head < heads; ++head)
      flops += bf16_form() ? step_head<bf16>(head, q, k, v, out) : step_head<float>(head, q, k, v, out);
    FlopCounter::add(flops);
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"cross_keys", &cross_cache_.key_tensor()},
            {"cross_values", &cross_cache_.value_tensor()},
            {"latent_keys", &latent_cache_.key_tensor()},
            {"latent_values", &latent_cache_.value_tensor()}};
  }

  static std::int64_t cross_capacity(const Problem& p, const PerceiverConfig& c, std::int64_t tokens) {
    const std::int64_t total = p.seq_len + tokens;
    return c.cross_window > 0 ? std::min(c.cross_window, total) : total;
  }
  static std::int64_t latent_capacity(const Problem& p, const PerceiverConfig& c, std::int64_t tokens) {
    return std::min(c.latents, p.seq_len + tokens);
  }

 private:
  // Latent (h, i, c): the first draw within ±2σ of the normals at (h, i, c + t·D), t = 0, 1, …
  void draw_latents() {
    const CounterRng rng(seed_, "perceiver/latents");
    const std::int64_t d = p_.head_dim;
    for (std::int64_t h = 0; h < p_.heads; ++h)
      for (std::int64_t i = 0; i < m_; ++i)
        for (std::int64_t f = 0; f < d; ++f) {
          double x = rng.normal_at(h, i, f);
          for (std::int64_t t = 1; std::fabs(x) > kTruncation; ++t) x = rng.normal_at(h, i, f + t * d);
          latents_.data()[(h * m_ + i) * d + f] = static_cast<float>(x) * kLatentStd;
        }
  }

  bool bf16_form() const { return p_.dtype == DType::BF16; }
  const float* latent_queries(std::int64_t bh) const { return latents_.data() + bh % p_.heads * m_ * p_.head_dim; }
  // One head's cross-attention queries Qc [M, D] and its k, v [N, D] as fp32 rows.
  struct HeadInputs {
    const float *queries, *k, *v;
  };
  HeadInputs fp32_inputs(std::int64_t bh, const Tensor& q, const Tensor& k, const Tensor& v) const {
    const std::int64_t at = bh * p_.seq_len * p_.head_dim;
    const float* queries = p_.causal ? q.data() + at + (p_.seq_len - m_) * p_.head_dim : latent_queries(bh);
    return {queries, k.data() + at, v.data() + at};
  }
  // The bf16 form: the head's k, v and causal q's last M rows widened into rows [2N (+ M), D].
  HeadInputs widened_inputs(std::int64_t bh, const Tensor& q, const Tensor& k, const Tensor& v, float* rows) const {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, at = bh * n * d;
    const Tensor* inputs[] = {&k, &v};
    widen_spans(inputs, at, n * d, rows, n * d);
    if (!p_.causal) return {latent_queries(bh), rows, rows + n * d};
    widen(q.bf16_data() + at + (n - m_) * d, rows + 2 * n * d, m_ * d);
    return {rows + 2 * n * d, rows, rows + n * d};
  }
  const float* projection(std::int64_t head, std::int64_t which) const {
    return projections_.data() + (head * 3 + which) * p_.head_dim * p_.head_dim;
  }
  // The thread's part of a per-thread buffer [threads, …].
  static float* thread_rows(Tensor& t, int thread) { return t.data() + thread * (t.size() / t.dim(0)); }

  // One (batch, head): the cross-attention into C (the saved one when the backward is prepared),
  // then the latent layer into out. Returns the FLOPs outside the products.
  std::int64_t forward_head(std::int64_t bh, const HeadInputs& in, float* out, int thread) {
    const std::int64_t d = p_.head_dim, n = p_.seq_len;
    float* cross = saved_cross_.empty() ? thread_rows(cross_out_, thread) : saved_cross_.data() + bh * m_ * d;
    float* lse = saved_lse_.empty() ? nullptr : saved_lse_.data() + bh * m_;
    std::int64_t flops = cross_attention(in.queries, in.k, in.v, cross, lse, thread);
    float* rows = thread_rows(latent_rows_, thread);
    flops += latent_layer(bh % p_.heads, cross, rows, out, thread);
    if (latent_cache_.capacity() == 0) return flops;
    // The prefill keeps the latents' keys and values (rounded once in the bf16 form).
    if (bf16_form())
      store_latents<bf16>(bh, n - m_, rows + m_ * d, rows + 2 * m_ * d, m_);
    else
      store_latents<float>(bh, n - m_, rows + m_ * d, rows + 2 * m_ * d, m_);
    return flops;
  }

  // Latent keys and values [count, D] of positions first, first + 1, … into head's latent ring.
  template <class T>
  void store_latents(std::int64_t head, std::int64_t first, const float* lk, const float* lv, std::int64_t count) {
    const std::int64_t d = p_.head_dim, capacity = latent_cache_.capacity();
    for (std::int64_t r = 0; r < count; ++r) {
      const std::int64_t slot = (first + r) % capacity * d;
      convert(lk + r * d, latent_cache_.keys<T>(head) + slot, d);
      convert(lv + r * d, latent_cache_.values<T>(head) + slot, d);
    }
  }

  // C = the masked softmax of s·Qc·Kᵀ times V, by key tiles with an online softmax per row; with
  // `lse`, also each row's log-sum-exp.
  std::int64_t cross_attention(const float* qc, const float* k, const float* v, float* cross, float* lse, int thread) {
    const std::int64_t d = p_.head_dim, ld = tile_.dim(2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* tile = tile_.data() + thread * tile_.dim(1) * ld;
    float* row_max = stats_.data() + thread * 2 * m_;
    float* row_sum = row_max + m_;
    std::fill(cross, cross + m_ * d, 0.0f);
    std::fill(row_max, row_max + m_, -std::numeric_limits<float>::infinity());
    std::fill(row_sum, row_sum + m_, 0.0f);
    std::int64_t flops = 0;
    for (std::int64_t r0 = 0; r0 < m_; r0 += c_.block_rows) {
      const std::int64_t rows = std::min(c_.block_rows, m_ - r0);
      const KeyRange keys = block_range(p_, c_, r0, rows);
      for (std::int64_t j0 = keys.first; j0 <= keys.last; j0 += c_.block_keys) {
        const std::int64_t cols = std::min(c_.block_keys, keys.last + 1 - j0);
        ops::gemm(false, true, rows, cols, d, scale, qc + r0 * d, d, k + j0 * d, d, 0.0f, tile, ld);
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = r0 + r;
          float* s = tile + r * ld;
          const Span span = visible(cross_range(p_, c_, i), j0, cols);
          if (span.a >= span.b) {
            std::fill(s, s + cols, 0.0f);
            continue;
          }
          const std::int64_t count = span.b - span.a;
          const float new_max = ops::row_max(s + span.a, count, row_max[i]);
          const float factor = ops::fast_exp(row_max[i] - new_max);
          float* acc = cross + i * d;
#pragma omp simd
          for (std::int64_t f = 0; f < d; ++f) acc[f] *= factor;
          row_sum[i] = row_sum[i] * factor + ops::exp_and_sum(s + span.a, count, new_max);
          row_max[i] = new_max;
          std::fill(s, s + span.a, 0.0f);
          std::fill(s + span.b, s + cols, 0.0f);
          flops += kOnlineSoftmaxFlopsPerElement * count + d;
        }
        ops::gemm(false, false, rows, d, cols, 1.0f, tile, ld, v + j0 * d, d, 1.0f, cross + r0 * d, d);
      }
    }
    for (std::int64_t i = 0; i < m_; ++i) {
      const float inverse = 1.0f / row_sum[i];
#pragma omp simd
      for (std::int64_t f = 0; f < d; ++f) cross[i * d + f] *= inverse;
      if (lse != nullptr) lse[i] = row_max[i] + std::log(row_sum[i]);
    }
    return flops + m_ * d;
  }

  // rows = [Lq; Lk; Lv] = C·[Wq, Wk, Wv]; out = the (causal) softmax of s·Lq·Lkᵀ times Lv.
  std::int64_t latent_layer(std::int64_t head, const float* cross, float* rows, float* out, int thread) {
    const std::int64_t d = p_.head_dim, ld = latent_scores_.dim(2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int64_t which = 0; which < 3; ++which)
      ops::gemm(false, false, m_, d, d, 1.0f, cross, d, projection(head, which), d, 0.0f, rows + which * m_ * d, d);
    float* scores = latent_scores_.data() + thread * m_ * ld;
    latent_probabilities(rows, scores, scale);
    ops::gemm(false, false, m_, d, m_, 1.0f, scores, ld, rows + 2 * m_ * d, d, 0.0f, out, d);
    return latent_softmax_flops(p_, m_);
  }

  // scores = the latent layer's probabilities from rows = [Lq; Lk; Lv].
  void latent_probabilities(const float* rows, float* scores, float scale) {
    const std::int64_t d = p_.head_dim, ld = latent_scores_.dim(2);
    ops::gemm(false, true, m_, m_, d, scale, rows, d, rows + m_ * d, d, 0.0f, scores, ld);
    for (std::int64_t r = 0; r < m_; ++r) softmax_prefix(scores + r * ld, latent_valid(p_, m_, r), m_);
  }

  void zero_head_gradients(std::int64_t head) {
    const std::int64_t d = p_.head_dim;
    std::fill_n(d_projections_.data() + head * 3 * d * d, 3 * d * d, 0.0f);
    if (!p_.causal) std::fill_n(d_latents_.data() + head * m_ * d, m_ * d, 0.0f);
  }

  // One (batch, head): the latent layer's backward (recomputed from the saved C), then the cross
  // attention's, tile by tile from the saved log-sum-exp. Returns the FLOPs outside the products.
  // dk, dv [N, D] and (causal) d_queries [M, D] must be zero; non-causal d_queries is the head's
  // dlatents, which every batch element adds to.
  std::int64_t backward_head(std::int64_t bh, const HeadInputs& in, const float* dout, float* d_queries, float* dk,
                             float* dv, int thread) {
    const std::int64_t d = p_.head_dim;
    const float* cross = saved_cross_.data() + bh * m_ * d;
    float* d_cross = thread_rows(cross_grads_, thread);
    std::int64_t flops = latent_backward(bh % p_.heads, cross, dout, d_cross, thread);
    return flops + cross_backward(in.queries, in.k, in.v, cross, saved_lse_.data() + bh * m_, d_cross, d_queries, dk,
                                  dv, thread);
  }

  std::int64_t fp32_backward(std::int64_t bh, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                             Tensor& dq, Tensor& dk, Tensor& dv, int thread) {
    const std::int64_t d = p_.head_dim, n = p_.seq_len, at = bh * n * d;
    for (Tensor* g : {&dq, &dk, &dv}) std::fill_n(g->data() + at, n * d, 0.0f);
    float* d_queries = p_.causal ? dq.data() + at + (n - m_) * d : d_latents_.data() + bh % p_.heads * m_ * d;
    return backward_head(bh, fp32_inputs(bh, q, k, v), dout.data() + bh * m_ * d, d_queries, dk.data() + at,
                         dv.data() + at, thread);
  }

  // The bf16 form's backward of one head on the thread's fp32 rows (widened_, widened_grads_: dK,
  // dV, dO, causal dQc), its gradients rounded once.
  std::int64_t widened_backward(std::int64_t bh, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                                Tensor& dq, Tensor& dk, Tensor& dv, int thread) {
    const std::int64_t d = p_.head_dim, n = p_.seq_len, at = bh * n * d;
    float* grads = thread_rows(widened_grads_, thread);
    float* d_out = grads + 2 * n * d;
    float* d_queries = p_.causal ? d_out + m_ * d : d_latents_.data() + bh % p_.heads * m_ * d;
    std::fill_n(grads, 2 * n * d, 0.0f);
    if (p_.causal) std::fill_n(d_queries, m_ * d, 0.0f);
    widen(dout.bf16_data() + bh * m_ * d, d_out, m_ * d);
    const std::int64_t flops = backward_head(bh, widened_inputs(bh, q, k, v, thread_rows(widened_, thread)), d_out,
                                             d_queries, grads, grads + n * d, thread);
    Tensor* const gradients[] = {&dk, &dv};
    narrow_spans(grads, n * d, gradients, at, n * d);
    std::fill_n(dq.bf16_data() + at, n * d, bf16{});
    if (p_.causal) narrow(d_queries, dq.bf16_data() + at + (n - m_) * d, m_ * d);
    return flops;
  }

  // From dO to dC (written), adding the head's dWq, dWk, dWv.
  std::int64_t latent_backward(std::int64_t head, const float* cross, const float* d_out, float* d_cross, int thread) {
    const std::int64_t d = p_.head_dim, ld = latent_scores_.dim(2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* rows = thread_rows(latent_rows_, thread);
    float* grads = thread_rows(latent_grads_, thread);
    float* probabilities = latent_scores_.data() + thread * m_ * ld;
    float* score_grads = latent_score_grads_.data() + thread * m_ * ld;
    for (std::int64_t which = 0; which < 3; ++which)
      ops::gemm(false, false, m_, d, d, 1.0f, cross, d, projection(head, which), d, 0.0f, rows + which * m_ * d, d);
    latent_probabilities(rows, probabilities, scale);
    const float* lq = rows;
    const float* lk = rows + m_ * d;
    const float* lv = rows + 2 * m_ * d;
    ops::gemm(true, false, m_, d, m_, 1.0f, probabilities, ld, d_out, d, 0.0f, grads + 2 * m_ * d, d);  // dLv
    ops::gemm(false, true, m_, m_, d, 1.0f, d_out, d, lv, d, 0.0f, score_grads, ld);                    // dP
    std::int64_t valid_total = 0;
    for (std::int64_t r = 0; r < m_; ++r) {
      const std::int64_t valid = latent_valid(p_, m_, r);
      const float* pr = probabilities + r * ld;
      float* gr = score_grads + r * ld;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t j = 0; j < valid; ++j) dot += pr[j] * gr[j];
#pragma omp simd
      for (std::int64_t j = 0; j < valid; ++j) gr[j] = pr[j] * (gr[j] - dot);
      std::fill(gr + valid, gr + m_, 0.0f);
      valid_total += valid;
    }
    ops::gemm(false, false, m_, d, m_, scale, score_grads, ld, lk, d, 0.0f, grads, d);          // dLq
    ops::gemm(true, false, m_, d, m_, scale, score_grads, ld, lq, d, 0.0f, grads + m_ * d, d);  // dLk
    float* d_projections = d_projections_.data() + head * 3 * d * d;
    for (std::int64_t which = 0; which < 3; ++which) {
      ops::gemm(true, false, d, d, m_, 1.0f, cross, d, grads + which * m_ * d, d, 1.0f, d_projections + which * d * d,
                d);
      ops::gemm(false, true, m_, d, d, 1.0f, grads + which * m_ * d, d, projection(head, which), d,
                which == 0 ? 0.0f : 1.0f, d_cross, d);
    }
    return latent_softmax_flops(p_, m_) + kSoftmaxBackwardFlopsPerElement * valid_total;
  }

  // The cross-attention's backward: dQc (added to d_queries), dK, dV (added) from dC.
  std::int64_t cross_backward(const float* qc, const float* k, const float* v, const float* cross, const float* lse,
                              const float* d_cross, float* d_queries, float* dk, float* dv, int thread) {
    const std::int64_t d = p_.head_dim, ld = tile_.dim(2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* probabilities = tile_.data() + thread * tile_.dim(1) * ld;
    float* grads = tile_grads_.data() + thread * tile_.dim(1) * ld;
    float* delta = deltas_.data() + thread * m_;
    for (std::int64_t i = 0; i < m_; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t f = 0; f < d; ++f) dot += d_cross[i * d + f] * cross[i * d + f];
      delta[i] = dot;
    }
    std::int64_t flops = 2 * m_ * d;
    for (std::int64_t r0 = 0; r0 < m_; r0 += c_.block_rows) {
      const std::int64_t rows = std::min(c_.block_rows, m_ - r0);
      const KeyRange keys = block_range(p_, c_, r0, rows);
      for (std::int64_t j0 = keys.first; j0 <= keys.last; j0 += c_.block_keys) {
        const std::int64_t cols = std::min(c_.block_keys, keys.last + 1 - j0);
        ops::gemm(false, true, rows, cols, d, scale, qc + r0 * d, d, k + j0 * d, d, 0.0f, probabilities, ld);
        for (std::int64_t r = 0; r < rows; ++r) {
          float* s = probabilities + r * ld;
          const Span span = visible(cross_range(p_, c_, r0 + r), j0, cols);
          const float shift = lse[r0 + r];
          for (std::int64_t j = 0; j < cols; ++j) s[j] = j >= span.a && j < span.b ? ops::fast_exp(s[j] - shift) : 0.0f;
          flops += 2 * std::max<std::int64_t>(0, span.b - span.a);
        }
        ops::gemm(true, false, cols, d, rows, 1.0f, probabilities, ld, d_cross + r0 * d, d, 1.0f, dv + j0 * d, d);
        ops::gemm(false, true, rows, cols, d, 1.0f, d_cross + r0 * d, d, v + j0 * d, d, 0.0f, grads, ld);
        for (std::int64_t r = 0; r < rows; ++r) {
          const float* pr = probabilities + r * ld;
          float* gr = grads + r * ld;
          const float row_delta = delta[r0 + r];
          const Span span = visible(cross_range(p_, c_, r0 + r), j0, cols);
          const std::int64_t a = std::min(span.a, cols), b = std::max(span.b, a);
#pragma omp simd
          for (std::int64_t j = a; j < b; ++j) gr[j] = pr[j] * (gr[j] - row_delta);
          std::fill(gr, gr + a, 0.0f);
          std::fill(gr + b, gr + cols, 0.0f);
          flops += 2 * (b - a);
        }
        ops::gemm(false, false, rows, d, cols, scale, grads, ld, k + j0 * d, d, 1.0f, d_queries + r0 * d, d);
        ops::gemm(true, false, cols, d, rows, scale, grads, ld, qc + r0 * d, d, 1.0f, dk + j0 * d, d);
      }
    }
    return flops;
  }

  // One decode step of one head: the token's cross-attention over the cached inputs, its latent
  // keys and values into the latent ring, its latent query over the last `latents` positions. On
  // T = bf16 tensors and caches: the query widened, the products and P in fp32 (storage only), the
  // latent key and value rounded into the ring, the output rounded.
  template <class T>
  std::int64_t step_head(std::int64_t head, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t d = p_.head_dim, position = length_, h = head % p_.heads;
    float* buffers = step_.data() + head * kStepRows * d;
    float *query = buffers, *acc = buffers + d, *cross = buffers + 2 * d, *lq = buffers + 3 * d;
    float *lk = buffers + 4 * d, *lv = buffers + 5 * d, *latent_query = buffers + 6 * d, *latent_acc = buffers + 7 * d;
    const std::int64_t cross_cap = cross_cache_.capacity(), latent_cap = latent_cache_.capacity();
    cross_cache_.store(head, position % cross_cap, elements<T>(k) + head * d, elements<T>(v) + head * d, 1);
    const std::int64_t first = c_.cross_window > 0 ? std::max<std::int64_t>(0, position - c_.cross_window + 1) : 0;
    RowSoftmax row = begin_row(acc, d);
    row.fp32_probabilities = true;
    std::int64_t flops = scale_query(elements<T>(q) + head * d, d, query);
    flops += attend_ring(row, query, cross_cache_.keys<T>(head), cross_cache_.values<T>(head), cross_cap, first,
                         position - first + 1);
    flops += finish_row(row, cross);
    float* projected[3] = {lq, lk, lv};
    for (std::int64_t which = 0; which < 3; ++which) {
      const float* w = projection(h, which);
      float* y = projected[which];
      std::fill_n(y, d, 0.0f);
      for (std::int64_t e = 0; e < d; ++e) {
        const float x = cross[e];
#pragma omp simd
        for (std::int64_t f = 0; f < d; ++f) y[f] += x * w[e * d + f];
      }
    }
    flops += 3 * matmul_flops(1, d, d);
    store_latents<T>(head, position, lk, lv, 1);
    const std::int64_t count = std::min(c_.latents, position + 1);
    RowSoftmax latent = begin_row(latent_acc, d);
    latent.fp32_probabilities = true;
    flops += scale_query(lq, d, latent_query);
    flops += attend_ring(latent, latent_query, latent_cache_.keys<T>(head), latent_cache_.values<T>(head), latent_cap,
                         position - count + 1, count);
    return flops + finish_row(latent, elements<T>(out) + head * d);
  }

  Problem p_;
  PerceiverConfig c_;
  std::uint64_t seed_;
  std::int64_t m_;  // latent rows, min(latents, N)
  Tensor latents_, projections_;
  // Per thread: C, the rows' running max and sum, a cross score tile, [Lq; Lk; Lv], latent scores.
  Tensor cross_out_, stats_, tile_, latent_rows_, latent_scores_;
  // Backward (prepare_backward): saved C and log-sum-exp, parameter gradients, per thread dC,
  // [dLq; dLk; dLv], latent score gradients, a cross gradient tile, the rows' dC·C.
  Tensor saved_cross_, saved_lse_, d_latents_, d_projections_;
  Tensor cross_grads_, latent_grads_, latent_score_grads_, tile_grads_, deltas_;
  // bf16: per thread bf16_forward_floats and bf16_backward_floats of fp32 rows.
  Tensor widened_, widened_grads_;
  // Decode (prepare_decode): the cross keys and values, the latent ring, the step's buffers.
  KvCache cross_cache_, latent_cache_;
  Tensor step_;
  std::int64_t length_ = 0;
};

// Σ over rows of (D per key tile of the row's block that meets its range + 4 per visible key),
// the online softmax's FLOPs outside the products, and the products' tile FLOPs (2·rows·cols·D
// per product, `products` of them per tile).
struct CrossCounts {
  std::int64_t tile_flops = 0, row_flops = 0, visible = 0;
};
CrossCounts cross_counts(const Problem& p, const PerceiverConfig& c, std::int64_t products) {
  const std::int64_t m = latent_rows(p, c), d = p.head_dim;
  CrossCounts counts;
  for (std::int64_t r0 = 0; r0 < m; r0 += c.block_rows) {
    const std::int64_t rows = std::min(c.block_rows, m - r0);
    const KeyRange keys = block_range(p, c, r0, rows);
    for (std::int64_t j0 = keys.first; j0 <= keys.last; j0 += c.block_keys) {
      const std::int64_t cols = std::min(c.block_keys, keys.last + 1 - j0);
      counts.tile_flops += products * matmul_flops(rows, cols, d);
    }
    for (std::int64_t i = r0; i < r0 + rows; ++i) {
      const KeyRange range = cross_range(p, c, i);
      const std::int64_t first_tile = (range.first - keys.first) / c.block_keys;
      const std::int64_t last_tile = (range.last - keys.first) / c.block_keys;
      counts.row_flops += (last_tile - first_tile + 1) * d;
      counts.visible += range.last - range.first + 1;
    }
  }
  return counts;
}

std::int64_t latent_products(const Problem& p, std::int64_t m) {
  const std::int64_t d = p.head_dim;
  return 3 * matmul_flops(m, d, d) + 2 * matmul_flops(m, m, d);
}

std::int64_t latent_valid_total(const Problem& p, std::int64_t m) { return p.causal ? m * (m + 1) / 2 : m * m; }

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const PerceiverConfig& c, std::uint64_t seed) {
  return std::make_unique<Perceiver>(problem, c, seed);
}

std::int64_t output_rows(const Problem& p, const PerceiverConfig& c) { return latent_rows(p, c); }

std::int64_t flops(const Problem& p, const PerceiverConfig& c) {
  const std::int64_t m = latent_rows(p, c), d = p.head_dim;
  const CrossCounts cross = cross_counts(p, c, 2);
  const std::int64_t per_head = cross.tile_flops + cross.row_flops + kOnlineSoftmaxFlopsPerElement * cross.visible +
                                m * d + latent_products(p, m) + latent_softmax_flops(p, m);
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const PerceiverConfig& c) {
  const std::int64_t h = p.heads, d = p.head_dim, m = latent_rows(p, c);
  const std::int64_t parameters = (p.causal ? 0 : h * m * d) + h * 3 * d * d;
  const std::int64_t per_thread = m * d + 2 * m + tile_rows(p, c) * ops::padded_ld(tile_cols(p, c)) + 3 * m * d +
                                  m * ops::padded_ld(m) + (p.dtype == DType::BF16 ? bf16_forward_floats(p, c) : 0);
  return (parameters + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_flops(const Problem& p, const PerceiverConfig& c) {
  const std::int64_t m = latent_rows(p, c), d = p.head_dim;
  const CrossCounts cross = cross_counts(p, c, 5);
  // Recomputed projections and scores; dLv, dP, dLq, dLk; dW and dC of each projection.
  const std::int64_t latent = 3 * matmul_flops(m, d, d) + 5 * matmul_flops(m, m, d) + 6 * matmul_flops(d, d, m) +
                              latent_softmax_flops(p, m) + kSoftmaxBackwardFlopsPerElement * latent_valid_total(p, m);
  const std::int64_t per_head =
      latent + 2 * m * d + cross.tile_flops + kRecomputedSoftmaxBackwardFlopsPerElement * cross.visible;
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const PerceiverConfig& c) {
  const std::int64_t h = p.heads, d = p.head_dim, m = latent_rows(p, c), bh = p.batch * h;
  const std::int64_t saved = bh * m * d + bh * m;
  const std::int64_t gradients = (p.causal ? 0 : h * m * d) + h * 3 * d * d;
  const std::int64_t per_thread = m * d + 3 * m * d + m * ops::padded_ld(m) +
                                  tile_rows(p, c) * ops::padded_ld(tile_cols(p, c)) + m +
                                  (p.dtype == DType::BF16 ? bf16_backward_floats(p, c) : 0);
  return (saved + gradients + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t decode_workspace(const Problem& p, const PerceiverConfig& c, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim;
  return KvCache::bytes(heads, Perceiver::cross_capacity(p, c, tokens), d, p.dtype) +
         KvCache::bytes(heads, Perceiver::latent_capacity(p, c, tokens), d, p.dtype) +
         heads * kStepRows * d * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<PerceiverConfig> config_fields(const PerceiverConfig*) {
  return {int_field("latents", &PerceiverConfig::latents, 1, 1 << 16,
                    "M, latent rows per head (clamped to N); causal: the last M positions"),
          int_field("cross_window", &PerceiverConfig::cross_window, 0, 1 << 24,
                    "causal: inputs each latent cross-attends to, tokens (0 = every earlier input); non-causal: "
                    "unused, recorded as 0"),
          int_field("block_rows", &PerceiverConfig::block_rows, 1, 1 << 16,
                    "latent rows per cross-attention tile (implementation)"),
          int_field("block_keys", &PerceiverConfig::block_keys, 1, 1 << 16,
                    "input keys per cross-attention tile, tokens (implementation)")};
}

// latents is kept as given (the decoder's window grows to it); M = min(latents, N) is output_rows.
// cross_window applies to the causal form only: 0 otherwise, as the manifest records.
PerceiverConfig resolve(const Problem& p, PerceiverConfig c) {
  if (!p.causal) c.cross_window = 0;
  return c;
}

template <>
Implementation implementation<PerceiverConfig>() {
  Implementation impl = implement<PerceiverConfig>();
  impl.bf16_forward = true;  // storage only (perceiver.hpp): forward, decode and backward
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
