#include "taxonomy/memory/set_transformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"

namespace xfb {
namespace {

constexpr float kLayerNormEps = 1e-5f;
// Non-product FLOPs per row element of one MAB after its attention: residual + LN, rFF bias +
// ReLU, residual + LN.
constexpr std::int64_t kMabTailFlopsPerElement = (1 + kLayerNormFlopsPerElement) + 2 + (1 + kLayerNormFlopsPerElement);

// Rows of a query block that the tiles actually hold.
std::int64_t block_rows(const Problem& p, const SetTransformerConfig& c) { return std::min(c.block_q, p.seq_len); }

// In-place softmax of one row of n values (n >= 1).
void softmax_row(float* row, std::int64_t n) {
  const float inverse = 1.0f / ops::exp_and_sum(row, n, ops::row_max(row, n, row[0]));
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) row[j] *= inverse;
}

// dst = LN(a + b) over each of `rows` rows of d features; dst may alias a or b.
void add_and_norm(const float* a, const float* b, float* dst, std::int64_t rows, std::int64_t d, const float* gain,
                  const float* shift) {
  const float inverse_d = 1.0f / static_cast<float>(d);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* y = dst + r * d;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t j = 0; j < d; ++j) {
      y[j] = a[r * d + j] + b[r * d + j];
      sum += y[j];
    }
    const float mean = sum * inverse_d;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (std::int64_t j = 0; j < d; ++j) squares += (y[j] - mean) * (y[j] - mean);
    const float inverse_std = 1.0f / std::sqrt(squares * inverse_d + kLayerNormEps);
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) y[j] = (y[j] - mean) * inverse_std * gain[j] + shift[j];
  }
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
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t bh_count = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    const std::int64_t blocks = (n + c_.block_q - 1) / c_.block_q;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t bh = 0; bh < bh_count; ++bh)
        flops += summarise(bh, k.data() + bh * n * d, v.data() + bh * n * d, thread);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < bh_count * blocks; ++task) {
        const std::int64_t bh = task / blocks, offset = bh * n * d + task % blocks * c_.block_q * d;
        flops += read_out(bh, task % blocks * c_.block_q, q.data() + offset, out.data() + offset, thread);
      }
    }
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> parameters() const override {
    return {{"inducing_points", &inducing_}, {"kv_projections", &projections_}, {"ff_weights", &ff_weights_},
            {"ff_biases", &ff_biases_},      {"ln_gains", &ln_gains_},          {"ln_shifts", &ln_shifts_}};
  }

 private:
  std::int64_t head_offset(std::int64_t index, std::int64_t head) const {
    return (index * p_.heads + head) * p_.head_dim;
  }

  // MAB 1 for one (batch, head): writes S, S·Wk, S·Wv into summaries_[0..2][bh]. Returns non-gemm FLOPs.
  std::int64_t summarise(std::int64_t bh, const float* k, const float* v, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, m = c_.inducing_points, head = bh % p_.heads;
    const std::int64_t ld = summary_scores_.dim(2);
    float* scores = summary_scores_.data() + thread * m * ld;
    const float* inducing = inducing_.data() + head * m * d;
    float* summary = summaries_.data() + bh * m * d;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, m, n, d, scale, inducing, d, k, d, 0.0f, scores, ld);
    for (std::int64_t r = 0; r < m; ++r) softmax_row(scores + r * ld, n);
    ops::gemm(false, false, m, d, n, 1.0f, scores, ld, v, d, 0.0f, summary, d);
    mab_tail(inducing, summary, m, head, 0, thread);
    const std::int64_t stride = summaries_.dim(1) * m * d;
    const float* projections = projections_.data() + head * d * d;
    ops::gemm(false, false, m, d, d, 1.0f, summary, d, projections, d, 0.0f, summary + stride, d);
    ops::gemm(false, false, m, d, d, 1.0f, summary, d, projections + p_.heads * d * d, d, 0.0f, summary + 2 * stride,
              d);
    return kSoftmaxFlopsPerElement * m * n + kMabTailFlopsPerElement * m * d;
  }

  // MAB 2 for rows [r0, r0 + block) of one (batch, head); q and out point at row r0.
  std::int64_t read_out(std::int64_t bh, std::int64_t r0, const float* q, float* out, int thread) {
    const std::int64_t d = p_.head_dim, m = c_.inducing_points, head = bh % p_.heads;
    const std::int64_t rows = std::min(c_.block_q, p_.seq_len - r0), ld = query_scores_.dim(2);
    float* scores = query_scores_.data() + thread * query_scores_.dim(1) * ld;
    const std::int64_t stride = summaries_.dim(1) * m * d;
    const float* keys = summaries_.data() + stride + bh * m * d;
    const float* values = keys + stride;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, rows, m, d, scale, q, d, keys, d, 0.0f, scores, ld);
    for (std::int64_t r = 0; r < rows; ++r) softmax_row(scores + r * ld, m);
    ops::gemm(false, false, rows, d, m, 1.0f, scores, ld, values, d, 0.0f, out, d);
    mab_tail(q, out, rows, head, 1, thread);
    return kSoftmaxFlopsPerElement * rows * m + kMabTailFlopsPerElement * rows * d;
  }

  // x = LN(H + rFF(H)) with H = LN(residual + x), for MAB `mab` (0 or 1) of `head`.
  void mab_tail(const float* residual, float* x, std::int64_t rows, std::int64_t head, std::int64_t mab, int thread) {
    const std::int64_t d = p_.head_dim;
    float* ff = hidden_.data() + thread * hidden_.dim(1) * d;
    const float* gains = ln_gains_.data();
    const float* shifts = ln_shifts_.data();
    add_and_norm(residual, x, x, rows, d, gains + head_offset(2 * mab, head), shifts + head_offset(2 * mab, head));
    ops::gemm(false, false, rows, d, d, 1.0f, x, d, ff_weights_.data() + (mab * p_.heads + head) * d * d, d, 0.0f, ff,
              d);
    const float* bias = ff_biases_.data() + head_offset(mab, head);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = ff + r * d;
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) row[j] = std::max(row[j] + bias[j], 0.0f);
    }
    add_and_norm(x, ff, x, rows, d, gains + head_offset(2 * mab + 1, head), shifts + head_offset(2 * mab + 1, head));
  }

  Problem p_;
  SetTransformerConfig c_;
  std::uint64_t seed_;
  Tensor inducing_, projections_, ff_weights_, ff_biases_, ln_gains_, ln_shifts_;
  Tensor summaries_, summary_scores_, query_scores_, hidden_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const SetTransformerConfig& c, std::uint64_t seed) {
  return std::make_unique<SetTransformer>(problem, c, seed);
}

