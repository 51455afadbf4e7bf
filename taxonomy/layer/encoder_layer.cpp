#include "taxonomy/layer/encoder_layer.hpp"

#include <cmath>
#include <cstring>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"

namespace xfb {
namespace {
// W_qkv, W_o, W₁, W₂ and the two LayerNorms' gains and shifts (E = H·D, F = d_ff); their gradients
// are as many. A mixture of experts holds its own W₁, W₂ (MoeFfn).
std::int64_t weight_floats(std::int64_t e, std::int64_t d_ff, const MoeSettings& ffn) {
  return e * 3 * e + e * e + (ffn.kind == FfnKind::Dense ? 2 * e * d_ff : 0) + 4 * e;
}
bool dense(const MoeSettings& ffn) { return ffn.kind == FfnKind::Dense; }

Tensor random_weight(std::int64_t rows, std::int64_t cols, std::uint64_t seed, const char* name) {
  Tensor w(Shape{rows, cols});
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
  w_qkv_ = random_weight(e_, 3 * e_, seed, "layer/w_qkv");
  w_o_ = random_weight(e_, e_, seed, "layer/w_o");
  if (dense(ffn)) {
    w_1_ = random_weight(e_, f_, seed, "layer/w_1");
    w_2_ = random_weight(f_, e_, seed, "layer/w_2");
  } else {
    moe_ = std::make_unique<MoeFfn>(ffn, p_.batch * m_, e_, f_, p_.threads, seed);
  }
  ln1_gain_ = constant(e_, 1.0f);
  ln1_shift_ = constant(e_, 0.0f);
  ln2_gain_ = constant(e_, 1.0f);
  ln2_shift_ = constant(e_, 0.0f);
  const std::int64_t tokens = p_.batch * p_.seq_len, rows = p_.batch * m_;
  normed_ = Tensor(Shape{tokens, e_});
  qkv_ = Tensor(Shape{tokens, 3 * e_});
  q_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  k_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  v_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  o_ = Tensor::bhnd(p_.batch, p_.heads, m_, p_.head_dim);
  merged_ = Tensor(Shape{rows, e_});
  hidden_ = Tensor(Shape{rows, e_});
  if (!moe_) ffn_ = Tensor(Shape{rows, f_});
}

namespace {
// Rows of token-major [B·n, parts·E] (row t = [part 0 heads | part 1 heads | …]) to or from head-major
// [B, H, n, D] tensors, one per part (n: N tokens, or M output rows).
void split_heads(const Problem& p, std::int64_t n, const float* rows, std::int64_t parts, float* const* heads) {
  const std::int64_t d = p.head_dim, h = p.heads, e = h * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t) {
      const float* row = rows + (b * n + t) * parts * e;
      for (std::int64_t part = 0; part < parts; ++part)
        for (std::int64_t head = 0; head < h; ++head)
          std::memcpy(heads[part] + ((b * h + head) * n + t) * d, row + part * e + head * d, d * sizeof(float));
    }
}

void merge_heads(const Problem& p, std::int64_t n, const float* const* heads, std::int64_t parts, float* rows) {
  const std::int64_t d = p.head_dim, h = p.heads, e = h * d;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t) {
      float* row = rows + (b * n + t) * parts * e;
      for (std::int64_t part = 0; part < parts; ++part)
        for (std::int64_t head = 0; head < h; ++head)
          std::memcpy(row + part * e + head * d, heads[part] + ((b * h + head) * n + t) * d, d * sizeof(float));
    }
}
}  // namespace

void EncoderLayer::project_qkv(const Tensor& x) {
  const std::int64_t tokens = p_.batch * p_.seq_len;
  float* normed = training() ? first_normed_.data() : normed_.data();
  ops::layer_norm(x.data(), normed, tokens, e_, ln1_gain_.data(), ln1_shift_.data());
  ops::matmul({.m = tokens, .n = 3 * e_, .k = e_}, normed, w_qkv_.data(), qkv_.data());
  float* const parts[3] = {q_.data(), k_.data(), v_.data()};
  split_heads(p_, p_.seq_len, qkv_.data(), 3, parts);
}

