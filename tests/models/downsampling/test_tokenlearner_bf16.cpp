// tokenlearner in bf16 (taxonomy/downsampling/tokenlearner.hpp) against its float64 reference on the
// same bf16 inputs and fp32 parameters, the bound derived through each rounding point of the form.
//
// With u = 2⁻⁸ and ε the fp32 unit roundoff, per head:
//   α: computed in fp32 (relative error e_α, the fp32 test's: 8ε·(2·logit error + log2 N)) and
//      rounded, so |α̂ − α| ≤ r_α·α, r_α = u + (1 + u)·e_α.
//   x̃ = bf16(Σ_j α̂_j·x_j), x = q, k, v: |x̃̂ − x̃| ≤ E_x = (1 + 2u)·((r_α + 1.01·N·ε)·Σ_j α_j·|x_j| + u·|x̃|).
//   S_ab = σ·Q̃_a·K̃_b: |ΔS_ab| ≤ σ·Σ_c (E_Q·|K̃| + |Q̃|·E_K + E_Q·E_K) + 1.01·D·ε·σ·Σ_c (|Q̃| + E_Q)(|K̃| + E_K).
//   P = softmax(S) and out = bf16(Σ_b bf16(P̂)·Ṽ̂): those score shifts, E_V and P's rounding through the
//      softmax (perturbed_attention_error, tests/support/bf16_check.hpp) give Δ, and the output's
//      rounding |out̂ − out| ≤ (1 + 2u)·(Δ + u·|out|).
// Every term is first order in u but the exponential; the (1 + 2u) factors cover the second order.
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
#include "tests/support/tokenlearner_reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

// The bound above for every element of one head's output ([S, D]).
std::vector<double> output_bound(const TokenLearnerParts& parts, const std::vector<double>& x, const Problem& p,
                                 std::int64_t b, std::int64_t h, double weight_error, const std::vector<double>& want) {
  const std::int64_t n = p.seq_len, d = p.head_dim, s = static_cast<std::int64_t>(parts.weights.size()) / n;
  const double r_alpha = kU + (1 + kU) * weight_error, sigma = 1 / std::sqrt(static_cast<double>(d));
  const double eps = kFloatEps;
  // E_x per token element, for q, k, v (x holds the named q, k, v of the whole problem, one after another).
  std::vector<double> error[3];
  for (int which = 0; which < 3; ++which) {
    const double* rows = x.data() + which * p.batch * p.heads * n * d + (b * p.heads + h) * n * d;
    const std::vector<double>& tokens = parts.tokens[which];
    error[which].assign(s * d, 0.0);
    for (std::int64_t t = 0; t < s; ++t)
      for (std::int64_t c = 0; c < d; ++c) {
        double spread = 0;
        for (std::int64_t j = 0; j < n; ++j) spread += parts.weights[t * n + j] * std::fabs(rows[j * d + c]);
        error[which][t * d + c] =
            (1 + 2 * kU) * ((r_alpha + 1.01 * n * eps) * spread + kU * std::fabs(tokens[t * d + c]));
      }
  }
  const std::vector<double>&tq = parts.tokens[0], &tk = parts.tokens[1], &tv = parts.tokens[2];
  std::vector<double> bound(s * d, 0.0);
  for (std::int64_t a = 0; a < s; ++a) {
    std::vector<double> score(s), shift(s), prob(s);
    for (std::int64_t c2 = 0; c2 < s; ++c2) {
      double dot = 0, moved = 0, sum_error = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        const double q_ac = tq[a * d + c], k_bc = tk[c2 * d + c], eq = error[0][a * d + c], ek = error[1][c2 * d + c];
        dot += q_ac * k_bc;
        moved += eq * std::fabs(k_bc) + std::fabs(q_ac) * ek + eq * ek;
        sum_error += (std::fabs(q_ac) + eq) * (std::fabs(k_bc) + ek);
      }
      score[c2] = sigma * dot;
      shift[c2] = sigma * moved + 1.01 * d * eps * sigma * sum_error;
    }
    const double peak = *std::max_element(score.begin(), score.end());
    double total = 0;
    for (std::int64_t c2 = 0; c2 < s; ++c2) total += prob[c2] = std::exp(score[c2] - peak);
    for (double& value : prob) value /= total;
    const std::vector<double> moved = perturbed_attention_error(prob, shift, tv.data(), error[2].data(), d, kU);
    for (std::int64_t c = 0; c < d; ++c)
      bound[a * d + c] = (1 + 2 * kU) * (moved[static_cast<std::size_t>(c)] + kU * std::fabs(want[a * d + c]));
  }
  return bound;
}

