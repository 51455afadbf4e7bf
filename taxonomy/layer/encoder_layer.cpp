#include "taxonomy/layer/encoder_layer.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"

namespace xfb {
namespace {
constexpr std::int64_t kFloat = static_cast<std::int64_t>(sizeof(float));

bool dense(const MoeSettings& ffn) { return ffn.kind == FfnKind::Dense; }
// The elements of W_qkv, W_o, W₁, W₂ (E = H·D, F = d_ff; held in the point's dtype) and of the two
// LayerNorms' gains and shifts (fp32); their gradients are as many, all fp32. A mixture of experts holds
// its own W₁, W₂ (MoeFfn).
std::int64_t matrix_elements(std::int64_t e, std::int64_t d_ff, const MoeSettings& ffn) {
  return e * 3 * e + e * e + (dense(ffn) ? 2 * e * d_ff : 0);
}
std::int64_t weight_bytes(std::int64_t e, std::int64_t d_ff, const MoeSettings& ffn, DType dtype) {
  return matrix_elements(e, d_ff, ffn) * element_bytes(dtype) + 4 * e * kFloat;
}
// The bf16 GELU's fp32 chunks (ops::gelu on bf16) for the dense FFN of a bf16 layer on `rows` rows.
std::int64_t gelu_scratch_floats(const MoeSettings& ffn, DType dtype, std::int64_t rows, std::int64_t d_ff) {
  return dense(ffn) && dtype == DType::BF16 ? ops::bf16_eltwise_scratch_floats(rows * d_ff) : 0;
}

// N(0, 1/rows) draws, rounded to bf16 for a bf16 layer (the fp32 layer's values, rounded).
Tensor random_weight(std::int64_t rows, std::int64_t cols, std::uint64_t seed, const char* name, DType dtype) {
  Tensor w(Shape{rows, cols}, dtype);
  CounterRng(seed, name).fill_normal(w, 0.0f, 1.0f / std::sqrt(static_cast<float>(rows)));
  return w;
}
Tensor constant(std::int64_t n, float value) {
  Tensor t(Shape{n});
  t.fill(value);
  return t;
}
}  // namespace

EncoderLayer::EncoderLayer(const Problem& problem, std::int64_t d_ff, std::int64_t out_rows, bool residual,
                           std::uint64_t seed, const MoeSettings& ffn)
    : p_(problem), e_(problem.heads * problem.head_dim), f_(d_ff), m_(out_rows), residual_(residual) {
  const DType dt = p_.dtype;
  w_qkv_ = random_weight(e_, 3 * e_, seed, "layer/w_qkv", dt);
  w_o_ = random_weight(e_, e_, seed, "layer/w_o", dt);
  if (dense(ffn)) {
    w_1_ = random_weight(e_, f_, seed, "layer/w_1", dt);
    w_2_ = random_weight(f_, e_, seed, "layer/w_2", dt);
  } else {
    moe_ = std::make_unique<MoeFfn>(ffn, p_.batch * m_, e_, f_, p_.threads, seed, dt);
  }
  ln1_gain_ = constant(e_, 1.0f);
  ln1_shift_ = constant(e_, 0.0f);
  ln2_gain_ = constant(e_, 1.0f);
  ln2_shift_ = constant(e_, 0.0f);
  const std::int64_t tokens = p_.batch * p_.seq_len, rows = p_.batch * m_;
  normed_ = Tensor(Shape{tokens, e_}, dt);
  qkv_ = Tensor(Shape{tokens, 3 * e_}, dt);
  q_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim, dt);
  k_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim, dt);
  v_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim, dt);
  o_ = Tensor::bhnd(p_.batch, p_.heads, m_, p_.head_dim, dt);
  merged_ = Tensor(Shape{rows, e_}, dt);
  hidden_ = Tensor(Shape{rows, e_}, dt);
  if (!moe_) ffn_ = Tensor(Shape{rows, f_}, dt);
  if (const std::int64_t floats = gelu_scratch_floats(ffn, dt, rows, f_); floats > 0)
    gelu_scratch_ = Tensor(Shape{floats});
}

