#include "taxonomy/kernels/linear_transformer.hpp"


#include "lib/ops.hpp"
#include "taxonomy/kernels/linear_attention.hpp"

namespace xfb {
namespace {

LinearTransformerConfig config_from(const ParamValues& values) { return {.chunk = values.get_int("chunk")}; }

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

std::unique_ptr<Mechanism> create(const Problem& problem, const ParamValues& values, std::uint64_t) {
  return std::make_unique<LinearTransformer>(problem, config_from(values));
}

std::int64_t flops(const Problem& p, const ParamValues& values) {
  const std::int64_t per_row = kEluPlusOneFlops * p.head_dim;
  return linear_attention_flops(p, config_from(values).chunk, {p.head_dim, per_row, per_row, false});
}

std::int64_t workspace(const Problem& p, const ParamValues& values) {
  return linear_attention_workspace(p, config_from(values).chunk, p.head_dim);
}

}  // namespace

Implementation linear_transformer_implementation() {
  return {{{"chunk", ParamType::Int, "32", 1, 8192, {}, "rows per chunk of the prefix-sum walk (tokens)"}},
          create,
          flops,
          workspace};
}

}  // namespace xfb
