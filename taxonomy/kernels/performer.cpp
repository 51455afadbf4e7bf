#include "taxonomy/kernels/performer.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/kernels/linear_attention.hpp"

namespace xfb {
namespace {

// Rows of `block` (d×d Gaussian) orthonormalised in order by modified Gram–Schmidt; keeps `rows`.
std::vector<double> orthonormal_rows(const CounterRng& rng, std::int64_t block, std::int64_t d, std::int64_t rows) {
  std::vector<double> u(static_cast<std::size_t>(rows * d));
  for (std::int64_t r = 0; r < rows; ++r) {
    double* row = u.data() + r * d;
    for (std::int64_t c = 0; c < d; ++c) row[c] = rng.normal(static_cast<std::uint64_t>((block * d + r) * d + c));
    for (std::int64_t s = 0; s < r; ++s) {
      const double* prior = u.data() + s * d;
      double dot = 0;
      for (std::int64_t c = 0; c < d; ++c) dot += row[c] * prior[c];
      for (std::int64_t c = 0; c < d; ++c) row[c] -= dot * prior[c];
    }
    double norm = 0;
    for (std::int64_t c = 0; c < d; ++c) norm += row[c] * row[c];
    norm = std::sqrt(norm);
    for (std::int64_t c = 0; c < d; ++c) row[c] /= norm;
  }
  return u;
}

// ω [m, d]: orthogonal blocks with chi(d)-distributed row norms (see performer.hpp).
Tensor orthogonal_random_features(std::int64_t m, std::int64_t d, std::uint64_t seed) {
  const CounterRng directions(seed, "performer/directions"), lengths(seed, "performer/norms");
  Tensor omega(Shape{m, d});
  for (std::int64_t block = 0; block * d < m; ++block) {
    const std::int64_t rows = std::min(d, m - block * d);
    const auto unit = orthonormal_rows(directions, block, d, rows);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t i = block * d + r;
      double norm = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        const double g = lengths.normal(static_cast<std::uint64_t>(i * d + c));
        norm += g * g;
      }
      norm = std::sqrt(norm);
      for (std::int64_t c = 0; c < d; ++c)
        omega[i * d + c] = static_cast<float>(norm * unit[static_cast<std::size_t>(r * d + c)]);
    }
  }
  return omega;
}

class FavorFeatures final : public FeatureMap {
 public:
  // omega_transposed: ωᵀ [D, M] for single-row projections (decoding), or nullptr.
  FavorFeatures(const Tensor& omega, PerformerKernel kernel, const float* omega_transposed = nullptr)
      : omega_(omega.data()), omega_t_(omega_transposed), m_(omega.dim(0)), d_(omega.dim(1)), kernel_(kernel) {}

  std::int64_t dim() const override { return m_; }
  bool shifts() const override { return kernel_ == PerformerKernel::Softmax; }

  std::int64_t queries(const float* x, std::int64_t rows, float* phi, std::int64_t ld) const override {
    project(x, rows, phi, ld);
    if (kernel_ == PerformerKernel::Relu) return relu(phi, rows, ld);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = phi + r * ld;
      ops::exp_and_sum(row, m_, ops::row_max(row, m_, row[0]));  // φ's exponentials; the sum is not needed
    }
    return rows * 3 * m_;
  }

  bool differentiable() const override { return true; }

  // softmax: ∂φ_m/∂x = φ_m·(α·ω_m − [keys]·α²·x) (the row max and the shift are constants);
  // relu: ∂φ_m/∂x = [ω_m·x > 0]·ω_m/√M. So dx = α·u·ω (− α²·x·Σ_m u_m for keys) with u = dφ ⊙ φ,
  // or u = dφ ⊙ [φ > 10⁻³] and α = 1/√M. u overwrites dphi.
  std::int64_t gradient(const float* x, std::int64_t rows, const float* phi, float* dphi, std::int64_t ld, float* dx,
                        bool keys) const override {
    const bool softmax = kernel_ == PerformerKernel::Softmax;
    std::int64_t flops = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      float* u = dphi + r * ld;
      const float* f = phi + r * ld;
#pragma omp simd
      for (std::int64_t j = 0; j < m_; ++j)
        u[j] = softmax ? u[j] * f[j] : (f[j] > kPerformerReluStabiliser ? u[j] : 0.0f);
    }
    flops += rows * m_;
    ops::gemm(false, false, rows, d_, m_, alpha(), dphi, ld, omega_, d_, 0.0f, dx, d_);
    if (!softmax || !keys) return flops;
    const float alpha2 = alpha() * alpha();
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* u = dphi + r * ld;
      float total = 0.0f;
