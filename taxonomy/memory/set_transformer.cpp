#include "taxonomy/memory/set_transformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {
namespace {

constexpr float kLayerNormEps = 1e-5f;
// Non-product FLOPs per row element of one MAB after its attention: residual + LN, rFF bias +
// ReLU, residual + LN.
constexpr std::int64_t kMabTailFlopsPerElement = (1 + kLayerNormFlopsPerElement) + 2 + (1 + kLayerNormFlopsPerElement);

// Rows of a query block that the tiles actually hold.
std::int64_t block_rows(const Problem& p, const SetTransformerConfig& c) { return std::min(c.block_q, p.seq_len); }

// Keys of K or V the bf16 form widens at a time in the first MAB.
std::int64_t widening_rows(const Problem& p) { return std::min<std::int64_t>(256, p.seq_len); }

// The bf16 form's fp32 floats per thread: a widened chunk of K or V, a query block's rows and its
// output rows.
std::int64_t bf16_thread_floats(const Problem& p, const SetTransformerConfig& c) {
  return (widening_rows(p) + 2 * block_rows(p, c)) * p.head_dim;
}

// dst = LN(a + b); dst may alias a or b. With `sum`, a + b is also kept there (the backward's LN input).
void add_and_norm(const float* a, const float* b, float* dst, std::int64_t rows, std::int64_t d, const float* gain,
                  const float* shift, float* sum = nullptr) {
  for (std::int64_t e = 0; e < rows * d; ++e) dst[e] = a[e] + b[e];
  if (sum != nullptr) std::copy(dst, dst + rows * d, sum);
  ops::layer_norm_rows(dst, dst, rows, d, gain, shift, kLayerNormEps);
}

// dst[e] += src[e] over n values.
void accumulate(float* dst, const float* src, std::int64_t n) {
#pragma omp simd
  for (std::int64_t e = 0; e < n; ++e) dst[e] += src[e];
}

class SetTransformer final : public Mechanism {
 public:
  SetTransformer(const Problem& problem, const SetTransformerConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, d = p_.head_dim, m = c_.inducing_points;
    const float weight_std = 1.0f / std::sqrt(static_cast<float>(d));
    inducing_ = Tensor(Shape{h, m, d});
    projections_ = Tensor(Shape{2, h, d, d});
    ff_weights_ = Tensor(Shape{2, h, d, d});
    ff_biases_ = Tensor(Shape{2, h, d});
    ln_gains_ = Tensor(Shape{4, h, d});
    ln_shifts_ = Tensor(Shape{4, h, d});
    CounterRng(seed_, "set-transformer/inducing_points").fill_normal(inducing_);
    CounterRng(seed_, "set-transformer/kv_projections").fill_normal(projections_, 0.0f, weight_std);
    CounterRng(seed_, "set-transformer/ff_weights").fill_normal(ff_weights_, 0.0f, weight_std);
    CounterRng(seed_, "set-transformer/ff_biases").fill_normal(ff_biases_, 0.0f, 0.1f);
    CounterRng(seed_, "set-transformer/ln_gains").fill_normal(ln_gains_, 1.0f, 0.1f);
    CounterRng(seed_, "set-transformer/ln_shifts").fill_normal(ln_shifts_, 0.0f, 0.1f);

    const std::int64_t bh = p_.batch * h, threads = p_.threads, rows = block_rows(p_, c_);
    summaries_ = Tensor(Shape{3, bh, m, d});
    summary_scores_ = Tensor(Shape{threads, m, ops::padded_ld(p_.seq_len)});
    query_scores_ = Tensor(Shape{threads, rows, ops::padded_ld(m)});
    hidden_ = Tensor(Shape{threads, std::max(rows, m), d});
    if (p_.dtype == DType::BF16) widened_ = Tensor(Shape{threads, bf16_thread_floats(p_, c_)});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (p_.dtype == DType::BF16) return forward_rows<bf16>(q, k, v, out);
    forward_rows<float>(q, k, v, out);
  }

  std::vector<NamedTensor> parameters() const override {
    return {{"inducing_points", &inducing_}, {"kv_projections", &projections_}, {"ff_weights", &ff_weights_},
            {"ff_biases", &ff_biases_},      {"ln_gains", &ln_gains_},          {"ln_shifts", &ln_shifts_}};
  }

