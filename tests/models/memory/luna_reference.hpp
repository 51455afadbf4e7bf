#pragma once
// Luna's naive double-precision references of both forms (taxonomy/memory/luna.hpp) and their fp32
// tolerance, for the fp32 and bf16 tests.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "taxonomy/registry.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

using Matrix = std::vector<double>;  // row-major

// What fp32 rounding scales with: the largest sum of |terms| of a score (after its scale), and the
// largest |value| the outputs average.
struct ErrorScale {
  double score_terms = 0, values = 0;
};

// softmax over n entries in place.
inline void luna_softmax(double* x, std::int64_t n) {
  const double peak = *std::max_element(x, x + n);
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += x[j] = std::exp(x[j] - peak);
  for (std::int64_t j = 0; j < n; ++j) x[j] /= sum;
}

// Non-causal Luna of one head: Y = softmax_N(c·P·Kᵀ)·V, O = softmax_l(c·Q·Yᵀ)·Y; P [l, d].
inline Matrix noncausal_head(const double* q, const double* k, const double* v, const double* p, std::int64_t n,
                             std::int64_t l, std::int64_t d, ErrorScale& e) {
  const double c = 1.0 / std::sqrt(static_cast<double>(d));
  Matrix packed(static_cast<std::size_t>(l * d), 0.0), out(static_cast<std::size_t>(n * d), 0.0);
  std::vector<double> scores(static_cast<std::size_t>(std::max(n, l)));
  for (std::int64_t j = 0; j < l; ++j) {
    for (std::int64_t s = 0; s < n; ++s) {
      double dot = 0, terms = 0;
      for (std::int64_t f = 0; f < d; ++f)
        dot += p[j * d + f] * k[s * d + f], terms += std::fabs(p[j * d + f] * k[s * d + f]);
      scores[s] = c * dot;
      e.score_terms = std::max(e.score_terms, c * terms);
    }
    luna_softmax(scores.data(), n);
    for (std::int64_t s = 0; s < n; ++s)
      for (std::int64_t f = 0; f < d; ++f) packed[j * d + f] += scores[s] * v[s * d + f];
  }
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < l; ++j) {
      double dot = 0, terms = 0;
      for (std::int64_t f = 0; f < d; ++f)
        dot += q[i * d + f] * packed[j * d + f], terms += std::fabs(q[i * d + f] * packed[j * d + f]);
      scores[j] = c * dot;
      e.score_terms = std::max(e.score_terms, c * terms);
    }
    luna_softmax(scores.data(), l);
    for (std::int64_t j = 0; j < l; ++j)
      for (std::int64_t f = 0; f < d; ++f) out[i * d + f] += scores[j] * packed[j * d + f];
  }
  for (std::int64_t s = 0; s < n * d; ++s) e.values = std::max(e.values, std::fabs(v[s]));
  return out;
}

// Causal Luna of one head straight from its definition, no prefix sums: a_s = elu(c·P·k_s) + 1,
// s_t = (1/t)·Σ_{s≤t} c·(q_t·k_s)·a_s, π_t = softmax(s_t), o_t = (1/t)·Σ_j π_tj·Σ_{s≤t} a_sj·v_s.
inline Matrix causal_head(const double* q, const double* k, const double* v, const double* p, std::int64_t n,
                          std::int64_t l, std::int64_t d, ErrorScale& e) {
  const double c = 1.0 / std::sqrt(static_cast<double>(d));
  Matrix a(static_cast<std::size_t>(n * l)), out(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t s = 0; s < n; ++s)
    for (std::int64_t j = 0; j < l; ++j) {
      double z = 0;
      for (std::int64_t f = 0; f < d; ++f) z += k[s * d + f] * p[j * d + f];
      z *= c;
      a[s * l + j] = z > 0 ? z + 1 : std::exp(z);
    }
  std::vector<double> scores(static_cast<std::size_t>(l)), terms(static_cast<std::size_t>(l));
  for (std::int64_t i = 0; i < n; ++i) {
    const double t = static_cast<double>(i + 1);
    std::fill(scores.begin(), scores.end(), 0.0);
    std::fill(terms.begin(), terms.end(), 0.0);
    for (std::int64_t s = 0; s <= i; ++s) {
      double dot = 0, dot_terms = 0;
      for (std::int64_t f = 0; f < d; ++f)
        dot += q[i * d + f] * k[s * d + f], dot_terms += std::fabs(q[i * d + f] * k[s * d + f]);
      for (std::int64_t j = 0; j < l; ++j)
        scores[j] += c * dot * a[s * l + j] / t, terms[j] += c * dot_terms * a[s * l + j] / t;
    }
    for (double x : terms) e.score_terms = std::max(e.score_terms, x);
    luna_softmax(scores.data(), l);
    for (std::int64_t s = 0; s <= i; ++s)
      for (std::int64_t j = 0; j < l; ++j)
        for (std::int64_t f = 0; f < d; ++f) out[i * d + f] += scores[j] * a[s * l + j] * v[s * d + f] / t;
  }
  // The weights a ≤ 1 + |z| scale the averaged values.
  double largest_a = 0;
  for (double x : a) largest_a = std::max(largest_a, x);
  for (std::int64_t s = 0; s < n * d; ++s) e.values = std::max(e.values, largest_a * std::fabs(v[s]));
  return out;
}

// Every head's reference output ([B, H, N, D] order) from the named inputs.
inline Matrix luna_reference(const NamedValues& x, const Problem& p, std::int64_t l,
                             std::vector<ErrorScale>* scales = nullptr) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  Matrix all;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const double* projected = x.at("projected_sequence").data() + h * l * d;
      ErrorScale e;
      const Matrix o = p.causal ? causal_head(x.at("q").data() + at, x.at("k").data() + at, x.at("v").data() + at,
                                              projected, n, l, d, e)
                                : noncausal_head(x.at("q").data() + at, x.at("k").data() + at, x.at("v").data() + at,
                                                 projected, n, l, d, e);
      all.insert(all.end(), o.begin(), o.end());
      if (scales != nullptr) scales->push_back(e);
    }
  return all;
}

// The rows of P the model uses on the problem, as resolved.
inline std::int64_t resolved_rows(const Problem& p, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("luna");
  REQUIRE(info != nullptr);
  return info->impl.resolved(p, resolve_params("luna", info->impl.params, params)).get_int("projected_length");
}

// fp32 tolerance of one head's output: the scores' rounding (their |terms|), the products' d-term
// sums, the softmaxes over N and l and, causal, the running sums over up to N tokens (√N: rounding
// of independent terms), relative to the averaged values.
inline double tolerance_of(const ErrorScale& e, const Problem& p, std::int64_t l) {
  const double n = static_cast<double>(p.seq_len);
  const double sums = p.causal ? std::sqrt(n) : std::log2(n + 1);
  return 8 * kFloatEps * (e.score_terms + sums + static_cast<double>(p.head_dim + l) + 1) * std::max(1.0, e.values);
}

}  // namespace xfb::test