namespace {
// Rows of token-major [B·n, parts·E] (row t = [part 0 heads | part 1 heads | …]) to or from head-major
// [B, H, n, D] tensors, one per part (n: N tokens, or M output rows); T float or bf16 (a copy either way).
template <class T>
void split_heads(const Problem& p, std::int64_t n, const T* rows, std::int64_t parts, T* const* heads) {
  const std::int64_t d = p.head_dim, h = p.heads, e = h * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t) {
      const T* row = rows + (b * n + t) * parts * e;
      for (std::int64_t part = 0; part < parts; ++part)
        for (std::int64_t head = 0; head < h; ++head)
          std::copy_n(row + part * e + head * d, d, heads[part] + ((b * h + head) * n + t) * d);
    }
}

template <class T>
void merge_heads(const Problem& p, std::int64_t n, const T* const* heads, std::int64_t parts, T* rows) {
  const std::int64_t d = p.head_dim, h = p.heads, e = h * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t) {
      T* row = rows + (b * n + t) * parts * e;
      for (std::int64_t part = 0; part < parts; ++part)
        for (std::int64_t head = 0; head < h; ++head)
          std::copy_n(heads[part] + ((b * h + head) * n + t) * d, d, row + part * e + head * d);
    }
}
}  // namespace

template <class T>
void EncoderLayer::project_qkv(const Tensor& x) {
  const std::int64_t tokens = p_.batch * p_.seq_len;
  T* normed = elements<T>(training() ? first_normed_ : normed_);
  ops::layer_norm(elements<T>(x), normed, tokens, e_, ln1_gain_.data(), ln1_shift_.data());
  ops::matmul({.m = tokens, .n = 3 * e_, .k = e_}, normed, elements<T>(w_qkv_), elements<T>(qkv_));
  T* const parts[3] = {elements<T>(q_), elements<T>(k_), elements<T>(v_)};
  split_heads(p_, p_.seq_len, elements<T>(qkv_), 3, parts);
}

void EncoderLayer::prepare(Mechanism& mechanism, const Tensor& x) {
  if (bf16_form())
    project_qkv<bf16>(x);
  else
    project_qkv<float>(x);
  mechanism.prepare(q_, k_, v_);
}

void EncoderLayer::forward(Mechanism& mechanism, const Tensor& x, Tensor& y) {
  if (bf16_form())
    forward_as<bf16>(mechanism, x, y);
  else
    forward_as<float>(mechanism, x, y);
}

template <class T>
void EncoderLayer::forward_as(Mechanism& mechanism, const Tensor& x, Tensor& y) {
  const std::int64_t tokens = p_.batch * m_;  // the rows after attention
  project_qkv<T>(x);
  // A forward pass's stages are the mechanism's own and exclude the projections before it; a
  // training step's `forward` stage is the whole layer forward (point.cpp mutes the clock inside).
  if (!training()) stage_clock::restart();
  mechanism.forward(q_, k_, v_, o_);
  const T* const heads[1] = {elements<T>(o_)};
  T* merged = elements<T>(merged_);
  T* hidden = elements<T>(hidden_);
  T* normed = elements<T>(normed_);
  T* out = elements<T>(y);
  merge_heads(p_, m_, heads, 1, merged);
  if (residual_) std::copy_n(elements<T>(x), hidden_.size(), hidden);
  ops::matmul({.m = tokens, .n = e_, .k = e_, .accumulate = residual_}, merged, elements<T>(w_o_), hidden);
  ops::layer_norm(hidden, normed, tokens, e_, ln2_gain_.data(), ln2_shift_.data());
  std::copy_n(hidden, hidden_.size(), out);
  if (moe_) return moe_->forward(normed, out);
  T* activation = elements<T>(ffn_);
  T* pre = training() ? elements<T>(ffn_pre_) : activation;
  ops::matmul({.m = tokens, .n = f_, .k = e_}, normed, elements<T>(w_1_), pre);
  ops::gelu(pre, activation, tokens * f_, gelu_scratch_.data());
  ops::matmul({.m = tokens, .n = e_, .k = f_, .accumulate = true}, activation, elements<T>(w_2_), out);
}

