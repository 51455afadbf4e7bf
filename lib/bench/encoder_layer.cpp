#include "lib/bench/encoder_layer.hpp"

#include <cmath>
#include <cstring>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"

namespace xfb {
namespace {
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

EncoderLayer::EncoderLayer(const Problem& problem, std::int64_t d_ff, std::uint64_t seed)
    : p_(problem), e_(problem.heads * problem.head_dim), f_(d_ff) {
  w_qkv_ = random_weight(e_, 3 * e_, seed, "layer/w_qkv");
  w_o_ = random_weight(e_, e_, seed, "layer/w_o");
  w_1_ = random_weight(e_, f_, seed, "layer/w_1");
  w_2_ = random_weight(f_, e_, seed, "layer/w_2");
  ln1_gain_ = constant(e_, 1.0f);
  ln1_shift_ = constant(e_, 0.0f);
  ln2_gain_ = constant(e_, 1.0f);
  ln2_shift_ = constant(e_, 0.0f);
  const std::int64_t tokens = p_.batch * p_.seq_len;
  normed_ = Tensor(Shape{tokens, e_});
  qkv_ = Tensor(Shape{tokens, 3 * e_});
  q_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  k_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  v_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  o_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
  merged_ = Tensor(Shape{tokens, e_});
  hidden_ = Tensor(Shape{tokens, e_});
  ffn_ = Tensor(Shape{tokens, f_});
}

void EncoderLayer::project_qkv(const Tensor& x) {
  const std::int64_t tokens = p_.batch * p_.seq_len, n = p_.seq_len, d = p_.head_dim, h = p_.heads;
  ops::layer_norm(x.data(), normed_.data(), tokens, e_, ln1_gain_.data(), ln1_shift_.data());
  ops::matmul({.m = tokens, .n = 3 * e_, .k = e_}, normed_.data(), w_qkv_.data(), qkv_.data());
  // qkv row t = [q heads | k heads | v heads]; split into [B, H, N, D].
  float* dst[3] = {q_.data(), k_.data(), v_.data()};
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < p_.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t) {
      const float* row = qkv_.data() + (b * n + t) * 3 * e_;
      for (int part = 0; part < 3; ++part)
        for (std::int64_t head = 0; head < h; ++head)
          std::memcpy(dst[part] + ((b * h + head) * n + t) * d, row + part * e_ + head * d, d * sizeof(float));
    }
}

void EncoderLayer::prepare(Mechanism& mechanism, const Tensor& x) {
  project_qkv(x);
  mechanism.prepare(q_, k_, v_);
}

void EncoderLayer::forward(Mechanism& mechanism, const Tensor& x, Tensor& y) {
  const std::int64_t tokens = p_.batch * p_.seq_len, n = p_.seq_len, d = p_.head_dim, h = p_.heads;
  project_qkv(x);
  stage_clock::restart();  // the mechanism's stages exclude the projections before it
  mechanism.forward(q_, k_, v_, o_);
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < p_.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t head = 0; head < h; ++head)
        std::memcpy(merged_.data() + (b * n + t) * e_ + head * d, o_.data() + ((b * h + head) * n + t) * d,
                    d * sizeof(float));
  std::memcpy(hidden_.data(), x.data(), static_cast<std::size_t>(x.bytes()));
  ops::matmul({.m = tokens, .n = e_, .k = e_, .accumulate = true}, merged_.data(), w_o_.data(), hidden_.data());
  ops::layer_norm(hidden_.data(), normed_.data(), tokens, e_, ln2_gain_.data(), ln2_shift_.data());
  ops::matmul({.m = tokens, .n = f_, .k = e_}, normed_.data(), w_1_.data(), ffn_.data());
  ops::gelu(ffn_.data(), tokens * f_);
  std::memcpy(y.data(), hidden_.data(), static_cast<std::size_t>(hidden_.bytes()));
  ops::matmul({.m = tokens, .n = e_, .k = f_, .accumulate = true}, ffn_.data(), w_2_.data(), y.data());
}

std::vector<NamedTensor> EncoderLayer::parameters() const {
  return {{"layer_w_qkv", &w_qkv_},         {"layer_w_o", &w_o_},           {"layer_w_1", &w_1_},
          {"layer_w_2", &w_2_},             {"layer_ln1_gain", &ln1_gain_}, {"layer_ln1_shift", &ln1_shift_},
          {"layer_ln2_gain", &ln2_gain_}, {"layer_ln2_shift", &ln2_shift_}};
}

std::int64_t EncoderLayer::flops_outside_mechanism(const Problem& p, std::int64_t d_ff) {
  const std::int64_t tokens = p.batch * p.seq_len, e = p.heads * p.head_dim;
  return 2 * kLayerNormFlopsPerElement * tokens * e + matmul_flops(tokens, 3 * e, e) + matmul_flops(tokens, e, e) +
         matmul_flops(tokens, d_ff, e) + matmul_flops(tokens, e, d_ff) + kGeluFlopsPerElement * tokens * d_ff;
}

std::int64_t EncoderLayer::workspace_bytes(const Problem& p, std::int64_t d_ff) {
  const std::int64_t tokens = p.batch * p.seq_len, e = p.heads * p.head_dim;
  const std::int64_t weights = e * 3 * e + e * e + 2 * e * d_ff + 4 * e;
  const std::int64_t buffers = tokens * (e + 3 * e + 4 * e + e + e + d_ff);
  return (weights + buffers) * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace xfb
