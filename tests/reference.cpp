#include "tests/reference.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"

namespace xfb::test {

std::vector<double> reference_attention(const float* q, const float* k, const float* v, std::int64_t nq,
                                        std::int64_t nk, std::int64_t d, double scale, const MaskFn& allowed) {
  std::vector<double> out(static_cast<std::size_t>(nq * d), 0.0), scores(static_cast<std::size_t>(nk));
  for (std::int64_t i = 0; i < nq; ++i) {
    double peak = -INFINITY;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (!allowed(i, j)) continue;
      double s = 0;
      for (std::int64_t c = 0; c < d; ++c) s += static_cast<double>(q[i * d + c]) * k[j * d + c];
      scores[j] = s * scale;
      peak = std::max(peak, scores[j]);
    }
    if (peak == -INFINITY) continue;
    double sum = 0;
    for (std::int64_t j = 0; j < nk; ++j)
      if (allowed(i, j)) sum += std::exp(scores[j] - peak);
    for (std::int64_t j = 0; j < nk; ++j) {
      if (!allowed(i, j)) continue;
      const double w = std::exp(scores[j] - peak) / sum;
      for (std::int64_t c = 0; c < d; ++c) out[i * d + c] += w * v[j * d + c];
    }
  }
  return out;
}

double attention_tolerance(const float* q, const float* k, const float* v, std::int64_t nq, std::int64_t nk,
                           std::int64_t d, double scale) {
  double largest_score_terms = 0;
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j) {
      double terms = 0;
      for (std::int64_t c = 0; c < d; ++c) terms += std::fabs(static_cast<double>(q[i * d + c]) * k[j * d + c]);
      largest_score_terms = std::max(largest_score_terms, terms * scale);
    }
  double largest_v = 0;
  for (std::int64_t j = 0; j < nk * d; ++j) largest_v = std::max(largest_v, std::fabs(static_cast<double>(v[j])));
  return 8 * kFloatEps * (largest_score_terms + std::log2(static_cast<double>(nk)) + 1) * largest_v;
}

AttentionInputs random_inputs(const Problem& p, std::uint64_t seed) {
  AttentionInputs in{Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim),
                     Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim),
                     Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim)};
  CounterRng(seed, "q").fill_normal(in.q);
  CounterRng(seed, "k").fill_normal(in.k);
  CounterRng(seed, "v").fill_normal(in.v);
  return in;
}

Tensor run_mechanism(const std::string& model, const Problem& p, const AttentionInputs& in,
                     const std::vector<std::string>& params, std::uint64_t seed) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  auto mechanism = info->impl.create(on_test_threads(p), resolve_params(model, info->impl.params, params), seed);
  mechanism->prepare(in.q, in.k, in.v);
  Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  out.fill(std::nanf(""));  // every element must be written
  mechanism->forward(in.q, in.k, in.v, out);
  return out;
}

void check_against_reference(const Tensor& got, const AttentionInputs& in, const Problem& p, const MaskFn& allowed,
                             const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto want = reference_attention(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale, allowed);
      const double tolerance = attention_tolerance(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale);
      const float* out = got.head(b, h);
      std::int64_t failures = 0;
      for (std::int64_t e = 0; e < n * d; ++e) {
        const double error = std::fabs(static_cast<double>(out[e]) - want[static_cast<std::size_t>(e)]);
        if (!(error <= tolerance)) {
          if (failures++ < 3) {
            std::ostringstream message;
            message << label << ": b=" << b << " h=" << h << " token " << e / d << " feature " << e % d << ": got "
                    << out[e] << ", want " << want[static_cast<std::size_t>(e)] << " (tolerance " << tolerance << ")";
            FAIL_CHECK(message.str());
          }
        }
      }
      CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
    }
}

}  // namespace xfb::test
