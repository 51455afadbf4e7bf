#pragma once
// Synthesizer's logits and output computed naively in double (taxonomy/low_rank/synthesizer.hpp),
// from the parameter tensors the mechanism reports: the reference of the fp32 and bf16 tests.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

// Synthesizer logits for one (batch, head), in double, with the magnitude of their terms.
struct Logits {
  std::vector<double> value, terms;  // [N, N]
};

inline Logits synthesizer_logits(const MechanismRun& run, const std::string& variant, double mix, const float* q,
                                 const float* k, std::int64_t head, std::int64_t n, std::int64_t d) {
  Logits l{std::vector<double>(static_cast<std::size_t>(n * n)), std::vector<double>(static_cast<std::size_t>(n * n))};
  std::vector<double> hidden(static_cast<std::size_t>(n * d)), hidden_terms(static_cast<std::size_t>(n * d));
  if (variant == "dense") {
    const float* w1 = run.parameter("w1").data() + head * d * d;
    const float* b1 = run.parameter("b1").data() + head * d;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t c = 0; c < d; ++c) {
        double s = b1[c], t = std::fabs(b1[c]);
        for (std::int64_t e = 0; e < d; ++e) {
          s += static_cast<double>(q[i * d + e]) * w1[e * d + c];
          t += std::fabs(static_cast<double>(q[i * d + e]) * w1[e * d + c]);
        }
        hidden[i * d + c] = std::max(s, 0.0);
        hidden_terms[i * d + c] = t;
      }
  }
  const std::int64_t rank = variant == "factorized-random" ? run.parameter("r1").dim(2) : 0;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0, t = 0;
      if (variant == "dense") {
        const float* w2 = run.parameter("w2").data() + head * d * n;
        const double b2 = run.parameter("b2")[head * n + j];
        s = b2;
        t = std::fabs(b2);
        for (std::int64_t c = 0; c < d; ++c) {
          s += hidden[i * d + c] * w2[c * n + j];
          t += hidden_terms[i * d + c] * std::fabs(w2[c * n + j]);
        }
      } else if (variant == "random") {
        s = run.parameter("r")[(head * n + i) * n + j];
        t = std::fabs(s);
      } else {
        const float* r1 = run.parameter("r1").data() + head * n * rank;
        const float* r2 = run.parameter("r2").data() + head * n * rank;
        for (std::int64_t c = 0; c < rank; ++c) {
          s += static_cast<double>(r1[i * rank + c]) * r2[j * rank + c];
          t += std::fabs(static_cast<double>(r1[i * rank + c]) * r2[j * rank + c]);
        }
      }
      double dot = 0, dot_terms = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        dot += static_cast<double>(q[i * d + c]) * k[j * d + c];
        dot_terms += std::fabs(static_cast<double>(q[i * d + c]) * k[j * d + c]);
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      l.value[i * n + j] = (1 - mix) * s + mix * dot * scale;
      l.terms[i * n + j] = (1 - mix) * t + mix * dot_terms * scale;
    }
  return l;
}

inline std::vector<double> softmax_times_v(const Logits& l, const float* v, std::int64_t n, std::int64_t d,
                                           bool causal) {
  std::vector<double> out(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t valid = causal ? i + 1 : n;
    double peak = -INFINITY, sum = 0;
    for (std::int64_t j = 0; j < valid; ++j) peak = std::max(peak, l.value[i * n + j]);
    for (std::int64_t j = 0; j < valid; ++j) sum += std::exp(l.value[i * n + j] - peak);
    for (std::int64_t j = 0; j < valid; ++j) {
      const double w = std::exp(l.value[i * n + j] - peak) / sum;
      for (std::int64_t c = 0; c < d; ++c) out[i * d + c] += w * v[j * d + c];
    }
  }
  return out;
}

// As attention_tolerance, with the logits' own term magnitudes.
inline double logits_tolerance(const Logits& l, const float* v, std::int64_t n, std::int64_t d) {
  double largest = 0;
  for (double t : l.terms) largest = std::max(largest, t);
  return 8 * kFloatEps * (largest + std::log2(static_cast<double>(n)) + 1) * max_abs(v, n * d);
}

}  // namespace xfb::test
