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
//
// The gradients: the bf16 backward is the fp32 form's computation on the widened bf16 values, so the
// float64 backward here starts from the tensors the model stored (α, Q̃, K̃, Ṽ and P in bf16, the
// inputs, dO and the fp32 parameters) and the only bf16 roundings left are dq, dk, dv's, once each.
// An element of dq, dk, dv may be off by A + u·(|g| + A), A = 64·ε·(log2 N + D + log2 F)·G the fp32
// form's own allowance (tests/support/gradient_check.hpp) with G the largest element of that tensor
// (each is an fp32 product of stored tensors, its sums' errors on its own scale); a parameter gradient
// (fp32, summed over the batch) by A with G the largest gradient of any tensor, as gradient_check.hpp
// has it (db2 sums to about 0: the softmax over N is shift-invariant, so its error is on its terms' scale).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
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

// One head's float64 backward from the stored tensors: alpha [S, N], tokens Q̃, K̃, Ṽ [S, D] each,
// probs P [S, S], x = q, k, v [N, D] each, dout [S, D] and the head's parameters; the parameter
// gradients are added into grads (named as parameter_gradients() names them).
struct HeadInputs {
  std::vector<double> alpha, tokens[3], probs, x[3], dout;
};
struct HeadGrads {
  std::vector<double> dx[3];
};
HeadGrads head_backward(const HeadInputs& in, const NamedValues& params, std::int64_t h, std::int64_t n, std::int64_t d,
                        std::int64_t f, std::int64_t s, std::map<std::string, std::vector<double>>& grads) {
  const double sigma = 1 / std::sqrt(static_cast<double>(d));
  const auto zeros = [](std::int64_t count) { return std::vector<double>(static_cast<std::size_t>(count), 0.0); };
  // The token attention: dṼ = Pᵀ·dO, dS = P ⊙ (dO·Ṽᵀ − rowsum), dQ̃ = σ·dS·K̃, dK̃ = σ·dSᵀ·Q̃.
  std::vector<double> dtokens[3] = {zeros(s * d), zeros(s * d), zeros(s * d)};
  for (std::int64_t a = 0; a < s; ++a) {
    std::vector<double> dp(static_cast<std::size_t>(s));
    double delta = 0;
    for (std::int64_t c2 = 0; c2 < s; ++c2) {
      for (std::int64_t c = 0; c < d; ++c) dp[c2] += in.dout[a * d + c] * in.tokens[2][c2 * d + c];
      delta += in.probs[a * s + c2] * dp[c2];
    }
    for (std::int64_t c2 = 0; c2 < s; ++c2) {
      const double p = in.probs[a * s + c2], ds = p * (dp[c2] - delta);
      for (std::int64_t c = 0; c < d; ++c) {
        dtokens[2][c2 * d + c] += p * in.dout[a * d + c];
        dtokens[0][a * d + c] += sigma * ds * in.tokens[1][c2 * d + c];
        dtokens[1][c2 * d + c] += sigma * ds * in.tokens[0][a * d + c];
      }
    }
  }
  // The pooling: dx = αᵀ·dx̃; dα = Σ dx̃·xᵀ; d logits = α ⊙ (dα − rowsum(α ⊙ dα)).
  HeadGrads g{{zeros(n * d), zeros(n * d), zeros(n * d)}};
  std::vector<double> dlogits = zeros(s * n);
  for (std::int64_t t = 0; t < s; ++t) {
    double delta = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      double dalpha = 0;
      for (int which = 0; which < 3; ++which)
        for (std::int64_t c = 0; c < d; ++c) {
          g.dx[which][i * d + c] += in.alpha[t * n + i] * dtokens[which][t * d + c];
          dalpha += dtokens[which][t * d + c] * in.x[which][i * d + c];
        }
      dlogits[t * n + i] = dalpha;
      delta += in.alpha[t * n + i] * dalpha;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      dlogits[t * n + i] = in.alpha[t * n + i] * (dlogits[t * n + i] - delta);
      grads["db2"][h * s + t] += dlogits[t * n + i];
    }
  }
  // The weight MLP on v, recomputed: LN, z = LN·W1 + b1, GELU, logits = GELU(z)·W2 + b2.
  const double* gain = params.at("ln_gains").data() + h * d;
  const double* w1 = params.at("w1").data() + h * d * f;
  const double* b1 = params.at("b1").data() + h * f;
  const double* w2 = params.at("w2").data() + h * f * s;
  const double* shift = params.at("ln_shifts").data() + h * d;
  for (std::int64_t i = 0; i < n; ++i) {
    const double* v = in.x[2].data() + i * d;
    double mean = 0, variance = 0;
    for (std::int64_t c = 0; c < d; ++c) mean += v[c] / static_cast<double>(d);
    for (std::int64_t c = 0; c < d; ++c) variance += (v[c] - mean) * (v[c] - mean) / static_cast<double>(d);
    const double inverse_std = 1 / std::sqrt(variance + 1e-6);
    std::vector<double> normal(static_cast<std::size_t>(d)), normalised(normal.size()), dnormalised(normal.size());
    for (std::int64_t c = 0; c < d; ++c) {
      normal[c] = (v[c] - mean) * inverse_std;
      normalised[c] = normal[c] * gain[c] + shift[c];
    }
    for (std::int64_t j = 0; j < f; ++j) {
      double z = b1[j];
      for (std::int64_t c = 0; c < d; ++c) z += normalised[c] * w1[c * f + j];
      double dhidden = 0;
      for (std::int64_t t = 0; t < s; ++t) {
        dhidden += dlogits[t * n + i] * w2[j * s + t];
        grads["dw2"][(h * f + j) * s + t] += gelu(z) * dlogits[t * n + i];
      }
      const double slope =
          0.5 * (1 + std::erf(z / std::sqrt(2.0))) + z * std::exp(-0.5 * z * z) / std::sqrt(2 * 3.14159265358979323846);
      const double dz = dhidden * slope;
      grads["db1"][h * f + j] += dz;
      for (std::int64_t c = 0; c < d; ++c) {
        grads["dw1"][(h * d + c) * f + j] += normalised[c] * dz;
        dnormalised[c] += dz * w1[c * f + j];
      }
    }
    // LN backward: dx̂ = dLN·gain, dv += (dx̂ − mean(dx̂) − x̂·mean(dx̂·x̂)) / σ.
    double mean_grad = 0, mean_projection = 0;
    for (std::int64_t c = 0; c < d; ++c) {
      grads["dln_gains"][h * d + c] += dnormalised[c] * normal[c];
      grads["dln_shifts"][h * d + c] += dnormalised[c];
      mean_grad += dnormalised[c] * gain[c] / static_cast<double>(d);
      mean_projection += dnormalised[c] * gain[c] * normal[c] / static_cast<double>(d);
    }
    for (std::int64_t c = 0; c < d; ++c)
      g.dx[2][i * d + c] += inverse_std * (dnormalised[c] * gain[c] - mean_grad - normal[c] * mean_projection);
  }
  return g;
}

