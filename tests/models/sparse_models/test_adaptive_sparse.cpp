// adaptive-sparse (α-entmax attention): the threshold solvers against an exact double-precision
// entmax (full sort), the whole mechanism against a double reference at and around its blocks,
// causal and not, α → 1 against softmax, gradients (including in the learned α) by central
// differences, and the FLOP and memory scaling of its counters.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "taxonomy/sparse_models/adaptive_sparse.hpp"
#include "tests/models/sparse_models/adaptive_sparse_reference.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

void check_model(const Problem& p, const std::vector<std::string>& params, double alpha, const std::string& label) {
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len * 7 + 1));
  const Tensor out = run_mechanism("adaptive-sparse", p, in, params);
  const std::vector<double> want = reference_model(named(in), p, alpha);
  const std::int64_t per_head = p.seq_len * p.head_dim;
  for (std::int64_t head = 0; head < p.batch * p.heads; ++head)
    check_head(out.data() + head * per_head,
               std::vector<double>(want.begin() + head * per_head, want.begin() + (head + 1) * per_head), p.seq_len,
               p.head_dim, output_tolerance(in, p, head, alpha), label + " head " + std::to_string(head));
}

// entmax_threshold + entmax_probabilities on one row against reference_entmax. θ is a float near
// max z − 1/(α−1), off by its rounding (and the solver's): δθ = 4·eps·(max|z| + 1/(α−1)). Each p_j
// then moves by δθ·p_j^(2−α) (∂p_j/∂θ = −p_j^(2−α)), and the power adds its relative error
// 4·eps·(1 + |ln p_j|) (twice fast_power's; the squares at α = 1.5 are within it) times p_j, with a floor
// of 4·eps: so the same support up to entries within that of 0. The row sum moves by δθ·Σ p_j^(2−α)
// (at α → 1 about 1/(α−1) ulps, a float θ's own) plus 4·eps·(log2 n + 1) of summation.
void check_row(const std::vector<float>& z, double alpha, bool sort, const std::string& label) {
  const std::int64_t n = static_cast<std::int64_t>(z.size());
  std::vector<float> scratch(z.size()), p(z.size());
  const float theta = entmax_threshold(z.data(), n, alpha, sort, scratch.data());
  entmax_probabilities(z.data(), n, alpha, theta, p.data());
  const std::vector<double> want = reference_entmax(std::vector<double>(z.begin(), z.end()), alpha);
  double largest = 0;
  for (float value : z) largest = std::max(largest, std::fabs(static_cast<double>(value)));
  const double log_n = std::log2(static_cast<double>(n));
  const double theta_error = 4 * kFloatEps * (largest + 1.0 / (alpha - 1.0));
  double sum = 0, sum_sensitivity = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    const double got = p[static_cast<std::size_t>(j)], exact = want[static_cast<std::size_t>(j)];
    const double sensitivity = exact > 0 ? std::pow(exact, 2.0 - alpha) : 0.0;
    const double power_error = exact > 0 ? 4 * kFloatEps * (1 + std::fabs(std::log(exact))) * exact : 0.0;
    const double tolerance = theta_error * sensitivity + power_error + 4 * kFloatEps;
    sum += got;
    sum_sensitivity += sensitivity;
    CHECK_MESSAGE(std::fabs(got - exact) <= tolerance, label << " alpha " << alpha << (sort ? " sort" : " bisect")
                                                             << " j " << j << ": got " << got << ", want " << exact
                                                             << " (tolerance " << tolerance << ")");
  }
  CHECK_MESSAGE(std::fabs(sum - 1.0) <= theta_error * sum_sensitivity + 4 * kFloatEps * (log_n + 1),
                label << " alpha " << alpha << ": the row sums to " << sum);
}

std::vector<float> random_row(std::int64_t n, float spread, std::uint64_t seed) {
  Tensor t(Shape{n});
  CounterRng(seed, "entmax/row").fill_normal(t, 0.0f, spread);
  return std::vector<float>(t.data(), t.data() + n);
}

}  // namespace

