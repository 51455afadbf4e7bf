#include "taxonomy/kernels/rfa.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/params.hpp"
#include "lib/core/rng.hpp"

namespace xfb {
namespace {

inline constexpr float kMinNorm = 1e-12f;
inline constexpr std::int64_t kSigmoidFlops = 3;  // exp, add, divide
inline constexpr float kMinDecay = 1e-30f;        // gates below this decay as if they were it (log stays finite)

// sin x and cos x in one vectorisable function (std::sin and std::cos are scalar library calls,
// slower here than the features' gemm): x = j·π/2 + y by a three-part Cody–Waite reduction,
// |y| ≤ π/4, Cephes' single-precision minimax polynomials for sin y and cos y, then the
// quadrant j mod 4 swaps and signs them. Absolute error below 10⁻⁷ for |x| ≤ 10⁴ (measured
// against double); the angles here are W̃·(σ ⊙ x̂), of order ‖σ‖.
#pragma omp declare simd
inline void sin_cos(float x, float& sine, float& cosine) {
  const float j = std::nearbyint(x * 0.636619772367581343f);  // x · 2/π
  const float y = ((x - j * 1.5703125f) - j * 4.837512969970703125e-4f) - j * 7.54978995489188216e-8f;
  const float y2 = y * y;
  const float s = y + y * y2 * (-1.6666654611e-1f + y2 * (8.3321608736e-3f + y2 * -1.9515295891e-4f));
  const float c =
      1.0f - 0.5f * y2 + y2 * y2 * (4.166664568298827e-2f + y2 * (-1.388731625493765e-3f + y2 * 2.443315711809948e-5f));
  const int quadrant = static_cast<int>(j) & 3;
  const float sin_abs = (quadrant & 1) ? c : s, cos_abs = (quadrant & 1) ? s : c;
  sine = (quadrant & 2) ? -sin_abs : sin_abs;
  cosine = (quadrant == 1 || quadrant == 2) ? -cos_abs : cos_abs;
}

// The sizes every function below shares.
struct Dims {
  std::int64_t n, d, r, m, c, ld_m, ld_v, ld_c, chunks;
};

Dims dims(const Problem& p, const RfaConfig& cfg) {
  const std::int64_t c = std::max<std::int64_t>(1, std::min(cfg.chunk, p.seq_len));
  return {p.seq_len,
          p.head_dim,
          cfg.features,
          2 * cfg.features,
          c,
          ops::padded_ld(2 * cfg.features),
          ops::padded_ld(p.head_dim + 1),
          ops::padded_ld(c),
          (p.seq_len + c - 1) / c};
}

// FLOPs of one row's features: the gemm, the normalisation and sin/cos (see rfa.hpp).
std::int64_t feature_row_flops(const Dims& s) { return matmul_flops(1, s.r, s.d) + 4 * s.d + 4 * s.r; }
// One key row's gate: w_g·k (2·D), + b_g, the sigmoid, 1 − g.
std::int64_t gate_row_flops(const Dims& s) { return 2 * s.d + 1 + kSigmoidFlops + 1; }
// One token of the recurrence (the decode step): the state update (gated a·S + (b·φ(k))v')
// and the output stateᵀφ(q); without features, gate and normalisation.
std::int64_t step_flops(const Dims& s, bool gated) {
  const std::int64_t cells = s.m * (s.d + 1);
  return gated ? 3 * cells + s.m + 2 * cells : 4 * cells;
}
// Per token: the features of its q and k rows and (gated) its gate.
std::int64_t token_input_flops(const Dims& s, bool gated) {
  return 2 * feature_row_flops(s) + (gated ? gate_row_flops(s) : 0);
}
// The gated chunk's decays of `rows` rows (see apply_decays).
std::int64_t decay_flops(const Dims& s, std::int64_t rows) {
  return rows * (2 + s.d + 2 + 3 + s.m) + 2 * rows * (rows + 1) + s.m * (s.d + 1);
}
// The causal chunk's gemms: φ(Q)·φ(K)ᵀ, φ(Q)·S, A·[V | 1], the state update.
std::int64_t causal_chunk_flops(const Dims& s, std::int64_t rows) {
  return matmul_flops(rows, rows, s.m) + 2 * matmul_flops(rows, s.d + 1, s.m) + matmul_flops(rows, s.d + 1, rows);
}
// The causal backward of one chunk of r rows (head_backward_causal), without output and feature
// gradients.
std::int64_t causal_backward_chunk_flops(const Dims& s, std::int64_t r, bool gated) {
  const std::int64_t m = s.m, d = s.d, cols = s.d + 1;
  std::int64_t f = r * token_input_flops(s, gated) + 3 * matmul_flops(r, r, m) + 2 * matmul_flops(r, r, cols) +
                   4 * matmul_flops(r, m, cols) + matmul_flops(r, d, r) + matmul_flops(r, d, m);
  if (!gated) return f + r * m;
  f += 2 * r;                              // cumulative logs
  f += 2 * r * (r + 1) + r * (d + 2);      // decayed scores
  f += 7 * r * (r + 1) / 2;                // T sums, P ⊙ W
  f += r * (3 * m + 4) + r * (5 * m + 4);  // query-state and carried key terms
  f += 2 * m * cols + 4 + 7 * r;           // gate chunk terms
  f += m * cols + r * (1 + m);             // decayed adjoint
  return f + r * (4 * d + 1);              // gate_gradient
}
// The gradient of one row's features given dφ: dp (3·R), dx̃ = dp·W̃ (gemm), then 8·D (see below).
std::int64_t feature_gradient_row_flops(const Dims& s) { return 3 * s.r + matmul_flops(1, s.d, s.r) + 8 * s.d; }

// Per-thread buffers of one (batch, head) task.
struct Buffers {
  float *xhat_q, *xhat_k, *scaled;  // [C, D]: x̂ of the chunk's q and k rows; x̃ scratch
  float *inv_q, *inv_k;             // [C]: 1/‖x‖
  float *phi_q, *phi_k;             // [C, ld_m]
  float *values, *numerators;       // [C, ld_v]: [v | 1]; out' = [numerator | z]
  float *decay, *input;             // [C]: a_t, b_t (the causal forward turns a_t into L_t)
  float* state;                     // [M, ld_v]: [S | z]
  float* scores;                    // [C, ld_c]: A (causal)
  float *query_rows, *key_rows;     // bf16: the chunk's q and k rows widened [C, D] (nullptr in fp32)
};

struct GradBuffers {
  float *dphi_q, *dphi_k;  // [C, ld_m]
  float* output_grads;     // G [C, ld_v]
  float* adjoint;          // dS (non-causal) or the running a_{t+1}·dS_{t+1} (causal) [M, ld_v]
  float* dscaled;          // dx̃ [C, D]
  float* gate_grads;       // du_t [C] (gated)
  float* masked;           // P, then P ⊙ W [C, ld_c] (causal)
  float* carried;          // Y = [V|1]·Rᵀ, then diag(β)·φ(K), then diag(e^L)·φ(Q) [C, ld_m] (causal)
  // [C] each (causal): L, dL, the row and column sums of T, dβ·β.
  float *logs = nullptr, *log_grads = nullptr, *row_sums = nullptr, *col_sums = nullptr, *beta_grads = nullptr;
  float* gradient_rows = nullptr;  // bf16: a chunk's fp32 dq, dk or dv rows [C, D] before rounding
};

class Rfa final : public Mechanism {
 public:
  Rfa(const Problem& problem, const RfaConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), s_(dims(problem, config)), seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, d = s_.d;
    features_ = Tensor(Shape{h, s_.r, d});
    CounterRng(seed_, "rfa/random_features").fill_normal(features_);
    sigma_ = Tensor(Shape{h, d});
    sigma_.fill(1.0f);
    if (c_.gate) {
      gate_weight_ = Tensor(Shape{h, d});
      CounterRng(seed_, "rfa/gate_weight").fill_normal(gate_weight_, 0.0f, 1.0f / std::sqrt(static_cast<float>(d)));
      gate_bias_ = Tensor(Shape{h});
    }
    const std::int64_t t = p_.threads, c = s_.c;
    xhat_q_ = Tensor(Shape{t, c, d});
    xhat_k_ = Tensor(Shape{t, c, d});
    scaled_ = Tensor(Shape{t, c, d});
    inv_q_ = Tensor(Shape{t, c});
    inv_k_ = Tensor(Shape{t, c});
    phi_q_ = Tensor(Shape{t, c, s_.ld_m});
    phi_k_ = Tensor(Shape{t, c, s_.ld_m});
    values_ = Tensor(Shape{t, c, s_.ld_v});
    numerators_ = Tensor(Shape{t, c, s_.ld_v});
    decay_ = Tensor(Shape{t, c});
    input_ = Tensor(Shape{t, c});
    state_ = Tensor(Shape{t, s_.m, s_.ld_v});
    if (p_.causal) scores_ = Tensor(Shape{t, c, s_.ld_c});
    if (p_.dtype == DType::BF16) input_rows_ = Tensor(Shape{t, 2, c, d});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (p_.dtype == DType::BF16)
      forward_heads(q.bf16_data(), k.bf16_data(), v.bf16_data(), out.bf16_data());
    else
      forward_heads(q.data(), k.data(), v.data(), out.data());
  }

