// poolingformer in bf16 (taxonomy/fixed_patterns/poolingformer.hpp) against a float64 reference on
// the same bf16 inputs, written here from the definition: level 1 over the clipped window, level 2
// over the mean-pooled rows in the query's band, their sum.
//
// The bound per output element, with u = 2⁻⁸, ε the fp32 unit roundoff and σ = 1/√D
// (perturbed_attention_error in tests/support/bf16_check.hpp carries a row's score and value errors
// through the softmax):
//   level 1 on the exact inputs: P rounded (u), fp32 sums: e_y = perturbed_attention_error(no shift).
//   K̄, V̄ = bf16(fp32 mean): |ΔX̄_mc| ≤ e_X = (1 + u)·(κ + 1)·ε·mean_t |x_tc| + u·|X̄_mc|.
//   level 2: scores off by σ·Σ_c (e_q·|K̄| + |q|·e_K + e_q·e_K) + 1.01·D·ε·σ·Σ_c (|q| + e_q)(|K̄| + e_K),
//     with e_q = 0 for the input query and, stacked, e_q = e_y + u·(|y| + e_y) (the query is bf16(y));
//     e_z = perturbed_attention_error(those shifts, V̄ with e_V, P rounded).
//   One level alone: (1 + 2u)·(e + u·|o|); both: (1 + 2u)·(e_y + e_z + (u + ε)·|y + z|) (y and z fp32,
//   their fp32 sum rounded once).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

struct Case {
  std::int64_t window = 128, pool_window = 512, kernel = 5, stride = 4;
  std::string levels = "both", pooled_query = "input";
  std::int64_t tile = 64;
  std::vector<std::string> params() const {
    return {"window=" + std::to_string(window),
            "pool_window=" + std::to_string(pool_window),
            "kernel=" + std::to_string(kernel),
            "stride=" + std::to_string(stride),
            "levels=" + levels,
            "pooled_query=" + pooled_query,
            "tile=" + std::to_string(tile)};
  }
  std::string describe(std::int64_t n) const {
    std::string text = "poolingformer bf16 N=" + std::to_string(n);
    for (const auto& assignment : params()) text += " " + assignment;
    return text;
  }
};