  void prepare_backward() override {
    const std::int64_t h = p_.heads, d = p_.head_dim, m = c_.inducing_points, bh = p_.batch * h;
    const std::int64_t threads = p_.threads, rows = std::max(block_rows(p_, c_), m);
    saved_summary_ = Tensor(Shape{2, bh, m, d});
    saved_rows_ = Tensor(Shape{2, bh, p_.seq_len, d});
    d_inducing_ = Tensor(inducing_.shape());
    d_projections_ = Tensor(projections_.shape());
    d_ff_weights_ = Tensor(ff_weights_.shape());
    d_ff_biases_ = Tensor(ff_biases_.shape());
    d_ln_gains_ = Tensor(ln_gains_.shape());
    d_ln_shifts_ = Tensor(ln_shifts_.shape());
    row_grads_ = Tensor(Shape{threads, kRowBuffers, rows, d});
    query_score_grads_ = Tensor(Shape{threads, query_scores_.dim(1), query_scores_.dim(2)});
    summary_score_grads_ = Tensor(Shape{threads, m, summary_scores_.dim(2)});
    summary_grads_ = Tensor(Shape{threads, 3, m, d});
    if (p_.dtype == DType::BF16) widened_gradients_ = Tensor(Shape{threads, 7, p_.seq_len, d});
    norm_grads_ = Tensor(Shape{threads, 2, d});
  }

  std::vector<NamedTensor> saved() const override {
    return {{"mab_sums_and_ffs", &saved_summary_}, {"set_sums_and_ffs", &saved_rows_}, {"summaries", &summaries_}};
  }