// The bf16 training step's dq, dk, dv and parameter gradients against head_backward on its stored
// tensors (the bound in the header).
void check_tokenlearner_gradients(const Problem& shape, TokenLearnerShape t, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, f = t.bottleneck, s = std::min(t.tokens, n);
  const std::int64_t all = p.batch * p.heads;
  const std::string label = "tokenlearner bf16 gradients N=" + std::to_string(n) + " S=" + std::to_string(t.tokens) +
                            " F=" + std::to_string(f) + " D=" + std::to_string(d);
  const Bf16GradientRun run = run_bf16_gradients("tokenlearner", p, tokenlearner_params(t), seed);
  const NamedValues params = with_parameters(run.in.widened, *run.mechanism);
  std::map<std::string, const Tensor*> stored, got_params;
  for (const auto& named : run.mechanism->saved()) stored[named.name] = named.tensor;
  for (const auto& named : run.mechanism->parameter_gradients()) got_params[named.name] = named.tensor;
  REQUIRE(stored.size() == 3);
  REQUIRE(got_params.size() == 6);
  const Tensor alpha = to_f32(*stored.at("weights")), tokens = to_f32(*stored.at("pooled_qkv")),
               probs = to_f32(*stored.at("token_attention"));
  const std::int64_t ld = alpha.dim(2);
  std::map<std::string, std::vector<double>> want_params;
  for (const auto& [name, tensor] : got_params) want_params[name].assign(static_cast<std::size_t>(tensor->size()), 0.0);
  std::vector<HeadGrads> heads;
  const Tensor* inputs[3] = {&run.in.widened.q, &run.in.widened.k, &run.in.widened.v};
  for (std::int64_t bh = 0; bh < all; ++bh) {
    HeadInputs in;
    for (std::int64_t r = 0; r < s; ++r)
      in.alpha.insert(in.alpha.end(), alpha.data() + (bh * s + r) * ld, alpha.data() + (bh * s + r) * ld + n);
    for (int which = 0; which < 3; ++which) {
      in.tokens[which] = widened(tokens.data() + (which * all + bh) * s * d, s * d);
      in.x[which] = widened(inputs[which]->data() + bh * n * d, n * d);
    }
    in.probs = widened(probs.data() + bh * s * s, s * s);
    in.dout = widened(run.dout_widened.data() + bh * s * d, s * d);
    heads.push_back(head_backward(in, params, bh % p.heads, n, d, f, s, want_params));
  }
  // A per tensor: the fp32 allowance on its largest element (parameters: on the largest of any tensor).
  const double size_factor =
      64 * kFloatEps * (std::log2(static_cast<double>(n)) + static_cast<double>(d) + std::log2(static_cast<double>(f)));
  double largest[3] = {0, 0, 0}, overall = 0;
  for (const HeadGrads& head : heads)
    for (int which = 0; which < 3; ++which)
      for (double value : head.dx[which]) largest[which] = std::max(largest[which], std::fabs(value));
  for (const auto& [name, values] : want_params)
    for (double value : values) overall = std::max(overall, std::fabs(value));
  for (double value : largest) overall = std::max(overall, value);
  const Tensor* got[3] = {&run.dq, &run.dk, &run.dv};
  for (std::int64_t bh = 0; bh < all; ++bh)
    for (int which = 0; which < 3; ++which) {
      const std::vector<double>& want = heads[static_cast<std::size_t>(bh)].dx[which];
      const double allowance = size_factor * largest[which];
      check_bf16_elements(
          got[which]->data() + bh * n * d, want, n * d,
          [&](std::int64_t e) {
            return allowance + kU * (std::fabs(want[static_cast<std::size_t>(e)]) + allowance) + 1e-30;
          },
          label + " head " + std::to_string(bh) + " d" + "qkv"[which]);
    }
  for (const auto& [name, tensor] : got_params)
    check_bf16_elements(
        tensor->data(), want_params.at(name), tensor->size(),
        [&](std::int64_t) { return size_factor * overall + 1e-30; }, label + " " + name);
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

  TEST_CASE("tokenlearner in bf16: gradients against a float64 backward on its stored tensors, N around the chunks") {
    // S = 8 (N = 7 clamps it), the 256-row chunks of the widened rows and the MLP (N = 255 … 257, 600),
    // D of the tile kernels and not.
    for (std::int64_t n : {1, 7, 8, 9, 255, 256, 257, 600})
      for (std::int64_t d : {16, 12})
        check_tokenlearner_gradients({.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = false}, {},
                                     static_cast<std::uint64_t>(n + d));
    for (const TokenLearnerShape t : {TokenLearnerShape{1, 64}, TokenLearnerShape{16, 5}, TokenLearnerShape{3, 7}})
      for (std::int64_t n : {15, 16, 17})
        check_tokenlearner_gradients({.batch = 2, .heads = 3, .seq_len = n, .head_dim = 16, .causal = false}, t,
                                     static_cast<std::uint64_t>(n));
  }

  TEST_CASE("tokenlearner bf16 rows: FLOPs as fp32's, halved inputs and state, estimates exact (every pass)") {
    // α [B·H, S, ld], Q̃ K̃ Ṽ and the token attention halve; the bf16 form's fp32 rows per thread add
    // (check_bf16_rows holds both estimates to the measured bytes).
    for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train})
      for (std::int64_t n : {1, 100, 257}) check_bf16_rows("tokenlearner", n, false, pass);
  }
}
