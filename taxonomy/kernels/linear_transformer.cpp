#include "taxonomy/kernels/linear_transformer.hpp"

#include "lib/core/config_table.hpp"
#include "lib/core/ops.hpp"
#include "taxonomy/kernels/linear_attention.hpp"

namespace xfb {
namespace {

inline constexpr std::int64_t kEluPlusOneFlops = 4;
inline constexpr std::int64_t kEluPlusOneGradientFlops = 2;  // select φ(x) or 1, multiply

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
  bool differentiable() const override { return true; }
  // φ'(x) = e^x = φ(x) for x < 0, 1 otherwise.
  std::int64_t gradient(const float* x, std::int64_t rows, const float* phi, float* dphi, std::int64_t ld, float* dx,
                        bool) const override {
    for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (std::int64_t c = 0; c < d_; ++c)
        dx[r * d_ + c] = dphi[r * ld + c] * (x[r * d_ + c] < 0.0f ? phi[r * ld + c] : 1.0f);
    }
    return rows * d_ * kEluPlusOneGradientFlops;
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

  void prepare_backward() override { engine_->enable_backward(); }
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    engine_->backward(EluFeatures(p_.head_dim), q, k, v, out, dout, dq, dk, dv);
  }
  std::vector<NamedTensor> saved() const override {
    return {{"normalisers", &engine_->normalisers()}, {"chunk_shifts", &engine_->chunk_shifts()}};
  }

  void prepare_decode(std::int64_t) override { engine_->enable_decode(); }
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    engine_->decode_step(EluFeatures(p_.head_dim), q, k, v, out);
  }
  std::vector<NamedTensor> decode_state() const override {
    return {{"state", &engine_->decode_states()}, {"key_shift", &engine_->decode_shifts()}};
  }

 private:
  Problem p_;
  LinearTransformerConfig c_;
  std::unique_ptr<ChunkedLinearAttention> engine_;
};

FeatureCosts costs(const Problem& p) {
  const std::int64_t per_row = kEluPlusOneFlops * p.head_dim;
  const std::int64_t gradient = kEluPlusOneGradientFlops * p.head_dim;
  return {p.head_dim, per_row, per_row, false, gradient, gradient};
}

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const LinearTransformerConfig& c, std::uint64_t) {
  return std::make_unique<LinearTransformer>(problem, c);
}

std::int64_t flops(const Problem& p, const LinearTransformerConfig& c) {
  return linear_attention_flops(p, c.chunk, costs(p));
}

std::int64_t workspace(const Problem& p, const LinearTransformerConfig& c) {
  return linear_attention_workspace(p, c.chunk, p.head_dim);
}

std::int64_t backward_flops(const Problem& p, const LinearTransformerConfig& c) {
  return linear_attention_backward_flops(p, c.chunk, costs(p));
}

std::int64_t backward_workspace(const Problem& p, const LinearTransformerConfig& c) {
  return linear_attention_backward_workspace(p, c.chunk, p.head_dim);
}

std::int64_t decode_workspace(const Problem& p, const LinearTransformerConfig&, std::int64_t) {
  return linear_attention_decode_workspace(p, p.head_dim);
}

FieldTable<LinearTransformerConfig> config_fields(const LinearTransformerConfig*) {
  return {
      int_field("chunk", &LinearTransformerConfig::chunk, 1, 8192, "rows per chunk of the prefix-sum walk (tokens)")};
}

template <>
Implementation implementation<LinearTransformerConfig>() {
  Implementation impl = implement<LinearTransformerConfig>();
  impl.bf16_forward = true;  // forward and decode, on the engine's bf16 form
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