void EncoderLayer::prepare(Mechanism& mechanism, const Tensor& x) {
  project_qkv(x);
  mechanism.prepare(q_, k_, v_);
}

void EncoderLayer::forward(Mechanism& mechanism, const Tensor& x, Tensor& y) {
  const std::int64_t tokens = p_.batch * m_;  // the rows after attention
  project_qkv(x);
  // A forward pass's stages are the mechanism's own and exclude the projections before it; a
  // training step's `forward` stage is the whole layer forward (point.cpp mutes the clock inside).
  if (!training()) stage_clock::restart();
  mechanism.forward(q_, k_, v_, o_);
  const float* const heads[1] = {o_.data()};
  merge_heads(p_, m_, heads, 1, merged_.data());
  if (residual_) std::memcpy(hidden_.data(), x.data(), static_cast<std::size_t>(x.bytes()));
  ops::matmul({.m = tokens, .n = e_, .k = e_, .accumulate = residual_}, merged_.data(), w_o_.data(), hidden_.data());
  ops::layer_norm(hidden_.data(), normed_.data(), tokens, e_, ln2_gain_.data(), ln2_shift_.data());
  if (moe_) {
    std::memcpy(y.data(), hidden_.data(), static_cast<std::size_t>(hidden_.bytes()));
    moe_->forward(normed_.data(), y.data());
    return;
  }
  if (training()) {
    ops::matmul({.m = tokens, .n = f_, .k = e_}, normed_.data(), w_1_.data(), ffn_pre_.data());
    std::memcpy(ffn_.data(), ffn_pre_.data(), static_cast<std::size_t>(ffn_pre_.bytes()));
  } else {
    ops::matmul({.m = tokens, .n = f_, .k = e_}, normed_.data(), w_1_.data(), ffn_.data());
  }
  ops::gelu(ffn_.data(), tokens * f_);
  std::memcpy(y.data(), hidden_.data(), static_cast<std::size_t>(hidden_.bytes()));
  ops::matmul({.m = tokens, .n = e_, .k = f_, .accumulate = true}, ffn_.data(), w_2_.data(), y.data());
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
  training_ = true;
  first_normed_ = Tensor(Shape{tokens, e_});
  if (moe_) {
    moe_->prepare_training();
  } else {
    ffn_pre_ = Tensor(Shape{rows, f_});
    d_ffn_ = Tensor(Shape{rows, f_});
    dw_1_ = Tensor(w_1_.shape());
    dw_2_ = Tensor(w_2_.shape());
  }
  for (Tensor* t : {&d_normed_, &ln_scratch_}) *t = Tensor(Shape{tokens, e_});
  for (Tensor* t : {&d_hidden_, &d_merged_}) *t = Tensor(Shape{rows, e_});
  d_qkv_ = Tensor(Shape{tokens, 3 * e_});
  do_ = Tensor::bhnd(p_.batch, p_.heads, m_, p_.head_dim);
  for (Tensor* t : {&dq_, &dk_, &dv_}) *t = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  dw_qkv_ = Tensor(w_qkv_.shape());
  dw_o_ = Tensor(w_o_.shape());
  for (Tensor* t : {&d_ln1_gain_, &d_ln1_shift_, &d_ln2_gain_, &d_ln2_shift_}) *t = Tensor(Shape{e_});
}

