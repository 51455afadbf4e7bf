// linformer in bf16 (taxonomy/low_rank/linformer.hpp), in two parts so each bound is the plain one
// of its rounding points (u = 2⁻⁸, ε the fp32 unit roundoff):
//   - the projected rows K̄, V̄ the model keeps, against the float64 product of its fp32 E (F) with
//     the same bf16 rows: an element is an fp32 sum of N products, rounded once, so
//     |K̄ − K̄*| ≤ (1 + u)·1.01·N·ε·T + u·|K̄*|, T the sum of the products' magnitudes;
//   - the output against float64 softmax attention of the bf16 queries over the model's own K̄, V̄,
//     within the softmax bound 2u(1 + u)·max|V̄| + the fp32 bound (tests/support/bf16_check.hpp).
// With projection=identity (k ≥ N) K̄ = K and V̄ = V exactly, and the output is checked against exact
// softmax attention on the bf16 inputs.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "lib/core/bf16.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/low_rank/linformer.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

// One head's projected rows got [k, D] (bf16) against the float64 product of its projection e [k, N]
// (fp32) with its bf16 rows x [N, D]; returns the rows widened.
std::vector<float> check_projected(const bf16* got, const float* e, const float* x, std::int64_t k, std::int64_t n,
                                   std::int64_t d, const std::string& label) {
  std::vector<float> rows(static_cast<std::size_t>(k * d));
  std::int64_t failures = 0;
  for (std::int64_t r = 0; r < k; ++r)
    for (std::int64_t c = 0; c < d; ++c) {
      double sum = 0, terms = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        const double product = static_cast<double>(e[r * n + j]) * x[j * d + c];
        sum += product;
        terms += std::fabs(product);
      }
      const std::size_t at = static_cast<std::size_t>(r * d + c);
      rows[at] = to_float(got[at]);
      const double bound = (1 + kU) * 1.01 * static_cast<double>(n) * kFloatEps * terms + kU * std::fabs(sum);
      if (!(std::fabs(rows[at] - sum) <= bound) && failures++ < 3)
        FAIL_CHECK(label << " row " << r << " feature " << c << ": got " << rows[at] << ", want " << sum << " (bound "
                         << bound << ")");
    }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " projected elements out of bound");
  return rows;
}

void check_case(const Problem& shape, std::int64_t k, const std::string& sharing, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, rows = std::min(k, n);
  const std::string label = "linformer bf16 N=" + std::to_string(n) + " k=" + std::to_string(k) + " " + sharing;
  const Bf16Inputs in = bf16_inputs(p, seed);
  auto mechanism = bf16_mechanism("linformer", p, {"k=" + std::to_string(k), "sharing=" + sharing});
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  const auto parameters = mechanism->parameters(), saved = mechanism->saved();
  const bool shared_kv = sharing == "key-value", per_head = sharing == "per-head";
  const Tensor& e = tensor_named(parameters, shared_kv ? "projection_ef" : "projection_e");
  const Tensor& f = tensor_named(parameters, shared_kv ? "projection_ef" : "projection_f");
  const Tensor &keys = tensor_named(saved, "projected_keys"), &values = tensor_named(saved, "projected_values");
  REQUIRE(keys.dtype() == DType::BF16);
  REQUIRE(values.dtype() == DType::BF16);
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const std::int64_t head = b * p.heads + h, matrix = per_head ? h * rows * n : 0;
      const auto projected_keys = check_projected(keys.bf16_data() + head * rows * d, e.data() + matrix,
                                                  in.widened.k.head(b, h), rows, n, d, where + " K̄");
      const auto projected_values = check_projected(values.bf16_data() + head * rows * d, f.data() + matrix,
                                                    in.widened.v.head(b, h), rows, n, d, where + " V̄");
      const float* q = in.widened.q.head(b, h);
      const auto want =
          reference_attention(q, projected_keys.data(), projected_values.data(), n, rows, d, scale, MaskFn(full_mask));
      const double bound = 2 * kU * (1 + kU) * max_abs_of(projected_values.data(), rows * d) +
                           attention_tolerance(q, projected_keys.data(), projected_values.data(), n, rows, d, scale);
      check_bf16_elements(
          got.head(b, h), want, n * d, [&](std::int64_t) { return bound; }, where);
    }
}