  void prepare_backward() override {
    const std::int64_t t = p_.threads, c = s_.c, d = s_.d, tasks = p_.batch * p_.heads;
    const std::int64_t slots = tasks * (p_.causal ? s_.chunks : 1);
    checkpoints_ = Tensor(Shape{slots, s_.m, s_.ld_v}, p_.dtype);
    if (p_.dtype == DType::BF16) checkpoint_z_ = Tensor(Shape{slots, s_.m});
    if (p_.dtype == DType::BF16) gradient_rows_ = Tensor(Shape{t, c, d});
    dphi_q_ = Tensor(Shape{t, c, s_.ld_m});
    dphi_k_ = Tensor(Shape{t, c, s_.ld_m});
    output_grads_ = Tensor(Shape{t, c, s_.ld_v});
    adjoint_ = Tensor(Shape{t, s_.m, s_.ld_v});
    dscaled_ = Tensor(Shape{t, c, d});
    gate_grads_ = Tensor(Shape{t, c});
    if (p_.causal) {
      masked_ = Tensor(Shape{t, c, s_.ld_c});
      carried_ = Tensor(Shape{t, c, s_.ld_m});
      chunk_scalars_ = Tensor(Shape{t, 5, c});
    }
    sigma_parts_ = Tensor(Shape{tasks, d});
    dsigma_ = Tensor(Shape{p_.heads, d});
    if (c_.gate) {
      gate_weight_parts_ = Tensor(Shape{tasks, d});
      gate_bias_parts_ = Tensor(Shape{tasks});
      dgate_weight_ = Tensor(Shape{p_.heads, d});
      dgate_bias_ = Tensor(Shape{p_.heads});
    }
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    std::int64_t flops = 0;
    if (p_.dtype == DType::BF16)
      flops = backward_heads(q.bf16_data(), k.bf16_data(), v.bf16_data(), out.bf16_data(), dout.bf16_data(),
                             dq.bf16_data(), dk.bf16_data(), dv.bf16_data());
    else
      flops = backward_heads(q.data(), k.data(), v.data(), out.data(), dout.data(), dq.data(), dk.data(), dv.data());
    flops += reduce_parts(sigma_parts_, dsigma_, s_.d);
    if (c_.gate)
      flops += reduce_parts(gate_weight_parts_, dgate_weight_, s_.d) + reduce_parts(gate_bias_parts_, dgate_bias_, 1);
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> saved() const override {
    if (checkpoints_.empty()) return {};
    std::vector<NamedTensor> all{{p_.causal ? "chunk_states" : "summary", &checkpoints_}};
    if (!checkpoint_z_.empty())
      all.push_back({p_.causal ? "chunk_normalisers" : "summary_normalisers", &checkpoint_z_});
    return all;
  }
  std::vector<NamedTensor> parameter_gradients() const override {
    std::vector<NamedTensor> grads{{"dsigma", &dsigma_}};
    if (c_.gate) grads.insert(grads.end(), {{"dgate_weight", &dgate_weight_}, {"dgate_bias", &dgate_bias_}});
    return grads;
  }
  std::string gradient_note() const override { return "random features W̃ held fixed (drawn, not learned)"; }

  void prepare_decode(std::int64_t) override {
    decode_states_ = Tensor(Shape{p_.batch * p_.heads, s_.m, s_.ld_v}, p_.dtype);
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (p_.dtype == DType::BF16)
      decode_heads(q.bf16_data(), k.bf16_data(), v.bf16_data(), out.bf16_data(), decode_states_.bf16_data());
    else
      decode_heads(q.data(), k.data(), v.data(), out.data(), decode_states_.data());
  }
  std::vector<NamedTensor> decode_state() const override { return {{"state", &decode_states_}}; }

  std::vector<NamedTensor> parameters() const override {
    std::vector<NamedTensor> all{{"random_features", &features_}, {"sigma", &sigma_}};
    if (c_.gate) all.insert(all.end(), {{"gate_weight", &gate_weight_}, {"gate_bias", &gate_bias_}});
    return all;
  }

 private:
  // The passes over every (batch, head) task, on fp32 (T = float) or bf16 (T = bf16) tensors.
  template <class T>
  void forward_heads(const T* q, const T* k, const T* v, T* out) {
    const std::int64_t tasks = p_.batch * p_.heads, head_size = s_.n * s_.d;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const Buffers b = buffers(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t o = task * head_size, h = task % p_.heads;
        flops += p_.causal ? head_causal(h, q + o, k + o, v + o, out + o, task, b)
                           : head_full(h, q + o, k + o, v + o, out + o, task, b);
      }
    }
    FlopCounter::add(flops);
  }

