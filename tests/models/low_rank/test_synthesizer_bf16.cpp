// synthesizer in bf16 (taxonomy/low_rank/synthesizer.hpp), u = 2⁻⁸: the output against the naive
// float64 formula on the bf16 inputs (tests/models/low_rank/synthesizer_reference.hpp) within the
// bound of softmax attention in bf16 (tests/support/bf16_check.hpp) with the logits' own fp32 error:
// 2u(1 + u)·max|v| (rounding P and O) + logits_tolerance (the logits carry fp32 rounding only: the
// bf16 products are exact in fp32, the synthetic logits come from fp32 parameters). Decoding
// against the bf16 causal forward (check_bf16_decode: P rounded as the forward rounds it).
#include <doctest/doctest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "tests/models/low_rank/synthesizer_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

void check_case(const std::string& variant, double mix, const Problem& p, std::uint64_t seed) {
  std::vector<std::string> params{"variant=" + variant, "vanilla_weight=" + std::to_string(mix)};
  if (p.seq_len == 33) params.push_back("factor_rank=3");
  const std::string label = "synthesizer bf16 " + variant + " mix=" + std::to_string(mix) +
                            " N=" + std::to_string(p.seq_len) + (p.causal ? " causal" : "");
  const Bf16Inputs in = bf16_inputs(p, seed);
  MechanismRun run{bf16_mechanism("synthesizer", p, params), Tensor()};
  const Tensor got = run_bf16(*run.mechanism, p, in.bf16);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float* v = in.widened.v.head(b, h);
      const Logits logits =
          synthesizer_logits(run, variant, mix, in.widened.q.head(b, h), in.widened.k.head(b, h), h, n, d);
      const double bound =
          2 * kBf16Roundoff * (1 + kBf16Roundoff) * max_abs_of(v, n * d) + logits_tolerance(logits, v, n, d);
      check_bf16_elements(
          got.head(b, h), softmax_times_v(logits, v, n, d, p.causal), n * d, [&](std::int64_t) { return bound; },
          label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

// The bf16 backward against the fp32 form's on the same values (the bf16 inputs and dout widened).
// Both compute dL = P·(dP − Σ P·dP) from fp32 dP; the bf16 form's P is rounded to bf16 and, for dQ
// and dK, dL too, so per entry |dL' − dL| ≤ E = (3u(1 + u) + 8(N + D)ε)·T, T = P·(|dP| + Σ P·|dP|)
// (rounding P moves both factors by ≤ u·P; rounding dL by ≤ u·|dL| ≤ u·T; 8(N + D)ε covers the two
// forms' fp32 rounding of P, dP and the products). Every gradient is linear in dL with fixed
// operands, so its error is that map applied to E with the operands' magnitudes (the ReLU mask is
// the same in both forms), plus its own rounding u·|g| for dq, dk, dv; dV = Pᵀ·dO is off by
// ≤ (2u + 8(N + D)ε)·Σ P·|dO| + u·|dv|.
void check_gradients(const std::string& variant, double mix, const Problem& shape) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, heads = p.heads;
  std::vector<std::string> params{"variant=" + variant, "vanilla_weight=" + std::to_string(mix)};
  if (n == 17) params.push_back("factor_rank=3");
  const std::string label = "synthesizer bf16 backward " + variant + " mix=" + std::to_string(mix) +
                            " N=" + std::to_string(n) + (p.causal ? " causal" : "");
  const Bf16GradientRun run = run_bf16_gradients("synthesizer", p, params, static_cast<std::uint64_t>(n) + 11);
  const AttentionInputs& in = run.in.widened;
  const ModelInfo* info = find_model("synthesizer");
  MechanismRun f32{info->impl.create(p, resolve_params("synthesizer", info->impl.params, params), 42), Tensor()};
  const auto bhnd = [&] { return Tensor::bhnd(p.batch, heads, n, d); };
  Tensor out = bhnd(), dq = bhnd(), dk = bhnd(), dv = bhnd();
  f32.mechanism->prepare(in.q, in.k, in.v);
  f32.mechanism->prepare_backward();
  f32.mechanism->forward(in.q, in.k, in.v, out);
  f32.mechanism->backward(in.q, in.k, in.v, out, run.dout_widened, dq, dk, dv);
  const double u = kBf16Roundoff, fp32 = 8 * double(n + d) * kFloatEps, factor = 3 * u * (1 + u) + fp32;
  const double scale = 1 / std::sqrt(double(d)), alpha = mix;
  const bool dense = variant == "dense";
  // Bounds accumulated per element, in the gradients' own layouts.
  std::vector<double> bq(dq.size(), 0.0), bk(dk.size(), 0.0), bv(dv.size(), 0.0);
  std::map<std::string, std::vector<double>> bp;
  for (const auto& named : f32.mechanism->parameter_gradients())
    bp[named.name].assign(static_cast<std::size_t>(named.tensor->size()), 0.0);
  const Tensor* hidden = dense ? &tensor_named(f32.mechanism->saved(), "hidden") : nullptr;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h) {
      const std::int64_t bh = b * heads + h, at = bh * n * d;
      const float *q = in.q.head(b, h), *k = in.k.head(b, h), *v = in.v.head(b, h), *dout = run.dout_widened.head(b, h);
      const Logits logits = synthesizer_logits(f32, variant, mix, q, k, h, n, d);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t valid = p.causal ? i + 1 : n;
        double peak = -INFINITY, sum = 0, weighted = 0;
        for (std::int64_t j = 0; j < valid; ++j) peak = std::max(peak, logits.value[i * n + j]);
        std::vector<double> prob(static_cast<std::size_t>(valid)), dp(static_cast<std::size_t>(valid));
        for (std::int64_t j = 0; j < valid; ++j) sum += prob[j] = std::exp(logits.value[i * n + j] - peak);
        for (std::int64_t j = 0; j < valid; ++j) {
          prob[j] /= sum;
          for (std::int64_t c = 0; c < d; ++c) dp[j] += double(dout[i * d + c]) * v[j * d + c];
          weighted += prob[j] * std::fabs(dp[j]);
        }
        for (std::int64_t j = 0; j < valid; ++j) {
          const double e = factor * prob[j] * (std::fabs(dp[j]) + weighted), synthetic = (1 - mix) * e;
          for (std::int64_t c = 0; c < d; ++c) {
            bv[at + j * d + c] += (2 * u + fp32) * prob[j] * std::fabs(dout[i * d + c]);
            bq[at + i * d + c] += alpha * scale * e * std::fabs(k[j * d + c]);
            bk[at + j * d + c] += alpha * scale * e * std::fabs(q[i * d + c]);
          }
          if (variant == "random") bp["dr"][(h * n + i) * n + j] += synthetic;
          if (variant == "factorized-random") {
            const std::int64_t rank = f32.parameter("r1").dim(2);
            const float *r1 = f32.parameter("r1").data() + h * n * rank,
                        *r2 = f32.parameter("r2").data() + h * n * rank;
            for (std::int64_t c = 0; c < rank; ++c) {
              bp["dr1"][(h * n + i) * rank + c] += synthetic * std::fabs(r2[j * rank + c]);
              bp["dr2"][(h * n + j) * rank + c] += synthetic * std::fabs(r1[i * rank + c]);
            }
          }
          if (dense) {
            const float* w1 = f32.parameter("w1").data() + h * d * d;
            const float* w2 = f32.parameter("w2").data() + h * d * n;
            bp["db2"][h * n + j] += synthetic;
            for (std::int64_t c = 0; c < d; ++c) {
              const double hidden_grad = synthetic * std::fabs(w2[c * n + j]);  // d hidden[i][c]'s part
              bp["dw2"][(h * d + c) * n + j] += synthetic * std::fabs(hidden->data()[(bh * n + i) * (d + 1) + c]);
              bp["db1"][h * d + c] += hidden_grad;
              for (std::int64_t f = 0; f < d; ++f) {
                bp["dw1"][(h * d + f) * d + c] += std::fabs(q[i * d + f]) * hidden_grad;
                bq[at + i * d + f] += hidden_grad * std::fabs(w1[f * d + c]);
              }
            }
          }
        }
      }
    }
  const auto check = [&](const float* got, const float* want, const std::vector<double>& bound, bool rounded,
                         const std::string& what) {
    std::int64_t failures = 0;
    for (std::size_t e = 0; e < bound.size(); ++e) {
      const double limit = bound[e] + (rounded ? u * std::fabs(want[e]) : 0.0) + 1e-30;
      if (!(std::fabs(got[e] - want[e]) <= limit) && failures++ < 3)
        FAIL_CHECK(label << " " << what << " element " << e << ": got " << got[e] << ", want " << want[e] << " (bound "
                         << limit << ")");
    }
    CHECK_MESSAGE(failures == 0, label << " " << what << ": " << failures << " out of the bound");
  };
  check(run.dq.data(), dq.data(), bq, true, "dq");
  check(run.dk.data(), dk.data(), bk, true, "dk");
  check(run.dv.data(), dv.data(), bv, true, "dv");
  for (const auto& named : run.mechanism->parameter_gradients())
    check(named.tensor->data(), tensor_named(f32.mechanism->parameter_gradients(), named.name).data(), bp[named.name],
          false, named.name);
}

}  // namespace