  std::vector<NamedTensor> parameter_gradients() const override {
    return {{"dinducing_points", &d_inducing_}, {"dkv_projections", &d_projections_}, {"dff_weights", &d_ff_weights_},
            {"dff_biases", &d_ff_biases_},      {"dln_gains", &d_ln_gains_},          {"dln_shifts", &d_ln_shifts_}};
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < p_.heads; ++head) {
      const int thread = omp_get_thread_num();
      zero_head_gradients(head);
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t bh = b * p_.heads + head, size = p_.seq_len * p_.head_dim, at = bh * size;
        if (p_.dtype != DType::BF16) {
          flops += read_out_backward(bh, q.data() + at, dout.data() + at, dq.data() + at, thread);
          flops += summarise_backward(bh, k.data() + at, v.data() + at, dk.data() + at, dv.data() + at, thread);
          continue;
        }
        // bf16 (storage only): q, dO, k, v widened, the fp32 backward into fp32 dQ, dK, dV, each rounded once.
        float* rows = widened_gradients_.data() + thread * 7 * size;
        const Tensor* inputs[4] = {&q, &dout, &k, &v};
        widen_spans(inputs, at, size, rows, size);
        flops += read_out_backward(bh, rows, rows + size, rows + 4 * size, thread);
        flops += summarise_backward(bh, rows + 2 * size, rows + 3 * size, rows + 5 * size, rows + 6 * size, thread);
        Tensor* grads[3] = {&dq, &dk, &dv};
        narrow_spans(rows + 4 * size, size, grads, at, size);
      }
    }
    FlopCounter::add(flops);
  }

 private:
  std::int64_t head_offset(std::int64_t index, std::int64_t head) const {
    return (index * p_.heads + head) * p_.head_dim;
  }

  // T = float, or bf16 (the bf16 form: q, k, v and out bf16, everything else as in fp32; header).
  template <class T>
  void forward_rows(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t bh_count = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    const std::int64_t blocks = (n + c_.block_q - 1) / c_.block_q;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t bh = 0; bh < bh_count; ++bh)
        flops += summarise(bh, elements<T>(k) + bh * n * d, elements<T>(v) + bh * n * d, thread);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < bh_count * blocks; ++task) {
        const std::int64_t bh = task / blocks, offset = bh * n * d + task % blocks * c_.block_q * d;
        flops += read_out(bh, task % blocks * c_.block_q, elements<T>(q) + offset, elements<T>(out) + offset, thread);
      }
    }
    FlopCounter::add(flops);
  }

  // The bf16 form's per-thread fp32 rows: a widened chunk of K or V, a block's q and its output.
  float* widened_chunk(int thread) { return widened_.data() + thread * widened_.dim(1); }
  float* widened_queries(int thread) { return widened_chunk(thread) + widening_rows(p_) * p_.head_dim; }
  float* output_rows(int thread) { return widened_queries(thread) + block_rows(p_, c_) * p_.head_dim; }

  // MAB 1 for one (batch, head): writes S, S·Wk, S·Wv into summaries_[0..2][bh]. Returns non-gemm
  // FLOPs. k, v [N, D]: fp32 in one product each, or bf16 widened widening_rows keys at a time.
  template <class T>
  std::int64_t summarise(std::int64_t bh, const T* k, const T* v, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, m = c_.inducing_points, head = bh % p_.heads;
    const std::int64_t ld = summary_scores_.dim(2), chunk = std::is_same_v<T, float> ? n : widening_rows(p_);
    float* scores = summary_scores_.data() + thread * m * ld;
    const float* inducing = inducing_.data() + head * m * d;
    float* summary = summaries_.data() + bh * m * d;
    float* scratch = std::is_same_v<T, float> ? nullptr : widened_chunk(thread);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int64_t c0 = 0; c0 < n; c0 += chunk) {
      const std::int64_t cols = std::min(chunk, n - c0);
      ops::gemm(false, true, m, cols, d, scale, inducing, d, fp32_rows(k, c0, cols, d, scratch), d, 0.0f, scores + c0,
                ld);
    }
    for (std::int64_t r = 0; r < m; ++r) ops::softmax_in_place(scores + r * ld, n);
    for (std::int64_t c0 = 0; c0 < n; c0 += chunk) {
      const std::int64_t cols = std::min(chunk, n - c0);
      ops::gemm(false, false, m, d, cols, 1.0f, scores + c0, ld, fp32_rows(v, c0, cols, d, scratch), d,
                c0 > 0 ? 1.0f : 0.0f, summary, d);
    }
    mab_tail(inducing, summary, m, head, 0, thread, saved_pointer(saved_summary_, 0, bh * m * d),
             saved_pointer(saved_summary_, 1, bh * m * d));
    const std::int64_t stride = summaries_.dim(1) * m * d;
    const float* projections = projections_.data() + head * d * d;
    ops::gemm(false, false, m, d, d, 1.0f, summary, d, projections, d, 0.0f, summary + stride, d);
    ops::gemm(false, false, m, d, d, 1.0f, summary, d, projections + p_.heads * d * d, d, 0.0f, summary + 2 * stride,
              d);
    return kSoftmaxFlopsPerElement * m * n + kMabTailFlopsPerElement * m * d;
  }

  // MAB 2 for rows [r0, r0 + block) of one (batch, head); q and out point at row r0 (bf16: the
  // rows widened, the output computed in fp32 and rounded once).
  template <class T>
  std::int64_t read_out(std::int64_t bh, std::int64_t r0, const T* q_rows, T* out_rows, int thread) {
    const std::int64_t d = p_.head_dim, m = c_.inducing_points, head = bh % p_.heads;
    const std::int64_t rows = std::min(c_.block_q, p_.seq_len - r0), ld = query_scores_.dim(2);
    const bool widens = !std::is_same_v<T, float>;
    const float* q = fp32_rows(q_rows, 0, rows, d, widens ? widened_queries(thread) : nullptr);
    float* out = fp32_target(out_rows, 0, d, widens ? output_rows(thread) : nullptr);
    float* scores = query_scores_.data() + thread * query_scores_.dim(1) * ld;
    const std::int64_t stride = summaries_.dim(1) * m * d;
    const float* keys = summaries_.data() + stride + bh * m * d;
    const float* values = keys + stride;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, rows, m, d, scale, q, d, keys, d, 0.0f, scores, ld);
    for (std::int64_t r = 0; r < rows; ++r) ops::softmax_in_place(scores + r * ld, m);
    ops::gemm(false, false, rows, d, m, 1.0f, scores, ld, values, d, 0.0f, out, d);
    const std::int64_t saved_at = (bh * p_.seq_len + r0) * d;
    mab_tail(q, out, rows, head, 1, thread, saved_pointer(saved_rows_, 0, saved_at),
             saved_pointer(saved_rows_, 1, saved_at));
    store_rows(out, out_rows, 0, rows, d);
    return kSoftmaxFlopsPerElement * rows * m + kMabTailFlopsPerElement * rows * d;
  }

  // Where the forward keeps the backward's inputs: part `part` of `saved` at `offset`, or nullptr
  // before prepare_backward.
  float* saved_pointer(Tensor& saved, std::int64_t part, std::int64_t offset) {
    return saved.empty() ? nullptr : saved.data() + part * saved.dim(1) * saved.dim(2) * saved.dim(3) + offset;
  }

  // x = LN(H + rFF(H)) with H = LN(residual + x), for MAB `mab` (0 or 1) of `head`. With `sum` and
  // `relu`, also keeps residual + x and rFF(H) there (what the backward needs).
  void mab_tail(const float* residual, float* x, std::int64_t rows, std::int64_t head, std::int64_t mab, int thread,
                float* sum = nullptr, float* relu = nullptr) {
    const std::int64_t d = p_.head_dim;
    float* ff = hidden_.data() + thread * hidden_.dim(1) * d;
    const float* gains = ln_gains_.data();
    const float* shifts = ln_shifts_.data();
    add_and_norm(residual, x, x, rows, d, gains + head_offset(2 * mab, head), shifts + head_offset(2 * mab, head), sum);
    ops::gemm(false, false, rows, d, d, 1.0f, x, d, ff_weights_.data() + (mab * p_.heads + head) * d * d, d, 0.0f, ff,
              d);
    const float* bias = ff_biases_.data() + head_offset(mab, head);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = ff + r * d;
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) row[j] = std::max(row[j] + bias[j], 0.0f);
    }
    if (relu != nullptr) std::copy(ff, ff + rows * d, relu);
    add_and_norm(x, ff, x, rows, d, gains + head_offset(2 * mab + 1, head), shifts + head_offset(2 * mab + 1, head));
  }

  // Per thread row buffers of the backward: H recomputed, LN input of the second LN, its gradient,
  // the rFF pre-activation gradient, the first LN input's gradient, LN scratch.
  enum RowBuffer { kHidden, kSecondSum, kSecondSumGrad, kPreGrad, kFirstSumGrad, kNormalised, kRowBuffers };
  float* row_buffer(int thread, RowBuffer which) {
    return row_grads_.data() + (thread * kRowBuffers + which) * row_grads_.dim(2) * p_.head_dim;
  }

  void zero_head_gradients(std::int64_t head) {
    const std::int64_t h = p_.heads, d = p_.head_dim, m = c_.inducing_points;
    std::fill(d_inducing_.data() + head * m * d, d_inducing_.data() + (head + 1) * m * d, 0.0f);
    for (std::int64_t i = 0; i < 2; ++i) {
      std::fill(d_projections_.data() + (i * h + head) * d * d, d_projections_.data() + (i * h + head + 1) * d * d,
                0.0f);
      std::fill(d_ff_weights_.data() + (i * h + head) * d * d, d_ff_weights_.data() + (i * h + head + 1) * d * d, 0.0f);
      std::fill(d_ff_biases_.data() + head_offset(i, head), d_ff_biases_.data() + head_offset(i, head) + d, 0.0f);
    }
    for (std::int64_t i = 0; i < 4; ++i) {
      std::fill(d_ln_gains_.data() + head_offset(i, head), d_ln_gains_.data() + head_offset(i, head) + d, 0.0f);
      std::fill(d_ln_shifts_.data() + head_offset(i, head), d_ln_shifts_.data() + head_offset(i, head) + d, 0.0f);
    }
  }

  // LN index `ln` of `head`: dx += its backward at input x for output gradient dy; its gain and
  // shift gradients added to the head's. Returns the FLOPs ops::layer_norm_backward does not count.
  std::int64_t norm_backward(const float* x, const float* dy, float* dx, std::int64_t rows, std::int64_t ln,
                             std::int64_t head, int thread) {
    const std::int64_t d = p_.head_dim;
    float* gain_grad = norm_grads_.data() + thread * 2 * d;
    ops::layer_norm_backward(x, dy, rows, d, ln_gains_.data() + head_offset(ln, head), dx, gain_grad, gain_grad + d,
                             row_buffer(thread, kNormalised), kLayerNormEps);
    accumulate(d_ln_gains_.data() + head_offset(ln, head), gain_grad, d);
    accumulate(d_ln_shifts_.data() + head_offset(ln, head), gain_grad + d, d);
    return 2 * d;
  }

  // The backward of mab_tail: from d_out (the gradient of LN(H + rFF(H))) to d_sum (written: the
  // gradient of residual + x), from the saved sum and rFF(H); H is recomputed. Adds the rFF's and
  // both LNs' parameter gradients.
  std::int64_t tail_backward(const float* sum, const float* relu, const float* d_out, float* d_sum, std::int64_t rows,
                             std::int64_t head, std::int64_t mab, int thread) {
    const std::int64_t d = p_.head_dim, count = rows * d;
    float* hidden = row_buffer(thread, kHidden);
    float* second_sum = row_buffer(thread, kSecondSum);
    float* second_grad = row_buffer(thread, kSecondSumGrad);
    float* pre_grad = row_buffer(thread, kPreGrad);
    ops::layer_norm_rows(sum, hidden, rows, d, ln_gains_.data() + head_offset(2 * mab, head),
                         ln_shifts_.data() + head_offset(2 * mab, head), kLayerNormEps);
    for (std::int64_t e = 0; e < count; ++e) second_sum[e] = hidden[e] + relu[e];
    std::fill(second_grad, second_grad + count, 0.0f);
    std::int64_t flops = norm_backward(second_sum, d_out, second_grad, rows, 2 * mab + 1, head, thread);
    float* bias_grad = d_ff_biases_.data() + head_offset(mab, head);
    for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) pre_grad[r * d + j] = relu[r * d + j] > 0.0f ? second_grad[r * d + j] : 0.0f;
      accumulate(bias_grad, pre_grad + r * d, d);
    }
    const float* weights = ff_weights_.data() + (mab * p_.heads + head) * d * d;
    ops::gemm(true, false, d, d, rows, 1.0f, hidden, d, pre_grad, d, 1.0f,
              d_ff_weights_.data() + (mab * p_.heads + head) * d * d, d);
    ops::gemm(false, true, rows, d, d, 1.0f, pre_grad, d, weights, d, 1.0f, second_grad, d);  // dH
    std::fill(d_sum, d_sum + count, 0.0f);
    flops += norm_backward(sum, second_grad, d_sum, rows, 2 * mab, head, thread);
    return flops + (kLayerNormFlopsPerElement + 3) * count;
  }

  // MAB 2's backward for every query block of one (batch, head); dSk, dSv accumulate in the
  // thread's summary gradients (zeroed here).
  std::int64_t read_out_backward(std::int64_t bh, const float* q, const float* dout, float* dq, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, m = c_.inducing_points, head = bh % p_.heads;
    const std::int64_t ld = query_scores_.dim(2), stride = summaries_.dim(1) * m * d;
    const float* keys = summaries_.data() + stride + bh * m * d;
    const float* values = keys + stride;
    float* key_grads = summary_grads_.data() + thread * 3 * m * d;
    float* value_grads = key_grads + m * d;
    std::fill(key_grads, key_grads + 2 * m * d, 0.0f);
    float* scores = query_scores_.data() + thread * query_scores_.dim(1) * ld;
    float* score_grads = query_score_grads_.data() + thread * query_scores_.dim(1) * ld;
    float* sum_grad = row_buffer(thread, kFirstSumGrad);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::int64_t flops = 0;
    for (std::int64_t r0 = 0; r0 < n; r0 += c_.block_q) {
      const std::int64_t rows = std::min(c_.block_q, n - r0), at = r0 * d;
      const std::int64_t saved_at = (bh * n + r0) * d, part = saved_rows_.dim(1) * n * d;
      flops += tail_backward(saved_rows_.data() + saved_at, saved_rows_.data() + part + saved_at, dout + at, sum_grad,
                             rows, head, 1, thread);
      std::copy(sum_grad, sum_grad + rows * d, dq + at);  // the residual Q
      ops::gemm(false, true, rows, m, d, scale, q + at, d, keys, d, 0.0f, scores, ld);
      for (std::int64_t r = 0; r < rows; ++r) ops::softmax_in_place(scores + r * ld, m);
      ops::gemm(true, false, m, d, rows, 1.0f, scores, ld, sum_grad, d, 1.0f, value_grads, d);
      ops::gemm(false, true, rows, m, d, 1.0f, sum_grad, d, values, d, 0.0f, score_grads, ld);
      softmax_backward_rows(scores, score_grads, rows, m, ld);
      ops::gemm(false, false, rows, d, m, scale, score_grads, ld, keys, d, 1.0f, dq + at, d);
      ops::gemm(true, false, m, d, rows, scale, score_grads, ld, q + at, d, 1.0f, key_grads, d);
      flops += (kSoftmaxFlopsPerElement + kSoftmaxBackwardFlopsPerElement) * rows * m;
    }
    return flops;
  }

  // MAB 1's backward for one (batch, head), from the thread's dSk, dSv: through Wk, Wv, the tail,
  // the residual I and the inducing points' attention over K, V.
  std::int64_t summarise_backward(std::int64_t bh, const float* k, const float* v, float* dk, float* dv, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, m = c_.inducing_points, head = bh % p_.heads, h = p_.heads;
    const float* summary = summaries_.data() + bh * m * d;
    float* key_grads = summary_grads_.data() + thread * 3 * m * d;
    float* value_grads = key_grads + m * d;
    float* summary_grad = value_grads + m * d;
    const float* projections = projections_.data() + head * d * d;
    ops::gemm(false, true, m, d, d, 1.0f, key_grads, d, projections, d, 0.0f, summary_grad, d);
    ops::gemm(false, true, m, d, d, 1.0f, value_grads, d, projections + h * d * d, d, 1.0f, summary_grad, d);
    ops::gemm(true, false, d, d, m, 1.0f, summary, d, key_grads, d, 1.0f, d_projections_.data() + head * d * d, d);
    ops::gemm(true, false, d, d, m, 1.0f, summary, d, value_grads, d, 1.0f, d_projections_.data() + (h + head) * d * d,
              d);
    float* sum_grad = row_buffer(thread, kFirstSumGrad);
    const std::int64_t part = saved_summary_.dim(1) * m * d;
    std::int64_t flops = tail_backward(saved_summary_.data() + bh * m * d, saved_summary_.data() + part + bh * m * d,
                                       summary_grad, sum_grad, m, head, 0, thread);
    float* inducing_grad = d_inducing_.data() + head * m * d;
    accumulate(inducing_grad, sum_grad, m * d);  // the residual I
    const std::int64_t ld = summary_scores_.dim(2);
    float* scores = summary_scores_.data() + thread * m * ld;
    float* score_grads = summary_score_grads_.data() + thread * m * ld;
    const float* inducing = inducing_.data() + head * m * d;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, m, n, d, scale, inducing, d, k, d, 0.0f, scores, ld);
    for (std::int64_t r = 0; r < m; ++r) ops::softmax_in_place(scores + r * ld, n);
    ops::gemm(true, false, n, d, m, 1.0f, scores, ld, sum_grad, d, 0.0f, dv, d);
    ops::gemm(false, true, m, n, d, 1.0f, sum_grad, d, v, d, 0.0f, score_grads, ld);
    softmax_backward_rows(scores, score_grads, m, n, ld);
    ops::gemm(false, false, m, d, n, scale, score_grads, ld, k, d, 1.0f, inducing_grad, d);
    ops::gemm(true, false, n, d, m, scale, score_grads, ld, inducing, d, 0.0f, dk, d);
    return flops + m * d + (kSoftmaxFlopsPerElement + kSoftmaxBackwardFlopsPerElement) * m * n;
  }

  Problem p_;
  SetTransformerConfig c_;
  std::uint64_t seed_;
  Tensor inducing_, projections_, ff_weights_, ff_biases_, ln_gains_, ln_shifts_;
  Tensor summaries_, summary_scores_, query_scores_, hidden_;
  Tensor widened_;            // bf16 form: per thread fp32 rows (bf16_thread_floats)
  Tensor widened_gradients_;  // bf16 training: per thread a head's q, dO, k, v, dQ, dK, dV in fp32 [7, N, D]
  // Backward (prepare_backward): saved LN inputs and rFF outputs ([2, B·H, m, D] of MAB 1,
  // [2, B·H, N, D] of MAB 2), the parameter gradients, per thread buffers.
  Tensor saved_summary_, saved_rows_;
  Tensor d_inducing_, d_projections_, d_ff_weights_, d_ff_biases_, d_ln_gains_, d_ln_shifts_;
  Tensor row_grads_, query_score_grads_, summary_score_grads_, summary_grads_, norm_grads_;
};