#pragma omp simd reduction(+ : total)
      for (std::int64_t j = 0; j < m_; ++j) total += u[j];
      const float factor = alpha2 * total;
#pragma omp simd
      for (std::int64_t c = 0; c < d_; ++c) dx[r * d_ + c] -= factor * x[r * d_ + c];
    }
    return flops + rows * (m_ + 2 * d_);
  }

  std::int64_t keys(const float* x, std::int64_t rows, float* phi, std::int64_t ld, float& shift) const override {
    project(x, rows, phi, ld);
    if (kernel_ == PerformerKernel::Relu) return relu(phi, rows, ld);
    const float half_scale2 = 0.5f / std::sqrt(static_cast<float>(d_));  // ‖D^(−1/4)·x‖²/2 = ‖x‖²·half_scale2
    float peak = shift;
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * d_;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (std::int64_t c = 0; c < d_; ++c) squares += xr[c] * xr[c];
      const float half_norm = squares * half_scale2;
      float* row = phi + r * ld;
#pragma omp simd reduction(max : peak)
      for (std::int64_t j = 0; j < m_; ++j) {
        const float exponent = row[j] - half_norm;
        row[j] = exponent;
        peak = exponent > peak ? exponent : peak;
      }
    }
    shift = peak;
    for (std::int64_t r = 0; r < rows; ++r) ops::exp_and_sum(phi + r * ld, m_, peak);  // the sum is not needed
    return rows * (2 * d_ + 4 * m_);
  }

 private:
  // α = D^(−1/4) (softmax kernel) or 1/√M (relu kernel).
  float alpha() const {
    return kernel_ == PerformerKernel::Softmax ? 1.0f / std::sqrt(std::sqrt(static_cast<float>(d_)))
                                               : 1.0f / std::sqrt(static_cast<float>(m_));
  }

  // phi = α·x·ωᵀ. One row with ωᵀ at hand (a decoding step): D multiply-adds of ωᵀ rows into phi,
  // contiguous over M, instead of a one-row sgemm call (2·M·D FLOPs either way, counted here).
  void project(const float* x, std::int64_t rows, float* phi, std::int64_t ld) const {
    if (rows != 1 || omega_t_ == nullptr) {
      ops::gemm(false, true, rows, m_, d_, alpha(), x, d_, omega_, d_, 0.0f, phi, ld);
      return;
    }
    std::fill_n(phi, m_, 0.0f);
    for (std::int64_t c = 0; c < d_; ++c) {
      const float weight = alpha() * x[c];
      const float* column = omega_t_ + c * m_;
#pragma omp simd
      for (std::int64_t j = 0; j < m_; ++j) phi[j] += weight * column[j];
    }
    FlopCounter::add(matmul_flops(1, m_, d_));
  }

  std::int64_t relu(float* phi, std::int64_t rows, std::int64_t ld) const {
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = phi + r * ld;
#pragma omp simd
      for (std::int64_t j = 0; j < m_; ++j) row[j] = (row[j] > 0.0f ? row[j] : 0.0f) + kPerformerReluStabiliser;
    }
    return rows * 2 * m_;
  }

  const float* omega_;
  const float* omega_t_;
  std::int64_t m_, d_;
  PerformerKernel kernel_;
};