// One softmax row in float64: out [d] and the probabilities of its keys rows[first … last) of x.
struct Row {
  std::vector<double> probs, out;
};
Row attend(const std::vector<double>& query, const double* keys, const double* values, std::int64_t first,
           std::int64_t last, std::int64_t d) {
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  Row row{std::vector<double>(static_cast<std::size_t>(last - first)),
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

// The score shifts of a row whose query is off by query_error (elementwise; empty: exact) over keys
// rows [first, last) off by key_error.
std::vector<double> score_shifts(const std::vector<double>& query, const std::vector<double>& query_error,
                                 const double* keys, const double* key_error, std::int64_t first, std::int64_t last,
                                 std::int64_t d) {
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  std::vector<double> shifts;
  for (std::int64_t j = first; j < last; ++j) {
    double moved = 0, magnitude = 0;
    for (std::int64_t c = 0; c < d; ++c) {
      const double eq = query_error.empty() ? 0.0 : query_error[static_cast<std::size_t>(c)];
      const double q = std::fabs(query[static_cast<std::size_t>(c)]), k = std::fabs(keys[j * d + c]);
      const double ek = key_error[j * d + c];
      moved += eq * k + q * ek + eq * ek;
      magnitude += (q + eq) * (k + ek);
    }
    shifts.push_back(scale * moved + 1.01 * static_cast<double>(d) * kFloatEps * scale * magnitude);
  }
  return shifts;
}

// Pooled rows of one head's x [n, d] (as doubles): the means and their error bound e_X.
struct Pooled {
  std::vector<double> mean, error;
};
Pooled pool(const double* x, std::int64_t n, std::int64_t d, const Case& c) {
  const std::int64_t rows = (n + c.stride - 1) / c.stride;
  Pooled pooled{std::vector<double>(static_cast<std::size_t>(rows * d)),
                std::vector<double>(static_cast<std::size_t>(rows * d))};
  for (std::int64_t m = 0; m < rows; ++m) {
    const std::int64_t count = std::min(c.kernel, n - m * c.stride);
    for (std::int64_t f = 0; f < d; ++f) {
      double sum = 0, magnitude = 0;
      for (std::int64_t t = 0; t < count; ++t) {
        sum += x[(m * c.stride + t) * d + f];
        magnitude += std::fabs(x[(m * c.stride + t) * d + f]);
      }
      const std::size_t at = static_cast<std::size_t>(m * d + f);
      pooled.mean[at] = sum / static_cast<double>(count);
      pooled.error[at] =
          (1 + kU) * static_cast<double>(c.kernel + 1) * kFloatEps * magnitude / static_cast<double>(count) +
          kU * std::fabs(pooled.mean[at]);
    }
  }
  return pooled;
}

void check_case(const Problem& shape, const Case& c, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const Bf16Inputs in = bf16_inputs(p, seed);
  const Tensor got = run_bf16("poolingformer", p, in.bf16, c.params());
  const bool window = c.levels != "pooled", pooled_level = c.levels != "window",
             stacked = c.pooled_query == "window_output";
  const std::int64_t reach = c.window / 2, pool_reach = c.pool_window / 2, rows = (n + c.stride - 1) / c.stride;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::vector<double> q = widened(in.widened.q.head(b, h), n * d),
                                k = widened(in.widened.k.head(b, h), n * d),
                                v = widened(in.widened.v.head(b, h), n * d);
      const Pooled pk = pool(k.data(), n, d, c), pv = pool(v.data(), n, d, c);
      const float* out = got.head(b, h);
      std::vector<double> want(static_cast<std::size_t>(n * d)), bound(want.size());
      for (std::int64_t i = 0; i < n; ++i) {
        const std::vector<double> query(q.begin() + i * d, q.begin() + (i + 1) * d);
        std::vector<double> y(static_cast<std::size_t>(d)), e_y(static_cast<std::size_t>(d)), z = y, e_z = y;
        if (window) {
          const std::int64_t first = std::max<std::int64_t>(i - reach, 0), last = std::min(i + reach + 1, n);
          const Row row = attend(query, k.data(), v.data(), first, last, d);
          y = row.out;
          e_y = perturbed_attention_error(row.probs, std::vector<double>(row.probs.size(), 0.0), v.data() + first * d,
                                          nullptr, d, kU);
        }
        if (pooled_level) {
          const std::int64_t first = (std::max<std::int64_t>(i - pool_reach, 0) + c.stride - 1) / c.stride;
          const std::int64_t last = std::min((i + pool_reach) / c.stride + 1, rows);
          std::vector<double> level_query = stacked ? y : query, query_error;
          if (stacked)
            for (std::int64_t f = 0; f < d; ++f) {
              const double e = e_y[static_cast<std::size_t>(f)];
              query_error.push_back(e + kU * (std::fabs(y[static_cast<std::size_t>(f)]) + e));
            }
          const Row row = attend(level_query, pk.mean.data(), pv.mean.data(), first, last, d);
          z = row.out;
          const std::vector<double> shifts =
              score_shifts(level_query, query_error, pk.mean.data(), pk.error.data(), first, last, d);
          e_z = perturbed_attention_error(row.probs, shifts, pv.mean.data() + first * d, pv.error.data() + first * d, d,
                                          kU);
        }
        for (std::int64_t f = 0; f < d; ++f) {
          const std::size_t at = static_cast<std::size_t>(i * d + f), fs = static_cast<std::size_t>(f);
          want[at] = (window ? y[fs] : 0.0) + (pooled_level ? z[fs] : 0.0);
          const double sum_rounding = window && pooled_level ? kU + kFloatEps : kU;
          bound[at] = (1 + 2 * kU) * ((window ? e_y[fs] : 0.0) + (pooled_level ? e_z[fs] : 0.0) +
                                      sum_rounding * std::fabs(want[at])) +
                      1e-30;
        }
      }
      check_bf16_elements(
          out, want, n * d, [&](std::int64_t e) { return bound[static_cast<std::size_t>(e)]; },
          c.describe(n) + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

}  // namespace

TEST_SUITE("poolingformer_bf16") {
  TEST_CASE("poolingformer in bf16 equals the float64 levels within the derived bound, every level and path") {
    // Small windows so both levels are sparse at these N; N one below, at and above the 16-row tile
    // and the stride, and longer than a window.
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const std::string levels : {"both", "window", "pooled"}) {
        Case c{.window = 9, .pool_window = 24, .kernel = 5, .stride = 4, .levels = levels, .tile = 16};
        for (std::int64_t n : {1, 3, 4, 5, 15, 16, 17, 70})
          check_case({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false}, c,
                     static_cast<std::uint64_t>(n));
      }
      Case stacked{
          .window = 9, .pool_window = 24, .kernel = 3, .stride = 2, .pooled_query = "window_output", .tile = 16};
      for (std::int64_t n : {2, 17, 40}) check_case({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32}, stacked, 5);
      // The defaults (w₁ 128, w₂ 512, κ 5, ξ 4, tiles of 64) at N around the tile.
      for (std::int64_t n : {63, 64, 65, 300})
        check_case({.batch = 1, .heads = 1, .seq_len = n, .head_dim = 16}, {}, 9);
    });
  }

  TEST_CASE("poolingformer bf16 rows: FLOPs as fp32's, halved inputs and pooled rows, the estimate exact") {
    for (const char* levels : {"levels=both", "levels=window", "levels=pooled"})
      for (std::int64_t n : {100, 257}) check_bf16_rows("poolingformer", n, false, Pass::Forward, {levels});
    check_bf16_rows("poolingformer", 100, false, Pass::Forward, {"pooled_query=window_output"});
    for (Pass pass : {Pass::Backward, Pass::Train}) {
      const ResultRow row = run_point(bf16_point("poolingformer", 100, false, pass));
      CHECK(row.status == Status::Unsupported);
      CHECK(row.reason.find("no bf16 backward") != std::string::npos);
    }
    check_bf16_head_dim_unsupported("poolingformer");
  }
}