void EncoderLayer::backward(Mechanism& mechanism, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const std::int64_t tokens = p_.batch * m_, e = e_, f = f_;
  // FFN on the B·M rows: y = h + GELU(z)·W₂, z = LN₂(h)·W₁ (or y = h + moe(LN₂(h))).
  if (moe_) {
    moe_->backward(normed_.data(), dy.data(), d_normed_.data());
  } else {
    ops::matmul({.m = f, .n = e, .k = tokens, .trans_a = true}, ffn_.data(), dy.data(), dw_2_.data());
    ops::matmul({.m = tokens, .n = f, .k = e, .trans_b = true}, dy.data(), w_2_.data(), d_ffn_.data());
    ops::gelu_backward(ffn_pre_.data(), d_ffn_.data(), tokens * f);
    ops::matmul({.m = e, .n = f, .k = tokens, .trans_a = true}, normed_.data(), d_ffn_.data(), dw_1_.data());
    ops::matmul({.m = tokens, .n = e, .k = f, .trans_b = true}, d_ffn_.data(), w_1_.data(), d_normed_.data());
  }
  std::memcpy(d_hidden_.data(), dy.data(), static_cast<std::size_t>(dy.bytes()));
  ops::layer_norm_backward(hidden_.data(), d_normed_.data(), tokens, e, ln2_gain_.data(), d_hidden_.data(),
                           d_ln2_gain_.data(), d_ln2_shift_.data(), ln_scratch_.data());
  // Attention block: h = x + merge(o)·W_o (h = merge(o)·W_o without the residual when M ≠ N).
  ops::matmul({.m = e, .n = e, .k = tokens, .trans_a = true}, merged_.data(), d_hidden_.data(), dw_o_.data());
  ops::matmul({.m = tokens, .n = e, .k = e, .trans_b = true}, d_hidden_.data(), w_o_.data(), d_merged_.data());
  float* const out_grad[1] = {do_.data()};
  split_heads(p_, m_, d_merged_.data(), 1, out_grad);
  mechanism.backward(q_, k_, v_, o_, do_, dq_, dk_, dv_);
  const float* const qkv_grads[3] = {dq_.data(), dk_.data(), dv_.data()};
  merge_heads(p_, p_.seq_len, qkv_grads, 3, d_qkv_.data());
  const std::int64_t inputs = p_.batch * p_.seq_len;
  ops::matmul({.m = e, .n = 3 * e, .k = inputs, .trans_a = true}, first_normed_.data(), d_qkv_.data(), dw_qkv_.data());
  ops::matmul({.m = inputs, .n = e, .k = 3 * e, .trans_b = true}, d_qkv_.data(), w_qkv_.data(), d_normed_.data());
  if (residual_)
    std::memcpy(dx.data(), d_hidden_.data(), static_cast<std::size_t>(d_hidden_.bytes()));
  else
    dx.fill(0.0f);
  ops::layer_norm_backward(x.data(), d_normed_.data(), inputs, e, ln1_gain_.data(), dx.data(), d_ln1_gain_.data(),
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
  const std::int64_t weights = weight_floats(e, d_ff, ffn);
  const std::int64_t ffn_rows = dense(ffn) ? rows * d_ff : 0;  // z and dz of the dense FFN
  const std::int64_t activations = tokens * e + ffn_rows;      // LN₁ output, z
  // dz; dLN, scratch; dh, d merge; dqkv; do; dq, dk, dv
  const std::int64_t gradients = ffn_rows + tokens * 2 * e + rows * 2 * e + tokens * 3 * e + rows * e + tokens * 3 * e;
  const std::int64_t experts = dense(ffn) ? 0 : MoeFfn::backward_workspace_bytes(ffn, rows, e, d_ff);
  return (weights + activations + gradients) * static_cast<std::int64_t>(sizeof(float)) + experts;
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
  const std::int64_t weights = weight_floats(e, d_ff, ffn);
  // LN output, [q|k|v], q, k, v; o, merge(o), h; GELU input (the experts' buffers instead)
  const std::int64_t buffers = tokens * (e + 3 * e + 3 * e) + rows * (e + e + e + (dense(ffn) ? d_ff : 0));
  const std::int64_t experts = dense(ffn) ? 0 : MoeFfn::workspace_bytes(ffn, rows, e, d_ff);
  return (weights + buffers) * static_cast<std::int64_t>(sizeof(float)) + experts;
}

}  // namespace xfb
