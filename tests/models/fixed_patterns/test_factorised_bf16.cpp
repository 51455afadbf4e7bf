// sparse-transformer and axial in bf16 (taxonomy/engines/block_sparse_bf16.hpp: the single-plan
// tiles with strided views, and the online form for axial's causal union) against float64
// references on the same bf16 inputs — the masks of the papers, and rows-then-columns attention
// for axial, written here independently of the mechanisms — forward and gradients on every bf16
// kernel path, causal and not, at sizes around the strides, grid widths and the 64-row tile;
// decode against the bf16 causal forward; FLOPs, bytes and the workspace estimate.
//
// sparse-transformer's bounds are the single-softmax ones of tests/support/bf16_check.hpp (each
// query row is one tile's softmax; key rows that several tiles reach sum in fp32, rounded once).
//
// axial's forward bound, per head. The row stage is one softmax per row: its output U (rounded to
// bf16) is within e₁ = 2u(1 + u)·max|v| + attention_tolerance of the float64 U. The second stage is
// one softmax per token over values that are the computed U (column keys) or V (row keys): within
// 2u(1 + u)·max(|U|, |v|) + attention_tolerance of the float64 attention over those same values,
// and its weights (summing to 1) carry U's error e₁ into the output at most once; |U| ≤ max|v| + e₁:
//   |o − o_ref| ≤ e₁ + 2u(1 + u)·(max|v| + e₁) + attention_tolerance.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/factorised_reference.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

std::int64_t root_ceiling(std::int64_t n) {
  std::int64_t root = 1;
  while (root * root < n) ++root;
  return root;
}

struct SparseCase {
  std::vector<std::string> params;
  bool fixed;
  std::int64_t stride, summary;  // stride 0: ⌈√N⌉; summary clamped to the stride
  std::vector<std::int64_t> sizes;
};
std::vector<SparseCase> sparse_cases() {
  return {
      {{"stride=8"}, false, 8, 0, {1, 7, 8, 9, 17, 63, 64, 65}},
      {{"stride=2"}, false, 2, 0, {127, 128, 129, 130}},  // residue classes longer than a 64-row tile
      {{"stride=40"}, false, 40, 0, {39, 40, 41, 150}},
      {{}, false, 0, 0, {2, 100}},
      {{"pattern=fixed", "stride=8", "summary=3"}, true, 8, 3, {1, 7, 8, 9, 17, 100}},
      {{"pattern=fixed", "stride=70", "summary=5"}, true, 70, 5, {64, 65, 70, 71, 150}},
      {{"pattern=fixed"}, true, 0, 8, {30, 100}},
  };
}

struct AxialCase {
  std::vector<std::string> params;
  std::int64_t cols;  // 0: ⌈√N⌉
  std::vector<std::int64_t> sizes;
};
std::vector<AxialCase> axial_cases() {
  return {
      {{}, 0, {1, 2, 15, 16, 17, 64, 65, 100}},
      {{"cols=8"}, 8, {7, 8, 9, 63, 64, 65, 70}},
      {{"cols=2"}, 2, {127, 128, 129, 131}},  // columns longer than a 64-row tile
      {{"cols=70"}, 70, {69, 70, 71, 150}},   // rows longer than a 64-row tile
  };
}

