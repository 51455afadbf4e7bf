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
//
// The gradients, level by level in float64, each level on the tensors the model stored before it (as
// funnel's test uses the model's Q̃): level 1 on q, k, v; level 2 on the model's bf16 K̄, V̄ with the
// query q or, stacked, the model's bf16(y) ("window_output"). Per level (level_backward has the
// derivation) the bf16 kernel's own roundings — P for dV (u·Σ P·|dO|), dS for dQ and dK
// (u·σ·Σ|dS|·|K|, |Q|), as bf16_head_gradients for a single softmax: tighter than the terms bound
// 3u(1 + u)·T, which here would hide a wrong combination of the levels — plus the fp32 factor·T, plus what the level's
// inputs carry, propagated to first order: δ_i read off a stored output (bf16(o); level 2 beside
// level 1: out − bf16(y)) with that output's actual error against the level's float64 output, and,
// stacked, level 1's output gradient bf16(dO + dq₂). The levels' parts
// are summed in fp32 and rounded once: dq = dq₁ + dq₂ (stacked: dq₁), dk_t = dk₁_t + Σ_{m ∋ t} dK̄_m /
// c_m (dv likewise), within the parts' bounds + (κ + 2)·ε·T + u·|dq|.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/bf16_level.hpp"
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

// A gradient's reference value, its parts' bounds and terms per element, summed from the levels.
struct Expected {
  std::vector<double> want, bound, terms;
  explicit Expected(std::int64_t count)
      : want(static_cast<std::size_t>(count)), bound(want.size()), terms(want.size()) {}
  // Adds weight·(element `from` of a level's gradient) at element `to`.
  void add(std::int64_t to, std::int64_t from, double weight, const std::vector<double>& value,
           const std::vector<double>& part_bound, const std::vector<double>& part_terms) {
    const auto t = static_cast<std::size_t>(to), f = static_cast<std::size_t>(from);
    want[t] += weight * value[f];
    bound[t] += weight * part_bound[f];
    terms[t] += weight * part_terms[f];
  }
  // The stored gradient's bound: the parts', the fp32 sum of at most κ + 2 of them ((κ + 2)·ε·T) and
  // the rounding to bf16 (u·|computed|).
  double total(std::int64_t e, std::int64_t kernel) const {
    const auto at = static_cast<std::size_t>(e);
    const double computed = bound[at] + static_cast<double>(kernel + 2) * kFloatEps * terms[at];
    return computed + kU * (std::fabs(want[at]) + computed) + 1e-30;
  }
};