TEST_SUITE("adaptive_sparse") {
  TEST_CASE("entmax threshold: sort and bisection equal the exact double entmax, ties and one-survivor rows") {
    for (double alpha : {1.5, 2.0, 1.2, 1.8, 1.01})
      for (bool sort : {true, false}) {
        if (sort && alpha != 1.5 && alpha != 2.0) continue;
        // Rows around the sort's narrowing threshold (32 candidates) and long ones, narrow to wide.
        for (std::int64_t n : {1, 2, 3, 31, 32, 33, 100, 257, 1000})
          for (float spread : {0.1f, 1.0f, 4.0f, 40.0f})
            check_row(random_row(n, spread, static_cast<std::uint64_t>(n)), alpha, sort,
                      "n " + std::to_string(n) + " spread " + std::to_string(spread));
        check_row(std::vector<float>(37, 0.25f), alpha, sort, "all tied");       // p = 1/n
        check_row({3.0f, 3.0f, -1.0f, 0.5f, 3.0f}, alpha, sort, "tied maxima");  // three equal shares
        std::vector<float> lone(50, -200.0f);                                    // all but one dropped
        lone[17] = 5.0f;
        check_row(lone, alpha, sort, "one survivor");
        std::vector<float> edge(40, 0.0f);  // a key exactly on the candidate cut (α−1)(z − max) = −1
        edge[0] = static_cast<float>(1.0 / (alpha - 1.0));
        check_row(edge, alpha, sort, "on the cut");
      }
    // A lone survivor gets exactly 1 and the rest exactly 0.
    std::vector<float> lone(9, -50.0f), scratch(9), p(9);
    lone[4] = 10.0f;
    entmax_probabilities(lone.data(), 9, 1.5, entmax_threshold(lone.data(), 9, 1.5, true, scratch.data()), p.data());
    for (std::int64_t j = 0; j < 9; ++j) CHECK(p[static_cast<std::size_t>(j)] == (j == 4 ? 1.0f : 0.0f));
  }

  TEST_CASE("adaptive-sparse equals the double reference at block sizes ±1 and non-multiples, causal and not") {
    struct Case {
      std::vector<std::string> params;
      double alpha;
      std::vector<std::int64_t> lengths;
    };
    for (const Case& c :
         {Case{{"block_q=16"}, 1.5, {1, 15, 16, 17, 33, 100}}, Case{{"block_q=16", "algorithm=bisect"}, 1.5, {17, 40}},
          Case{{"block_q=7", "alpha=2"}, 2.0, {6, 7, 8, 29}},
          Case{{"block_q=7", "alpha=2", "algorithm=bisect"}, 2.0, {8, 29}}, Case{{"alpha=1.2"}, 1.2, {63, 64, 65}},
          Case{{"block_q=9", "alpha=1.8"}, 1.8, {10, 50}}, Case{{}, 1.5, {130}}})
      for (std::int64_t n : c.lengths)
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          std::string label = "N=" + std::to_string(n) + (causal ? " causal" : "");
          for (const auto& param : c.params) label += " " + param;
          check_model(p, c.params, c.alpha, label);
        }
  }

  TEST_CASE("adaptive-sparse with learned alpha runs alpha = clamp(1 + sigmoid(a), 1.01, 2) per head") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 8, .causal = false};
    const auto in = random_inputs(p, 9);
    const MechanismRun run = run_keeping("adaptive-sparse", p, in, {"learn_alpha=true", "alpha=1.3", "block_q=16"});
    const Tensor& logit = run.parameter("alpha_logit");
    const Tensor& alpha = run.parameter("alpha");
    for (std::int64_t h = 0; h < 2; ++h) {
      CHECK(logit[h] == doctest::Approx(std::log(0.3 / 0.7)).epsilon(1e-6));
      CHECK(alpha[h] == doctest::Approx(1.3).epsilon(1e-6));
    }
    const std::vector<double> want = reference_model(named(in), p, 1.3);
    for (std::int64_t head = 0; head < 2; ++head)
      check_head(run.out.data() + head * 320,
                 std::vector<double>(want.begin() + head * 320, want.begin() + (head + 1) * 320), 40, 8,
                 output_tolerance(in, p, head, 1.3), "learned alpha head " + std::to_string(head));
  }

  TEST_CASE("alpha -> 1 approaches softmax attention") {
    // entmax_α = softmax + O(α − 1): the largest output difference from softmax attention shrinks
    // with α − 1 (≈ linearly: a tenth of α − 1 gives well under half the difference), and at α =
    // 1.01 it is within 0.05·max|v| (N(0, 1) scores, N = 64).
    const Problem p{.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 16, .causal = false};
    const auto in = random_inputs(p, 4);
    const double scale = 1.0 / 4.0;
    auto difference = [&](double alpha) {
      const Tensor out = run_mechanism("adaptive-sparse", p, in, {"alpha=" + std::to_string(alpha)});
      double largest = 0;
      for (std::int64_t head = 0; head < 2; ++head) {
        const std::int64_t at = head * 64 * 16;
        const std::vector<double> softmax =
            reference_attention(in.q.data() + at, in.k.data() + at, in.v.data() + at, 64, 64, 16, scale, full_mask);
        for (std::int64_t e = 0; e < 64 * 16; ++e)
          largest = std::max(largest, std::fabs(out.data()[at + e] - softmax[static_cast<std::size_t>(e)]));
      }
      return largest;
    };
    const double wide = difference(1.1), narrow = difference(1.01);
    MESSAGE("max |entmax - softmax| output: alpha 1.1 " << wide << ", alpha 1.01 " << narrow);
    CHECK(narrow < 0.2 * wide);
    CHECK(narrow < 0.02 * max_abs(in.v.data(), in.v.size()));
  }

  TEST_CASE("adaptive-sparse gradients by central differences: q, k, v and the learned alpha") {
    struct Case {
      std::vector<std::string> params;
      double alpha;
      std::int64_t n;
    };
    for (const Case& c : {Case{{"block_q=4"}, 1.5, 9}, Case{{"block_q=8", "alpha=1.3"}, 1.3, 17},
                          Case{{"block_q=4", "alpha=2"}, 2.0, 9}, Case{{"learn_alpha=true", "block_q=4"}, 1.5, 9},
                          Case{{"learn_alpha=true", "alpha=1.7", "block_q=8"}, 1.7, 17}})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = c.n, .head_dim = 4, .causal = causal};
        CAPTURE(c.n);
        CAPTURE(causal);
        CAPTURE(c.params.front());
        check_composite_gradients(
            "adaptive-sparse", p, c.params, [&](const NamedValues& x) { return reference_model(x, p, c.alpha); },
            c.n <= 9);
      }
  }

  TEST_CASE("adaptive-sparse causal: changing future tokens changes no earlier output") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 100, .head_dim = 8, .causal = true};
    for (const char* alpha : {"alpha=1.5", "alpha=1.4"}) {
      auto in = random_inputs(p, 5);
      const Tensor before = run_mechanism("adaptive-sparse", p, in, {alpha, "block_q=16"});
      const std::int64_t cut = 37;
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t e = cut * 8; e < 100 * 8; ++e) {
          in.k.head(0, h)[e] += 3.0f;
          in.v.head(0, h)[e] -= 5.0f;
          in.q.head(0, h)[e] *= -1.0f;
        }
      const Tensor after = run_mechanism("adaptive-sparse", p, in, {alpha, "block_q=16"});
      for (std::int64_t h = 0; h < 2; ++h) {
        CHECK(std::memcmp(before.head(0, h), after.head(0, h), cut * 8 * sizeof(float)) == 0);
        CHECK(std::memcmp(before.head(0, h) + cut * 8, after.head(0, h) + cut * 8, 8 * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("adaptive-sparse counters: FLOPs grow as N², tracked memory as N") {
    auto row = [](std::int64_t n, bool causal) { return quick_row("adaptive-sparse", n, causal); };
    for (bool causal : {false, true}) {
      const ResultRow r1 = row(512, causal), r2 = row(1024, causal), r4 = row(2048, causal);
      // Not causal: exactly 4·N²·D + 5·N² per head. Causal: the row blocks' triangle adds a term
      // linear in N (block_q·N/2 entries), so the ratio approaches 4 from below.
      for (const double ratio : {static_cast<double>(r2.flops) / r1.flops, static_cast<double>(r4.flops) / r2.flops}) {
        if (causal) {
          CHECK(ratio > 3.75);
          CHECK(ratio < 4.0);
        } else {
          CHECK(ratio == doctest::Approx(4.0).epsilon(1e-12));
        }
      }
      CHECK(static_cast<double>(r4.workspace_bytes) / r2.workspace_bytes == doctest::Approx(2.0).epsilon(0.05));
      CHECK(static_cast<double>(r4.peak_tensor_bytes) / r2.peak_tensor_bytes < 2.1);
    }
    CHECK(quick_row("adaptive-sparse", 2048, false).peak_tensor_bytes <
          0.2 * quick_row("vanilla", 2048, false).peak_tensor_bytes);
  }

  TEST_CASE("adaptive-sparse rejects a learned alpha that sigmoid cannot start from") {
    const ModelInfo* info = find_model("adaptive-sparse");
    REQUIRE(info != nullptr);
    const Problem p{.batch = 1, .heads = 2, .seq_len = 16, .head_dim = 8};
    CHECK_THROWS_AS(
        info->impl.validate(p, resolve_params("adaptive-sparse", info->impl.params, {"learn_alpha=true", "alpha=2"})),
        ParamError);
    CHECK_NOTHROW(info->impl.validate(p, resolve_params("adaptive-sparse", info->impl.params, {"alpha=2"})));
  }
}
