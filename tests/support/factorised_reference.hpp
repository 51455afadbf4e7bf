#pragma once
// float64 references of the factorised patterns (sparse-transformer's heads, axial's two stages),
// shared by their fp32 and bf16 tests.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <utility>
#include <vector>

#include "tests/support/reference.hpp"

namespace xfb::test {

// Heads h < ⌈H/2⌉ use A1, the rest A2 (Child et al. 2019, Section 4.2/4.3).
inline HeadMask sparse_mask(bool fixed, std::int64_t l, std::int64_t c, std::int64_t heads, bool causal) {
  return [=](std::int64_t h, std::int64_t i, std::int64_t j) {
    if (causal && j > i) return false;
    const bool first = h < (heads + 1) / 2;
    if (fixed) return first ? i / l == j / l : j % l >= l - c;
    if (first) return causal ? j >= i - l : std::abs(i - j) <= l;
    return ((i - j) % l + l) % l == 0;
  };
}

// Axial attention of one head, naively in double: rows of `cols` tokens, then columns over the
// row outputs; causal: one softmax over the column tokens strictly above (values: row outputs)
// and the row tokens at or before the query (values: V).
template <class T>
std::vector<double> axial_reference(const T* q, const T* k, const T* v, std::int64_t n, std::int64_t d,
                                    std::int64_t cols, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto score = [&](std::int64_t i, std::int64_t j) {
    double s = 0;
    for (std::int64_t e = 0; e < d; ++e) s += static_cast<double>(q[i * d + e]) * k[j * d + e];
    return s * scale;
  };
  std::vector<double> u(static_cast<std::size_t>(n * d), 0.0), out(static_cast<std::size_t>(n * d), 0.0);
  std::vector<double> v_double(v, v + n * d);
  // (key, value row, use row outputs) triples of query i, then softmax-weighted sum.
  auto attend = [&](std::int64_t i, const std::vector<std::pair<std::int64_t, bool>>& keys, std::vector<double>& dst) {
    if (keys.empty()) return;
    double peak = -INFINITY;
    for (auto [j, from_u] : keys) peak = std::max(peak, score(i, j));
    double sum = 0;
    for (auto [j, from_u] : keys) sum += std::exp(score(i, j) - peak);
    for (auto [j, from_u] : keys) {
      const double w = std::exp(score(i, j) - peak) / sum;
      const std::vector<double>& values = from_u ? u : v_double;
      for (std::int64_t e = 0; e < d; ++e) dst[i * d + e] += w * values[j * d + e];
    }
  };
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<std::pair<std::int64_t, bool>> keys;
    for (std::int64_t j = 0; j < n; ++j)
      if (j / cols == i / cols) keys.emplace_back(j, false);
    attend(i, keys, u);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<std::pair<std::int64_t, bool>> keys;
    for (std::int64_t j = 0; j < n; ++j) {
      const bool same_column = j % cols == i % cols, same_row = j / cols == i / cols;
      if (!causal && same_column) keys.emplace_back(j, true);
      if (causal && same_column && j / cols < i / cols) keys.emplace_back(j, true);
      if (causal && same_row && j <= i) keys.emplace_back(j, false);
    }
    attend(i, keys, out);
  }
  return out;
}

}  // namespace xfb::test
