#include "taxonomy/layer/moe_ffn.hpp"

#include <algorithm>
#include <cmath>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"

namespace xfb {
namespace {

constexpr std::int64_t kFloat = static_cast<std::int64_t>(sizeof(float));

std::int64_t group_rows(const MoeSettings& s, std::int64_t rows) {
  return s.group_size > 0 ? std::min(s.group_size, rows) : rows;
}

// The router's input rows widened per block (bf16 form): [min(T, kRouterBlock), d] fp32.
constexpr std::int64_t kRouterBlock = 1024;
std::int64_t router_scratch_floats(std::int64_t rows, std::int64_t width, DType dtype) {
  return dtype == DType::BF16 ? std::min(rows, kRouterBlock) * width : 0;
}
// GELU runs on one expert's c_e ≤ slots rows at a time.
std::int64_t gelu_scratch_floats(DType dtype, std::int64_t slot_rows, std::int64_t d_ff) {
  return dtype == DType::BF16 ? ops::bf16_eltwise_scratch_floats(slot_rows * d_ff) : 0;
}

Tensor random_weight(Shape shape, std::int64_t fan_in, std::uint64_t seed, const char* stream,
                     DType dtype = DType::F32) {
  Tensor w(std::move(shape), dtype);
  CounterRng(seed, stream).fill_normal(w, 0.0f, 1.0f / std::sqrt(static_cast<float>(fan_in)));
  return w;
}

// The row's largest entry other than `skip` (ties: the lower index); experts ≥ 2 when skip ≥ 0.
std::int64_t top_expert(const float* p, std::int64_t experts, std::int64_t skip) {
  std::int64_t best = skip == 0 ? 1 : 0;
  for (std::int64_t i = best + 1; i < experts; ++i)
    if (i != skip && p[i] > p[best]) best = i;
  return best;
}

}  // namespace

std::int64_t MoeFfn::groups(const MoeSettings& s, std::int64_t rows) {
  const std::int64_t size = group_rows(s, rows);
  return (rows + size - 1) / size;
}

std::int64_t MoeFfn::capacity(const MoeSettings& s, std::int64_t group) {
  const auto even = static_cast<std::int64_t>(
      std::floor(static_cast<double>(ffn_top_k(s.kind) * group) * s.capacity_factor / static_cast<double>(s.experts)));
  return std::min(group, std::max(kMinCapacity, even));
}

std::int64_t MoeFfn::slots(const MoeSettings& s, std::int64_t rows) {
  const std::int64_t size = group_rows(s, rows), full = rows / size, rest = rows % size;
  return full * capacity(s, size) + (rest > 0 ? capacity(s, rest) : 0);
}

MoeFfn::MoeFfn(const MoeSettings& settings, std::int64_t rows, std::int64_t width, std::int64_t d_ff, int threads,
               std::uint64_t seed, DType dtype)
    : s_(settings),
      dtype_(dtype),
      t_(rows),
      d_(width),
      f_(d_ff),
      x_(settings.experts),
      k_(ffn_top_k(settings.kind)),
      slots_(slots(settings, rows)),
      threads_(threads) {
  w_router_ = random_weight(Shape{d_, x_}, d_, seed, "moe/w_router");
  w_1_ = random_weight(Shape{x_, d_, f_}, d_, seed, "moe/w_1", dtype);
  w_2_ = random_weight(Shape{x_, f_, d_}, f_, seed, "moe/w_2", dtype);
  if (k_ == 2) {
    second_draw_ = Tensor(Shape{t_});
    CounterRng(seed, "moe/second_draw").fill_uniform(second_draw_, 0.0f, 1.0f);
  }
  probs_ = Tensor(Shape{t_, x_});
  for (Tensor* t : {&choice_, &gate_, &slot_}) *t = Tensor(Shape{t_, k_});
  aux_ = Tensor(Shape{1});
  first_fraction_ = Tensor(Shape{groups(s_, t_), x_});
  expert_in_ = Tensor(Shape{x_, slots_, d_}, dtype);
  expert_hidden_ = Tensor(Shape{x_, slots_, f_}, dtype);
  expert_out_ = Tensor(Shape{x_, slots_, d_}, dtype);
  if (dtype == DType::BF16) {
    router_rows_ = Tensor(Shape{router_scratch_floats(t_, d_, dtype)});
    gelu_scratch_ = Tensor(Shape{gelu_scratch_floats(dtype, slots_, f_)});
  }
  counts_.assign(static_cast<std::size_t>(x_), 0);
}

void MoeFfn::prepare_training() {
  expert_pre_ = Tensor(Shape{x_, slots_, f_}, dtype_);
  d_expert_hidden_ = Tensor(Shape{x_, slots_, f_}, dtype_);
  d_expert_out_ = Tensor(Shape{x_, slots_, d_}, dtype_);
  d_expert_in_ = Tensor(Shape{x_, slots_, d_}, dtype_);
  d_probs_ = Tensor(Shape{t_, x_});
  dw_router_ = Tensor(w_router_.shape());
  dw_1_ = Tensor(w_1_.shape());
  dw_2_ = Tensor(w_2_.shape());
}

double MoeFfn::expert_load() const {
  if (routed_ == 0) return 0;
  const std::int64_t most = *std::max_element(counts_.begin(), counts_.end());
  return static_cast<double>(most) * static_cast<double>(x_) / static_cast<double>(routed_);
}

void MoeFfn::route() {
  const std::int64_t x = x_, k = k_;
  float* probs = probs_.data();
  float* choice = choice_.data();
  float* gate = gate_.data();
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (std::int64_t t = 0; t < t_; ++t) {
    float* p = probs + t * x;
    ops::softmax_in_place(p, x);
    const std::int64_t first = top_expert(p, x, -1);
    choice[t * k] = static_cast<float>(first);
    if (k == 1) {
      gate[t] = p[first];
      continue;
    }
    const std::int64_t second = top_expert(p, x, first);
    const float sum = p[first] + p[second];
    gate[t * k] = p[first] / sum;
    gate[t * k + 1] = p[second] / sum;
    choice[t * k + 1] = static_cast<float>(second);
  }
  // Capacity, group by group in row order: first choices, then the second choices the draw keeps.
  float* slot = slot_.data();
  std::fill(counts_.begin(), counts_.end(), 0);
  std::vector<std::int64_t> taken(static_cast<std::size_t>(x));
  const std::int64_t size = group_rows(s_, t_), group_count = groups(s_, t_);
  double loss = 0;
  dropped_ = 0;
  for (std::int64_t g = 0; g < group_count; ++g) {
    const std::int64_t begin = g * size, end = std::min(t_, begin + size), rows = end - begin;
    const std::int64_t cap = capacity(s_, rows);
    std::fill(taken.begin(), taken.end(), 0);
    std::vector<std::int64_t> firsts(static_cast<std::size_t>(x), 0);
    std::vector<double> mean_p(static_cast<std::size_t>(x), 0.0);
    for (std::int64_t t = begin; t < end; ++t) {
      ++firsts[static_cast<std::int64_t>(choice[t * k])];
      for (std::int64_t i = 0; i < x; ++i) mean_p[i] += probs[t * x + i];
    }
    float* fraction = first_fraction_.data() + g * x;
    for (std::int64_t i = 0; i < x; ++i) fraction[i] = static_cast<float>(firsts[i]) / static_cast<float>(rows);
    for (std::int64_t j = 0; j < k; ++j)
      for (std::int64_t t = begin; t < end; ++t) {
        const auto e = static_cast<std::int64_t>(choice[t * k + j]);
        const bool drawn = j == 0 || second_draw_[t] < gate[t * k + j] / static_cast<float>(kSecondThreshold);
        if (drawn && taken[e] < cap) {
          ++taken[e];
          slot[t * k + j] = static_cast<float>(counts_[e]++);
        } else {
          slot[t * k + j] = -1.0f;
          gate[t * k + j] = 0.0f;
        }
      }
    double group_loss = 0;
    for (std::int64_t i = 0; i < x; ++i) group_loss += fraction[i] * mean_p[i] / static_cast<double>(rows);
    loss += static_cast<double>(x) * group_loss;
  }
  routed_ = 0;
  for (std::int64_t t = 0; t < t_; ++t) {
    bool kept = false;
    for (std::int64_t j = 0; j < k; ++j) kept = kept || slot[t * k + j] >= 0;
    dropped_ += kept ? 0 : 1;
  }
  for (std::int64_t c : counts_) routed_ += c;
  aux_loss_ = kAuxLossCoefficient * loss / static_cast<double>(group_count);
  aux_[0] = static_cast<float>(aux_loss_);
}

// logits = a·W_r into probs_ (fp32): a fp32 directly; bf16 rows widened block by block (exact), so the
// router sees the same values in fp32 either way.
void MoeFfn::router_logits(const float* a) {
  ops::matmul({.m = t_, .n = x_, .k = d_}, a, w_router_.data(), probs_.data());
}
void MoeFfn::router_logits(const bf16* a) {
  for (std::int64_t r0 = 0; r0 < t_; r0 += kRouterBlock) {
    const std::int64_t rows = std::min(kRouterBlock, t_ - r0);
    widen(a + r0 * d_, router_rows_.data(), rows * d_);
    ops::matmul({.m = rows, .n = x_, .k = d_}, router_rows_.data(), w_router_.data(), probs_.data() + r0 * x_);
  }
}
// dW_r = aᵀ·dlogits (fp32), a widened block by block for bf16.
void MoeFfn::router_weight_gradient(const float* a, const float* dlogits) {
  ops::matmul({.m = d_, .n = x_, .k = t_, .trans_a = true}, a, dlogits, dw_router_.data());
}
void MoeFfn::router_weight_gradient(const bf16* a, const float* dlogits) {
  for (std::int64_t r0 = 0; r0 < t_; r0 += kRouterBlock) {
    const std::int64_t rows = std::min(kRouterBlock, t_ - r0);
    widen(a + r0 * d_, router_rows_.data(), rows * d_);
    ops::matmul({.m = d_, .n = x_, .k = rows, .trans_a = true, .accumulate = r0 > 0}, router_rows_.data(),
                dlogits + r0 * x_, dw_router_.data());
  }
}

void MoeFfn::forward(const float* a, float* y) { forward_as(a, y); }
void MoeFfn::forward(const bf16* a, bf16* y) { forward_as(a, y); }
void MoeFfn::backward(const float* a, const float* dy, float* da) { backward_as(a, dy, da); }
void MoeFfn::backward(const bf16* a, const bf16* dy, float* da) { backward_as(a, dy, da); }

template <class T>
void MoeFfn::forward_as(const T* a, T* y) {
  const std::int64_t d = d_, f = f_, k = k_;
  router_logits(a);
  route();
  FlopCounter::add(flops(s_, t_, d, f, 0) - matmul_flops(t_, x_, d));  // softmax, aux loss, renormalisation
  const float* slot = slot_.data();
  const float* choice = choice_.data();
  T* expert_in = elements<T>(expert_in_);
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (std::int64_t t = 0; t < t_; ++t)
    for (std::int64_t j = 0; j < k; ++j)
      if (slot[t * k + j] >= 0) {
        const auto e = static_cast<std::int64_t>(choice[t * k + j]), row = static_cast<std::int64_t>(slot[t * k + j]);
        std::copy_n(a + t * d, d, expert_in + (e * slots_ + row) * d);
      }
  T* expert_out = elements<T>(expert_out_);
  for (std::int64_t e = 0; e < x_; ++e) {
    const std::int64_t rows = counts_[e];
    if (rows == 0) continue;
    T* hidden = elements<T>(expert_hidden_) + e * slots_ * f;
    T* pre = training() ? elements<T>(expert_pre_) + e * slots_ * f : hidden;
    ops::matmul({.m = rows, .n = f, .k = d}, expert_in + e * slots_ * d, elements<T>(w_1_) + e * d * f, pre);
    ops::gelu(pre, hidden, rows * f, gelu_scratch_.data());
    ops::matmul({.m = rows, .n = d, .k = f}, hidden, elements<T>(w_2_) + e * f * d, expert_out + e * slots_ * d);
  }
  // y_t += Σ_kept g·out, summed in fp32 and stored once.
  const float* gate = gate_.data();
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (std::int64_t t = 0; t < t_; ++t) {
    const T* outs[2] = {nullptr, nullptr};
    float gates[2] = {0.0f, 0.0f};
    std::int64_t kept = 0;
    for (std::int64_t j = 0; j < k; ++j)
      if (slot[t * k + j] >= 0) {
        const auto e = static_cast<std::int64_t>(choice[t * k + j]), row = static_cast<std::int64_t>(slot[t * k + j]);
        outs[kept] = expert_out + (e * slots_ + row) * d;
        gates[kept++] = gate[t * k + j];
      }
    T* target = y + t * d;
    for (std::int64_t i = 0; i < d; ++i) {
      float value = as_float(target[i]);
      for (std::int64_t c = 0; c < kept; ++c) value += gates[c] * as_float(outs[c][i]);
      target[i] = stored<T>(value);
    }
  }
  FlopCounter::add(routed_ * 2 * d);
}

template <class T>
void MoeFfn::backward_as(const T* a, const T* dy, float* da) {
  const std::int64_t d = d_, f = f_, k = k_, x = x_;
  const float* slot = slot_.data();
  const float* choice = choice_.data();
  const float* gate = gate_.data();
  const float* probs = probs_.data();
  float* dp = d_probs_.data();
  const T* expert_out = elements<T>(expert_out_);
  T* d_expert_out = elements<T>(d_expert_out_);
  // Each kept pair: dg = ⟨dy_t, FFN_e(a_t)⟩ into dp through the gates, and the expert's output gradient g·dy_t.
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (std::int64_t t = 0; t < t_; ++t) {
    float dg[2] = {0.0f, 0.0f};
    for (std::int64_t j = 0; j < k; ++j) {
      if (slot[t * k + j] < 0) continue;
      const auto e = static_cast<std::int64_t>(choice[t * k + j]), row = static_cast<std::int64_t>(slot[t * k + j]);
      const T* out = expert_out + (e * slots_ + row) * d;
      T* d_out = d_expert_out + (e * slots_ + row) * d;
      const T* grad = dy + t * d;
      const float g = gate[t * k + j];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t i = 0; i < d; ++i) {
        dot += as_float(grad[i]) * as_float(out[i]);
        d_out[i] = stored<T>(g * as_float(grad[i]));
      }
      dg[j] = dot;
    }
    float* row_dp = dp + t * x;
    std::fill(row_dp, row_dp + x, 0.0f);
    const auto first = static_cast<std::int64_t>(choice[t * k]);
    if (k == 1) {
      row_dp[first] = dg[0];
    } else {  // g_j = p_j/(p₁ + p₂): ∂g₁/∂p₁ = p₂/s², ∂g₁/∂p₂ = −p₁/s², and g₂ alike
      const auto second = static_cast<std::int64_t>(choice[t * k + 1]);
      const float p1 = probs[t * x + first], p2 = probs[t * x + second], s = p1 + p2;
      const float scale = (dg[0] - dg[1]) / (s * s);
      row_dp[first] = p2 * scale;
      row_dp[second] = -p1 * scale;
    }
  }
  // The aux loss: ∂L/∂p_ti = 0.01·X·f_gi/(G·S_g).
  const std::int64_t size = group_rows(s_, t_), group_count = groups(s_, t_);
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (std::int64_t t = 0; t < t_; ++t) {
    const std::int64_t g = t / size, rows = std::min(t_, (g + 1) * size) - g * size;
    const float scale =
        static_cast<float>(kAuxLossCoefficient * static_cast<double>(x) / static_cast<double>(group_count * rows));
    const float* fraction = first_fraction_.data() + g * x;
    for (std::int64_t i = 0; i < x; ++i) dp[t * x + i] += scale * fraction[i];
  }
  ops::softmax_backward_rows_masked(probs, dp, 1, t_, x, x, false);
  // The experts, each on its c_e rows.
  for (std::int64_t e = 0; e < x; ++e) {
    const std::int64_t rows = counts_[e];
    float* dw1 = dw_1_.data() + e * d * f;
    float* dw2 = dw_2_.data() + e * f * d;
    if (rows == 0) {
      std::fill(dw1, dw1 + d * f, 0.0f);
      std::fill(dw2, dw2 + f * d, 0.0f);
      continue;
    }
    const T* d_out = d_expert_out + e * slots_ * d;
    T* d_hidden = elements<T>(d_expert_hidden_) + e * slots_ * f;
    ops::matmul({.m = f, .n = d, .k = rows, .trans_a = true}, elements<T>(expert_hidden_) + e * slots_ * f, d_out, dw2);
    ops::matmul({.m = rows, .n = f, .k = d, .trans_b = true}, d_out, elements<T>(w_2_) + e * f * d, d_hidden);
    ops::gelu_backward(elements<T>(expert_pre_) + e * slots_ * f, d_hidden, rows * f, gelu_scratch_.data());
    ops::matmul({.m = d, .n = f, .k = rows, .trans_a = true}, elements<T>(expert_in_) + e * slots_ * d, d_hidden, dw1);
    ops::matmul({.m = rows, .n = d, .k = f, .trans_b = true}, d_hidden, elements<T>(w_1_) + e * d * f,
                elements<T>(d_expert_in_) + e * slots_ * d);
  }
  // da = Σ_kept ∂FFN (scattered back) + dlogits·W_rᵀ; dW_r = aᵀ·dlogits.
  const T* d_expert_in = elements<T>(d_expert_in_);
#pragma omp parallel for schedule(static) num_threads(threads_)
  for (std::int64_t t = 0; t < t_; ++t) {
    float* target = da + t * d;
    std::fill(target, target + d, 0.0f);
    for (std::int64_t j = 0; j < k; ++j)
      if (slot[t * k + j] >= 0) {
        const auto e = static_cast<std::int64_t>(choice[t * k + j]), row = static_cast<std::int64_t>(slot[t * k + j]);
        const T* grad = d_expert_in + (e * slots_ + row) * d;
#pragma omp simd
        for (std::int64_t i = 0; i < d; ++i) target[i] += as_float(grad[i]);
      }
  }
  router_weight_gradient(a, dp);
  ops::matmul({.m = t_, .n = d, .k = x, .trans_b = true, .accumulate = true}, dp, w_router_.data(), da);
  FlopCounter::add(routed_ * 4 * d + t_ * x + (k == 2 ? 6 * t_ : 0));
}