// axial's gradients in float64 and their bf16 bound, per element of dq, dk, dv (one head). The
// reference differentiates axial_reference: the second stage's softmax (values U or V) into dQ,
// dK, dU and dV, then the row stage with dU as its output gradient. The bound follows the
// single-softmax one (tests/support/bf16_check.hpp) through both stages: T, the terms of an
// element, is the same recursion on absolute values with the row stage fed the terms of dU (which
// bound |dU| and carry its error linearly), and six bf16 roundings each move an element by
// ≤ u(1 + u)·T — P and dS of each stage, dU before the row stage, the gradient once at the end —
// plus the fp32 factor of each stage: κ = 6u(1 + u) + 2·gradient_error_factor. On top, E: what the
// stored bf16 forward quantities bring in through dS = P ⊙ (dP − δ): the second stage's δ from O
// (Δδ_i ≤ 1.01·Σ_c |dO_ic|·e_O[i, c]) and its dP from U (ΔdP_ij ≤ Σ_c |dO_ic|·e_U[j, c]), the row
// stage's δ from U (Δδ_i ≤ 1.01·Σ_c T_dU[i, c]·e_U[i, c]), each times P and |K| (dQ) or |Q| (dK);
// e_U and e_O per element as in the forward bound but on each element's own magnitudes (rounding P
// moves an element by ≤ u·Σ_t p_t·|value_t|, rounding it by ≤ u·|element|; U's error rides into O
// through its weights), with `fp32` (attention_tolerance) for the fp32 rounding of each stage.
struct AxialGradients {
  std::vector<double> grads[3], bounds[3];  // dq, dk, dv
};
AxialGradients axial_gradients(const float* q, const float* k, const float* v, const float* dout, std::int64_t n,
                               std::int64_t d, std::int64_t cols, bool causal, double fp32, double kappa) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  using Keys = std::vector<std::pair<std::int64_t, bool>>;  // (token, value from U?)
  std::vector<Keys> rows(static_cast<std::size_t>(n)), second(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      const bool column = j % cols == i % cols, row = j / cols == i / cols;
      if (row) rows[static_cast<std::size_t>(i)].emplace_back(j, false);
      if (column && (!causal || j / cols < i / cols)) second[static_cast<std::size_t>(i)].emplace_back(j, true);
      if (causal && row && j <= i) second[static_cast<std::size_t>(i)].emplace_back(j, false);
    }
  auto weights = [&](std::int64_t i, const Keys& keys) {
    std::vector<double> p;
    double peak = -INFINITY, sum = 0;
    for (auto [j, from_u] : keys) {
      double dot = 0;
      for (std::int64_t c = 0; c < d; ++c) dot += static_cast<double>(q[i * d + c]) * k[j * d + c];
      p.push_back(dot * scale);
      peak = std::max(peak, p.back());
    }
    for (double& x : p) sum += x = std::exp(x - peak);
    for (double& x : p) x /= sum;
    return p;
  };
  const std::size_t size = static_cast<std::size_t>(n * d);
  const double r = kBf16Roundoff * (1 + kBf16Roundoff);
  std::vector<double> u(size, 0.0), e_u(size, 0.0), e_out(size, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const auto p = weights(i, rows[static_cast<std::size_t>(i)]);
    for (std::int64_t c = 0; c < d; ++c) {
      const auto me = static_cast<std::size_t>(i * d + c);
      double magnitude = 0;
      for (std::size_t t = 0; t < p.size(); ++t) {
        const float value = v[rows[static_cast<std::size_t>(i)][t].first * d + c];
        u[me] += p[t] * value;
        magnitude += p[t] * std::fabs(value);
      }
      e_u[me] = r * (magnitude + std::fabs(u[me])) + fp32;
    }
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const Keys& keys = second[static_cast<std::size_t>(i)];
    const auto p = weights(i, keys);
    for (std::int64_t c = 0; c < d; ++c) {
      double o = 0, magnitude = 0, carried = 0;
      for (std::size_t t = 0; t < p.size(); ++t) {
        const auto at = static_cast<std::size_t>(keys[t].first * d + c);
        const double value = keys[t].second ? u[at] : static_cast<double>(v[keys[t].first * d + c]);
        o += p[t] * value;
        magnitude += p[t] * (std::fabs(value) + (keys[t].second ? e_u[at] : 0.0));
        if (keys[t].second) carried += p[t] * e_u[at];
      }
      e_out[static_cast<std::size_t>(i * d + c)] = r * (magnitude + std::fabs(o) + carried) + carried + fp32;
    }
  }
  // g: dq, dk, dv, du; a: their terms; e: the extra E of dq, dk.
  std::vector<double> g[4], a[4], e[2];
  for (auto* set : {g, a})
    for (int x = 0; x < 4; ++x) set[x].assign(size, 0.0);
  for (auto& x : e) x.assign(size, 0.0);
  // One stage's backward for output gradient go (terms ga); value_errors: e_U when the stage's
  // values from U are the computed U (else nullptr); delta_error[i]: Δδ_i.
  auto stage = [&](const std::vector<Keys>& lists, const std::vector<double>& go, const std::vector<double>& ga,
                   const std::vector<double>* value_errors, const std::vector<double>& delta_error) {
    for (std::int64_t i = 0; i < n; ++i) {
      const Keys& keys = lists[static_cast<std::size_t>(i)];
      const auto p = weights(i, keys);
      std::vector<double> dp(keys.size()), dpa(keys.size()), dp_error(keys.size());
      double delta = 0, delta_abs = 0;
      for (std::size_t t = 0; t < keys.size(); ++t) {
        const auto [j, from_u] = keys[t];
        for (std::int64_t c = 0; c < d; ++c) {
          const auto at = static_cast<std::size_t>(j * d + c), me = static_cast<std::size_t>(i * d + c);
          const double value = from_u ? u[at] : static_cast<double>(v[j * d + c]);
          dp[t] += go[me] * value;
          dpa[t] += ga[me] * std::fabs(value);
          if (from_u && value_errors != nullptr) dp_error[t] += ga[me] * (*value_errors)[at];
        }
        delta += p[t] * dp[t];
        delta_abs += p[t] * dpa[t];
      }
      for (std::size_t t = 0; t < keys.size(); ++t) {
        const auto [j, from_u] = keys[t];
        const double ds = p[t] * (dp[t] - delta), dsa = p[t] * (dpa[t] + delta_abs);
        const double extra = p[t] * (dp_error[t] + delta_error[static_cast<std::size_t>(i)]);
        for (std::int64_t c = 0; c < d; ++c) {
          const auto at = static_cast<std::size_t>(j * d + c), me = static_cast<std::size_t>(i * d + c);
          g[0][me] += scale * ds * k[j * d + c];
          a[0][me] += scale * dsa * std::fabs(k[j * d + c]);
          e[0][me] += scale * extra * std::fabs(k[j * d + c]);
          g[1][at] += scale * ds * q[i * d + c];
          a[1][at] += scale * dsa * std::fabs(q[i * d + c]);
          e[1][at] += scale * extra * std::fabs(q[i * d + c]);
          g[from_u ? 3 : 2][at] += p[t] * go[me];
          a[from_u ? 3 : 2][at] += p[t] * ga[me];
        }
      }
    }
  };
  const std::vector<double> go(dout, dout + n * d);
  std::vector<double> ga(size), delta_error(static_cast<std::size_t>(n));
  for (std::size_t x = 0; x < size; ++x) ga[x] = std::fabs(go[x]);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < d; ++c)
      delta_error[static_cast<std::size_t>(i)] += 1.01 * e_out[static_cast<std::size_t>(i * d + c)] * ga[i * d + c];
  stage(second, go, ga, &e_u, delta_error);
  const std::vector<double> du = g[3], du_terms = a[3];
  std::fill(delta_error.begin(), delta_error.end(), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < d; ++c)
      delta_error[static_cast<std::size_t>(i)] +=
          1.01 * e_u[static_cast<std::size_t>(i * d + c)] * du_terms[static_cast<std::size_t>(i * d + c)];
  stage(rows, du, du_terms, nullptr, delta_error);
  AxialGradients out;
  for (int x = 0; x < 3; ++x) {
    out.grads[x] = g[x];
    out.bounds[x].resize(size);
    for (std::size_t y = 0; y < size; ++y) out.bounds[x][y] = kappa * a[x][y] + (x < 2 ? e[x][y] : 0.0) + 1e-30;
  }
  return out;
}

