#pragma once
// One softmax attention level in float64 with what the bf16 kernels' backward may be off by, for the
// bf16 tests of models whose attention runs over contiguous key ranges of tensors they store
// (poolingformer's levels, memory-compressed's local blocks and compressed slots): the model's own
// stored bf16 keys and values are the level's exact inputs, and the bound follows each bf16 rounding
// of the kernel (engines/gathered_attention_bf16.hpp) and the errors the level's inputs carry.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "tests/support/bf16_check.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

// One softmax row in float64 over the key rows [first, last): its output [d] and probabilities.
struct ReferenceRow {
  std::vector<double> probs, out;
};
inline ReferenceRow reference_row(const std::vector<double>& query, const double* keys, const double* values,
                                  std::int64_t first, std::int64_t last, std::int64_t d) {
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  ReferenceRow row{std::vector<double>(static_cast<std::size_t>(last - first)),
                   std::vector<double>(static_cast<std::size_t>(d))};
  double peak = -INFINITY, sum = 0;
  for (std::int64_t j = first; j < last; ++j) {
    double dot = 0;
    for (std::int64_t c = 0; c < d; ++c) dot += query[static_cast<std::size_t>(c)] * keys[j * d + c];
    row.probs[static_cast<std::size_t>(j - first)] = dot * scale;
    peak = std::max(peak, dot * scale);
  }
  for (double& p : row.probs) sum += p = std::exp(p - peak);
  for (std::int64_t j = first; j < last; ++j) {
    double& p = row.probs[static_cast<std::size_t>(j - first)];
    p /= sum;
    for (std::int64_t c = 0; c < d; ++c) row.out[static_cast<std::size_t>(c)] += p * values[j * d + c];
  }
  return row;
}

