#pragma once
// The Long-Short Transformer's naive double-precision reference of both forms
// (taxonomy/low_rank/long_short.hpp) and its fp32 tolerance, for the fp32 and bf16 tests
// (namespace long_short: its names are short).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "taxonomy/registry.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test::long_short {

using Matrix = std::vector<double>;  // row-major

// The settings as they run: non-causal (segment w, rank R), causal (window w, chunk l, rank R).
struct Settings {
  bool causal = false;
  std::int64_t window = 0, rank = 0, chunk = 0;
};

inline Settings settings_of(const Problem& p, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("long-short");
  REQUIRE(info != nullptr);
  const ParamValues values = info->impl.resolved(p, resolve_params("long-short", info->impl.params, params));
  if (p.causal) return {true, values.get_int("window"), values.get_int("chunk_rank"), values.get_int("chunk")};
  return {false, values.get_int("segment"), values.get_int("rank"), 0};
}

// What fp32 rounding scales with: the largest |terms| sum of a score, the largest |value| averaged,
// and how much a LayerNorm amplifies its input's rounding (Σ|terms| of a compressed entry / its
// row's standard deviation).
struct ErrorScale {
  double score_terms = 0, values = 0, amplification = 1;
};

inline void softmax(double* x, std::int64_t n) {
  const double peak = *std::max_element(x, x + n);
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += x[j] = std::exp(x[j] - peak);
  for (std::int64_t j = 0; j < n; ++j) x[j] /= sum;
}

// LN over d features in place (gain, shift); returns 1/std.
inline double layer_norm(double* x, std::int64_t d, const double* gain, const double* shift) {
  double mean = 0, var = 0;
  for (std::int64_t f = 0; f < d; ++f) mean += x[f];
  mean /= static_cast<double>(d);
  for (std::int64_t f = 0; f < d; ++f) var += (x[f] - mean) * (x[f] - mean);
  const double inverse_std = 1.0 / std::sqrt(var / static_cast<double>(d) + 1e-5);
  for (std::int64_t f = 0; f < d; ++f) x[f] = (x[f] - mean) * inverse_std * gain[f] + shift[f];
  return inverse_std;
}

struct HeadParams {
  const double *projection, *long_gain, *long_shift, *short_gain, *short_shift;  // [D, R], [D] ×4
};

// A head's keys and values as the reference attends to them: the compressed rows [groups·R, D] and
// the window's LN'd rows [N, D].
struct HeadRows {
  Matrix comp_k, comp_v, win_k, win_v;
};

