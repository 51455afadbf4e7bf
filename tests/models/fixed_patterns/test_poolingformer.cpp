// Poolingformer against naive double-precision references written here from the definition in
// taxonomy/fixed_patterns/poolingformer.hpp, independently of the mechanism: level 1 is dense
// attention restricted to the clipped window |i − j| ≤ ⌊w₁/2⌋; level 2 is dense attention over the
// mean-pooled rows (row m: tokens [m·ξ, m·ξ + κ) ∩ [0, N)) restricted to the rows starting within
// ⌊w₂/2⌋ of the query; levels=both is their sum.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "apps/bench/point.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

struct Case {
  std::int64_t window = 128, pool_window = 512, kernel = 5, stride = 4;
  std::string levels = "both";
  std::int64_t tile = 64;
  std::string pooled_query = "input";
  std::vector<std::string> params() const {
    return {"window=" + std::to_string(window),
            "pool_window=" + std::to_string(pool_window),
            "kernel=" + std::to_string(kernel),
            "stride=" + std::to_string(stride),
            "levels=" + levels,
            "pooled_query=" + pooled_query,
            "tile=" + std::to_string(tile)};
  }
  std::string describe(const Problem& p) const {
    std::ostringstream text;
    text << "poolingformer N=" << p.seq_len << " B=" << p.batch << " D=" << p.head_dim;
    for (const auto& assignment : params()) text << " " << assignment;
    return text.str();
  }
};

// Mean of the token rows [m·ξ, m·ξ + κ) ∩ [0, n) of x [n, d], for every m with m·ξ < n.
std::vector<double> mean_pooled(const double* x, std::int64_t n, std::int64_t d, const Case& c) {
  std::vector<double> pooled;
  for (std::int64_t first = 0; first < n; first += c.stride) {
    const std::int64_t last = std::min(first + c.kernel, n);
    for (std::int64_t f = 0; f < d; ++f) {
      double sum = 0.0;
      for (std::int64_t t = first; t < last; ++t) sum += x[t * d + f];
      pooled.push_back(sum / static_cast<double>(last - first));
    }
  }
  return pooled;
}

// The whole formula in double, [B, H, N, D] from the named inputs q, k, v.
ModelReference reference(const Problem& p, const Case& c) {
  return [=](const NamedValues& x) {
    const std::int64_t n = p.seq_len, d = p.head_dim, pooled_rows = (n + c.stride - 1) / c.stride;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> out(static_cast<std::size_t>(p.batch * p.heads * n * d), 0.0);
    for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
      const double *q = x.at("q").data() + head * n * d, *k = x.at("k").data() + head * n * d,
                   *v = x.at("v").data() + head * n * d;
      double* o = out.data() + head * n * d;
      std::vector<double> y;
      if (c.levels != "pooled") {
        y = reference_attention(q, k, v, n, n, d, scale,
                                [&](std::int64_t i, std::int64_t j) { return std::abs(i - j) <= c.window / 2; });
        for (std::size_t e = 0; e < y.size(); ++e) o[e] += y[e];
      }
      if (c.levels != "window") {
        const auto keys = mean_pooled(k, n, d, c), values = mean_pooled(v, n, d, c);
        const double* query = c.pooled_query == "window_output" ? y.data() : q;
        const auto z = reference_attention(
            query, keys.data(), values.data(), n, pooled_rows, d, scale,
            [&](std::int64_t i, std::int64_t m) { return std::abs(m * c.stride - i) <= c.pool_window / 2; });
        for (std::size_t e = 0; e < z.size(); ++e) o[e] += z[e];
      }
    }
    return out;
  };
}

NamedValues widened_inputs(const AttentionInputs& in) {
  return {{"q", widened(in.q.data(), in.q.size())},
          {"k", widened(in.k.data(), in.k.size())},
          {"v", widened(in.v.data(), in.v.size())}};
}