std::vector<NamedTensor> EncoderLayer::parameters() const {
  std::vector<NamedTensor> named = {{"layer_w_qkv", &w_qkv_},       {"layer_w_o", &w_o_},
                                    {"layer_ln1_gain", &ln1_gain_}, {"layer_ln1_shift", &ln1_shift_},
                                    {"layer_ln2_gain", &ln2_gain_}, {"layer_ln2_shift", &ln2_shift_}};
  if (!moe_) named.insert(named.begin() + 2, {{"layer_w_1", &w_1_}, {"layer_w_2", &w_2_}});
  if (moe_)
    for (const auto& t : moe_->parameters()) named.push_back(t);
  return named;
}

void EncoderLayer::prepare_backward(Mechanism& mechanism) {
  if (!training()) prepare_training();
  mechanism.prepare_backward();
}

void EncoderLayer::prepare_training() {
  const std::int64_t tokens = p_.batch * p_.seq_len, rows = p_.batch * m_;
  const DType dt = p_.dtype;
  training_ = true;
  first_normed_ = Tensor(Shape{tokens, e_}, dt);
  if (moe_) {
    moe_->prepare_training();
  } else {
    ffn_pre_ = Tensor(Shape{rows, f_}, dt);
    d_ffn_ = Tensor(Shape{rows, f_}, dt);
    dw_1_ = Tensor(w_1_.shape());
    dw_2_ = Tensor(w_2_.shape());
  }
  for (Tensor* t : {&d_normed_, &ln_scratch_}) *t = Tensor(Shape{tokens, e_});
  d_hidden_ = Tensor(Shape{rows, e_});
  d_merged_ = Tensor(Shape{rows, e_}, dt);
  if (bf16_form()) d_hidden_rounded_ = Tensor(Shape{rows, e_}, dt);
  d_qkv_ = Tensor(Shape{tokens, 3 * e_}, dt);
  do_ = Tensor::bhnd(p_.batch, p_.heads, m_, p_.head_dim, dt);
  for (Tensor* t : {&dq_, &dk_, &dv_}) *t = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim, dt);
  dw_qkv_ = Tensor(w_qkv_.shape());
  dw_o_ = Tensor(w_o_.shape());
  for (Tensor* t : {&d_ln1_gain_, &d_ln1_shift_, &d_ln2_gain_, &d_ln2_shift_}) *t = Tensor(Shape{e_});
}

void EncoderLayer::backward(Mechanism& mechanism, const Tensor& x, const Tensor& dy, Tensor& dx) {
  if (bf16_form())
    backward_as<bf16>(mechanism, x, dy, dx);
  else
    backward_as<float>(mechanism, x, dy, dx);
}

