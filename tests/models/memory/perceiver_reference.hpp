#pragma once
// Perceiver's naive double-precision reference of both forms (taxonomy/memory/perceiver.hpp) and
// its fp32 tolerance, for the fp32 and bf16 tests.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

struct PerceiverShape {
  std::int64_t latents = 512, window = 0;
};

// Error bookkeeping for a tolerance: the largest |score| sum of terms of each attention, the
// largest |value| of each, the largest Σ|·| of a row of Lq or Lk, the largest column sum of
// |projection| and |C·W| sum of terms.
struct PerceiverErrors {
  double cross_terms = 0, cross_values = 0, latent_terms = 0, latent_values = 0, latent_l1 = 0;
  double projection_sum = 0, projection_terms = 0;
};

// softmax over keys [first, last] of scale·query·key, times values; rows of d.
inline std::vector<double> perceiver_attend(const double* query, const double* keys, const double* values,
                                            std::int64_t first, std::int64_t last, std::int64_t d, double& terms_out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> scores(static_cast<std::size_t>(last - first + 1));
  double peak = -INFINITY;
  for (std::int64_t j = first; j <= last; ++j) {
    double s = 0, terms = 0;
    for (std::int64_t f = 0; f < d; ++f) {
      s += query[f] * keys[j * d + f];
      terms += std::fabs(query[f] * keys[j * d + f]);
    }
    scores[static_cast<std::size_t>(j - first)] = s * scale;
    terms_out = std::max(terms_out, terms * scale);
    peak = std::max(peak, s * scale);
  }
  double sum = 0;
  for (double& s : scores) sum += (s = std::exp(s - peak));
  std::vector<double> out(static_cast<std::size_t>(d), 0.0);
  for (std::int64_t j = first; j <= last; ++j)
    for (std::int64_t f = 0; f < d; ++f)
      out[f] += scores[static_cast<std::size_t>(j - first)] / sum * values[j * d + f];
  return out;
}

// The whole model in double: out [B, H, M, D] from x["q"], x["k"], x["v"] ([B, H, N, D]),
// x["latents"] ([H, M, D], non-causal) and x["latent_projections"] ([H, 3, D, D]); with
// latent_rows, also each head's [Lq; Lk; Lv] ([B·H, 3, M, D]).
inline std::vector<double> perceiver_reference(const Problem& p, const PerceiverShape& s, const NamedValues& x,
                                               PerceiverErrors* scale_info = nullptr,
                                               std::vector<double>* latent_rows = nullptr) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = std::min(s.latents, n);
  PerceiverErrors local;
  PerceiverErrors& e = scale_info != nullptr ? *scale_info : local;
  std::vector<double> out(static_cast<std::size_t>(p.batch * p.heads * m * d));
  if (latent_rows != nullptr) latent_rows->clear();
  const auto& w = x.at("latent_projections");
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const double* k = x.at("k").data() + at;
      const double* v = x.at("v").data() + at;
      for (std::int64_t e2 = 0; e2 < n * d; ++e2) e.cross_values = std::max(e.cross_values, std::fabs(v[e2]));
      std::vector<double> cross(static_cast<std::size_t>(m * d));
      for (std::int64_t i = 0; i < m; ++i) {
        const double* query =
            p.causal ? x.at("q").data() + at + (n - m + i) * d : x.at("latents").data() + (h * m + i) * d;
        const std::int64_t position = p.causal ? n - m + i : n - 1;
        const std::int64_t first = p.causal && s.window > 0 ? std::max<std::int64_t>(0, position - s.window + 1) : 0;
        const auto row = perceiver_attend(query, k, v, first, position, d, e.cross_terms);
        std::copy(row.begin(), row.end(), cross.begin() + i * d);
      }
      std::vector<double> latent(static_cast<std::size_t>(3 * m * d), 0.0);
      for (std::int64_t which = 0; which < 3; ++which) {
        const double* wm = w.data() + (h * 3 + which) * d * d;
        for (std::int64_t f = 0; f < d; ++f) {
          double column = 0;
          for (std::int64_t c = 0; c < d; ++c) column += std::fabs(wm[c * d + f]);
          e.projection_sum = std::max(e.projection_sum, column);
        }
        for (std::int64_t i = 0; i < m; ++i)
          for (std::int64_t f = 0; f < d; ++f) {
            double sum = 0, terms = 0;
            for (std::int64_t c = 0; c < d; ++c) {
              sum += cross[i * d + c] * wm[c * d + f];
              terms += std::fabs(cross[i * d + c] * wm[c * d + f]);
            }
            latent[(which * m + i) * d + f] = sum;
            e.projection_terms = std::max(e.projection_terms, terms);
            if (which == 2) e.latent_values = std::max(e.latent_values, std::fabs(sum));
          }
      }
      if (latent_rows != nullptr) latent_rows->insert(latent_rows->end(), latent.begin(), latent.end());
      for (std::int64_t r = 0; r < 2 * m; ++r) {  // rows of Lq and Lk
        double l1 = 0;
        for (std::int64_t f = 0; f < d; ++f) l1 += std::fabs(latent[r * d + f]);
        e.latent_l1 = std::max(e.latent_l1, l1);
      }
      for (std::int64_t i = 0; i < m; ++i) {
        const auto row = perceiver_attend(latent.data() + i * d, latent.data() + m * d, latent.data() + 2 * m * d, 0,
                                          p.causal ? i : m - 1, d, e.latent_terms);
        std::copy(row.begin(), row.end(), out.begin() + ((b * p.heads + h) * m + i) * d);
      }
    }
  return out;
}

// The fp32 error bound of an element of Lq, Lk or Lv: C carries attention's rounding
// (8·eps·(score terms + log2 N + 1)·max|v|); the projections add their own rounding and scale C's
// error by the column sums of |W|.
inline double perceiver_row_error(const Problem& p, const PerceiverErrors& e) {
  const double n = static_cast<double>(p.seq_len), d = static_cast<double>(p.head_dim);
  const double cross_error = 8 * kFloatEps * (e.cross_terms + std::log2(n) + 1) * e.cross_values;
  return e.projection_sum * cross_error + 8 * kFloatEps * (std::log2(d) + 1) * e.projection_terms;
}

// The fp32 error bound of an output element: the rows' (perceiver_row_error) through the latent
// attention, which adds its rounding and turns an error e in its rows into at most e (values) +
// 2·max|Lv|·2·s·max Σ|L_row|·e (scores).
inline double perceiver_tolerance(const Problem& p, std::int64_t m, const PerceiverErrors& e) {
  const double d = static_cast<double>(p.head_dim);
  const double row_error = perceiver_row_error(p, e);
  const double score_gain = 4 * e.latent_values * e.latent_l1 / std::sqrt(d);
  return 8 * kFloatEps * (e.latent_terms + std::log2(static_cast<double>(m)) + 1) * e.latent_values +
         row_error * (1 + score_gain);
}

}  // namespace xfb::test