// The bf16 gradients with Gaussian projections, through the model's own saved K̄, V̄: the float64
// attention backward over (q, K̄, V̄) gives dq and dK̄*, dV̄* with terms T, each within B = factor·T
// (check_bf16_gradients' factor: the model's dq is rounded, its dK̄, dV̄ stay fp32); then
//   dk* = Eᵀ·dK̄*, within (1 + u)·(Σ_r |E_rj|·B_rc + 1.01·k·ε·Σ_r |E_rj|·(|dK̄*_rc| + B_rc)) + u·|dk*|;
//   dE* = Σ over the pairs sharing E of dK̄*·Kᵀ, within Σ B_rc·|K_jc| + 1.01·(pairs·D)·ε·Σ |terms|
// (dE stays fp32); V and F alike (key-value sharing: one dE over both).
void check_gradients(const Problem& shape, std::int64_t k, const std::string& sharing, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, rows = std::min(k, n);
  const std::string label =
      "linformer bf16 gradients N=" + std::to_string(n) + " k=" + std::to_string(k) + " " + sharing;
  const Bf16GradientRun run =
      run_bf16_gradients("linformer", p, {"k=" + std::to_string(k), "sharing=" + sharing}, seed);
  const Bf16Inputs& in = run.in;
  const Tensor &dout_wide = run.dout_widened, &got_dq = run.dq, &got_dk = run.dk, &got_dv = run.dv;
  const Mechanism* mechanism = run.mechanism.get();
  const bool shared_kv = sharing == "key-value", per_head = sharing == "per-head";
  const auto parameters = mechanism->parameters(), saved = mechanism->saved(),
             parameter_grads = mechanism->parameter_gradients();
  const Tensor* projection[2] = {&tensor_named(parameters, shared_kv ? "projection_ef" : "projection_e"),
                                 &tensor_named(parameters, shared_kv ? "projection_ef" : "projection_f")};
  const Tensor* projection_grad[2] = {&tensor_named(parameter_grads, shared_kv ? "dprojection_ef" : "dprojection_e"),
                                      &tensor_named(parameter_grads, shared_kv ? "dprojection_ef" : "dprojection_f")};
  const Tensor projected[2] = {to_f32(tensor_named(saved, "projected_keys")),
                               to_f32(tensor_named(saved, "projected_values"))};
  const Tensor* got_src[2] = {&got_dk, &got_dv};
  const Tensor* inputs[2] = {&in.widened.k, &in.widened.v};
  const std::int64_t matrices = per_head ? p.heads : 1, size = rows * n;
  // dE* (and dF*) per matrix, their bounds and magnitudes; [tensor][matrix · k · N].
  std::vector<double> want_grad[2], grad_bound[2], grad_terms[2];
  for (int t = 0; t < 2; ++t) {
    want_grad[t].assign(static_cast<std::size_t>(matrices * size), 0.0);
    grad_bound[t] = grad_terms[t] = want_grad[t];
  }
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const std::int64_t head = b * p.heads + h, matrix = per_head ? h : 0;
      const float* q = in.widened.q.head(b, h);
      const float* keys = projected[0].data() + head * rows * d;
      const float* values = projected[1].data() + head * rows * d;
      const auto ref =
          reference_attention_backward(q, keys, values, dout_wide.head(b, h), n, rows, d, scale, MaskFn(full_mask));
      const double factor = 3 * kU * (1 + kU) + gradient_error_factor(q, keys, n, rows, d, scale);
      check_bf16_elements(
          got_dq.head(b, h), ref.dq, n * d,
          [&](std::int64_t e) { return factor * ref.dq_terms[static_cast<std::size_t>(e)] + 1e-30; }, where + " dq");
      const std::vector<double>* bar[2] = {&ref.dk, &ref.dv};
      const std::vector<double>* bar_terms[2] = {&ref.dk_terms, &ref.dv_terms};
      for (int t = 0; t < 2; ++t) {
        const float* e = projection[t]->data() + matrix * size;
        const float* x = inputs[t]->head(b, h);
        std::vector<double> want(static_cast<std::size_t>(n * d)), bound(want.size());
        for (std::int64_t j = 0; j < n; ++j)
          for (std::int64_t c = 0; c < d; ++c) {
            double sum = 0, propagated = 0, terms = 0;
            for (std::int64_t r = 0; r < rows; ++r) {
              const double weight = e[r * n + j], g = (*bar[t])[static_cast<std::size_t>(r * d + c)];
              const double g_bound = factor * (*bar_terms[t])[static_cast<std::size_t>(r * d + c)];
              sum += weight * g;
              propagated += std::fabs(weight) * g_bound;
              terms += std::fabs(weight) * (std::fabs(g) + g_bound);
            }
            const std::size_t at = static_cast<std::size_t>(j * d + c);
            want[at] = sum;
            bound[at] = (1 + kU) * (propagated + 1.01 * static_cast<double>(rows) * kFloatEps * terms) +
                        kU * std::fabs(sum) + 1e-30;
          }
        check_bf16_elements(
            got_src[t]->head(b, h), want, n * d, [&](std::int64_t i) { return bound[static_cast<std::size_t>(i)]; },
            where + (t == 0 ? " dk" : " dv"));
        const int into = shared_kv ? 0 : t;
        for (std::int64_t r = 0; r < rows; ++r)
          for (std::int64_t j = 0; j < n; ++j) {
            const std::size_t at = static_cast<std::size_t>(matrix * size + r * n + j);
            for (std::int64_t c = 0; c < d; ++c) {
              const double g = (*bar[t])[static_cast<std::size_t>(r * d + c)], value = x[j * d + c];
              const double g_bound = factor * (*bar_terms[t])[static_cast<std::size_t>(r * d + c)];
              want_grad[into][at] += g * value;
              grad_bound[into][at] += g_bound * std::fabs(value);
              grad_terms[into][at] += (std::fabs(g) + g_bound) * std::fabs(value);
            }
          }
      }
    }
  const std::int64_t pairs = (per_head ? p.batch : p.batch * p.heads) * (shared_kv ? 2 : 1);
  for (int t = 0; t < (shared_kv ? 1 : 2); ++t) {
    const std::vector<double>& bounds = grad_bound[t];
    const std::vector<double>& terms = grad_terms[t];
    check_bf16_elements(
        projection_grad[t]->data(), want_grad[t], matrices * size,
        [&](std::int64_t i) {
          const auto at = static_cast<std::size_t>(i);
          return bounds[at] + 1.01 * static_cast<double>(pairs * d) * kFloatEps * terms[at] + 1e-30;
        },
        label + (t == 0 ? " dE" : " dF"));
  }
}

}  // namespace