template <class T>
void EncoderLayer::backward_as(Mechanism& mechanism, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const std::int64_t tokens = p_.batch * m_, e = e_, f = f_;
  const T* grad = elements<T>(dy);
  const T* normed = elements<T>(normed_);
  float* d_normed = d_normed_.data();
  // FFN on the B·M rows: y = h + GELU(z)·W₂, z = LN₂(h)·W₁ (or y = h + moe(LN₂(h))).
  if (moe_) {
    moe_->backward(normed, grad, d_normed);
  } else {
    T* d_ffn = elements<T>(d_ffn_);
    ops::matmul({.m = f, .n = e, .k = tokens, .trans_a = true}, elements<T>(ffn_), grad, dw_2_.data());
    ops::matmul({.m = tokens, .n = f, .k = e, .trans_b = true}, grad, elements<T>(w_2_), d_ffn);
    ops::gelu_backward(elements<T>(ffn_pre_), d_ffn, tokens * f, gelu_scratch_.data());
    ops::matmul({.m = e, .n = f, .k = tokens, .trans_a = true}, normed, d_ffn, dw_1_.data());
    ops::matmul({.m = tokens, .n = e, .k = f, .trans_b = true}, d_ffn, elements<T>(w_1_), d_normed);
  }
  convert(grad, d_hidden_.data(), dy.size());
  ops::layer_norm_backward(elements<T>(hidden_), d_normed, tokens, e, ln2_gain_.data(), d_hidden_.data(),
                           d_ln2_gain_.data(), d_ln2_shift_.data(), ln_scratch_.data());
  // Attention block: h = x + merge(o)·W_o (h = merge(o)·W_o without the residual when M ≠ N). A bf16
  // layer rounds dh once for the products (d_hidden_rounded_).
  T* d_hidden = elements<T>(bf16_form() ? d_hidden_rounded_ : d_hidden_);
  if constexpr (std::is_same_v<T, bf16>) narrow(d_hidden_.data(), d_hidden, d_hidden_.size());
  T* d_merged = elements<T>(d_merged_);
  ops::matmul({.m = e, .n = e, .k = tokens, .trans_a = true}, elements<T>(merged_), d_hidden, dw_o_.data());
  ops::matmul({.m = tokens, .n = e, .k = e, .trans_b = true}, d_hidden, elements<T>(w_o_), d_merged);
  T* const out_grad[1] = {elements<T>(do_)};
  split_heads(p_, m_, d_merged, 1, out_grad);
  mechanism.backward(q_, k_, v_, o_, do_, dq_, dk_, dv_);
  const T* const qkv_grads[3] = {elements<T>(dq_), elements<T>(dk_), elements<T>(dv_)};
  T* d_qkv = elements<T>(d_qkv_);
  merge_heads(p_, p_.seq_len, qkv_grads, 3, d_qkv);
  const std::int64_t inputs = p_.batch * p_.seq_len;
  ops::matmul({.m = e, .n = 3 * e, .k = inputs, .trans_a = true}, elements<T>(first_normed_), d_qkv, dw_qkv_.data());
  ops::matmul({.m = inputs, .n = e, .k = 3 * e, .trans_b = true}, d_qkv, elements<T>(w_qkv_), d_normed);
  T* d_input = elements<T>(dx);
  if (residual_)
    std::copy_n(d_hidden, dx.size(), d_input);
  else
    std::fill_n(d_input, dx.size(), stored<T>(0.0f));
  ops::layer_norm_backward(elements<T>(x), d_normed, inputs, e, ln1_gain_.data(), d_input, d_ln1_gain_.data(),
                           d_ln1_shift_.data(), ln_scratch_.data());
}

std::vector<NamedTensor> EncoderLayer::saved() const {
  std::vector<NamedTensor> named = {{"layer_ln1_out", &first_normed_},
                                    {"layer_q", &q_},
                                    {"layer_k", &k_},
                                    {"layer_v", &v_},
                                    {"layer_attention_out", &o_},
                                    {"layer_merged", &merged_},
                                    {"layer_hidden", &hidden_},
                                    {"layer_ln2_out", &normed_}};
  if (moe_)
    for (const auto& t : moe_->saved()) named.push_back(t);
  else
    named.insert(named.end(), {{"layer_ffn_pre", &ffn_pre_}, {"layer_ffn", &ffn_}});
  return named;
}

std::vector<NamedTensor> EncoderLayer::parameter_gradients() const {
  std::vector<NamedTensor> named = {{"dlayer_w_qkv", &dw_qkv_},        {"dlayer_w_o", &dw_o_},
                                    {"dlayer_ln1_gain", &d_ln1_gain_}, {"dlayer_ln1_shift", &d_ln1_shift_},
                                    {"dlayer_ln2_gain", &d_ln2_gain_}, {"dlayer_ln2_shift", &d_ln2_shift_}};
  if (!moe_) named.insert(named.begin() + 2, {{"dlayer_w_1", &dw_1_}, {"dlayer_w_2", &dw_2_}});
  if (moe_)
    for (const auto& t : moe_->parameter_gradients()) named.push_back(t);
  return named;
}

std::vector<NamedTensor> EncoderLayer::attention_gradients() const {
  return {{"attention_dout", &do_}, {"dq", &dq_}, {"dk", &dk_}, {"dv", &dv_}};
}