// Every element of every head against the reference. Tolerance: the fp32 attention tolerance of the
// head's raw q, k, v per level summed. A pooled row is a convex combination of raw rows, so its
// scores and values are bounded by the raw ones; its κ-term sums add κ·eps relative to max|v|.
// Stacked, level 2 has its own tolerance on the query y, plus level 1's error e_y carried through:
// |∂z_f/∂y|₁ ≤ scale·2·max|V̄|·2·max_m ‖K̄_m‖₁, so it adds e_y·4·scale·max|v|·max_t ‖k_t‖₁.
double stacked_tolerance(const float* q, const float* k, const float* v, const Problem& p, const Case& c,
                         double window_tolerance) {
  const std::int64_t n = p.seq_len, d = p.head_dim, pooled_rows = (n + c.stride - 1) / c.stride;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const auto wide_k = widened(k, n * d), wide_v = widened(v, n * d);
  const auto y = reference_attention(q, k, v, n, n, d, scale,
                                     [&](std::int64_t i, std::int64_t j) { return std::abs(i - j) <= c.window / 2; });
  const auto keys = mean_pooled(wide_k.data(), n, d, c), values = mean_pooled(wide_v.data(), n, d, c);
  const std::vector<float> y_f(y.begin(), y.end()), keys_f(keys.begin(), keys.end()),
      values_f(values.begin(), values.end());
  double key_norm = 0.0;
  for (std::int64_t t = 0; t < n; ++t) {
    double norm = 0.0;
    for (std::int64_t f = 0; f < d; ++f) norm += std::fabs(static_cast<double>(k[t * d + f]));
    key_norm = std::max(key_norm, norm);
  }
  return attention_tolerance(y_f.data(), keys_f.data(), values_f.data(), n, pooled_rows, d, scale) +
         window_tolerance * 4.0 * scale * max_abs(v, n * d) * key_norm;
}

void check_case(const Problem& p, const Case& c, std::uint64_t seed) {
  const auto in = random_inputs(p, seed);
  const ModelInfo* info = find_model("poolingformer");
  REQUIRE(info != nullptr);
  auto mechanism =
      info->impl.create(on_test_threads(p), resolve_params("poolingformer", info->impl.params, c.params()), seed);
  Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
  mechanism->prepare(in.q, in.k, in.v);
  out.fill(std::nanf(""));  // every element must be written
  mechanism->forward(in.q, in.k, in.v, out);
  const auto want = reference(p, c)(widened_inputs(in));
  const std::int64_t n = p.seq_len, d = p.head_dim, per_head = n * d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d)), levels = c.levels == "both" ? 2.0 : 1.0;
  const double eps = std::numeric_limits<float>::epsilon();
  for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
    const float *q = in.q.data() + head * per_head, *k = in.k.data() + head * per_head,
                *v = in.v.data() + head * per_head;
    const double raw = attention_tolerance(q, k, v, n, n, d, scale);
    const double tolerance =
        (c.pooled_query == "window_output" ? raw + stacked_tolerance(q, k, v, p, c, raw) : levels * raw) +
        static_cast<double>(c.kernel) * eps * max_abs(v, per_head);
    std::int64_t failures = 0;
    for (std::int64_t e = 0; e < per_head; ++e) {
      const double got = out.data()[head * per_head + e],
                   expected = want[static_cast<std::size_t>(head * per_head + e)];
      if (!(std::fabs(got - expected) <= tolerance) && failures++ < 3)
        FAIL_CHECK(c.describe(p) << ": head " << head << " token " << e / d << " feature " << e % d << ": got " << got
                                 << ", want " << expected << " (tolerance " << tolerance << ")");
    }
    CHECK_MESSAGE(failures == 0, c.describe(p) << " head " << head << ": " << failures << " elements out of tolerance");
  }
}