std::vector<NamedTensor> MoeFfn::parameters() const {
  std::vector<NamedTensor> named = {{"moe_w_router", &w_router_}, {"moe_w_1", &w_1_}, {"moe_w_2", &w_2_}};
  if (k_ == 2) named.push_back({"moe_second_draw", &second_draw_});
  named.insert(named.end(),
               {{"moe_choice", &choice_}, {"moe_slot", &slot_}, {"moe_gate", &gate_}, {"moe_aux_loss", &aux_}});
  return named;
}

std::vector<NamedTensor> MoeFfn::saved() const {
  return {{"moe_probabilities", &probs_},
          {"moe_expert_in", &expert_in_},
          {"moe_expert_pre", &expert_pre_},
          {"moe_expert_hidden", &expert_hidden_},
          {"moe_expert_out", &expert_out_}};
}

std::vector<NamedTensor> MoeFfn::parameter_gradients() const {
  return {{"dmoe_w_router", &dw_router_}, {"dmoe_w_1", &dw_1_}, {"dmoe_w_2", &dw_2_}};
}

std::vector<NamedTensor> MoeFfn::backward_intermediates() const {
  return {{"moe_d_expert_out", &d_expert_out_},
          {"moe_d_expert_pre", &d_expert_hidden_},
          {"moe_d_expert_in", &d_expert_in_},
          {"moe_d_logits", &d_probs_}};
}