FeatureCosts feature_costs(const Problem& p, const PerformerConfig& c) {
  const std::int64_t m = c.features, d = p.head_dim, projection = matmul_flops(1, m, d);
  // Gradients per row: u (M) and the product with ω (2·M·D); softmax keys also Σu (M) and x·α²Σu (2·D).
  const std::int64_t gradient = m + projection;
  if (c.kernel == PerformerKernel::Relu) return {m, projection + 2 * m, projection + 2 * m, false, gradient, gradient};
  return {m, projection + 3 * m, projection + 2 * d + 4 * m, true, gradient, gradient + m + 2 * d};
}

class Performer final : public Mechanism {
 public:
  Performer(const Problem& problem, const PerformerConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    omega_ = orthogonal_random_features(c_.features, p_.head_dim, seed_);
    engine_ = std::make_unique<ChunkedLinearAttention>(p_, c_.chunk, c_.features);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    engine_->forward(FavorFeatures(omega_, c_.kernel), q, k, v, out);
  }

  // The random features are redrawn, not learned: held fixed (no gradient).
  void prepare_backward() override { engine_->enable_backward(); }
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    engine_->backward(FavorFeatures(omega_, c_.kernel), q, k, v, out, dout, dq, dk, dv);
  }
  std::vector<NamedTensor> saved() const override {
    return {{"normalisers", &engine_->normalisers()}, {"chunk_shifts", &engine_->chunk_shifts()}};
  }

  void prepare_decode(std::int64_t) override {
    engine_->enable_decode();
    omega_transposed_ = Tensor(Shape{p_.head_dim, c_.features});
    for (std::int64_t j = 0; j < c_.features; ++j)
      for (std::int64_t c = 0; c < p_.head_dim; ++c)
        omega_transposed_[c * c_.features + j] = omega_[j * p_.head_dim + c];
  }
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    engine_->decode_step(FavorFeatures(omega_, c_.kernel, omega_transposed_.data()), q, k, v, out);
  }
  std::vector<NamedTensor> decode_state() const override {
    return {{"state", &engine_->decode_states()}, {"key_shift", &engine_->decode_shifts()}};
  }
  std::string gradient_note() const override { return "random features held fixed (redrawn, not learned)"; }

  std::vector<NamedTensor> parameters() const override { return {{"random_features", &omega_}}; }

 private:
  Problem p_;
  PerformerConfig c_;
  std::uint64_t seed_;
  Tensor omega_;
  Tensor omega_transposed_;  // decoding only: ωᵀ [D, M]
  std::unique_ptr<ChunkedLinearAttention> engine_;
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const PerformerConfig& c, std::uint64_t seed) {
  return std::make_unique<Performer>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const PerformerConfig& c) {
  return linear_attention_flops(p, c.chunk, feature_costs(p, c));
}

std::int64_t workspace(const Problem& p, const PerformerConfig& c) {
  return c.features * p.head_dim * static_cast<std::int64_t>(sizeof(float)) +
         linear_attention_workspace(p, c.chunk, c.features);
}

std::int64_t backward_flops(const Problem& p, const PerformerConfig& c) {
  return linear_attention_backward_flops(p, c.chunk, feature_costs(p, c));
}

std::int64_t backward_workspace(const Problem& p, const PerformerConfig& c) {
  return linear_attention_backward_workspace(p, c.chunk, c.features);
}

std::int64_t decode_workspace(const Problem& p, const PerformerConfig& c, std::int64_t) {
  return linear_attention_decode_workspace(p, c.features) +
         c.features * p.head_dim * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<PerformerConfig> config_fields(const PerformerConfig*) {
  return {int_field("features", &PerformerConfig::features, 1, 16384, "random features M per head"),
          choice_field("kernel", &PerformerConfig::kernel,
                       {{"softmax", PerformerKernel::Softmax}, {"relu", PerformerKernel::Relu}},
                       "softmax: FAVOR+ positive features for exp(qᵀk/√D); relu: max(ωx/√M, 0) + 1e-3"),
          int_field("chunk", &PerformerConfig::chunk, 1, 8192, "rows per chunk of the prefix-sum walk (tokens)")};
}

template <>
Implementation implementation<PerformerConfig>() {
  Implementation impl = implement<PerformerConfig>();
  impl.bf16_forward = true;  // forward and decode, on the engine's bf16 form
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