struct Counters {
  double flops, workspace, peak;
};
Counters counters(std::int64_t n, const std::vector<std::string>& params, const std::string& model = "poolingformer") {
  DnnlContext::instance().clear_cache();
  const ResultRow row =
      run_point(counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = false}, params));
  REQUIRE(row.status == Status::Ok);
  return {static_cast<double>(row.flops), static_cast<double>(row.workspace_bytes),
          static_cast<double>(row.peak_tensor_bytes)};
}

}  // namespace

TEST_SUITE("poolingformer") {
  TEST_CASE("each level and their sum against dense attention on exactly their patterns, at/±1 of w1, w2, κ, ξ") {
    // w1 = 8 (reach 4), w2 = 16 (reach 8), tile 8; κ below, at and above ξ; N around every size.
    for (const char* levels : {"window", "pooled", "both"})
      for (std::int64_t n : {1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 70})
        for (const auto& [kernel, stride] :
             std::vector<std::pair<std::int64_t, std::int64_t>>{{5, 4}, {3, 4}, {4, 4}, {4, 3}, {1, 1}, {9, 8}}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false};
          const Case c{.window = 8, .pool_window = 16, .kernel = kernel, .stride = stride, .levels = levels, .tile = 8};
          check_case(p, c, static_cast<std::uint64_t>(n * 31 + kernel * 7 + stride));
        }
    // Stacked: level 2's query is level 1's output.
    for (std::int64_t n : {1, 4, 5, 9, 16, 17, 70})
      for (const auto& [kernel, stride] : std::vector<std::pair<std::int64_t, std::int64_t>>{{5, 4}, {3, 4}, {1, 1}}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false};
        const Case c{.window = 8,
                     .pool_window = 16,
                     .kernel = kernel,
                     .stride = stride,
                     .tile = 8,
                     .pooled_query = "window_output"};
        check_case(p, c, static_cast<std::uint64_t>(n * 17 + kernel));
      }
    // The windows one below and above: odd widths share the reach of the even one below.
    for (std::int64_t window : {7, 9, 0})
      for (std::int64_t pool_window : {15, 17, 6})
        for (std::int64_t n : {9, 16, 17, 40}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false};
          check_case(p, {.window = window, .pool_window = pool_window, .kernel = 5, .stride = 4, .tile = 8},
                     static_cast<std::uint64_t>(window * 100 + pool_window + n));
        }
  }

  TEST_CASE("defaults (w1 128, w2 512, κ 5, ξ 4) around the windows' halves and full sizes, two batches") {
    for (std::int64_t n : {63, 64, 65, 255, 256, 257, 300}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_case(p, Case{}, static_cast<std::uint64_t>(n));
      check_case(p, Case{.tile = 48}, static_cast<std::uint64_t>(n + 1));
      check_case(p, Case{.pooled_query = "window_output"}, static_cast<std::uint64_t>(n + 2));
    }
  }

  TEST_CASE("gradients of q, k, v through both levels and the pooling (central differences of the whole formula)") {
    for (const char* levels : {"both", "window", "pooled"}) {
      // Tiny: every element; windows, kernel, stride and tile cut at non-multiples.
      const Case tiny{.window = 4, .pool_window = 6, .kernel = 3, .stride = 2, .levels = levels, .tile = 4};
      for (std::int64_t n : {1, 2, 5, 9}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = false};
        check_composite_gradients("poolingformer", p, tiny.params(), reference(p, tiny), true);
      }
      // Larger: a sample of elements and the directional derivative; κ > ξ and κ < ξ.
      for (const auto& [kernel, stride] : std::vector<std::pair<std::int64_t, std::int64_t>>{{5, 4}, {2, 3}}) {
        const Case c{.window = 16, .pool_window = 40, .kernel = kernel, .stride = stride, .levels = levels, .tile = 8};
        const Problem p{.batch = 2, .heads = 2, .seq_len = 70, .head_dim = 8, .causal = false};
        check_composite_gradients("poolingformer", p, c.params(), reference(p, c), false);
      }
    }
  }

  TEST_CASE("stacked levels: gradients through level 1's output as level 2's query") {
    const Case tiny{
        .window = 4, .pool_window = 6, .kernel = 3, .stride = 2, .tile = 4, .pooled_query = "window_output"};
    for (std::int64_t n : {1, 2, 5, 9}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = false};
      check_composite_gradients("poolingformer", p, tiny.params(), reference(p, tiny), true);
    }
    const Case c{.window = 16, .pool_window = 40, .kernel = 5, .stride = 4, .tile = 8, .pooled_query = "window_output"};
    const Problem p{.batch = 2, .heads = 2, .seq_len = 70, .head_dim = 8, .causal = false};
    check_composite_gradients("poolingformer", p, c.params(), reference(p, c), false);
  }

  TEST_CASE("every level setting: executed FLOPs equal the formulas and the workspace estimates are exact") {
    const ModelInfo& info = *find_model("poolingformer");
    for (const auto& [levels, query] : std::vector<std::pair<std::string, std::string>>{
             {"both", "input"}, {"window", "input"}, {"pooled", "input"}, {"both", "window_output"}})
      for (std::int64_t n : {1, 37, 100, 300}) {
        const Case c{.window = 16,
                     .pool_window = 40,
                     .kernel = 5,
                     .stride = 3,
                     .levels = levels,
                     .tile = 16,
                     .pooled_query = query};
        const Problem p = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false});
        const ParamValues values = resolve_params("poolingformer", info.impl.params, c.params());
        CAPTURE(c.describe(p));
        for (Pass pass : {Pass::Forward, Pass::Train}) {
          PointConfig point = counter_point("poolingformer", p, c.params());
          point.pass = pass;
          const ResultRow row = run_point(point);
          REQUIRE(row.status == Status::Ok);
          const std::int64_t forward = info.impl.flops(p, values);
          CHECK(row.flops == (pass == Pass::Forward ? forward : forward + info.impl.backward_flops(p, values)));
          CHECK(row.peak_owned_bytes - point_io_bytes(point) == row.estimated_workspace_bytes);
        }
      }
  }

  TEST_CASE("a level-2 window too short to hold a pooled row is a parameter error") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 8, .causal = false};
    CHECK_THROWS_AS(validate_point(counter_point("poolingformer", p, {"pool_window=5", "stride=4"})), ParamError);
    CHECK_NOTHROW(validate_point(counter_point("poolingformer", p, {"pool_window=6", "stride=4"})));
    CHECK_NOTHROW(validate_point(counter_point("poolingformer", p, {"pool_window=0", "stride=4", "levels=window"})));
    CHECK_THROWS_AS(validate_point(counter_point("poolingformer", p, {"levels=pooled", "pooled_query=window_output"})),
                    ParamError);
  }

  TEST_CASE("FLOP and memory counters are linear in N, as O(N·(w1 + w2/ξ)·D)") {
    const std::vector<std::string> params{"window=64", "pool_window=256"};
    const Counters small = counters(1024, params), large = counters(4096, params), larger = counters(8192, params);
    CHECK(large.flops / small.flops == doctest::Approx(4.0).epsilon(0.06));
    CHECK(larger.flops / large.flops == doctest::Approx(2.0).epsilon(0.03));
    CHECK(large.peak / small.peak == doctest::Approx(4.0).epsilon(0.1));
    CHECK(larger.peak / large.peak == doctest::Approx(2.0).epsilon(0.05));
    CHECK(large.workspace <= 4.2 * small.workspace + 65536);
    // Per query: 4·D FLOPs per key of each level (two products), ~(w1 + 1) + (w2 + 1)/ξ keys.
    const double per_query = large.flops / (2.0 * 4096.0 * 4.0 * 32.0);
    CHECK(per_query > 65.0 + 64.0);
    CHECK(per_query < 2.0 * (65.0 + 65.0));
    // At the defaults, far less memory than vanilla's N×N scores.
    CHECK(counters(4096, {}).peak < 0.25 * counters(4096, {}, "vanilla").peak);
  }
}