std::vector<NamedTensor> EncoderLayer::backward_intermediates() const {
  std::vector<NamedTensor> named = {{"layer_dhidden", &d_hidden_}};
  if (!moe_) named.push_back({"layer_dffn_pre", &d_ffn_});
  if (bf16_form()) named.push_back({"layer_dhidden_rounded", &d_hidden_rounded_});
  return named;
}

std::int64_t EncoderLayer::backward_flops_outside_mechanism(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                                            const MoeSettings& ffn, std::int64_t routed) {
  const std::int64_t tokens = p.batch * p.seq_len, rows = p.batch * out_rows, e = p.heads * p.head_dim;
  const std::int64_t attention = 2 * (matmul_flops(tokens, 3 * e, e) + matmul_flops(rows, e, e)) +
                                 kLayerNormBackwardFlopsPerElement * (tokens + rows) * e;
  if (!dense(ffn)) return attention + MoeFfn::backward_flops(ffn, rows, e, d_ff, routed);
  return attention + 2 * (matmul_flops(rows, d_ff, e) + matmul_flops(rows, e, d_ff)) +
         kGeluBackwardFlopsPerElement * rows * d_ff;
}

std::int64_t EncoderLayer::backward_workspace_bytes(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                                    const MoeSettings& ffn) {
  const std::int64_t tokens = p.batch * p.seq_len, rows = p.batch * out_rows, e = p.heads * p.head_dim;
  const std::int64_t ffn_rows = dense(ffn) ? rows * d_ff : 0;  // z and dz of the dense FFN
  // In the dtype: LN₁ output, z; dz; d merge, dh rounded (bf16 only); dqkv; do; dq, dk, dv.
  const std::int64_t rounded_dh = p.dtype == DType::BF16 ? rows * e : 0;
  const std::int64_t typed =
      tokens * e + 2 * ffn_rows + rows * e + rounded_dh + tokens * 3 * e + rows * e + tokens * 3 * e;
  // In fp32: the weights' gradients; dLN, LN scratch; dh.
  const std::int64_t floats = matrix_elements(e, d_ff, ffn) + 4 * e + tokens * 2 * e + rows * e;
  const std::int64_t experts = dense(ffn) ? 0 : MoeFfn::backward_workspace_bytes(ffn, rows, e, d_ff, p.dtype);
  return typed * element_bytes(p.dtype) + floats * kFloat + experts;
}

std::int64_t EncoderLayer::flops_outside_mechanism(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                                   const MoeSettings& ffn, std::int64_t routed) {
  const std::int64_t tokens = p.batch * p.seq_len, rows = p.batch * out_rows, e = p.heads * p.head_dim;
  const std::int64_t attention =
      kLayerNormFlopsPerElement * (tokens + rows) * e + matmul_flops(tokens, 3 * e, e) + matmul_flops(rows, e, e);
  if (!dense(ffn)) return attention + MoeFfn::flops(ffn, rows, e, d_ff, routed);
  return attention + matmul_flops(rows, d_ff, e) + matmul_flops(rows, e, d_ff) + kGeluFlopsPerElement * rows * d_ff;
}

std::int64_t EncoderLayer::workspace_bytes(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                           const MoeSettings& ffn) {
  const std::int64_t tokens = p.batch * p.seq_len, rows = p.batch * out_rows, e = p.heads * p.head_dim;
  // In the dtype: LN output, [q|k|v], q, k, v; o, merge(o), h; GELU input (the experts' buffers instead)
  const std::int64_t buffers = tokens * (e + 3 * e + 3 * e) + rows * (e + e + e + (dense(ffn) ? d_ff : 0));
  const std::int64_t experts = dense(ffn) ? 0 : MoeFfn::workspace_bytes(ffn, rows, e, d_ff, p.dtype);
  return weight_bytes(e, d_ff, ffn, p.dtype) + buffers * element_bytes(p.dtype) +
         gelu_scratch_floats(ffn, p.dtype, rows, d_ff) * kFloat + experts;
}

}  // namespace xfb
