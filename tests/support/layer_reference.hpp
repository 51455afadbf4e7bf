#pragma once
// The pre-LN encoder layer (taxonomy/layer/encoder_layer.hpp, docs/layer.md) in double precision with
// exact softmax attention, for the layer-scope gradient checks (tests/contract/test_backward.cpp, the
// mixture-of-experts layer in tests/models/sparse_models/test_moe.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lib/core/rng.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

// The FFN sublayer's output (without the residual) on `rows` rows of a = LN₂(h), [rows, E] row-major.
// The layer starts with γ = 1, β = 0; seeded N(1, 0.5²) gains and shifts make their gradients' factors
// visible.
inline void randomise_layer_norms(EncoderLayer& layer) {
  for (const auto& parameter : layer.parameters())
    if (parameter.name.find("_ln") != std::string::npos)
      CounterRng(5, parameter.name).fill_normal(*const_cast<Tensor*>(parameter.tensor), 1.0f, 0.5f);
}

using FfnReference = std::function<std::vector<double>(const std::vector<double>& a, std::int64_t rows)>;

// y of the layer from the named inputs "x" [B, N, E] and the layer's weights ("layer_w_qkv", "layer_w_o",
// "layer_ln{1,2}_{gain,shift}", and "layer_w_1", "layer_w_2" for the dense FFN), [B, M, E].
// `pooled`: Funnel's pooled-query attention (mean of query rows 2i, 2i + 1; M = ⌈N/2⌉ output rows),
// after which the layer runs on M rows without the attention residual. `ffn`: the FFN sublayer in place
// of the dense GELU(a·W₁)·W₂ (a mixture of experts).
inline std::vector<double> layer_reference(const Problem& p, std::int64_t f, const NamedValues& x, bool pooled = false,
                                           const FfnReference& ffn = {}) {
  const std::int64_t b = p.batch, n = p.seq_len, h = p.heads, d = p.head_dim, e = h * d;
  const std::int64_t m = pooled ? (n + 1) / 2 : n;
  auto layer_norm = [&](const std::vector<double>& in, std::int64_t rows, const std::string& gain,
                        const std::string& shift) {
    std::vector<double> out(in.size());
    for (std::int64_t t = 0; t < rows; ++t) {
      double mean = 0, var = 0;
      for (std::int64_t c = 0; c < e; ++c) mean += in[t * e + c] / e;
      for (std::int64_t c = 0; c < e; ++c) var += (in[t * e + c] - mean) * (in[t * e + c] - mean) / e;
      for (std::int64_t c = 0; c < e; ++c)
        out[t * e + c] = (in[t * e + c] - mean) / std::sqrt(var + 1e-5) * x.at(gain)[c] + x.at(shift)[c];
    }
    return out;
  };
  auto product = [&](const std::vector<double>& a, std::int64_t rows, const std::string& w, std::int64_t inner,
                     std::int64_t cols) {
    std::vector<double> out(static_cast<std::size_t>(rows * cols), 0.0);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t k = 0; k < inner; ++k)
        for (std::int64_t c = 0; c < cols; ++c) out[r * cols + c] += a[r * inner + k] * x.at(w)[k * cols + c];
    return out;
  };
  const auto qkv =
      product(layer_norm(x.at("x"), b * n, "layer_ln1_gain", "layer_ln1_shift"), b * n, "layer_w_qkv", e, 3 * e);
  std::vector<double> attention(static_cast<std::size_t>(b * m * e));
  for (std::int64_t bi = 0; bi < b; ++bi)
    for (std::int64_t head = 0; head < h; ++head) {
      std::vector<double> q(n * d), k(n * d), v(n * d), queries(m * d, 0.0);
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t c = 0; c < d; ++c) {
          const std::int64_t base = (bi * n + t) * 3 * e + head * d + c;
          q[t * d + c] = qkv[base];
          k[t * d + c] = qkv[base + e];
          v[t * d + c] = qkv[base + 2 * e];
        }
      for (std::int64_t i = 0; i < m; ++i) {
        const std::int64_t first = pooled ? 2 * i : i, count = pooled ? std::min<std::int64_t>(2, n - first) : 1;
        for (std::int64_t t = first; t < first + count; ++t)
          for (std::int64_t c = 0; c < d; ++c) queries[i * d + c] += q[t * d + c] / static_cast<double>(count);
      }
      const auto o = reference_attention(queries.data(), k.data(), v.data(), m, n, d, 1.0 / std::sqrt(double(d)),
                                         p.causal ? MaskFn(causal_mask) : MaskFn(full_mask));
      for (std::int64_t t = 0; t < m; ++t)
        for (std::int64_t c = 0; c < d; ++c) attention[(bi * m + t) * e + head * d + c] = o[t * d + c];
    }
  std::vector<double> hidden = product(attention, b * m, "layer_w_o", e, e);
  if (!pooled)
    for (std::size_t i = 0; i < hidden.size(); ++i) hidden[i] += x.at("x")[i];
  const auto normed = layer_norm(hidden, b * m, "layer_ln2_gain", "layer_ln2_shift");
  std::vector<double> y;
  if (ffn) {
    y = ffn(normed, b * m);
  } else {
    auto z = product(normed, b * m, "layer_w_1", e, f);
    for (auto& value : z) value = 0.5 * value * (1 + std::erf(value / std::sqrt(2.0)));
    y = product(z, b * m, "layer_w_2", f, e);
  }
  for (std::size_t i = 0; i < y.size(); ++i) y[i] += hidden[i];
  return y;
}

}  // namespace xfb::test