// The model's bf16 output (widened) on the bf16 inputs.
Tensor bf16_output(const std::string& model, const Problem& p, const Bf16Inputs& in,
                   const std::vector<std::string>& params) {
  return run_bf16(model, p, in.bf16, params);
}

}  // namespace

TEST_SUITE("factorised_bf16") {
  TEST_CASE("sparse-transformer in bf16 equals the float64 masked reference, strided and fixed, every path") {
    for_each_bf16_path([](const std::string& path) {
      for (const SparseCase& c : sparse_cases())
        for (std::int64_t n : c.sizes)
          for (bool causal : {false, true})
            for (std::int64_t heads : {1, 3}) {
              const Problem p =
                  on_test_threads({.batch = 1, .heads = heads, .seq_len = n, .head_dim = 16, .causal = causal});
              const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(n + heads));
              const Tensor got = bf16_output("sparse-transformer", p, in, c.params);
              const std::int64_t l = c.stride > 0 ? c.stride : root_ceiling(n);
              const HeadMask mask = sparse_mask(c.fixed, l, std::min(c.summary, l), heads, causal);
              double over_fp32 = 0;
              for (std::int64_t h = 0; h < heads; ++h) {
                const float *q = in.widened.q.head(0, h), *k = in.widened.k.head(0, h), *v = in.widened.v.head(0, h);
                const auto want = reference_attention(q, k, v, n, n, 16, 0.25,
                                                      [&](std::int64_t i, std::int64_t j) { return mask(h, i, j); });
                const double bound = bf16_forward_bound(q, k, v, n, 16),
                             fp32 = attention_tolerance(q, k, v, n, n, 16, 0.25);
                const std::string label = "sparse-transformer N=" + std::to_string(n) + " H=" + std::to_string(heads) +
                                          " h=" + std::to_string(h) + (causal ? " causal " : " ") + path +
                                          (c.params.empty() ? "" : " " + c.params[0]);
                check_bf16_elements(
                    got.head(0, h), want, n * 16, [&](std::int64_t) { return bound; }, label);
                for (std::int64_t e = 0; e < n * 16; ++e)
                  over_fp32 =
                      std::max(over_fp32, std::fabs(got.head(0, h)[e] - want[static_cast<std::size_t>(e)]) / fp32);
              }
              // Not fp32 in disguise: past a few keys, the bf16 rounding of P and O shows.
              if (n >= 15) CHECK_MESSAGE(over_fp32 > 1, "N=" << n << ": the error never exceeds the fp32 bound");
            }
    });
  }

  TEST_CASE("sparse-transformer bf16 gradients equal the float64 masked reference's, strided and fixed, every path") {
    for_each_bf16_path([](const std::string& path) {
      for (const SparseCase& c : sparse_cases())
        for (std::int64_t n : c.sizes)
          for (bool causal : {false, true}) {
            const Problem p = on_test_threads({.batch = 2, .heads = 3, .seq_len = n, .head_dim = 16, .causal = causal});
            const std::int64_t l = c.stride > 0 ? c.stride : root_ceiling(n);
            const HeadMask mask = sparse_mask(c.fixed, l, std::min(c.summary, l), 3, causal);
            check_bf16_masked_gradients(
                "sparse-transformer", p, c.params, static_cast<std::uint64_t>(n) + 5,
                [&mask](std::int64_t h) {
                  return [&mask, h](std::int64_t i, std::int64_t j) { return mask(h, i, j); };
                },
                "sparse-transformer N=" + std::to_string(n) + (causal ? " causal " : " ") + path +
                    (c.params.empty() ? "" : " " + c.params[0]));
          }
    });
  }

  TEST_CASE("axial in bf16 equals float64 rows-then-columns attention, causal union included, every path") {
    for_each_bf16_path([](const std::string& path) {
      for (const AxialCase& c : axial_cases())
        for (std::int64_t n : c.sizes)
          for (bool causal : {false, true}) {
            const Problem p = on_test_threads({.batch = 2, .heads = 1, .seq_len = n, .head_dim = 16, .causal = causal});
            const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(n) + 9);
            const Tensor got = bf16_output("axial", p, in, c.params);
            const std::int64_t cols = c.cols > 0 ? std::min(c.cols, n) : root_ceiling(n);
            double over_fp32 = 0;
            for (std::int64_t b = 0; b < 2; ++b) {
              const float *q = in.widened.q.head(b, 0), *k = in.widened.k.head(b, 0), *v = in.widened.v.head(b, 0);
              const auto want = axial_reference(q, k, v, n, 16, cols, causal);
              const double fp32 = attention_tolerance(q, k, v, n, n, 16, 0.25);
              const double row_stage = bf16_forward_bound(q, k, v, n, 16);
              const double bound = row_stage + 2 * kU * (1 + kU) * (max_abs_of(v, n * 16) + row_stage) + fp32;
              const std::string label = "axial N=" + std::to_string(n) + " C=" + std::to_string(cols) +
                                        (causal ? " causal " : " ") + path + " b=" + std::to_string(b);
              check_bf16_elements(
                  got.head(b, 0), want, n * 16, [&](std::int64_t) { return bound; }, label);
              for (std::int64_t e = 0; e < n * 16; ++e)
                over_fp32 =
                    std::max(over_fp32, std::fabs(got.head(b, 0)[e] - want[static_cast<std::size_t>(e)]) / fp32);
            }
            if (n >= 15) CHECK_MESSAGE(over_fp32 > 1, "N=" << n << ": the error never exceeds the fp32 bound");
          }
    });
  }

  TEST_CASE("axial bf16 gradients equal the float64 reference's within the two-stage bf16 bound, every path") {
    for_each_bf16_path([](const std::string& path) {
      for (const AxialCase& c : axial_cases())
        for (std::int64_t n : c.sizes)
          for (bool causal : {false, true}) {
            const std::int64_t d = 16;
            const Problem p = on_test_threads({.batch = 2, .heads = 1, .seq_len = n, .head_dim = d, .causal = causal});
            const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(n) + 21);
            Tensor dout32 = Tensor::bhnd(2, 1, n, d);
            CounterRng(7, "dout").fill_normal(dout32);
            const Tensor dout = to_bf16(dout32), dout_wide = to_f32(dout);
            auto mechanism = bf16_mechanism("axial", p, c.params);
            const auto bhnd = [&] { return Tensor::bhnd(2, 1, n, d, DType::BF16); };
            Tensor out = bhnd(), dq = bhnd(), dk = bhnd(), dv = bhnd();
            mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
            mechanism->prepare_backward();
            mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
            mechanism->backward(in.bf16.q, in.bf16.k, in.bf16.v, out, dout, dq, dk, dv);
            const Tensor got[3] = {to_f32(dq), to_f32(dk), to_f32(dv)};
            const std::int64_t cols = c.cols > 0 ? std::min(c.cols, n) : root_ceiling(n);
            for (std::int64_t b = 0; b < 2; ++b) {
              const float *q = in.widened.q.head(b, 0), *k = in.widened.k.head(b, 0), *v = in.widened.v.head(b, 0);
              const double scale = 0.25, fp32 = attention_tolerance(q, k, v, n, n, d, scale);
              const double kappa = 6 * kU * (1 + kU) + 2 * gradient_error_factor(q, k, n, n, d, scale);
              const AxialGradients ref =
                  axial_gradients(q, k, v, dout_wide.head(b, 0), n, d, cols, causal, fp32, kappa);
              const std::string label = "axial N=" + std::to_string(n) + " C=" + std::to_string(cols) +
                                        (causal ? " causal " : " ") + path + " b=" + std::to_string(b);
              for (int x = 0; x < 3; ++x)
                check_bf16_elements(
                    got[x].head(b, 0), ref.grads[x], n * d,
                    [&](std::int64_t e) { return ref.bounds[x][static_cast<std::size_t>(e)]; },
                    std::string("d") + "qkv"[x] + " " + label);
            }
          }
    });
  }

  TEST_CASE("the bf16 decode, on bf16 caches, equals the bf16 causal forward") {
    // check_bf16_decode's bound (tests/support/bf16_check.hpp). Strides and grid widths are given,
    // and axial's contexts are at least a grid row: the defaults and the clamp to N follow N, which
    // differs between the decoding model and the forward it is checked on.
    struct DecodeCase {
      std::string model;
      std::vector<std::string> params;
      std::vector<std::int64_t> contexts;
      std::int64_t tokens;
    };
    for (const DecodeCase& c : std::vector<DecodeCase>{
             {"sparse-transformer", {"stride=8"}, {1, 8, 9, 17, 31}, 20},
             {"sparse-transformer", {"stride=70"}, {64, 71}, 80},
             {"sparse-transformer", {"pattern=fixed", "stride=8", "summary=3"}, {1, 5, 8, 13, 16}, 20},
             {"axial", {"cols=8"}, {8, 13, 16, 30}, 20},
             {"axial", {"cols=70"}, {70, 75}, 70},
         })
      for (std::int64_t context : c.contexts) {
        CAPTURE(c.model);
        CAPTURE(context);
        CHECK(check_bf16_decode(c.model, {.batch = 1, .heads = 3, .head_dim = 16}, context, c.tokens, c.params) > 0);
      }
  }

  TEST_CASE("bf16 rows: FLOPs as fp32's, bytes halved where they should be, the workspace estimate exact") {
    struct RowCase {
      std::string model;
      std::vector<std::string> params;
      // Elements of the saved tensors held in bf16 (the rest, log-sum-exp and statistics, are fp32).
      std::function<std::int64_t(std::int64_t n, bool causal)> bf16_saved;
    };
    // Gathered summary rows of the fixed pattern (B = 1, H = 2: one A2 head): 2·G·D.
    const auto summaries = [](std::int64_t stride, std::int64_t summary) {
      return [=](std::int64_t n, bool) {
        const std::int64_t l = stride > 0 ? stride : root_ceiling(n), c = std::min(summary, l);
        std::int64_t g = 0;
        for (std::int64_t j = 0; j < n; ++j) g += j % l >= l - c ? 1 : 0;
        return 2 * g * 32;
      };
    };
    const auto none = [](std::int64_t, bool) { return std::int64_t{0}; };
    const auto row_outputs = [](std::int64_t n, bool) { return 2 * n * 32; };  // U, [1, 2, N, 32]
    for (const RowCase& c :
         std::vector<RowCase>{{"sparse-transformer", {}, none},
                              {"sparse-transformer", {"stride=8"}, none},
                              {"sparse-transformer", {"pattern=fixed"}, summaries(0, 8)},
                              {"sparse-transformer", {"pattern=fixed", "stride=70", "summary=5"}, summaries(70, 5)},
                              {"axial", {}, row_outputs},
                              {"axial", {"cols=70"}, row_outputs}})
      for (std::int64_t n : {100, 257})
        for (bool causal : {false, true})
          for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
            if (pass == Pass::Decode && !causal) continue;
            const auto [a, b] = check_bf16_rows(c.model, n, causal, pass, c.params);
            if (pass == Pass::Backward || pass == Pass::Train)
              CHECK(a.saved_bytes - b.saved_bytes == 2 * c.bf16_saved(n, causal));
            if (pass == Pass::Decode) {
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes == a.state_bytes);
            }
          }
  }

  TEST_CASE("a head dimension the bf16 tiles cannot take is an unsupported bf16 row, not fp32") {
    for (const std::string model : {"sparse-transformer", "axial"}) check_bf16_head_dim_unsupported(model);
  }
}