std::int64_t MoeFfn::flops(const MoeSettings& s, std::int64_t rows, std::int64_t width, std::int64_t d_ff,
                           std::int64_t routed) {
  const std::int64_t x = s.experts;
  const std::int64_t router = matmul_flops(rows, x, width) + kSoftmaxFlopsPerElement * rows * x + rows * x +
                              2 * groups(s, rows) * x + (ffn_top_k(s.kind) == 2 ? 3 * rows : 0);
  return router + routed * (2 * matmul_flops(1, d_ff, width) + kGeluFlopsPerElement * d_ff + 2 * width);
}

std::int64_t MoeFfn::backward_flops(const MoeSettings& s, std::int64_t rows, std::int64_t width, std::int64_t d_ff,
                                    std::int64_t routed) {
  const std::int64_t x = s.experts;
  const std::int64_t router = 2 * matmul_flops(rows, x, width) + kSoftmaxBackwardFlopsPerElement * rows * x + rows * x +
                              (ffn_top_k(s.kind) == 2 ? 6 * rows : 0);
  return router + routed * (4 * matmul_flops(1, d_ff, width) + kGeluBackwardFlopsPerElement * d_ff + 4 * width);
}

std::int64_t MoeFfn::workspace_bytes(const MoeSettings& s, std::int64_t rows, std::int64_t width, std::int64_t d_ff,
                                     DType dtype) {
  const std::int64_t x = s.experts, k = ffn_top_k(s.kind), slot_rows = x * slots(s, rows);
  // fp32: W_r, the second-choice draws, the routing, the bf16 form's scratch; in the dtype: W₁, W₂, the buffers.
  const std::int64_t floats = width * x + (k == 2 ? rows : 0) + rows * x + 3 * rows * k + 1 + groups(s, rows) * x +
                              router_scratch_floats(rows, width, dtype) +
                              gelu_scratch_floats(dtype, slots(s, rows), d_ff);
  const std::int64_t typed = 2 * x * width * d_ff + slot_rows * (2 * width + d_ff);
  return floats * kFloat + typed * element_bytes(dtype);
}

std::int64_t MoeFfn::backward_workspace_bytes(const MoeSettings& s, std::int64_t rows, std::int64_t width,
                                              std::int64_t d_ff, DType dtype) {
  const std::int64_t x = s.experts, slot_rows = x * slots(s, rows);
  const std::int64_t typed = slot_rows * (2 * d_ff + 2 * width);            // pre, d hidden, d out, d in
  const std::int64_t floats = rows * x + width * x + 2 * x * width * d_ff;  // d probs; the weights' gradients
  return typed * element_bytes(dtype) + floats * kFloat;
}

}  // namespace xfb