std::int64_t mab_tail_flops(std::int64_t rows, std::int64_t d) {
  return matmul_flops(rows, d, d) + kMabTailFlopsPerElement * rows * d;
}

// FLOPs of tail_backward over `rows` rows: the LN recompute, the second LN's input, the ReLU mask
// and the bias gradient per element; two LN backwards (with their gain and shift sums); dW, dH.
std::int64_t tail_backward_flops(std::int64_t rows, std::int64_t d) {
  return (kLayerNormFlopsPerElement + 3 + 2 * kLayerNormBackwardFlopsPerElement) * rows * d + 4 * d +
         2 * matmul_flops(rows, d, d);
}

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const SetTransformerConfig& c, std::uint64_t seed) {
  return std::make_unique<SetTransformer>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const SetTransformerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = c.inducing_points;
  const std::int64_t mab1 = matmul_flops(m, n, d) + matmul_flops(m, d, n) + kSoftmaxFlopsPerElement * m * n +
                            mab_tail_flops(m, d) + 2 * matmul_flops(m, d, d);
  const std::int64_t mab2 =
      matmul_flops(n, m, d) + matmul_flops(n, d, m) + kSoftmaxFlopsPerElement * n * m + mab_tail_flops(n, d);
  return p.batch * p.heads * (mab1 + mab2);
}

