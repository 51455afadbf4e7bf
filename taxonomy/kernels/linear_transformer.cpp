#include "taxonomy/kernels/linear_transformer.hpp"


#include "lib/core/config_table.hpp"
#include "lib/core/ops.hpp"
#include "taxonomy/engines/linear_attention.hpp"

namespace xfb {
namespace {

inline constexpr std::int64_t kEluPlusOneFlops = 4;

class EluFeatures final : public FeatureMap {
 public:
  explicit EluFeatures(std::int64_t d) : d_(d) {}
  std::int64_t dim() const override { return d_; }
  bool shifts() const override { return false; }

  std::int64_t queries(const float* x, std::int64_t rows, float* phi, std::int64_t ld) const override {
    return apply(x, rows, phi, ld);
  }
  std::int64_t keys(const float* x, std::int64_t rows, float* phi, std::int64_t ld, float&) const override {
    return apply(x, rows, phi, ld);
  }

 private:
  std::int64_t apply(const float* input, std::int64_t rows, float* phi, std::int64_t ld) const {
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* src = input + r * d_;
      float* dst = phi + r * ld;
#pragma omp simd
      for (std::int64_t c = 0; c < d_; ++c) {
        const float x = src[c];
        dst[c] = ops::fast_exp(x < 0.0f ? x : 0.0f) + (x > 0.0f ? x : 0.0f);
      }
    }
    return rows * d_ * kEluPlusOneFlops;
  }

  std::int64_t d_;
};

class LinearTransformer final : public Mechanism {
 public:
  LinearTransformer(const Problem& problem, const LinearTransformerConfig& config) : p_(problem), c_(config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    engine_ = std::make_unique<ChunkedLinearAttention>(p_, c_.chunk, p_.head_dim);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    engine_->forward(EluFeatures(p_.head_dim), q, k, v, out);
  }

 private:
  Problem p_;
  LinearTransformerConfig c_;
  std::unique_ptr<ChunkedLinearAttention> engine_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const LinearTransformerConfig& c, std::uint64_t) {
  return std::make_unique<LinearTransformer>(problem, c);
}

std::int64_t flops(const Problem& p, const LinearTransformerConfig& c) {
  const std::int64_t per_row = kEluPlusOneFlops * p.head_dim;
  return linear_attention_flops(p, c.chunk, {p.head_dim, per_row, per_row, false});
}

std::int64_t workspace(const Problem& p, const LinearTransformerConfig& c) {
  return linear_attention_workspace(p, c.chunk, p.head_dim);
}

}  // namespace

Implementation linear_transformer_implementation() {
  return implement(ModelSpec<LinearTransformerConfig>{
      .fields = {int_field("chunk", &LinearTransformerConfig::chunk, 1, 8192,
                           "rows per chunk of the prefix-sum walk (tokens)")},
      .create = create,
      .flops = flops,
      .workspace = workspace});
}

}  // namespace xfb