std::int64_t mab_tail_flops(std::int64_t rows, std::int64_t d) {
  return matmul_flops(rows, d, d) + kMabTailFlopsPerElement * rows * d;
}

std::int64_t set_transformer_flops(const Problem& p, const SetTransformerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = c.inducing_points;
  const std::int64_t mab1 = matmul_flops(m, n, d) + matmul_flops(m, d, n) + kSoftmaxFlopsPerElement * m * n +
                            mab_tail_flops(m, d) + 2 * matmul_flops(m, d, d);
  const std::int64_t mab2 = matmul_flops(n, m, d) + matmul_flops(n, d, m) + kSoftmaxFlopsPerElement * n * m +
                            mab_tail_flops(n, d);
  return p.batch * p.heads * (mab1 + mab2);
}

std::int64_t workspace(const Problem& p, const SetTransformerConfig& c) {
  const std::int64_t h = p.heads, d = p.head_dim, m = c.inducing_points, rows = block_rows(p, c);
  const std::int64_t threads = p.threads;
  const std::int64_t parameters = h * m * d + 4 * h * d * d + 2 * h * d + 8 * h * d;
  const std::int64_t summaries = 3 * p.batch * h * m * d;
  const std::int64_t per_thread = m * ops::padded_ld(p.seq_len) + rows * ops::padded_ld(m) + std::max(rows, m) * d;
  return (parameters + summaries + threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace

Implementation set_transformer_implementation() {
  return implement(ModelSpec<SetTransformerConfig>{
      .fields = {int_field("inducing_points", &SetTransformerConfig::inducing_points, 1, 4096,
                           "m, learned inducing points per head"),
                 int_field("block_q", &SetTransformerConfig::block_q, 1, 65536,
                           "query rows per task in the second MAB (tokens)")},
      .create = create,
      .flops = set_transformer_flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, SetTransformerConfig c) {
        c.block_q = block_rows(p, c);
        return c;
      }});
}

}  // namespace xfb