// One level's backward in float64 for one head: query rows [nq, d] over keys, values [nk, d], row i
// over the contiguous keys keys_of(i); dout [nq, d]. With each gradient, `bound` is what the bf16
// kernel's backward (engines/gathered_attention_bf16.hpp) may be off by before the gradient is
// rounded, σ = 1/√D:
//   - P rounded to bf16 for dV = Pᵀ·dO: u·Σ_i P_ij·|dO_i|; dS = P ⊙ (dP − δ) is formed in fp32 from
//     the unrounded P and rounded to bf16 for dQ = σ·dS·K and dK = σ·dSᵀ·Q: u·σ·Σ|dS|·|K|, |Q|
//     (q, k, v, dO are bf16 values, exact in the products);
//   - fp32 rounding: the fp32 factor (gradient_error_factor) times the element's terms T
//     (reference_attention_backward's);
//   - the level's inputs: dout off by ≤ dout_error [nq, d] (empty: exact) and δ_i read by the model off
//     a stored output off by ≤ out_error + stored_error (out_error: the level's fp32 forward with P
//     rounded, perturbed_attention_error), so
//       Δδ_i ≤ Σ_c E_ic·(|o_ic| + s_ic) + |dO_ic|·s_ic + 2.02·D·ε·Σ_c (|dO_ic| + E_ic)·(|o_ic| + s_ic);
//     they move dV_j by Σ_i P_ij·E_i and dS_ij by P_ij·(Σ_c E_ic·|v_jc| + Δδ_i), so dQ, dK by
//     σ·Σ|ΔdS|·|K|, |Q| — times (1 + 4u) for their second-order terms. With `stored_output` [nq, d]
//     (the values δ is read off as this level's output: its widened bf16 output, or a difference of
//     stored outputs), s_ic is their actual error |stored − o| plus stored_error (then only what the
//     reading adds, e.g. a difference's fp32 rounding) instead of out_error + stored_error.
using KeysOf = std::function<std::pair<std::int64_t, std::int64_t>(std::int64_t)>;
struct LevelGrads {
  std::vector<double> out, out_error;
  std::vector<double> dq, dk, dv, dq_terms, dk_terms, dv_terms, dq_bound, dk_bound, dv_bound;
};
inline LevelGrads level_backward(const float* query, const float* keys, const float* values,
                                 const std::vector<double>& dout, const std::vector<double>& dout_error,
                                 const std::vector<double>& stored_error, std::int64_t nq, std::int64_t nk,
                                 std::int64_t d, const KeysOf& keys_of, const float* stored_output = nullptr) {
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  const auto zeros = [](std::int64_t count) { return std::vector<double>(static_cast<std::size_t>(count), 0.0); };
  LevelGrads g{zeros(nq * d), zeros(nq * d), zeros(nq * d), zeros(nk * d), zeros(nk * d), zeros(nq * d),
               zeros(nk * d), zeros(nk * d), zeros(nq * d), zeros(nk * d), zeros(nk * d)};
  std::vector<double> dq_extra = zeros(nq * d), dk_extra = zeros(nk * d), dv_extra = zeros(nk * d);
  const std::vector<double> q = widened(query, nq * d), k = widened(keys, nk * d), v = widened(values, nk * d);
  for (std::int64_t i = 0; i < nq; ++i) {
    const auto [first, last] = keys_of(i);
    const ReferenceRow row = reference_row(std::vector<double>(q.begin() + i * d, q.begin() + (i + 1) * d), k.data(),
                                           v.data(), first, last, d);
    const std::vector<double> error = perturbed_attention_error(row.probs, std::vector<double>(row.probs.size(), 0.0),
                                                                v.data() + first * d, nullptr, d, kBf16Roundoff);
    const auto at = [&](std::int64_t c) { return static_cast<std::size_t>(i * d + c); };
    const auto e_dout = [&](std::int64_t c) { return dout_error.empty() ? 0.0 : dout_error[at(c)]; };
    double delta_error = 0;
    for (std::int64_t c = 0; c < d; ++c) {
      g.out[at(c)] = row.out[static_cast<std::size_t>(c)];
      g.out_error[at(c)] = error[static_cast<std::size_t>(c)];
      const double o = std::fabs(g.out[at(c)]);
      const double extra = stored_error.empty() ? 0.0 : stored_error[at(c)];
      const double s = stored_output != nullptr ? std::fabs(stored_output[at(c)] - g.out[at(c)]) + extra
                                                : g.out_error[at(c)] + extra;
      const double dy = std::fabs(dout[at(c)]);
      delta_error +=
          e_dout(c) * (o + s) + dy * s + 2.02 * static_cast<double>(d) * kFloatEps * (dy + e_dout(c)) * (o + s);
    }
    std::vector<double> dp(static_cast<std::size_t>(last - first)), dp_terms(dp.size()), dp_error(dp.size());
    double delta = 0, delta_terms = 0;
    for (std::int64_t j = first; j < last; ++j) {
      const auto js = static_cast<std::size_t>(j - first);
      for (std::int64_t c = 0; c < d; ++c) {
        dp[js] += dout[at(c)] * v[j * d + c];
        dp_terms[js] += std::fabs(dout[at(c)] * v[j * d + c]);
        dp_error[js] += e_dout(c) * std::fabs(v[j * d + c]);
      }
      delta += row.probs[js] * dp[js];
      delta_terms += row.probs[js] * dp_terms[js];
    }
    for (std::int64_t j = first; j < last; ++j) {
      const auto js = static_cast<std::size_t>(j - first);
      const double p = row.probs[js], ds = p * (dp[js] - delta), ds_terms = p * (dp_terms[js] + delta_terms),
                   ds_error = p * (dp_error[js] + delta_error);
      for (std::int64_t c = 0; c < d; ++c) {
        const auto key = static_cast<std::size_t>(j * d + c);
        const double kc = std::fabs(k[key]), qc = std::fabs(q[at(c)]);
        g.dv[key] += p * dout[at(c)];
        g.dv_terms[key] += p * std::fabs(dout[at(c)]);
        g.dv_bound[key] += kBf16Roundoff * p * std::fabs(dout[at(c)]);
        dv_extra[key] += p * e_dout(c);
        g.dq[at(c)] += scale * ds * k[key];
        g.dq_terms[at(c)] += scale * ds_terms * kc;
        g.dq_bound[at(c)] += kBf16Roundoff * scale * std::fabs(ds) * kc;
        dq_extra[at(c)] += scale * ds_error * kc;
        g.dk[key] += scale * ds * q[at(c)];
        g.dk_terms[key] += scale * ds_terms * qc;
        g.dk_bound[key] += kBf16Roundoff * scale * std::fabs(ds) * qc;
        dk_extra[key] += scale * ds_error * qc;
      }
    }
  }
  const double fp32 = gradient_error_factor(query, keys, nq, nk, d, scale);
  const auto finish = [&](std::vector<double>& bound, const std::vector<double>& terms,
                          const std::vector<double>& extra) {
    for (std::size_t e = 0; e < bound.size(); ++e) bound[e] += fp32 * terms[e] + (1 + 4 * kBf16Roundoff) * extra[e];
  };
  finish(g.dq_bound, g.dq_terms, dq_extra);
  finish(g.dk_bound, g.dk_terms, dk_extra);
  finish(g.dv_bound, g.dv_terms, dv_extra);
  return g;
}

}  // namespace xfb::test