// The bf16 training step's dq, dk, dv against the float64 levels (the bound in the header).
void check_gradients(const Problem& shape, const Case& c, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, rows = (n + c.stride - 1) / c.stride;
  const bool window = c.levels != "pooled", pooled_level = c.levels != "window",
             stacked = c.pooled_query == "window_output";
  const Bf16GradientRun run = run_bf16_gradients("poolingformer", p, c.params(), seed);
  const auto saved = [&](const std::string& name) {
    for (const auto& t : run.mechanism->saved())
      if (t.name == name) {
        REQUIRE(t.tensor->dtype() == DType::BF16);
        return to_f32(*t.tensor);
      }
    FAIL("no saved tensor " << name);
    return Tensor();
  };
  const Tensor pooled_k = pooled_level ? saved("pooled_keys") : Tensor(),
               pooled_v = pooled_level ? saved("pooled_values") : Tensor(),
               window_y = window && pooled_level ? saved("window_output") : Tensor();
  const KeysOf window_keys = [&](std::int64_t i) {
    return std::pair{std::max<std::int64_t>(i - c.window / 2, 0), std::min(i + c.window / 2 + 1, n)};
  };
  const KeysOf pooled_keys = [&](std::int64_t i) {
    return std::pair{(std::max<std::int64_t>(i - c.pool_window / 2, 0) + c.stride - 1) / c.stride,
                     std::min((i + c.pool_window / 2) / c.stride + 1, rows)};
  };
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string where = c.describe(n) + " gradients b=" + std::to_string(b) + " h=" + std::to_string(h);
      const float *q = run.in.widened.q.head(b, h), *k = run.in.widened.k.head(b, h), *v = run.in.widened.v.head(b, h);
      const float* out = run.out.head(b, h);
      const std::vector<double> dout = widened(run.dout_widened.head(b, h), n * d);
      const float* y = window && pooled_level ? window_y.head(b, h) : nullptr;
      Expected dq(n * d), dk(n * d), dv(n * d);
      // Level 2 first: stacked, its query gradient joins dO as level 1's output gradient.
      LevelGrads two;
      if (pooled_level) {
        // δ₂ is read off out, or beside level 1 off out − bf16(y) as dO·out − dO·bf16(y) in fp32: the
        // actual error of out − bf16(y), plus the second dot product's fp32 rounding.
        std::vector<float> z_read(out, out + n * d);
        std::vector<double> z_reading;
        if (window)
          for (std::int64_t e = 0; e < n * d; ++e) {
            z_read[static_cast<std::size_t>(e)] = out[e] - y[e];
            z_reading.push_back(2.02 * static_cast<double>(d) * kFloatEps * (std::fabs(out[e]) + std::fabs(y[e])));
          }
        two = level_backward(stacked ? y : q, pooled_k.head(b, h), pooled_v.head(b, h), dout, {}, z_reading, n, rows, d,
                             pooled_keys, z_read.data());
        if (!stacked)
          for (std::int64_t e = 0; e < n * d; ++e) dq.add(e, e, 1, two.dq, two.dq_bound, two.dq_terms);
        for (std::int64_t m = 0; m < rows; ++m) {
          const std::int64_t count = std::min(c.kernel, n - m * c.stride);
          for (std::int64_t t = m * c.stride; t < m * c.stride + count; ++t)
            for (std::int64_t f = 0; f < d; ++f) {
              const double weight = 1 / static_cast<double>(count);
              dk.add(t * d + f, m * d + f, weight, two.dk, two.dk_bound, two.dk_terms);
              dv.add(t * d + f, m * d + f, weight, two.dv, two.dv_bound, two.dv_terms);
            }
        }
      }
      if (window) {
        // Level 1's output gradient: dO, or stacked dY = dO + dq₂, which the model stores as bf16(dY).
        std::vector<double> dy = dout, dy_error;
        if (stacked)
          for (std::int64_t e = 0; e < n * d; ++e) {
            const auto i = static_cast<std::size_t>(e);
            dy[i] += two.dq[i];
            const double error = two.dq_bound[i] + kFloatEps * (std::fabs(dout[i]) + two.dq_terms[i]);
            dy_error.push_back(error + kU * (std::fabs(dy[i]) + error));
          }
        const LevelGrads one = level_backward(q, k, v, dy, dy_error, {}, n, n, d, window_keys, pooled_level ? y : out);
        for (std::int64_t e = 0; e < n * d; ++e) {
          dq.add(e, e, 1, one.dq, one.dq_bound, one.dq_terms);
          dk.add(e, e, 1, one.dk, one.dk_bound, one.dk_terms);
          dv.add(e, e, 1, one.dv, one.dv_bound, one.dv_terms);
        }
      }
      const std::pair<const Tensor*, const Expected*> checks[] = {{&run.dq, &dq}, {&run.dk, &dk}, {&run.dv, &dv}};
      for (int g = 0; g < 3; ++g) {
        const Expected& e = *checks[g].second;
        check_bf16_elements(
            checks[g].first->head(b, h), e.want, n * d, [&](std::int64_t i) { return e.total(i, c.kernel); },
            where + " d" + "qkv"[g]);
      }
    }
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
          const ReferenceRow row = reference_row(query, k.data(), v.data(), first, last, d);
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
          const ReferenceRow row = reference_row(level_query, pk.mean.data(), pv.mean.data(), first, last, d);
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

  TEST_CASE("poolingformer in bf16: gradients against the float64 levels on the model's stored tensors, every path") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const std::string levels : {"both", "window", "pooled"}) {
        Case c{.window = 9, .pool_window = 24, .kernel = 5, .stride = 4, .levels = levels, .tile = 16};
        // N one below, at and above the 16-row tile and the stride, and longer than the windows.
        for (std::int64_t n : {1, 3, 4, 5, 15, 16, 17, 70})
          check_gradients({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16}, c, static_cast<std::uint64_t>(n));
      }
      Case stacked{
          .window = 9, .pool_window = 24, .kernel = 3, .stride = 2, .pooled_query = "window_output", .tile = 16};
      for (std::int64_t n : {2, 17, 40})
        check_gradients({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32}, stacked, 5);
      // κ = ξ = 1: K̄, V̄ are the rows themselves, so level 2's gradients are as large as level 1's and an
      // error in combining them shows; parallel and stacked.
      for (const std::string query : {"input", "window_output"}) {
        const Case unpooled{
            .window = 9, .pool_window = 24, .kernel = 1, .stride = 1, .pooled_query = query, .tile = 16};
        check_gradients({.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 16}, unpooled, 11);
      }
      // κ < ξ (tokens in no pooled row) and the defaults around their 64-row tile.
      Case gaps{.window = 9, .pool_window = 24, .kernel = 2, .stride = 3, .tile = 16};
      check_gradients({.batch = 1, .heads = 2, .seq_len = 50, .head_dim = 16}, gaps, 3);
      for (std::int64_t n : {63, 64, 65})
        check_gradients({.batch = 1, .heads = 1, .seq_len = n, .head_dim = 16}, {}, 9);
    });
  }

  TEST_CASE("poolingformer bf16 rows: FLOPs as fp32's, halved inputs and outputs, estimates exact (every pass)") {
    for (const char* levels : {"levels=both", "levels=window", "levels=pooled"})
      for (std::int64_t n : {100, 257}) check_bf16_rows("poolingformer", n, false, Pass::Forward, {levels});
    check_bf16_rows("poolingformer", 100, false, Pass::Forward, {"pooled_query=window_output"});
    for (Pass pass : {Pass::Backward, Pass::Train}) {
      for (const char* levels : {"levels=both", "levels=window", "levels=pooled"})
        for (std::int64_t n : {100, 257}) check_bf16_rows("poolingformer", n, false, pass, {levels});
      check_bf16_rows("poolingformer", 100, false, pass, {"pooled_query=window_output"});
    }
    check_bf16_head_dim_unsupported("poolingformer");
  }
}