TEST_SUITE("synthesizer_bf16") {
  TEST_CASE("synthesizer bf16 variants against their float64 formulas, causal and not, with and without + Vanilla") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const char* variant : {"dense", "random", "factorized-random"})
        for (double mix : {0.0, 0.3, 1.0})
          for (std::int64_t n : {1, 7, 16, 33, 100})
            for (bool causal : {false, true})
              check_case(variant, mix, {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                         static_cast<std::uint64_t>(n) + 3);
      // D not a multiple of 16 (the bf16 matmul takes any D).
      check_case("dense", 0.3, {.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 24, .causal = true}, 5);
    });
  }

  TEST_CASE("synthesizer bf16 decode equals its bf16 causal forward, every variant") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (const char* mix : {"0", "0.5"})
        for (std::int64_t context : {1, 2, 17})
          check_bf16_decode("synthesizer", {.batch = 2, .heads = 2, .head_dim = 16}, context, 7,
                            {"variant=" + std::string(variant), std::string("vanilla_weight=") + mix});
  }

  TEST_CASE("synthesizer bf16 rows: FLOPs as fp32's, halved inputs and caches, estimates exact") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (const char* mix : {"0", "0.5"})
        for (bool causal : {false, true})
          for (Pass pass : {Pass::Forward, Pass::Decode}) {
            if (pass == Pass::Decode && !causal) continue;
            const auto [a, b] =
                check_bf16_rows("synthesizer", 100, causal, pass,
                                {"variant=" + std::string(variant), std::string("vanilla_weight=") + mix});
            if (pass == Pass::Decode) {
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes == a.state_bytes);
            }
          }
  }

  TEST_CASE("synthesizer bf16 gradients: the fp32 form's within dL's bf16 error carried through each product") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (double mix : {0.0, 0.4})
        for (std::int64_t n : {1, 16, 17, 40})
          for (bool causal : {false, true})
            check_gradients(variant, mix, {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal});
  }

  TEST_CASE("synthesizer bf16 training rows: FLOPs as fp32's, halved inputs and gradients, estimates exact") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (const char* mix : {"0", "0.5"})
        for (Pass pass : {Pass::Backward, Pass::Train}) {
          const auto [a, b] =
              check_bf16_rows("synthesizer", 100, true, pass,
                              {"variant=" + std::string(variant), std::string("vanilla_weight=") + mix});
          CHECK(b.saved_bytes < a.saved_bytes);  // P in a dense fp32 buffer (ld N, not padded)
        }
  }
}
