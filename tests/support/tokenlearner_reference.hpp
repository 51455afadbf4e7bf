#pragma once
// TokenLearner followed by attention over its tokens (taxonomy/downsampling/tokenlearner.hpp), one
// head naively in double, for the fp32 and bf16 tests.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

struct TokenLearnerShape {
  std::int64_t tokens = 8, bottleneck = 64;
};

// Bookkeeping for the tolerance: the largest sum of |terms| of a logit and of a token-attention
// score, the largest 1/σ of a normalised row, the largest |token| feature.
// What the head's reference computed on the way: α [S, N] and the tokens Q̃, K̃, Ṽ [S, D] each.
struct TokenLearnerParts {
  std::vector<double> weights;
  std::array<std::vector<double>, 3> tokens;
};

struct TokenErrorScale {
  double logit_terms = 0, score_terms = 0, inverse_std = 0, largest_token = 0;
};

inline double gelu(double z) { return 0.5 * z * (1 + std::erf(z / std::sqrt(2.0))); }

// One head of TokenLearner + attention over its S tokens, in double, from the named inputs and
// parameters (the layouts the header gives). Returns [S, D].
inline std::vector<double> tokenlearner_head(const NamedValues& x, const Problem& p, TokenLearnerShape t,
                                             std::int64_t b, std::int64_t h, TokenErrorScale& scale,
                                             TokenLearnerParts* parts = nullptr) {
  const std::int64_t n = p.seq_len, d = p.head_dim, f = t.bottleneck, s = std::min(t.tokens, n);
  const std::int64_t at = (b * p.heads + h) * n * d;
  const double* q = x.at("q").data() + at;
  const double* k = x.at("k").data() + at;
  const double* v = x.at("v").data() + at;
  const double* gain = x.at("ln_gains").data() + h * d;
  const double* shift = x.at("ln_shifts").data() + h * d;
  const double* w1 = x.at("w1").data() + h * d * f;
  const double* b1 = x.at("b1").data() + h * f;
  const double* w2 = x.at("w2").data() + h * f * s;
  const double* b2 = x.at("b2").data() + h * s;
  std::vector<double> logits(s * n);  // [S, N]
  for (std::int64_t i = 0; i < n; ++i) {
    double mean = 0, variance = 0;
    for (std::int64_t c = 0; c < d; ++c) mean += v[i * d + c] / d;
    for (std::int64_t c = 0; c < d; ++c) variance += (v[i * d + c] - mean) * (v[i * d + c] - mean) / d;
    const double inverse_std = 1 / std::sqrt(variance + 1e-6);
    scale.inverse_std = std::max(scale.inverse_std, inverse_std);
    std::vector<double> normalised(d), hidden(f);
    for (std::int64_t c = 0; c < d; ++c) normalised[c] = (v[i * d + c] - mean) * inverse_std * gain[c] + shift[c];
    for (std::int64_t j = 0; j < f; ++j) {
      double z = b1[j];
      for (std::int64_t c = 0; c < d; ++c) z += normalised[c] * w1[c * f + j];
      hidden[j] = gelu(z);
    }
    for (std::int64_t r = 0; r < s; ++r) {
      double logit = b2[r], terms = std::fabs(b2[r]);
      for (std::int64_t j = 0; j < f; ++j) {
        logit += hidden[j] * w2[j * s + r];
        terms += std::fabs(hidden[j] * w2[j * s + r]);
      }
      logits[r * n + i] = logit;
      scale.logit_terms = std::max(scale.logit_terms, terms);
    }
  }
  std::vector<double> tokens_q(s * d, 0.0), tokens_k(s * d, 0.0), tokens_v(s * d, 0.0);
  for (std::int64_t r = 0; r < s; ++r) {
    const double peak = *std::max_element(logits.begin() + r * n, logits.begin() + (r + 1) * n);
    double sum = 0;
    for (std::int64_t i = 0; i < n; ++i) sum += std::exp(logits[r * n + i] - peak);
    for (std::int64_t i = 0; i < n; ++i) {
      const double weight = std::exp(logits[r * n + i] - peak) / sum;
      for (std::int64_t c = 0; c < d; ++c) {
        tokens_q[r * d + c] += weight * q[i * d + c];
        tokens_k[r * d + c] += weight * k[i * d + c];
        tokens_v[r * d + c] += weight * v[i * d + c];
      }
    }
  }
  const double attention_scale = 1 / std::sqrt(double(d));
  for (std::int64_t r = 0; r < s; ++r)
    for (std::int64_t j = 0; j < s; ++j) {
      double terms = 0;
      for (std::int64_t c = 0; c < d; ++c) terms += std::fabs(tokens_q[r * d + c] * tokens_k[j * d + c]);
      scale.score_terms = std::max(scale.score_terms, attention_scale * terms);
    }
  for (const std::vector<double>* tokens : {&tokens_q, &tokens_k, &tokens_v})
    for (double value : *tokens) scale.largest_token = std::max(scale.largest_token, std::fabs(value));
  if (parts != nullptr) {
    parts->weights.assign(s * n, 0.0);
    for (std::int64_t r = 0; r < s; ++r) {
      const double peak = *std::max_element(logits.begin() + r * n, logits.begin() + (r + 1) * n);
      double sum = 0;
      for (std::int64_t i = 0; i < n; ++i) sum += std::exp(logits[r * n + i] - peak);
      for (std::int64_t i = 0; i < n; ++i) parts->weights[r * n + i] = std::exp(logits[r * n + i] - peak) / sum;
    }
    parts->tokens = {tokens_q, tokens_k, tokens_v};
  }
  return reference_attention(tokens_q.data(), tokens_k.data(), tokens_v.data(), s, s, d, attention_scale, full_mask);
}

inline std::vector<double> tokenlearner_reference(const NamedValues& x, const Problem& p, TokenLearnerShape t) {
  std::vector<double> out;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      TokenErrorScale unused;
      const std::vector<double> head = tokenlearner_head(x, p, t, b, h, unused);
      out.insert(out.end(), head.begin(), head.end());
    }
  return out;
}

inline std::vector<std::string> tokenlearner_params(TokenLearnerShape t) {
  return {"tokens=" + std::to_string(t.tokens), "bottleneck=" + std::to_string(t.bottleneck)};
}

inline NamedValues with_parameters(const AttentionInputs& in, const Mechanism& mechanism) {
  NamedValues x = named_inputs(in);
  for (const auto& parameter : mechanism.parameters())
    x[parameter.name] = widened(parameter.tensor->data(), parameter.tensor->size());
  return x;
}

}  // namespace xfb::test
