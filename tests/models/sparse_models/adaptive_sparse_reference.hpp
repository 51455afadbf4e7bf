#pragma once
// adaptive-sparse's reference in double (taxonomy/sparse_models/adaptive_sparse.hpp): exact α-entmax,
// the mechanism, and the fp32 output tolerance, for the fp32 and bf16 tests.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

// Exact α-entmax of z in double: x = (α−1)·z sorted in descending order; the support is the
// largest k whose mass at τ = x_(k), Σ_{j<k} (x_(j) − x_(k))^(1/(α−1)), is below 1; then τ on
// that support by 200 bisection steps in [max(x_(k+1), x_(1) − 1), x_(k)].
inline std::vector<double> reference_entmax(const std::vector<double>& z, double alpha) {
  const double a = alpha - 1.0, inverse = 1.0 / a;
  std::vector<double> x(z.size());
  for (std::size_t j = 0; j < z.size(); ++j) x[j] = a * z[j];
  std::vector<double> sorted = x;
  std::sort(sorted.begin(), sorted.end(), std::greater<double>());
  auto mass = [&](std::size_t k, double tau) {
    double sum = 0;
    for (std::size_t j = 0; j < k; ++j) sum += std::pow(std::max(0.0, sorted[j] - tau), inverse);
    return sum;
  };
  std::size_t support = 1;
  while (support < sorted.size() && mass(support, sorted[support]) < 1.0) ++support;
  double lo = sorted[0] - 1.0, hi = sorted[support - 1];
  if (support < sorted.size()) lo = std::max(lo, sorted[support]);
  for (int step = 0; step < 200; ++step) {
    const double mid = 0.5 * (lo + hi);
    (mass(support, mid) >= 1.0 ? lo : hi) = mid;
  }
  const double tau = 0.5 * (lo + hi);
  std::vector<double> p(z.size());
  for (std::size_t j = 0; j < z.size(); ++j) p[j] = std::pow(std::max(0.0, x[j] - tau), inverse);
  return p;
}

inline double clamped_alpha(double logit) { return std::clamp(1.0 + 1.0 / (1.0 + std::exp(-logit)), 1.01, 2.0); }

// The mechanism in double: per head o_i = entmax_α(q_i·Kᵀ/√D over the keys row i sees)·V, with
// x["alpha_logit"] giving α per head when it is there, else `alpha`.
inline std::vector<double> reference_model(const NamedValues& x, const Problem& p, double alpha) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto& q = x.at("q");
  const auto& k = x.at("k");
  const auto& v = x.at("v");
  const auto logits = x.find("alpha_logit");
  std::vector<double> out(q.size(), 0.0);
  for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
    const double head_alpha =
        logits == x.end() ? alpha : clamped_alpha(logits->second[static_cast<std::size_t>(head % p.heads)]);
    const std::size_t at = static_cast<std::size_t>(head * n * d);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t keys = p.causal ? i + 1 : n;
      std::vector<double> z(static_cast<std::size_t>(keys));
      for (std::int64_t j = 0; j < keys; ++j) {
        double dot = 0;
        for (std::int64_t c = 0; c < d; ++c) dot += q[at + i * d + c] * k[at + j * d + c];
        z[static_cast<std::size_t>(j)] = dot * scale;
      }
      const std::vector<double> prob = reference_entmax(z, head_alpha);
      for (std::int64_t j = 0; j < keys; ++j)
        for (std::int64_t c = 0; c < d; ++c)
          out[at + i * d + c] += prob[static_cast<std::size_t>(j)] * v[at + j * d + c];
    }
  }
  return out;
}

inline NamedValues named(const AttentionInputs& in) {
  return {{"q", widened(in.q.data(), in.q.size())},
          {"k", widened(in.k.data(), in.k.size())},
          {"v", widened(in.v.data(), in.v.size())}};
}

// An output element may be off by the attention rounding (scores, products) plus the threshold's
// own float rounding: |θ| ≤ max|z| + 1/(α−1), and ∂p_j/∂θ = −p_j^(2−α), whose sum over the support is ≤ support^(α−1).
inline double output_tolerance(const AttentionInputs& in, const Problem& p, std::int64_t head, double alpha) {
  const std::int64_t n = p.seq_len, d = p.head_dim, at = head * n * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const double base = attention_tolerance(in.q.data() + at, in.k.data() + at, in.v.data() + at, n, n, d, scale);
  double largest_score = 0;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (std::int64_t c = 0; c < d; ++c) dot += in.q.data()[at + i * d + c] * in.k.data()[at + j * d + c];
      largest_score = std::max(largest_score, std::fabs(dot * scale));
    }
  const double support = std::pow(static_cast<double>(n), alpha - 1.0);
  return base + 8 * kFloatEps * (largest_score + 1.0 / (alpha - 1.0)) * support * max_abs(in.v.data() + at, n * d);
}

}  // namespace xfb::test