std::int64_t workspace(const Problem& p, const SetTransformerConfig& c) {
  const std::int64_t h = p.heads, d = p.head_dim, m = c.inducing_points, rows = block_rows(p, c);
  const std::int64_t threads = p.threads;
  const std::int64_t parameters = h * m * d + 4 * h * d * d + 2 * h * d + 8 * h * d;
  const std::int64_t summaries = 3 * p.batch * h * m * d;
  const std::int64_t per_thread = m * ops::padded_ld(p.seq_len) + rows * ops::padded_ld(m) + std::max(rows, m) * d;
  const std::int64_t bf16_rows = p.dtype == DType::BF16 ? threads * bf16_thread_floats(p, c) : 0;
  return (parameters + summaries + threads * per_thread + bf16_rows) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_flops(const Problem& p, const SetTransformerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = c.inducing_points, block = block_rows(p, c);
  const std::int64_t softmax = kSoftmaxFlopsPerElement + kSoftmaxBackwardFlopsPerElement;
  std::int64_t mab2 = 0;
  for (std::int64_t r0 = 0; r0 < n; r0 += block) {
    const std::int64_t rows = std::min(block, n - r0);
    mab2 += tail_backward_flops(rows, d) + 5 * matmul_flops(rows, m, d) + softmax * rows * m;
  }
  const std::int64_t mab1 =
      4 * matmul_flops(m, d, d) + tail_backward_flops(m, d) + m * d + 5 * matmul_flops(m, n, d) + softmax * m * n;
  return p.batch * p.heads * (mab1 + mab2);
}

std::int64_t backward_workspace(const Problem& p, const SetTransformerConfig& c) {
  const std::int64_t h = p.heads, d = p.head_dim, m = c.inducing_points, rows = block_rows(p, c), bh = p.batch * h;
  const std::int64_t saved = 2 * bh * m * d + 2 * bh * p.seq_len * d;
  const std::int64_t gradients = h * m * d + 4 * h * d * d + 2 * h * d + 8 * h * d;
  const std::int64_t per_thread =
      6 * std::max(rows, m) * d + rows * ops::padded_ld(m) + m * ops::padded_ld(p.seq_len) + 3 * m * d + 2 * d;
  const std::int64_t widened = p.dtype == DType::BF16 ? 7 * p.seq_len * d : 0;  // widened_gradients_
  return (saved + gradients + p.threads * (per_thread + widened)) * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<SetTransformerConfig> config_fields(const SetTransformerConfig*) {
  return {int_field("inducing_points", &SetTransformerConfig::inducing_points, 1, 4096,
                    "m, learned inducing points per head"),
          int_field("block_q", &SetTransformerConfig::block_q, 1, 65536,
                    "query rows per task in the second MAB (tokens, clamped to N)")};
}

SetTransformerConfig resolve(const Problem& p, SetTransformerConfig c) {
  c.block_q = block_rows(p, c);
  return c;
}

template <>
Implementation implementation<SetTransformerConfig>() {
  Implementation impl = implement<SetTransformerConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