// One head straight from the definition (header of taxonomy/low_rank/long_short.hpp): every query's
// keys listed explicitly, no tiles.
inline Matrix head_reference(const double* q, const double* k, const double* v, const HeadParams& w, std::int64_t n,
                             std::int64_t d, const Settings& s, ErrorScale& e, HeadRows* rows = nullptr) {
  const double c = 1.0 / std::sqrt(static_cast<double>(d));
  const std::int64_t r = s.rank, len = s.causal ? s.chunk : n, groups = s.causal ? n / s.chunk : 1;
  // Compressed rows, group-major: [groups·R, D] keys and values.
  Matrix comp_k(static_cast<std::size_t>(std::max<std::int64_t>(groups * r, 1) * d), 0.0), comp_v = comp_k;
  std::vector<double> column(static_cast<std::size_t>(len));
  for (std::int64_t g = 0; g < groups; ++g)
    for (std::int64_t j = 0; j < r; ++j) {
      for (std::int64_t t = 0; t < len; ++t) {
        double z = 0;
        for (std::int64_t f = 0; f < d; ++f) z += k[(g * len + t) * d + f] * w.projection[f * r + j];
        column[static_cast<std::size_t>(t)] = z;
      }
      softmax(column.data(), len);
      double* rk = comp_k.data() + (g * r + j) * d;
      double* rv = comp_v.data() + (g * r + j) * d;
      std::vector<double> terms_k(static_cast<std::size_t>(d), 0.0), terms_v = terms_k;
      for (std::int64_t t = 0; t < len; ++t)
        for (std::int64_t f = 0; f < d; ++f) {
          const double p = column[static_cast<std::size_t>(t)];
          rk[f] += p * k[(g * len + t) * d + f], rv[f] += p * v[(g * len + t) * d + f];
          terms_k[static_cast<std::size_t>(f)] += p * std::fabs(k[(g * len + t) * d + f]);
          terms_v[static_cast<std::size_t>(f)] += p * std::fabs(v[(g * len + t) * d + f]);
        }
      const double ak = layer_norm(rk, d, w.long_gain, w.long_shift);
      const double av = layer_norm(rv, d, w.long_gain, w.long_shift);
      for (std::int64_t f = 0; f < d; ++f)
        e.amplification = std::max(
            {e.amplification, ak * terms_k[static_cast<std::size_t>(f)], av * terms_v[static_cast<std::size_t>(f)]});
    }
  Matrix win_k(k, k + n * d), win_v(v, v + n * d);
  for (std::int64_t i = 0; i < n; ++i) {
    layer_norm(win_k.data() + i * d, d, w.short_gain, w.short_shift);
    layer_norm(win_v.data() + i * d, d, w.short_gain, w.short_shift);
  }
  for (double x : comp_v) e.values = std::max(e.values, std::fabs(x));
  for (double x : win_v) e.values = std::max(e.values, std::fabs(x));
  if (rows != nullptr) *rows = {comp_k, comp_v, win_k, win_v};
  Matrix out(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t comp_rows = groups * r, first, last;  // window keys [first, last)
    if (s.causal) {
      comp_rows = i / s.chunk * r;
      first = std::max<std::int64_t>(0, i - s.window + 1), last = i + 1;
    } else {
      const std::int64_t segment = i / s.window, ext = std::max<std::int64_t>(s.window / 2, 1);
      first = std::max<std::int64_t>(0, segment * s.window - ext);
      last = std::min(n, segment * s.window + s.window + ext);
    }
    std::vector<const double*> keys, values;
    for (std::int64_t j = 0; j < comp_rows; ++j)
      keys.push_back(comp_k.data() + j * d), values.push_back(comp_v.data() + j * d);
    for (std::int64_t j = first; j < last; ++j)
      keys.push_back(win_k.data() + j * d), values.push_back(win_v.data() + j * d);
    std::vector<double> scores(keys.size());
    for (std::size_t j = 0; j < keys.size(); ++j) {
      double dot = 0, terms = 0;
      for (std::int64_t f = 0; f < d; ++f)
        dot += q[i * d + f] * keys[j][f], terms += std::fabs(q[i * d + f] * keys[j][f]);
      scores[j] = c * dot;
      e.score_terms = std::max(e.score_terms, c * terms);
    }
    softmax(scores.data(), static_cast<std::int64_t>(scores.size()));
    for (std::size_t j = 0; j < keys.size(); ++j)
      for (std::int64_t f = 0; f < d; ++f) out[static_cast<std::size_t>(i * d + f)] += scores[j] * values[j][f];
  }
  return out;
}

// Every head's reference output ([B, H, N, D] order) from the named inputs.
inline Matrix reference(const NamedValues& x, const Problem& p, const Settings& s,
                        std::vector<ErrorScale>* scales = nullptr, std::vector<HeadRows>* rows = nullptr) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  Matrix all;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const HeadParams w{x.at("projection").data() + h * d * s.rank, x.at("long_gain").data() + h * d,
                         x.at("long_shift").data() + h * d, x.at("short_gain").data() + h * d,
                         x.at("short_shift").data() + h * d};
      ErrorScale e;
      HeadRows head_rows;
      const Matrix o = head_reference(x.at("q").data() + at, x.at("k").data() + at, x.at("v").data() + at, w, n, d, s,
                                      e, &head_rows);
      if (rows != nullptr) rows->push_back(std::move(head_rows));
      all.insert(all.end(), o.begin(), o.end());
      if (scales != nullptr) scales->push_back(e);
    }
  return all;
}

// fp32 tolerance of one head's output: the scores' rounding (their |terms|), the d-term products,
// the softmaxes over N and the tile's keys, amplified by the compressed rows' LayerNorm, relative to
// the averaged values.
inline double tolerance_of(const ErrorScale& e, const Problem& p, const Settings& s) {
  const double n = static_cast<double>(p.seq_len);
  return 8 * kFloatEps * (e.score_terms + std::log2(n + 1) + static_cast<double>(p.head_dim + s.rank) + 1) *
         e.amplification * std::max(1.0, e.values);
}

}  // namespace xfb::test::long_short