TEST_SUITE("linformer_bf16") {
  TEST_CASE("linformer in bf16: K̄, V̄ against the float64 projections, the output against attention over them") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const std::string sharing : {"per-head", "headwise", "key-value"}) {
        // k one below, at and above N (clamped), and well below it.
        for (std::int64_t k : {16, 17, 18, 5})
          check_case({.batch = 2, .heads = 2, .seq_len = 17, .head_dim = 24}, k, sharing,
                     static_cast<std::uint64_t>(k));
        // N one below, at and above the projection's widening chunk (256 rows), and past two chunks.
        for (std::int64_t n : {255, 256, 257, 600})
          check_case({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16}, 32, sharing,
                     static_cast<std::uint64_t>(n));
      }
    });
  }

  TEST_CASE("linformer in bf16 with projection=identity is exact softmax attention on the bf16 inputs") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const std::string sharing : {"per-head", "key-value"})
        for (std::int64_t n : {1, 31, 257}) {
          const Problem p = on_test_threads({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32});
          const Bf16Inputs in = bf16_inputs(p, 11);
          const Tensor got = run_bf16("linformer", p, in.bf16,
                                      {"projection=identity", "sharing=" + sharing, "k=" + std::to_string(n)});
          check_bf16_head_errors(got, in.widened, p, false, "linformer identity bf16 " + sharing);
        }
    });
  }

  TEST_CASE("linformer's bf16 gradients: exact attention's with projection=identity, through K̄, V̄ and E, F else") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const std::string sharing : {"per-head", "key-value"})
        for (std::int64_t n : {1, 17, 40}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16};
          check_bf16_gradients("linformer", p, {"projection=identity", "sharing=" + sharing, "k=" + std::to_string(n)},
                               static_cast<std::uint64_t>(n), "linformer identity bf16 " + sharing);
        }
      for (const std::string sharing : {"per-head", "headwise", "key-value"}) {
        for (std::int64_t k : {5, 16, 17})  // k below N, and N one below, at (clamped to N)
          check_gradients({.batch = 2, .heads = 2, .seq_len = 17, .head_dim = 16}, k, sharing,
                          static_cast<std::uint64_t>(k));
        for (std::int64_t n : {255, 256, 257})  // the 256-column tasks one below, at and above
          check_gradients({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16}, 8, sharing,
                          static_cast<std::uint64_t>(n));
      }
    });
  }

  TEST_CASE("linformer bf16 rows: FLOPs as fp32's, halved inputs and gradients, estimates exact") {
    for (std::int64_t n : {100, 300})
      for (const std::string sharing : {"per-head", "key-value"})
        for (Pass pass : {Pass::Forward, Pass::Train})
          check_bf16_rows("linformer", n, false, pass, {"k=64", "sharing=" + sharing});
  }
}