  // Returns the FLOPs of every head (the parameter reductions not included).
  template <class T>
  std::int64_t backward_heads(const T* q, const T* k, const T* v, const T* out, const T* dout, T* dq, T* dk, T* dv) {
    const std::int64_t tasks = p_.batch * p_.heads, head_size = s_.n * s_.d;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
      const Buffers b = buffers(thread);
      const GradBuffers g = grad_buffers(thread);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t o = task * head_size;
        const T* in[] = {q + o, k + o, v + o, out + o, dout + o};
        T* grads[] = {dq + o, dk + o, dv + o};
        flops += p_.causal ? head_backward_causal(task, in, grads, b, g) : head_backward_full(task, in, grads, b, g);
      }
    }
    return flops;
  }

  // One token per head; states [B·H, M, ld_v] of T.
  template <class T>
  void decode_heads(const T* q, const T* k, const T* v, T* out, T* states) {
    const std::int64_t tasks = p_.batch * p_.heads, d = s_.d;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const Buffers b = buffers(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t h = task % p_.heads, o = task * d;
        flops += load_chunk(h, q + o, k + o, v + o, 0, 1, b);
        flops += step(b.phi_q, b.phi_k, b.values, b.decay[0], b.input[0], states + task * s_.m * s_.ld_v, b.numerators,
                      out + o);
      }
    }
    FlopCounter::add(flops);
  }

  Buffers buffers(int t) {
    const std::int64_t c = s_.c, d = s_.d;
    auto at = [t](Tensor& x, std::int64_t per) { return x.data() + t * per; };
    return {at(xhat_q_, c * d),
            at(xhat_k_, c * d),
            at(scaled_, c * d),
            at(inv_q_, c),
            at(inv_k_, c),
            at(phi_q_, c * s_.ld_m),
            at(phi_k_, c * s_.ld_m),
            at(values_, c * s_.ld_v),
            at(numerators_, c * s_.ld_v),
            at(decay_, c),
            at(input_, c),
            at(state_, s_.m * s_.ld_v),
            scores_.empty() ? nullptr : at(scores_, c * s_.ld_c),
            input_rows_.empty() ? nullptr : at(input_rows_, 2 * c * d),
            input_rows_.empty() ? nullptr : at(input_rows_, 2 * c * d) + c * d};
  }

  GradBuffers grad_buffers(int t) {
    const std::int64_t c = s_.c, cells = s_.m * s_.ld_v;
    auto at = [t](Tensor& x, std::int64_t per) { return x.empty() ? nullptr : x.data() + t * per; };
    GradBuffers g{at(dphi_q_, c * s_.ld_m), at(dphi_k_, c * s_.ld_m), at(output_grads_, c * s_.ld_v),
                  at(adjoint_, cells),      at(dscaled_, c * s_.d),   at(gate_grads_, c),
                  at(masked_, c * s_.ld_c), at(carried_, c * s_.ld_m)};
    float* scalars = at(chunk_scalars_, 5 * c);
    if (scalars != nullptr) {
      g.logs = scalars;
      g.log_grads = scalars + c;
      g.row_sums = scalars + 2 * c;
      g.col_sums = scalars + 3 * c;
      g.beta_grads = scalars + 4 * c;
    }
    g.gradient_rows = at(gradient_rows_, c * s_.d);
    return g;
  }

  // φ of `rows` rows x [rows, D] of head h into phi [rows, ld_m]; x̂ and 1/‖x‖ into xhat, inv.
  std::int64_t features(std::int64_t h, const float* x, std::int64_t rows, float* xhat, float* inv, float* scaled,
                        float* phi) const {
    const std::int64_t d = s_.d, r = s_.r;
    const float* sigma = sigma_.data() + h * d;
    for (std::int64_t i = 0; i < rows; ++i) {
      const float* xi = x + i * d;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (std::int64_t c = 0; c < d; ++c) squares += xi[c] * xi[c];
      inv[i] = 1.0f / std::max(std::sqrt(squares), kMinNorm);
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) {
        xhat[i * d + c] = xi[c] * inv[i];
        scaled[i * d + c] = xhat[i * d + c] * sigma[c];
      }
    }
    ops::gemm(false, true, rows, r, d, 1.0f, scaled, d, features_.data() + h * r * d, d, 0.0f, phi, s_.ld_m);
    const float alpha = 1.0f / std::sqrt(static_cast<float>(r));
    for (std::int64_t i = 0; i < rows; ++i) {
      float* row = phi + i * s_.ld_m;
#pragma omp simd
      for (std::int64_t j = 0; j < r; ++j) {
        float sine, cosine;
        sin_cos(row[j], sine, cosine);
        row[r + j] = alpha * cosine;
        row[j] = alpha * sine;
      }
    }
    return rows * (4 * d + 4 * r);
  }

  // dx [rows, D] of rows whose features are phi (x̂, 1/‖x‖ as features() left them), from dphi
  // (overwritten: dp in its first R columns); adds x̂ ⊙ dx̃ into dsigma [D]. FLOPs outside the gemm:
  // dp 3·R; per row dσ 2·D, dx̂ = σ⊙dx̃ D, x̂·dx̂ 2·D, dx = (dx̂ − x̂(x̂·dx̂))/‖x‖ 3·D.
  std::int64_t feature_gradient(std::int64_t h, std::int64_t rows, const float* phi, float* dphi, const float* xhat,
                                const float* inv, float* dscaled, float* dx, float* dsigma) const {
    const std::int64_t d = s_.d, r = s_.r;
    for (std::int64_t i = 0; i < rows; ++i) {
      const float* f = phi + i * s_.ld_m;
      float* u = dphi + i * s_.ld_m;
#pragma omp simd
      for (std::int64_t j = 0; j < r; ++j) u[j] = f[r + j] * u[j] - f[j] * u[r + j];
    }
    ops::gemm(false, false, rows, d, r, 1.0f, dphi, s_.ld_m, features_.data() + h * r * d, d, 0.0f, dscaled, d);
    const float* sigma = sigma_.data() + h * d;
    for (std::int64_t i = 0; i < rows; ++i) {
      float* g = dscaled + i * d;
      const float* xh = xhat + i * d;
      float dot = 0.0f;
      for (std::int64_t c = 0; c < d; ++c) {
        dsigma[c] += xh[c] * g[c];
        g[c] *= sigma[c];
        dot += xh[c] * g[c];
      }
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) dx[i * d + c] = (g[c] - xh[c] * dot) * inv[i];
    }
    return rows * (3 * r + 8 * d);
  }

  // The features of q and k rows [c0, c0 + rows), [v | 1], and (gated) a_t = g_t, b_t = 1 − g_t
  // from the raw key rows; ungated a_t = b_t = 1. q, k, v point at the head's first row. bf16: the
  // q and k rows are widened into b.query_rows, b.key_rows (where the backward reads them again).
  template <class T>
  std::int64_t load_chunk(std::int64_t h, const T* q, const T* k, const T* v, std::int64_t c0, std::int64_t rows,
                          const Buffers& b) const {
    const std::int64_t d = s_.d;
    const float* keys = fp32_rows(k, c0, rows, d, b.key_rows);
    std::int64_t flops =
        features(h, fp32_rows(q, c0, rows, d, b.query_rows), rows, b.xhat_q, b.inv_q, b.scaled, b.phi_q) +
        features(h, keys, rows, b.xhat_k, b.inv_k, b.scaled, b.phi_k);
    load_values(v + c0 * d, rows, b.values);
    if (!c_.gate) {
      std::fill_n(b.decay, rows, 1.0f);
      std::fill_n(b.input, rows, 1.0f);
      return flops;
    }
    const float* w = gate_weight_.data() + h * d;
    for (std::int64_t i = 0; i < rows; ++i) {
      float u = gate_bias_[h];
#pragma omp simd reduction(+ : u)
      for (std::int64_t c = 0; c < d; ++c) u += w[c] * keys[i * d + c];
      b.decay[i] = 1.0f / (1.0f + std::exp(-u));
      b.input[i] = 1.0f - b.decay[i];
    }
    return flops + rows * gate_row_flops(s_);
  }

  float denominator(float z) const { return std::max(z, static_cast<float>(c_.floor)); }

  // out = numerators[0:D] / den(numerators[D]) for `rows` rows (rounded once for a bf16 out).
  // FLOPs D per row.
  template <class T>
  std::int64_t normalise(const float* numerators, std::int64_t rows, T* out) const {
    const std::int64_t d = s_.d;
    for (std::int64_t i = 0; i < rows; ++i) {
      const float* src = numerators + i * s_.ld_v;
      const float inverse = 1.0f / denominator(src[d]);
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) out[i * d + c] = stored<T>(src[c] * inverse);
    }
    return rows * d;
  }

  // One causal step: state = a·state + b·φ(k)[v | 1]ᵀ; o' = stateᵀφ(q) into scratch; out = o'/den.
  // A bf16 state element is widened, updated in fp32, and rounded back once; o' sums the fp32
  // updated values (ungated a = b = 1: the update is a plain accumulation).
  template <class T>
  std::int64_t step(const float* phi_q, const float* phi_k, const float* values, float a, float b, T* state,
                    float* scratch, T* out) const {
    const std::int64_t cols = s_.d + 1;
    const float decay = c_.gate ? a : 1.0f;
    std::fill_n(scratch, cols, 0.0f);
    for (std::int64_t m = 0; m < s_.m; ++m) {
      T* row = state + m * s_.ld_v;
      const float weight = c_.gate ? b * phi_k[m] : phi_k[m], query = phi_q[m];
#pragma omp simd
      for (std::int64_t e = 0; e < cols; ++e) {
        const float updated = decay * as_float(row[e]) + weight * values[e];
        row[e] = stored<T>(updated);
        scratch[e] += query * updated;
      }
    }
    return step_flops(s_, c_.gate) + normalise(scratch, 1, out);
  }

  // The saved state of `slot` (a chunk start, or a head's S): [S | z] in T; bf16 also keeps its z
  // column in fp32 (checkpoint_z_), so the backward's recomputed normalisers are the forward's: z
  // sums signed features (sin, cos), and a rounded z would move row i's G by u·Σ_j |w_ij| / z_i.
  template <class T>
  void save_state(const float* state, std::int64_t slot) {
    const std::int64_t cells = s_.m * s_.ld_v;
    convert(state, elements<T>(checkpoints_) + slot * cells, cells);
    if (checkpoint_z_.empty()) return;
    float* z = checkpoint_z_.data() + slot * s_.m;
    for (std::int64_t m = 0; m < s_.m; ++m) z[m] = state[m * s_.ld_v + s_.d];
  }
  // The saved state of `slot` as fp32 [M, ld_v]: the checkpoint itself, or widened into scratch
  // with its fp32 z column.
  template <class T>
  const float* load_state(std::int64_t slot, float* scratch) const {
    const std::int64_t cells = s_.m * s_.ld_v;
    const float* state = fp32_elements(elements<T>(checkpoints_) + slot * cells, cells, scratch);
    if (checkpoint_z_.empty()) return state;
    const float* z = checkpoint_z_.data() + slot * s_.m;
    for (std::int64_t m = 0; m < s_.m; ++m) scratch[m * s_.ld_v + s_.d] = z[m];
    return scratch;
  }

  // Saves S per head (training; rounded once in bf16).
  template <class T>
  std::int64_t head_full(std::int64_t h, const T* q, const T* k, const T* v, T* out, std::int64_t task,
                         const Buffers& b) {
    const std::int64_t d = s_.d, cols = d + 1;
    std::int64_t flops = head_full_state(h, k, v, b);
    if (!checkpoints_.empty()) save_state<T>(b.state, task);
    for (std::int64_t c0 = 0; c0 < s_.n; c0 += s_.c) {
      const std::int64_t rows = std::min(s_.c, s_.n - c0);
      flops += features(h, fp32_rows(q, c0, rows, d, b.query_rows), rows, b.xhat_q, b.inv_q, b.scaled, b.phi_q);
      ops::gemm(false, false, rows, cols, s_.m, 1.0f, b.phi_q, s_.ld_m, b.state, s_.ld_v, 0.0f, b.numerators, s_.ld_v);
      flops += normalise(b.numerators, rows, out + c0 * d);
    }
    return flops;
  }

  // The causal walk in chunks of C rows (the chunkwise form of the recurrence), every product one
  // ops::gemm. With L_i = Σ_{l≤i} log a_l inside the chunk (0 ungated) and S the state before it:
  //   A = tril(φ(Q)·φ(K)ᵀ) ⊙ [b_j·exp(L_i − L_j)],  out'_c = A·[V | 1] + diag(exp(L))·φ(Q)·S,
  //   S ← exp(L_last)·S + (diag(b_j·exp(L_last − L_j))·φ(K))ᵀ·[V | 1].
  // Every exponent is ≤ 0. S stays fp32 (b.state) through the walk; it is saved at each chunk start
  // (training) and left after the last chunk for decoding, in T (one rounding each in bf16).
  template <class T>
  std::int64_t head_causal(std::int64_t h, const T* q, const T* k, const T* v, T* out, std::int64_t task,
                           const Buffers& b) {
    const std::int64_t cols = s_.d + 1, cells = s_.m * s_.ld_v;
    float* state = b.state;
    std::fill_n(state, cells, 0.0f);
    std::int64_t flops = 0;
    for (std::int64_t c0 = 0; c0 < s_.n; c0 += s_.c) {
      const std::int64_t rows = std::min(s_.c, s_.n - c0);
      if (!checkpoints_.empty()) save_state<T>(state, task * s_.chunks + c0 / s_.c);
      flops += load_chunk(h, q, k, v, c0, rows, b);
      ops::gemm(false, true, rows, rows, s_.m, 1.0f, b.phi_q, s_.ld_m, b.phi_k, s_.ld_m, 0.0f, b.scores, s_.ld_c);
      ops::gemm(false, false, rows, cols, s_.m, 1.0f, b.phi_q, s_.ld_m, state, s_.ld_v, 0.0f, b.numerators, s_.ld_v);
      if (c_.gate) flops += apply_decays(rows, b, state);
      for (std::int64_t i = 0; i + 1 < rows; ++i)
        std::fill(b.scores + i * s_.ld_c + i + 1, b.scores + i * s_.ld_c + rows, 0.0f);
      ops::gemm(false, false, rows, cols, rows, 1.0f, b.scores, s_.ld_c, b.values, s_.ld_v, 1.0f, b.numerators,
                s_.ld_v);
      ops::gemm(true, false, s_.m, cols, rows, 1.0f, b.phi_k, s_.ld_m, b.values, s_.ld_v, 1.0f, state, s_.ld_v);
      flops += normalise(b.numerators, rows, out + c0 * s_.d);
    }
    if (!decode_states_.empty()) convert(state, elements<T>(decode_states_) + task * cells, cells);
    return flops;
  }

  // The gated chunk's decays (see head_causal), before A·[V | 1] and the state update: L_i into
  // b.decay (log a, running sum: 2 per row); A_ij ⊙= b_j·exp(L_i − L_j) for j ≤ i (4 per entry);
  // out'_i ⊙= exp(L_i) (1 + D + 1 per row); φ(K)_j ⊙= b_j·exp(L_last − L_j) (3 + M per row);
  // S ⊙= exp(L_last) (M·(D+1)).
  std::int64_t apply_decays(std::int64_t rows, const Buffers& b, float* state) const {
    const std::int64_t cols = s_.d + 1;
    float running = 0.0f;
    for (std::int64_t i = 0; i < rows; ++i) {
      running += std::log(std::max(b.decay[i], kMinDecay));
      b.decay[i] = running;
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      float* row = b.scores + i * s_.ld_c;
      const float li = b.decay[i];
      for (std::int64_t j = 0; j <= i; ++j) row[j] *= b.input[j] * std::exp(li - b.decay[j]);
      const float scale = std::exp(li);
      float* numerator = b.numerators + i * s_.ld_v;
#pragma omp simd
      for (std::int64_t e = 0; e < cols; ++e) numerator[e] *= scale;
    }
    const float last = b.decay[rows - 1];
    for (std::int64_t j = 0; j < rows; ++j) {
      const float weight = b.input[j] * std::exp(last - b.decay[j]);
      float* key = b.phi_k + j * s_.ld_m;
#pragma omp simd
      for (std::int64_t m = 0; m < s_.m; ++m) key[m] *= weight;
    }
    const float carry = std::exp(last);
    for (std::int64_t m = 0; m < s_.m; ++m) {
      float* row = state + m * s_.ld_v;
#pragma omp simd
      for (std::int64_t e = 0; e < cols; ++e) row[e] *= carry;
    }
    return decay_flops(s_, rows);
  }

  // G rows [rows, ld_v] of the chunk from its numerators' z column (z[i] = numerators[i·ld_v + D]):
  // G[:D] = dout/den, G[D] = −(dout·out)/den, or 0 when clamped. FLOPs 3·D per row.
  template <class T>
  std::int64_t output_grads(const float* z, std::int64_t z_stride, const T* out, const T* dout, std::int64_t rows,
                            float* grads) const {
    const std::int64_t d = s_.d;
    for (std::int64_t i = 0; i < rows; ++i) {
      const float zi = z[i * z_stride], inverse = 1.0f / denominator(zi);
      const T *o = out + i * d, *g = dout + i * d;
      float* row = grads + i * s_.ld_v;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t c = 0; c < d; ++c) {
        const float grad = as_float(g[c]);
        row[c] = grad * inverse;
        dot += grad * as_float(o[c]);
      }
      row[d] = zi > static_cast<float>(c_.floor) ? -dot * inverse : 0.0f;
    }
    return rows * 3 * d;
  }

  // in: q, k, v, out, dout of the head; grads: dq, dk, dv (bf16: each chunk's rows computed in
  // g.gradient_rows and rounded once).
  template <class T>
  std::int64_t head_backward_full(std::int64_t task, const T* const* in, T* const* grads, const Buffers& b,
                                  const GradBuffers& g) {
    const std::int64_t h = task % p_.heads, d = s_.d, cols = d + 1;
    float* dsigma = sigma_parts_.data() + task * d;
    std::fill_n(dsigma, d, 0.0f);
    const float* summary = load_state<T>(task, b.state);
    std::int64_t flops = 0;
    for (std::int64_t c0 = 0; c0 < s_.n; c0 += s_.c) {  // G, dφ(Q), dS
      const std::int64_t rows = std::min(s_.c, s_.n - c0);
      flops += features(h, fp32_rows(in[0], c0, rows, d, b.query_rows), rows, b.xhat_q, b.inv_q, b.scaled, b.phi_q);
      ops::gemm(false, false, rows, cols, s_.m, 1.0f, b.phi_q, s_.ld_m, summary, s_.ld_v, 0.0f, b.numerators, s_.ld_v);
      flops += output_grads(b.numerators + d, s_.ld_v, in[3] + c0 * d, in[4] + c0 * d, rows, g.output_grads);
      ops::gemm(false, true, rows, s_.m, cols, 1.0f, g.output_grads, s_.ld_v, summary, s_.ld_v, 0.0f, g.dphi_q,
                s_.ld_m);
      ops::gemm(true, false, s_.m, cols, rows, 1.0f, b.phi_q, s_.ld_m, g.output_grads, s_.ld_v, c0 > 0 ? 1.0f : 0.0f,
                g.adjoint, s_.ld_v);
      float* dq = fp32_target(grads[0], c0, d, g.gradient_rows);
      flops += feature_gradient(h, rows, b.phi_q, g.dphi_q, b.xhat_q, b.inv_q, g.dscaled, dq, dsigma);
      store_rows(dq, grads[0], c0, rows, d);
    }
    for (std::int64_t c0 = 0; c0 < s_.n; c0 += s_.c) {  // dφ(K) = [V | 1]·dSᵀ, dV = φ(K)·dS[:, :D]
      const std::int64_t rows = std::min(s_.c, s_.n - c0);
      flops += features(h, fp32_rows(in[1], c0, rows, d, b.key_rows), rows, b.xhat_k, b.inv_k, b.scaled, b.phi_k);
      load_values(in[2] + c0 * d, rows, b.values);
      ops::gemm(false, true, rows, s_.m, cols, 1.0f, b.values, s_.ld_v, g.adjoint, s_.ld_v, 0.0f, g.dphi_k, s_.ld_m);
      float* dv = fp32_target(grads[2], c0, d, g.gradient_rows);
      ops::gemm(false, false, rows, d, s_.m, 1.0f, b.phi_k, s_.ld_m, g.adjoint, s_.ld_v, 0.0f, dv, d);
      store_rows(dv, grads[2], c0, rows, d);
      float* dk = fp32_target(grads[1], c0, d, g.gradient_rows);
      flops += feature_gradient(h, rows, b.phi_k, g.dphi_k, b.xhat_k, b.inv_k, g.dscaled, dk, dsigma);
      store_rows(dk, grads[1], c0, rows, d);
    }
    return flops;
  }

  // values[i] = [v_i | 1] (widened from bf16) for `rows` rows from v.
  template <class T>
  void load_values(const T* v, std::int64_t rows, float* values) const {
    for (std::int64_t i = 0; i < rows; ++i) {
      convert(v + i * s_.d, values + i * s_.ld_v, s_.d);
      values[i * s_.ld_v + s_.d] = 1.0f;
    }
  }

  // S = Σ φ(K_c)ᵀ [V_c | 1] into b.state (the non-causal forward's first pass).
  template <class T>
  std::int64_t head_full_state(std::int64_t h, const T* k, const T* v, const Buffers& b) const {
    const std::int64_t d = s_.d;
    std::int64_t flops = 0;
    for (std::int64_t c0 = 0; c0 < s_.n; c0 += s_.c) {
      const std::int64_t rows = std::min(s_.c, s_.n - c0);
      flops += features(h, fp32_rows(k, c0, rows, d, b.key_rows), rows, b.xhat_k, b.inv_k, b.scaled, b.phi_k);
      load_values(v + c0 * d, rows, b.values);
      ops::gemm(true, false, s_.m, d + 1, rows, 1.0f, b.phi_k, s_.ld_m, b.values, s_.ld_v, c0 > 0 ? 1.0f : 0.0f,
                b.state, s_.ld_v);
    }
    return flops;
  }

  // The causal backward, chunks in reverse, R = dS_end (the adjoint of the state after the chunk)
  // carried from the later chunks. Per chunk, with S0 its saved start state, L, W_ij = b_j·e^{L_i − L_j},
  // A = tril(φ(Q)φ(K)ᵀ) ⊙ W, β_j = b_j·e^{L_last − L_j} (ungated L = 0, W = β = 1):
  //   out' recomputed (A·[V|1] + diag(e^L)·φ(Q)·S0), G from it;  P = tril(G·[V|1]ᵀ);
  //   dφ(Q) = diag(e^L)·G·S0ᵀ + (P ⊙ W)·φ(K);   dφ(K) = (P ⊙ W)ᵀ·φ(Q) + diag(β)·Y,  Y = [V|1]·Rᵀ;
  //   dV = Aᵀ·G[:, :D] + diag(β)·φ(K)·R[:, :D];  R ← e^{L_last}·R + (diag(e^L)·φ(Q))ᵀ·G.
  // Gated, with T = P ⊙ A (row sums r_i, column sums c_j) and dβ_j = φ(k_j)·Y_j:
  //   dL_i = r_i − c_i + e^{L_i}·φ(q_i)·(G·S0ᵀ)_i − dβ_i·β_i + [i = last](Σ_j dβ_j·β_j + e^{L_last}·⟨R, S0⟩),
  //   b_j·db_j = c_j + dβ_j·β_j,  d(log a_l) = Σ_{i ≥ l} dL_i,  du_l = b_l·d(log a_l) − a_l·(b_l·db_l).
  // bf16: each chunk's saved start state is widened into b.state, its gradient rows computed in
  // g.gradient_rows and rounded once.
  template <class T>
  std::int64_t head_backward_causal(std::int64_t task, const T* const* in, T* const* grads, const Buffers& b,
                                    const GradBuffers& g) {
    const std::int64_t h = task % p_.heads, d = s_.d, cols = d + 1, cells = s_.m * s_.ld_v;
    float* dsigma = sigma_parts_.data() + task * d;
    std::fill_n(dsigma, d, 0.0f);
    float* dgate_w = c_.gate ? gate_weight_parts_.data() + task * d : nullptr;
    float* dgate_b = c_.gate ? gate_bias_parts_.data() + task : nullptr;
    if (c_.gate) {
      std::fill_n(dgate_w, d, 0.0f);
      *dgate_b = 0.0f;
    }
    std::fill_n(g.adjoint, cells, 0.0f);
    std::int64_t flops = 0;
    for (std::int64_t chunk = s_.chunks - 1; chunk >= 0; --chunk) {
      const std::int64_t c0 = chunk * s_.c, rows = std::min(s_.c, s_.n - c0);
      const float* start = load_state<T>(task * s_.chunks + chunk, b.state);
      flops += load_chunk(h, in[0], in[1], in[2], c0, rows, b);
      if (c_.gate) flops += cumulative_logs(rows, b.decay, g.logs);
      // out' of the chunk again, then G and P.
      ops::gemm(false, true, rows, rows, s_.m, 1.0f, b.phi_q, s_.ld_m, b.phi_k, s_.ld_m, 0.0f, b.scores, s_.ld_c);
      mask_upper(b.scores, rows);
      ops::gemm(false, false, rows, cols, s_.m, 1.0f, b.phi_q, s_.ld_m, start, s_.ld_v, 0.0f, b.numerators, s_.ld_v);
      if (c_.gate) flops += decay_scores(rows, b, g.logs);
      ops::gemm(false, false, rows, cols, rows, 1.0f, b.scores, s_.ld_c, b.values, s_.ld_v, 1.0f, b.numerators,
                s_.ld_v);
      flops += output_grads(b.numerators + d, s_.ld_v, in[3] + c0 * d, in[4] + c0 * d, rows, g.output_grads);
      ops::gemm(false, true, rows, rows, cols, 1.0f, g.output_grads, s_.ld_v, b.values, s_.ld_v, 0.0f, g.masked,
                s_.ld_c);
      mask_upper(g.masked, rows);
      if (c_.gate) flops += weight_score_grads(rows, b, g);
      // dφ(Q), dφ(K), dV.
      ops::gemm(false, true, rows, s_.m, cols, 1.0f, g.output_grads, s_.ld_v, start, s_.ld_v, 0.0f, g.dphi_q, s_.ld_m);
      if (c_.gate) flops += query_state_grads(rows, b, g);
      ops::gemm(false, false, rows, s_.m, rows, 1.0f, g.masked, s_.ld_c, b.phi_k, s_.ld_m, 1.0f, g.dphi_q, s_.ld_m);
      ops::gemm(true, false, rows, s_.m, rows, 1.0f, g.masked, s_.ld_c, b.phi_q, s_.ld_m, 0.0f, g.dphi_k, s_.ld_m);
      ops::gemm(false, true, rows, s_.m, cols, 1.0f, b.values, s_.ld_v, g.adjoint, s_.ld_v, 0.0f, g.carried, s_.ld_m);
      flops += carried_key_grads(rows, b, g);
      float* dv = fp32_target(grads[2], c0, d, g.gradient_rows);
      ops::gemm(true, false, rows, d, rows, 1.0f, b.scores, s_.ld_c, g.output_grads, s_.ld_v, 0.0f, dv, d);
      ops::gemm(false, false, rows, d, s_.m, 1.0f, c_.gate ? g.carried : b.phi_k, s_.ld_m, g.adjoint, s_.ld_v, 1.0f, dv,
                d);
      store_rows(dv, grads[2], c0, rows, d);
      if (c_.gate) flops += gate_chunk_grads(rows, b, g, start);
      // R for the chunk before: e^{L_last}·R + (diag(e^L)·φ(Q))ᵀ·G.
      if (c_.gate) flops += decay_adjoint(rows, b, g);
      ops::gemm(true, false, s_.m, cols, rows, 1.0f, c_.gate ? g.carried : b.phi_q, s_.ld_m, g.output_grads, s_.ld_v,
                1.0f, g.adjoint, s_.ld_v);
      float* dq = fp32_target(grads[0], c0, d, g.gradient_rows);
      flops += feature_gradient(h, rows, b.phi_q, g.dphi_q, b.xhat_q, b.inv_q, g.dscaled, dq, dsigma);
      store_rows(dq, grads[0], c0, rows, d);
      float* dk = fp32_target(grads[1], c0, d, g.gradient_rows);
      flops += feature_gradient(h, rows, b.phi_k, g.dphi_k, b.xhat_k, b.inv_k, g.dscaled, dk, dsigma);
      if (c_.gate)
        flops += gate_gradient(h, widened_rows(in[1], c0, d, b.key_rows), rows, g.gate_grads, dk, dgate_w, dgate_b);
      store_rows(dk, grads[1], c0, rows, d);
    }
    return flops;
  }

  void mask_upper(float* scores, std::int64_t rows) const {
    for (std::int64_t i = 0; i + 1 < rows; ++i)
      std::fill(scores + i * s_.ld_c + i + 1, scores + i * s_.ld_c + rows, 0.0f);
  }

  // logs[i] = L_i = Σ_{l≤i} log a_l (a_l in decay). FLOPs 2 per row.
  std::int64_t cumulative_logs(std::int64_t rows, const float* decay, float* logs) const {
    float running = 0.0f;
    for (std::int64_t i = 0; i < rows; ++i) {
      running += std::log(std::max(decay[i], kMinDecay));
      logs[i] = running;
    }
    return 2 * rows;
  }

  // scores ⊙= W (4 per lower entry); numerators (φ(Q)·S0) rows ⊙= e^{L_i} (1 + D + 1 per row).
  std::int64_t decay_scores(std::int64_t rows, const Buffers& b, const float* logs) const {
    for (std::int64_t i = 0; i < rows; ++i) {
      float* row = b.scores + i * s_.ld_c;
      for (std::int64_t j = 0; j <= i; ++j) row[j] *= b.input[j] * std::exp(logs[i] - logs[j]);
      const float scale = std::exp(logs[i]);
      float* numerator = b.numerators + i * s_.ld_v;
#pragma omp simd
      for (std::int64_t e = 0; e <= s_.d; ++e) numerator[e] *= scale;
    }
    return 2 * rows * (rows + 1) + rows * (s_.d + 2);
  }

  // T = P ⊙ A into its row and column sums (3 per lower entry); then P ⊙= W, the weight
  // recomputed (4 per lower entry).
  std::int64_t weight_score_grads(std::int64_t rows, const Buffers& b, const GradBuffers& g) const {
    std::fill_n(g.row_sums, rows, 0.0f);
    std::fill_n(g.col_sums, rows, 0.0f);
    for (std::int64_t i = 0; i < rows; ++i) {
      float* p = g.masked + i * s_.ld_c;
      const float* a = b.scores + i * s_.ld_c;
      for (std::int64_t j = 0; j <= i; ++j) {
        const float t = p[j] * a[j];
        g.row_sums[i] += t;
        g.col_sums[j] += t;
        p[j] *= b.input[j] * std::exp(g.logs[i] - g.logs[j]);
      }
    }
    return 7 * rows * (rows + 1) / 2;
  }

  // dL_i starts at r_i − c_i + e^{L_i}·φ(q_i)·(G·S0ᵀ)_i; then (G·S0ᵀ)_i ⊙= e^{L_i}. 3·M + 4 per row.
  std::int64_t query_state_grads(std::int64_t rows, const Buffers& b, const GradBuffers& g) const {
    for (std::int64_t i = 0; i < rows; ++i) {
      float* dq = g.dphi_q + i * s_.ld_m;
      const float* fq = b.phi_q + i * s_.ld_m;
      const float scale = std::exp(g.logs[i]);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t m = 0; m < s_.m; ++m) dot += fq[m] * dq[m];
#pragma omp simd
      for (std::int64_t m = 0; m < s_.m; ++m) dq[m] *= scale;
      g.log_grads[i] = g.row_sums[i] - g.col_sums[i] + scale * dot;
    }
    return rows * (3 * s_.m + 4);
  }

  // dφ(K) += diag(β)·Y with Y = [V|1]·Rᵀ in g.carried; gated also dβ_j·β_j = (φ(k_j)·Y_j)·β_j
  // into beta_grads and carried ← diag(β)·φ(K) (for dV). FLOPs per row: ungated M; gated 5·M + 4.
  std::int64_t carried_key_grads(std::int64_t rows, const Buffers& b, const GradBuffers& g) const {
    for (std::int64_t j = 0; j < rows; ++j) {
      float* dk = g.dphi_k + j * s_.ld_m;
      float* y = g.carried + j * s_.ld_m;
      const float* fk = b.phi_k + j * s_.ld_m;
      if (!c_.gate) {
#pragma omp simd
        for (std::int64_t m = 0; m < s_.m; ++m) dk[m] += y[m];
        continue;
      }
      const float beta = b.input[j] * std::exp(g.logs[rows - 1] - g.logs[j]);
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t m = 0; m < s_.m; ++m) {
        dot += fk[m] * y[m];
        dk[m] += beta * y[m];
        y[m] = beta * fk[m];
      }
      g.beta_grads[j] = dot * beta;  // dβ_j·β_j
    }
    return c_.gate ? rows * (5 * s_.m + 4) : rows * s_.m;
  }

  // The gate's chunk terms (see head_backward_causal) into g.gate_grads (du). FLOPs per chunk
  // 2·M·(D+1) (⟨R, S0⟩) + 4 (dL_last), per row 7 (the β sums, the suffix sum, b·db, du).
  std::int64_t gate_chunk_grads(std::int64_t rows, const Buffers& b, const GradBuffers& g, const float* start) const {
    float carry = 0.0f;
    for (std::int64_t m = 0; m < s_.m; ++m) {
      const float *r = g.adjoint + m * s_.ld_v, *s0 = start + m * s_.ld_v;
#pragma omp simd reduction(+ : carry)
      for (std::int64_t e = 0; e <= s_.d; ++e) carry += r[e] * s0[e];
    }
    float beta_total = 0.0f;
    for (std::int64_t j = 0; j < rows; ++j) {
      beta_total += g.beta_grads[j];
      g.log_grads[j] -= g.beta_grads[j];
    }
    g.log_grads[rows - 1] += beta_total + std::exp(g.logs[rows - 1]) * carry;
    float suffix = 0.0f;
    for (std::int64_t l = rows - 1; l >= 0; --l) {
      suffix += g.log_grads[l];
      const float input_grad = g.col_sums[l] + g.beta_grads[l];  // b_l·db_l
      g.gate_grads[l] = b.input[l] * suffix - b.decay[l] * input_grad;
    }
    return 2 * s_.m * (s_.d + 1) + 4 + 7 * rows;
  }

  // R ⊙= e^{L_last} (M·(D+1)); carried ← diag(e^L)·φ(Q) (1 + M per row).
  std::int64_t decay_adjoint(std::int64_t rows, const Buffers& b, const GradBuffers& g) const {
    const float carry = std::exp(g.logs[rows - 1]);
    for (std::int64_t m = 0; m < s_.m; ++m) {
      float* r = g.adjoint + m * s_.ld_v;
#pragma omp simd
      for (std::int64_t e = 0; e <= s_.d; ++e) r[e] *= carry;
    }
    for (std::int64_t i = 0; i < rows; ++i) {
      const float scale = std::exp(g.logs[i]);
      const float* fq = b.phi_q + i * s_.ld_m;
      float* y = g.carried + i * s_.ld_m;
#pragma omp simd
      for (std::int64_t m = 0; m < s_.m; ++m) y[m] = scale * fq[m];
    }
    return s_.m * (s_.d + 1) + rows * (1 + s_.m);
  }

  // dk += du·w_g, dw_g += du·k, db_g += du for the chunk's rows. FLOPs 4·D + 1 per row.
  std::int64_t gate_gradient(std::int64_t h, const float* k, std::int64_t rows, const float* du, float* dk, float* dw,
                             float* db) const {
    const std::int64_t d = s_.d;
    const float* w = gate_weight_.data() + h * d;
    for (std::int64_t i = 0; i < rows; ++i) {
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) {
        dk[i * d + c] += du[i] * w[c];
        dw[c] += du[i] * k[i * d + c];
      }
      *db += du[i];
    }
    return rows * (4 * d + 1);
  }

  // grad [H, width] = Σ over the batch of parts [B·H, width]. FLOPs B·H·width.
  std::int64_t reduce_parts(const Tensor& parts, Tensor& grad, std::int64_t width) const {
    grad.fill(0.0f);
    for (std::int64_t task = 0; task < p_.batch * p_.heads; ++task)
      for (std::int64_t c = 0; c < width; ++c) grad[(task % p_.heads) * width + c] += parts[task * width + c];
    return p_.batch * p_.heads * width;
  }

  Problem p_;
  RfaConfig c_;
  Dims s_;
  std::uint64_t seed_;
  Tensor features_, sigma_, gate_weight_, gate_bias_;
  Tensor xhat_q_, xhat_k_, scaled_, inv_q_, inv_k_, phi_q_, phi_k_, values_, numerators_, decay_, input_, state_,
      scores_;
  Tensor checkpoint_z_;  // bf16 training only: the z column of every saved state, fp32 [slots, M]
  Tensor checkpoints_, dphi_q_, dphi_k_, output_grads_, adjoint_, dscaled_, gate_grads_;  // training
  Tensor masked_, carried_, chunk_scalars_;                                               // training, causal
  Tensor sigma_parts_, gate_weight_parts_, gate_bias_parts_;                              // training
  Tensor dsigma_, dgate_weight_, dgate_bias_;                                             // training
  Tensor decode_states_;                                                                  // decoding
  Tensor input_rows_;     // bf16 only: each thread's widened q and k chunk rows [threads, 2, C, D]
  Tensor gradient_rows_;  // bf16 training only: each thread's fp32 dq/dk/dv chunk rows [threads, C, D]
};

