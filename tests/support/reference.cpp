#include "tests/support/reference.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"

namespace xfb::test {

namespace {
// Row i of softmax(scale·Q·Kᵀ) restricted to the mask, into probs [nk] (0 where not allowed);
// false when the row has no allowed key.
bool reference_probabilities(const double* q, const double* k, std::int64_t i, std::int64_t nk, std::int64_t d,
                             double scale, const MaskFn& allowed, std::vector<double>& probs) {
  double peak = -INFINITY;
  for (std::int64_t j = 0; j < nk; ++j) {
    probs[j] = 0;
    if (!allowed(i, j)) continue;
    double s = 0;
    for (std::int64_t c = 0; c < d; ++c) s += q[i * d + c] * k[j * d + c];
    probs[j] = s * scale;
    peak = std::max(peak, probs[j]);
  }
  if (peak == -INFINITY) return false;
  double sum = 0;
  for (std::int64_t j = 0; j < nk; ++j)
    if (allowed(i, j)) sum += std::exp(probs[j] - peak);
  for (std::int64_t j = 0; j < nk; ++j) probs[j] = allowed(i, j) ? std::exp(probs[j] - peak) / sum : 0.0;
  return true;
}
// max over (i, j) of scale·Σ_c |q[i,c]·k[j,c]|.
double largest_score_contribution(const float* q, const float* k, std::int64_t nq, std::int64_t nk, std::int64_t d,
                                  double scale) {
  double largest = 0;
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j) {
      double terms = 0;
      for (std::int64_t c = 0; c < d; ++c) terms += std::fabs(static_cast<double>(q[i * d + c]) * k[j * d + c]);
      largest = std::max(largest, terms * scale);
    }
  return largest;
}
}  // namespace

std::vector<double> reference_attention(const float* q, const float* k, const float* v, std::int64_t nq,
                                        std::int64_t nk, std::int64_t d, double scale, const MaskFn& allowed) {
  const auto qd = widened(q, nq * d), kd = widened(k, nk * d), vd = widened(v, nk * d);
  return reference_attention(qd.data(), kd.data(), vd.data(), nq, nk, d, scale, allowed);
}

std::vector<double> reference_attention(const double* q, const double* k, const double* v, std::int64_t nq,
                                        std::int64_t nk, std::int64_t d, double scale, const MaskFn& allowed) {
  std::vector<double> out(static_cast<std::size_t>(nq * d), 0.0), probs(static_cast<std::size_t>(nk));
  for (std::int64_t i = 0; i < nq; ++i) {
    if (!reference_probabilities(q, k, i, nk, d, scale, allowed, probs)) continue;
    for (std::int64_t j = 0; j < nk; ++j)
      for (std::int64_t c = 0; c < d; ++c) out[i * d + c] += probs[j] * v[j * d + c];
  }
  return out;
}

AttentionGradients reference_attention_backward(const float* q32, const float* k32, const float* v32,
                                                const float* dout32, std::int64_t nq, std::int64_t nk, std::int64_t d,
                                                double scale, const MaskFn& allowed) {
  const auto q = widened(q32, nq * d), k = widened(k32, nk * d), v = widened(v32, nk * d),
             dout = widened(dout32, nq * d);
  const auto zeros = [](std::int64_t count) { return std::vector<double>(static_cast<std::size_t>(count), 0.0); };
  AttentionGradients g{zeros(nq * d), zeros(nk * d), zeros(nk * d), zeros(nq * d),
                       zeros(nk * d), zeros(nk * d), zeros(nq * d), zeros(nk * d)};
  std::vector<double> probs(static_cast<std::size_t>(nk)), dp(static_cast<std::size_t>(nk)), dp_terms(dp.size());
  for (std::int64_t i = 0; i < nq; ++i) {
    if (!reference_probabilities(q.data(), k.data(), i, nk, d, scale, allowed, probs)) continue;
    double delta = 0, delta_terms = 0;
    for (std::int64_t j = 0; j < nk; ++j) {
      dp[j] = dp_terms[j] = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        dp[j] += dout[i * d + c] * v[j * d + c];
        dp_terms[j] += std::fabs(dout[i * d + c] * v[j * d + c]);
      }
      delta += probs[j] * dp[j];
      delta_terms += probs[j] * dp_terms[j];
    }
    for (std::int64_t j = 0; j < nk; ++j) {
      if (probs[j] == 0) continue;
      const double ds = probs[j] * (dp[j] - delta), ds_terms = probs[j] * (dp_terms[j] + delta_terms);
      for (std::int64_t c = 0; c < d; ++c) {
        g.dv[j * d + c] += probs[j] * dout[i * d + c];
        g.dv_terms[j * d + c] += probs[j] * std::fabs(dout[i * d + c]);
        g.dq[i * d + c] += scale * ds * k[j * d + c];
        g.dq_terms[i * d + c] += scale * ds_terms * std::fabs(k[j * d + c]);
        g.dk[j * d + c] += scale * ds * q[i * d + c];
        g.dk_terms[j * d + c] += scale * ds_terms * std::fabs(q[i * d + c]);
        g.dq_abs_ds[i * d + c] += scale * std::fabs(ds * k[j * d + c]);
        g.dk_abs_ds[j * d + c] += scale * std::fabs(ds * q[i * d + c]);
      }
    }
  }
  return g;
}

double gradient_error_factor(const float* q, const float* k, std::int64_t nq, std::int64_t nk, std::int64_t d,
                             double scale) {
  const double largest_score_terms = largest_score_contribution(q, k, nq, nk, d, scale);
  return 8 * kFloatEps *
         (largest_score_terms + std::log2(static_cast<double>(nk)) + std::log2(static_cast<double>(d)) + 1);
}

double attention_tolerance(const float* q, const float* k, const float* v, std::int64_t nq, std::int64_t nk,
                           std::int64_t d, double scale) {
  const double largest_score_terms = largest_score_contribution(q, k, nq, nk, d, scale);
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

Tensor rows_of(const Tensor& whole, std::int64_t first, std::int64_t count) {
  Tensor part = Tensor::bhnd(whole.dim(0), whole.dim(1), count, whole.dim(3));
  const std::int64_t d = whole.dim(3);
  for (std::int64_t b = 0; b < whole.dim(0); ++b)
    for (std::int64_t h = 0; h < whole.dim(1); ++h)
      std::copy_n(whole.head(b, h) + first * d, count * d, part.head(b, h));
  return part;
}

std::int64_t model_output_rows(const std::string& model, const Problem& p, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  return output_rows_of(info->impl, p, resolve_params(model, info->impl.params, params));
}

Tensor run_mechanism(const std::string& model, const Problem& p, const AttentionInputs& in,
                     const std::vector<std::string>& params, std::uint64_t seed) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  auto mechanism = info->impl.create(on_test_threads(p), resolve_params(model, info->impl.params, params), seed);
  mechanism->prepare(in.q, in.k, in.v);
  Tensor out = Tensor::bhnd(p.batch, p.heads, model_output_rows(model, p, params), p.head_dim);
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