void check_tokenlearner_bf16(const Problem& shape, TokenLearnerShape t, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::string label = "tokenlearner bf16 N=" + std::to_string(p.seq_len) + " S=" + std::to_string(t.tokens) +
                            " F=" + std::to_string(t.bottleneck) + " D=" + std::to_string(p.head_dim);
  const Bf16Inputs in = bf16_inputs(p, seed);
  auto mechanism = bf16_mechanism("tokenlearner", p, tokenlearner_params(t));
  const std::int64_t m = std::min(t.tokens, p.seq_len), d = p.head_dim;
  Tensor out = Tensor::bhnd(p.batch, p.heads, m, d, DType::BF16);
  mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
  mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
  const Tensor got = to_f32(out);
  const NamedValues x = with_parameters(in.widened, *mechanism);
  std::vector<double> qkv = x.at("q");
  qkv.insert(qkv.end(), x.at("k").begin(), x.at("k").end());
  qkv.insert(qkv.end(), x.at("v").begin(), x.at("v").end());
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      TokenErrorScale scale;
      TokenLearnerParts parts;
      const std::vector<double> want = tokenlearner_head(x, p, t, b, h, scale, &parts);
      const double logit_error =
          (std::log2(static_cast<double>(d)) + std::log2(static_cast<double>(t.bottleneck)) + 2) * scale.logit_terms *
          std::max(1.0, scale.inverse_std);
      const double weight_error = 8 * kFloatEps * (2 * logit_error + std::log2(static_cast<double>(p.seq_len)) + 1);
      const std::vector<double> bound = output_bound(parts, qkv, p, b, h, weight_error, want);
      check_bf16_elements(
          got.data() + (b * p.heads + h) * m * d, want, m * d,
          [&](std::int64_t e) { return bound[static_cast<std::size_t>(e)]; },
          label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

}  // namespace

TEST_SUITE("tokenlearner_bf16") {
  TEST_CASE("tokenlearner in bf16 equals its float64 reference within the derived bound, N around S and the chunks") {
    // Defaults S = 8 (N = 7 clamps S), the MLP's 256-row chunks (N = 255 … 257), D of the tile
    // kernels and not (the form takes any D), the bf16 matmul's 256-deep blocks (N = 257, 300).
    for (std::int64_t n : {1, 7, 8, 9, 255, 256, 257, 300})
      for (std::int64_t d : {16, 12})
        check_tokenlearner_bf16({.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = false}, {},
                                static_cast<std::uint64_t>(n + d));
    for (const TokenLearnerShape t : {TokenLearnerShape{1, 64}, TokenLearnerShape{16, 5}, TokenLearnerShape{3, 7}})
      for (std::int64_t n : {15, 16, 17})
        check_tokenlearner_bf16({.batch = 2, .heads = 3, .seq_len = n, .head_dim = 16, .causal = false}, t,
                                static_cast<std::uint64_t>(n));
  }

  TEST_CASE("tokenlearner bf16 rows: FLOPs as fp32's, halved inputs and state, the estimate exact; no bf16 backward") {
    // α [B·H, S, ld], Q̃ K̃ Ṽ and the token attention halve; the bf16 form's fp32 rows per thread add
    // (check_bf16_rows holds both estimates to the measured bytes).
    for (std::int64_t n : {1, 100, 257}) check_bf16_rows("tokenlearner", n, false, Pass::Forward);
    for (Pass pass : {Pass::Backward, Pass::Train}) {
      const ResultRow row = run_point(bf16_point("tokenlearner", 100, false, pass));
      CHECK(row.status == Status::Unsupported);
      CHECK(row.reason.find("no bf16 backward") != std::string::npos);
    }
  }
}