std::int64_t parameter_floats(const Problem& p, const RfaConfig& c) {
  return p.heads * (c.features * p.head_dim + p.head_dim) + (c.gate ? p.heads * (p.head_dim + 1) : 0);
}

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const RfaConfig& c, std::uint64_t seed) {
  return std::make_unique<Rfa>(problem, c, seed);
}

std::string unsupported(const Problem& p, const RfaConfig& c) {
  if (c.gate && !p.causal)
    return "RFA-Gate (gate=1) is a recurrence that decays the state over past tokens: causal only";
  return "";
}

std::int64_t flops(const Problem& p, const RfaConfig& c) {
  const Dims s = dims(p, c);
  std::int64_t per_head = s.n * token_input_flops(s, c.gate && p.causal) + s.n * s.d;
  if (!p.causal) return p.batch * p.heads * (per_head + 2 * matmul_flops(s.n, s.m, s.d + 1));
  for (std::int64_t c0 = 0; c0 < s.n; c0 += s.c) {
    const std::int64_t rows = std::min(s.c, s.n - c0);
    per_head += causal_chunk_flops(s, rows) + (c.gate ? decay_flops(s, rows) : 0);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const RfaConfig& c) {
  const Dims s = dims(p, c);
  std::int64_t per_thread = 3 * s.c * s.d + 4 * s.c + 2 * s.c * s.ld_m + 2 * s.c * s.ld_v + s.m * s.ld_v;
  if (p.causal) per_thread += s.c * s.ld_c;
  if (p.dtype == DType::BF16) per_thread += 2 * s.c * s.d;  // the widened q and k rows
  return (parameter_floats(p, c) + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_flops(const Problem& p, const RfaConfig& c) {
  const Dims s = dims(p, c);
  const std::int64_t n = s.n, d = s.d, cols = d + 1, tasks = p.batch * p.heads;
  const std::int64_t grads = n * 3 * d + 2 * n * feature_gradient_row_flops(s);
  std::int64_t per_head = 0;
  if (!p.causal) {
    // S saved; per query: features, out', G, dφ(Q), dS; per key: features, dφ(K), dV.
    per_head = 2 * n * feature_row_flops(s) + grads + 4 * matmul_flops(n, s.m, cols) + matmul_flops(n, d, s.m);
  } else {
    for (std::int64_t c0 = 0; c0 < n; c0 += s.c)
      per_head += causal_backward_chunk_flops(s, std::min(s.c, n - c0), c.gate);
    per_head += grads;
  }
  std::int64_t reduce = tasks * d + (c.gate ? tasks * (d + 1) : 0);
  return tasks * per_head + reduce;
}

std::int64_t backward_workspace(const Problem& p, const RfaConfig& c) {
  const Dims s = dims(p, c);
  const std::int64_t tasks = p.batch * p.heads, cells = s.m * s.ld_v;
  std::int64_t per_thread = 2 * s.c * s.ld_m + s.c * s.ld_v + cells + s.c * s.d + s.c;
  std::int64_t shared = tasks * s.d + p.heads * s.d + (c.gate ? tasks * (s.d + 1) + p.heads * (s.d + 1) : 0);
  if (p.causal) per_thread += s.c * s.ld_c + s.c * s.ld_m + 5 * s.c;
  const std::int64_t slots = tasks * (p.causal ? s.chunks : 1);
  if (p.dtype == DType::BF16) {
    per_thread += s.c * s.d;  // the fp32 gradient rows before rounding
    shared += slots * s.m;    // the saved states' fp32 z columns
  }
  const std::int64_t saved = slots * cells * element_bytes(p.dtype);
  return (shared + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float)) + saved;
}

std::int64_t decode_workspace(const Problem& p, const RfaConfig& c, std::int64_t) {
  const Dims s = dims(p, c);
  return p.batch * p.heads * s.m * s.ld_v * element_bytes(p.dtype);
}

FieldTable<RfaConfig> config_fields(const RfaConfig*) {
  return {int_field("features", &RfaConfig::features, 1, 4096, "random features R per head (φ has 2·R entries)"),
          flag_field("gate", &RfaConfig::gate,
                     "RFA-Gate: g_t = sigmoid(w_g·k_t + b_g) decays the recurrent state (causal only)"),
          real_field("floor", &RfaConfig::floor, 1e-30, 1e6,
                     "lower clamp of the denominator φ(q)·z, dimensionless (the authors' causal code: 1)"),
          int_field("chunk", &RfaConfig::chunk, 1, 8192,
                    "rows per chunk (tokens): feature gemms, non-causal sums, backward checkpoints")};
}

template <>
Implementation implementation<RfaConfig>() {
  Implementation impl = implement<RfaConfig>();
  impl.bf16_forward = true;  // forward and decode: bf16 q, k, v, out and state, fp32 features and sums
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
