#pragma once
// Shared pieces of the bf16 tests (issue 31): inputs rounded to bf16 as the harness makes them, a
// model's bf16 run, and the forward bound for softmax attention in bf16.
//
// The forward bound. The reference runs in float64 on the bf16 inputs themselves (widened exactly),
// so only the computation's rounding counts. With u = 2⁻⁸ (bf16's unit roundoff): the bf16 products
// of S are exact in fp32 and S, the softmax statistics and the P·V sums carry fp32 rounding only
// (the fp32 bound, attention_tolerance); rounding each probability (normalised or not) to bf16
// moves it by ≤ u·p_j, so an output element by ≤ u·Σ_j p_j·|v_j| / Σ_j p_j ≤ u·max|v|; rounding the
// output moves it by ≤ u·|o| ≤ u·max|v| more. Hence |o − o_ref| ≤ 2u(1 + u)·max|v| + the fp32 bound.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

inline constexpr double kBf16Roundoff = 1.0 / 256;  // u = 2⁻⁸

// The fp32 draws of random_inputs rounded to bf16 (as the harness makes a bf16 point's inputs),
// and the same values widened back to fp32 for the reference.
struct Bf16Inputs {
  AttentionInputs bf16, widened;
};
inline Bf16Inputs bf16_inputs(const Problem& p, std::uint64_t seed) {
  const AttentionInputs f32 = random_inputs(p, seed);
  AttentionInputs rounded{to_bf16(f32.q), to_bf16(f32.k), to_bf16(f32.v)};
  AttentionInputs widened{to_f32(rounded.q), to_f32(rounded.k), to_f32(rounded.v)};
  return {std::move(rounded), std::move(widened)};
}

// A model's bf16 mechanism on the problem (threads for the tests, dtype bf16) with resolved parameter
// values, or with `params`.
inline std::unique_ptr<Mechanism> bf16_mechanism(const std::string& model, Problem p, const ParamValues& values) {
  p = on_test_threads(p);
  p.dtype = DType::BF16;
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  return info->impl.create(p, values, 42);
}
inline std::unique_ptr<Mechanism> bf16_mechanism(const std::string& model, Problem p,
                                                 const std::vector<std::string>& params = {}) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  return bf16_mechanism(model, p, resolve_params(model, info->impl.params, params));
}

// The model's bf16 forward on the inputs: the output widened to fp32.
inline Tensor run_bf16(Mechanism& mechanism, const Problem& p, const AttentionInputs& in) {
  Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  mechanism.prepare(in.q, in.k, in.v);
  mechanism.forward(in.q, in.k, in.v, out);
  return to_f32(out);
}
inline Tensor run_bf16(const std::string& model, const Problem& p, const AttentionInputs& in,
                       const std::vector<std::string>& params = {}) {
  return run_bf16(*bf16_mechanism(model, p, params), p, in);
}

inline double max_abs_of(const float* x, std::int64_t count) {
  double largest = 0;
  for (std::int64_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(static_cast<double>(x[i])));
  return largest;
}

// Checks every head of `got` against the float64 softmax-attention reference within the bf16 bound
// above; returns the largest error over the fp32 bound alone (> 1 shows bf16 rounding happened).
inline double check_bf16_head_errors(const Tensor& got, const AttentionInputs& widened, const Problem& p, bool causal,
                                     const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double largest_over_fp32 = 0;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float *q = widened.q.head(b, h), *k = widened.k.head(b, h), *v = widened.v.head(b, h);
      const auto want = reference_attention(q, k, v, n, n, d, scale, causal ? MaskFn(causal_mask) : MaskFn(full_mask));
      const double fp32_bound = attention_tolerance(q, k, v, n, n, d, scale);
      const double bound = 2 * kBf16Roundoff * (1 + kBf16Roundoff) * max_abs_of(v, n * d) + fp32_bound;
      const float* out = got.head(b, h);
      std::int64_t failures = 0;
      for (std::int64_t e = 0; e < n * d; ++e) {
        const double error = std::fabs(out[e] - want[static_cast<std::size_t>(e)]);
        largest_over_fp32 = std::max(largest_over_fp32, error / fp32_bound);
        if (!(error <= bound) && failures++ < 3)
          FAIL_CHECK(label << ": b=" << b << " h=" << h << " token " << e / d << " feature " << e % d << ": got "
                           << out[e] << ", want " << want[static_cast<std::size_t>(e)] << " (bound " << bound << ")");
      }
      CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of the bf16 bound");
    }
  return largest_over_fp32;
}

// One bf16 training step of a model on bf16_inputs(p, seed) with a seeded bf16 dout: the inputs,
// dout (widened) and out, dq, dk, dv (widened), and the mechanism (for its saved tensors and
// parameter gradients). out and dout have the model's output rows (N, or M of a downsampling model).
struct Bf16GradientRun {
  Bf16Inputs in;
  Tensor dout_widened, out, dq, dk, dv;
  std::unique_ptr<Mechanism> mechanism;
};
inline Bf16GradientRun run_bf16_gradients(const std::string& model, const Problem& p,
                                          const std::vector<std::string>& params, std::uint64_t seed) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = model_output_rows(model, p, params);
  Bf16GradientRun run{bf16_inputs(p, seed), {}, {}, {}, {}, {}, bf16_mechanism(model, p, params)};
  Tensor dout32 = Tensor::bhnd(p.batch, p.heads, m, d);
  CounterRng(9, "dout").fill_normal(dout32);
  const Tensor dout = to_bf16(dout32);
  run.dout_widened = to_f32(dout);
  const auto bhnd = [&](std::int64_t rows) { return Tensor::bhnd(p.batch, p.heads, rows, d, DType::BF16); };
  Tensor out = bhnd(m), dq = bhnd(n), dk = bhnd(n), dv = bhnd(n);
  const AttentionInputs& in = run.in.bf16;
  run.mechanism->prepare(in.q, in.k, in.v);
  run.mechanism->prepare_backward();
  run.mechanism->forward(in.q, in.k, in.v, out);
  run.mechanism->backward(in.q, in.k, in.v, out, dout, dq, dk, dv);
  run.out = to_f32(out);
  run.dq = to_f32(dq);
  run.dk = to_f32(dk);
  run.dv = to_f32(dv);
  return run;
}

// The model's bf16 gradients (dq, dk, dv for a seeded bf16 dout) against the float64 softmax
// attention reference's. Per element with terms T (reference_attention_backward's *_terms):
// rounding P perturbs dV's terms and dS's (P·(|dP| + Σ P·|dP|)) by ≤ u·T, rounding dS to bf16 by
// ≤ u·T more, rounding the gradient by ≤ u·|g| ≤ u·T: |g − g_ref| ≤ 3u(1 + u)·T + the fp32 factor·T.
inline void check_bf16_gradients(const std::string& model, Problem p, const std::vector<std::string>& params,
                                 std::uint64_t seed, const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const Bf16GradientRun run = run_bf16_gradients(model, p, params, seed);
  const Bf16Inputs& in = run.in;
  const Tensor& dout_widened = run.dout_widened;
  const Tensor* got[3] = {&run.dq, &run.dk, &run.dv};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float *q = in.widened.q.head(b, h), *k = in.widened.k.head(b, h), *v = in.widened.v.head(b, h);
      const auto ref = reference_attention_backward(q, k, v, dout_widened.head(b, h), n, n, d, scale,
                                                    p.causal ? MaskFn(causal_mask) : MaskFn(full_mask));
      const double factor = 3 * kBf16Roundoff * (1 + kBf16Roundoff) + gradient_error_factor(q, k, n, n, d, scale);
      const std::vector<double>* want[3] = {&ref.dq, &ref.dk, &ref.dv};
      const std::vector<double>* terms[3] = {&ref.dq_terms, &ref.dk_terms, &ref.dv_terms};
      for (int g = 0; g < 3; ++g) {
        std::int64_t failures = 0;
        for (std::int64_t e = 0; e < n * d; ++e) {
          const auto i = static_cast<std::size_t>(e);
          const double error = std::fabs(got[g]->head(b, h)[e] - (*want[g])[i]);
          if (!(error <= factor * (*terms[g])[i] + 1e-30) && failures++ < 3)
            FAIL_CHECK(label << " d"
                             << "qkv"[g] << " b=" << b << " h=" << h << " element " << e << ": got "
                             << got[g]->head(b, h)[e] << ", want " << (*want[g])[i] << " (bound "
                             << factor * (*terms[g])[i] << ")");
        }
        CHECK_MESSAGE(failures == 0, label << " d"
                                           << "qkv"[g] << ": " << failures << " out of the bound");
      }
    }
}

// |got − want| ≤ (rounded ? u·|want| : 0) + 16·N·ε·max|want| per element: a bf16 storage-only
// result (rounded once) against the fp32 form's on the same values, up to fp32 summation order.
inline void check_rounded_fp32(const float* got, const float* want, std::int64_t count, std::int64_t n, bool rounded,
                               const std::string& label) {
  const double largest = max_abs_of(want, count);
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < count; ++e) {
    const double bound = (rounded ? kBf16Roundoff * std::fabs(want[e]) : 0.0) + 16 * double(n) * kFloatEps * largest;
    if (!(std::fabs(got[e] - want[e]) <= bound) && failures++ < 3)
      FAIL_CHECK(label << " element " << e << ": got " << got[e] << ", want " << want[e] << " (bound " << bound << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " out of the bound");
}

// A storage-only bf16 form's training step (the fp32 computation on widened rows, each result
// rounded once) against the fp32 form's on the same values — the bf16 inputs, dout and the bf16
// output (which a backward may read) widened:
// out, dq, dk, dv within the rounding u·|g| (check_rounded_fp32), the fp32 parameter gradients
// within summation order. The fp32 form is checked against float64 in its own tests.
inline void check_bf16_storage_gradients(const std::string& model, const Problem& shape,
                                         const std::vector<std::string>& params, std::uint64_t seed,
                                         const std::string& label) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const Bf16GradientRun run = run_bf16_gradients(model, p, params, seed);
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  auto f32 = info->impl.create(p, resolve_params(model, info->impl.params, params), 42);
  const AttentionInputs& in = run.in.widened;
  const auto bhnd = [&](std::int64_t rows) { return Tensor::bhnd(p.batch, p.heads, rows, d); };
  Tensor out = bhnd(model_output_rows(model, p, params)), dq = bhnd(n), dk = bhnd(n), dv = bhnd(n);
  f32->prepare(in.q, in.k, in.v);
  f32->prepare_backward();
  f32->forward(in.q, in.k, in.v, out);
  check_rounded_fp32(run.out.data(), out.data(), out.size(), n, true, label + " out");
  f32->backward(in.q, in.k, in.v, run.out, run.dout_widened, dq, dk, dv);  // the bf16 form's own output
  check_rounded_fp32(run.dq.data(), dq.data(), dq.size(), n, true, label + " dq");
  check_rounded_fp32(run.dk.data(), dk.data(), dk.size(), n, true, label + " dk");
  check_rounded_fp32(run.dv.data(), dv.data(), dv.size(), n, true, label + " dv");
  const auto want = f32->parameter_gradients(), got = run.mechanism->parameter_gradients();
  REQUIRE(want.size() == got.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    check_rounded_fp32(got[i].tensor->data(), want[i].tensor->data(), want[i].tensor->size(), n, false,
                       label + " " + want[i].name);
}

// The model's bf16 decode steps after a prefill of `context` tokens against its bf16 causal forward
// over context + tokens. The step rounds the same fp32 values as the forward (scores, softmax, P to
// bf16, O to bf16) up to fp32 summation order and the running max a probability is taken against,
// which may flip a bf16 rounding of some p_j (≤ 2u·Σ p_j|v_j| ≤ 2u·max|v| in all) and of the output
// (one bf16 ulp, ≤ 2u·|o|). The parameters are resolved for the context and run the whole forward
// too (as tests/contract/test_decode.cpp does: a block clamped to a short context stays clamped).
// Checks the state is bf16; returns the state bytes. A storage-only form (rounds_probabilities
// false: P stays fp32, only O is rounded) is held to one bf16 ulp of the output, 2u·|o|, instead.
inline std::int64_t check_bf16_decode(const std::string& model, const Problem& shape, std::int64_t context,
                                      std::int64_t tokens, const std::vector<std::string>& params = {},
                                      bool rounds_probabilities = true) {
  Problem whole = shape;
  whole.seq_len = context + tokens;
  whole.causal = true;
  const std::int64_t heads = whole.batch * whole.heads, d = whole.head_dim;
  const auto in = bf16_inputs(whole, static_cast<std::uint64_t>(context));
  Problem p = whole;
  p.seq_len = context;
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  const ParamValues values = info->impl.resolved(p, resolve_params(model, info->impl.params, params));
  const Tensor forward = run_bf16(*bf16_mechanism(model, whole, values), whole, in.bf16);
  auto mechanism = bf16_mechanism(model, p, values);
  auto rows = [&](const Tensor& t, std::int64_t first, std::int64_t count) {
    return to_bf16(rows_of(t, first, count));
  };
  const Tensor q = rows(in.widened.q, 0, context), k = rows(in.widened.k, 0, context),
               v = rows(in.widened.v, 0, context);
  Tensor prefill = Tensor::bhnd(whole.batch, whole.heads, context, d, DType::BF16);
  mechanism->prepare(q, k, v);
  mechanism->prepare_decode(tokens);
  mechanism->forward(q, k, v, prefill);
  const double largest_v = max_abs_of(in.widened.v.data(), in.widened.v.size());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int64_t token = context + t;
    Tensor out = Tensor::bhnd(whole.batch, whole.heads, 1, d, DType::BF16);
    mechanism->decode_step(rows(in.widened.q, token, 1), rows(in.widened.k, token, 1), rows(in.widened.v, token, 1),
                           out);
    const Tensor step = to_f32(out);
    std::int64_t failures = 0;
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t c = 0; c < d; ++c) {
        const float want = forward.data()[(h * whole.seq_len + token) * d + c], got = step.data()[h * d + c];
        const double bound = 2 * kBf16Roundoff * ((rounds_probabilities ? largest_v : 0.0) + std::fabs(want)) +
                             64 * kFloatEps * largest_v;
        if (!(std::fabs(got - want) <= bound) && failures++ < 3)
          FAIL_CHECK(model << " context " << context << " token " << token << " head " << h << " feature " << c
                           << ": got " << got << ", want " << want);
      }
    CHECK_MESSAGE(failures == 0, model << " context " << context << " token " << token);
  }
  for (const auto& named : mechanism->decode_state()) CHECK(named.tensor->dtype() == DType::BF16);
  return mechanism->state_bytes();
}

// Decodes tokens context, …, context + steps − 1 of the widened inputs ([B, H, N, D]), rounded to
// bf16, one step at a time after the mechanism's prefill; after each step check(length, out), length
// the tokens seen so far and out the step's bf16 output [B, H, 1, D].
template <class Check>
void decode_bf16_steps(Mechanism& mechanism, const AttentionInputs& widened, std::int64_t context, std::int64_t steps,
                       const Check& check) {
  for (std::int64_t token = context; token < context + steps; ++token) {
    Tensor out = Tensor::bhnd(widened.q.dim(0), widened.q.dim(1), 1, widened.q.dim(3), DType::BF16);
    mechanism.decode_step(to_bf16(rows_of(widened.q, token, 1)), to_bf16(rows_of(widened.k, token, 1)),
                          to_bf16(rows_of(widened.v, token, 1)), out);
    check(token + 1, out);
  }
}

// A quick_point (B=1 H=2 D=32) in bf16; decode points run 5 tokens.
inline PointConfig bf16_point(const std::string& model, std::int64_t n, bool causal, Pass pass = Pass::Forward,
                              std::vector<std::string> params = {}) {
  PointConfig c = quick_point(model, n, causal, Scope::Attention, std::move(params));
  c.problem.dtype = DType::BF16;
  c.pass = pass;
  if (pass == Pass::Decode) c.decode_tokens = 5;
  return c;
}

// The error of one softmax attention row computed from perturbed operands, against the exact row:
// probs p_j (its exact softmax over `count` keys, Σ p_j = 1), each score off by at most shift[j],
// each value element off by at most value_error[j·d + c] (values: the exact ones, [count, d]); the
// probabilities then rounded (relative probability_rounding: u, or 0 when they stay fp32) and the
// weighted sum taken in fp32. As p' = p·e^{δ_j}/Σ_i p_i·e^{δ_i}, |p' − p| ≤ r_j·p_j with
// r_j = (1 + 8ε·(log2 count + 1))·e^{shift_j + max shift} − 1 (the fp32 softmax's own error, as the
// fp32 tests bound it), so per feature c
//   |o' − o| ≤ Σ_j p_j·(r_j·|v_jc| + (1 + r_j)·(e_jc + (ρ + 1.01·count·ε)·(|v_jc| + e_jc))),
// ρ the probability rounding. The caller adds its output's rounding.
inline std::vector<double> perturbed_attention_error(const std::vector<double>& probs, const std::vector<double>& shift,
                                                     const double* values, const double* value_error, std::int64_t d,
                                                     double probability_rounding) {
  const std::int64_t count = static_cast<std::int64_t>(probs.size());
  const double largest = count > 0 ? *std::max_element(shift.begin(), shift.end()) : 0.0;
  const double sum_rounding = probability_rounding + 1.01 * static_cast<double>(count) * kFloatEps;
  const double softmax_error = 8 * kFloatEps * (std::log2(std::max(static_cast<double>(count), 1.0)) + 1);
  std::vector<double> error(static_cast<std::size_t>(d), 0.0);
  for (std::int64_t j = 0; j < count; ++j) {
    const double p = probs[static_cast<std::size_t>(j)];
    const double r = (1 + softmax_error) * std::exp(shift[static_cast<std::size_t>(j)] + largest) - 1;
    for (std::int64_t c = 0; c < d; ++c) {
      const double v = std::fabs(values[j * d + c]), e = value_error == nullptr ? 0.0 : value_error[j * d + c];
      error[static_cast<std::size_t>(c)] += p * (r * v + (1 + r) * (e + sum_rounding * (v + e)));
    }
  }
  return error;
}

// The rows of one bf16_point and of the same point in f32.
struct Bf16RowPair {
  ResultRow f32, bf16;
};

// Runs bf16_point(model, n, causal, pass, params) in both dtypes and checks what every bf16 form
// owes: both rows Ok, the bf16 row marked bf16, the FLOPs the fp32 form's (unless the FLOPs follow
// the data, which rounding changes: same_flops false), the point's inputs and outputs (q, k, v, out,
// and in training dout, dq, dk, dv) at half the bytes, and each dtype's workspace estimate exact.
// The caller checks the saved and the state bytes, which depend on the model.
inline Bf16RowPair check_bf16_rows(const std::string& model, std::int64_t n, bool causal, Pass pass,
                                   std::vector<std::string> params = {}, bool same_flops = true) {
  const PointConfig bf16 = bf16_point(model, n, causal, pass, std::move(params));
  PointConfig f32 = bf16;
  f32.problem.dtype = DType::F32;
  CAPTURE(model);
  CAPTURE(n);
  CAPTURE(causal);
  CAPTURE(pass_name(pass));
  Bf16RowPair rows{run_point(f32), run_point(bf16)};
  const ResultRow &a = rows.f32, &b = rows.bf16;
  REQUIRE_MESSAGE(a.status == Status::Ok, a.reason);
  REQUIRE_MESSAGE(b.status == Status::Ok, b.reason);
  CHECK(b.dtype == DType::BF16);
  if (same_flops) CHECK(b.flops == a.flops);
  CHECK(2 * point_io_bytes(bf16) == point_io_bytes(f32));
  CHECK(a.peak_owned_bytes - point_io_bytes(f32) == a.estimated_workspace_bytes);
  CHECK(b.peak_owned_bytes - point_io_bytes(bf16) == b.estimated_workspace_bytes);
  return rows;
}

// A head dimension the bf16 tile kernels cannot take (D % 16 ≠ 0) makes the model's bf16 point an
// `unsupported` row that says why, while the f32 point runs.
inline void check_bf16_head_dim_unsupported(const std::string& model, std::vector<std::string> params = {}) {
  CAPTURE(model);
  PointConfig c = counter_point(model, {.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 24}, std::move(params));
  c.problem.dtype = DType::BF16;
  const ResultRow row = run_point(c);
  CHECK(row.status == Status::Unsupported);
  CHECK(row.reason.find("multiple of 16") != std::string::npos);
  c.problem.dtype = DType::F32;
  CHECK(run_point(c).status == Status::Ok);
}

// Runs f(bf16_kernels_name()) on every bf16 kernel path this host has (vdpbf16ps, AVX-512 convert,
// AVX2 convert), the host's choice restored after.
template <class F>
void for_each_bf16_path(F f) {
  const KernelIsa isa = kernel_isa();
  const bool dot = bf16_dot_product();
  for (KernelIsa each : supported_kernel_isas()) {
    std::vector<bool> dots{false};
    if (each == KernelIsa::Avx512 && cpu_has_bf16_dot()) dots.push_back(true);
    for (bool use : dots) {
      force_kernel_isa(each);
      force_bf16_dot(use);
      f(bf16_kernels_name());
    }
  }
  force_kernel_isa(isa);
  force_bf16_dot(dot);
}

// ---------------------------------------------------------------------------------------------
// Sparse patterns (the gathered-attention models): the same bounds against the float64 reference
// restricted to a head's mask.

// The forward bound of one head (this file's header): 2u(1 + u)·max|v| + attention_tolerance.
inline double bf16_forward_bound(const float* q, const float* k, const float* v, std::int64_t n, std::int64_t d) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  return 2 * kBf16Roundoff * (1 + kBf16Roundoff) * max_abs_of(v, n * d) + attention_tolerance(q, k, v, n, n, d, scale);
}

// Checks got[e] against want[e] within bound(e) for e < count (the first few misses reported).
template <class Bound>
void check_bf16_elements(const float* got, const std::vector<double>& want, std::int64_t count, const Bound& bound,
                         const std::string& label) {
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < count; ++e) {
    const double error = std::fabs(got[e] - want[static_cast<std::size_t>(e)]);
    if (!(error <= bound(e)) && failures++ < 3)
      FAIL_CHECK(label << ": element " << e << ": got " << got[e] << ", want " << want[static_cast<std::size_t>(e)]
                       << " (bound " << bound(e) << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of the bf16 bound");
}

// P of one head in float64 ([nq, nk], 0 off the mask); q [nq, d], k [nk, d].
inline std::vector<double> masked_probabilities(const float* q, const float* k, std::int64_t nq, std::int64_t nk,
                                                std::int64_t d, const MaskFn& allowed) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> p(static_cast<std::size_t>(nq * nk), 0.0);
  for (std::int64_t i = 0; i < nq; ++i) {
    double* row = p.data() + i * nk;
    double peak = -std::numeric_limits<double>::infinity(), sum = 0;
    for (std::int64_t j = 0; j < nk; ++j) {
      if (!allowed(i, j)) continue;
      double s = 0;
      for (std::int64_t c = 0; c < d; ++c) s += static_cast<double>(q[i * d + c]) * k[j * d + c];
      row[j] = s * scale;
      peak = std::max(peak, row[j]);
    }
    for (std::int64_t j = 0; j < nk; ++j)
      if (allowed(i, j)) sum += row[j] = std::exp(row[j] - peak);
    for (std::int64_t j = 0; j < nk; ++j)
      if (allowed(i, j)) row[j] /= sum;
  }
  return p;
}

// Checks rows [rows_from, N) of every head of `got` against the float64 reference with the head's
// mask, within the forward bound of the header (the bound holds for any set of keys a row sees);
// returns the largest error over the fp32 bound alone.
inline double check_bf16_masked(const Tensor& got, const AttentionInputs& widened, const Problem& p,
                                const std::function<MaskFn(std::int64_t head)>& mask_of_head, std::int64_t rows_from,
                                const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double largest_over_fp32 = 0;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float *q = widened.q.head(b, h), *k = widened.k.head(b, h), *v = widened.v.head(b, h);
      const auto want = reference_attention(q, k, v, n, n, d, scale, mask_of_head(h));
      const double fp32_bound = attention_tolerance(q, k, v, n, n, d, scale);
      const double bound = 2 * kBf16Roundoff * (1 + kBf16Roundoff) * max_abs_of(v, n * d) + fp32_bound;
      const float* out = got.head(b, h);
      std::int64_t failures = 0;
      for (std::int64_t e = std::min(rows_from, n) * d; e < n * d; ++e) {
        const double error = std::fabs(out[e] - want[static_cast<std::size_t>(e)]);
        largest_over_fp32 = std::max(largest_over_fp32, error / fp32_bound);
        if (!(error <= bound) && failures++ < 3)
          FAIL_CHECK(label << ": b=" << b << " h=" << h << " token " << e / d << " feature " << e % d << ": got "
                           << out[e] << ", want " << want[static_cast<std::size_t>(e)] << " (bound " << bound << ")");
      }
      CHECK_MESSAGE(failures == 0, label << " h=" << h << ": " << failures << " elements out of the bf16 bound");
    }
  return largest_over_fp32;
}

// The bf16 gradients of one head of a masked softmax (queries q [nq, d] over keys k, values v [nk, d],
// bf16 values widened) in float64, with what a backward with the bf16 tile kernels' rounding points
// (the block-sparse, gathered and online engines) may be off by: P = exp(S − L) and dS = P ⊙ (dP − δ)
// formed in fp32, P rounded to bf16 for dV = Pᵀ·dO, dS rounded to bf16 for dQ = scale·dS·K and
// dK = scale·dSᵀ·Q, each gradient summed in fp32 and rounded once. Per element with terms T
// (reference_attention_backward's), before that rounding:
//   dV: u·Σ_r P_rj·|dO_rc| (P's rounding; = u·T);  dQ, dK: u·scale·Σ|dS|·|K|, |Q| (dS's; *_abs_ds);
//   + the fp32 factor·T;  + for dQ, dK the share of δ_r = dO_r·O_r taken from the stored bf16 output O
// (`out`, [nq, d]) instead of the exact O*: the model's δ_r is off by Δδ_r ≤ Σ_c |dO_rc|·|O_rc − O*_rc|
// (the output's actual error) + 2D·ε·Σ_c |dO_rc·O_rc| (its fp32 sum), and dS_rj moves by P_rj·Δδ_r
// more, which moves
//   dQ[r, c] by scale·Δδ_r·Σ_j P_rj·|K_jc|  and  dK[j, c] by scale·Σ_r P_rj·Δδ_r·|Q_rc|  (dV: none);
// that sum times (1 + 2u) for the roundings' second-order terms, plus the final rounding u·|g|.
// dS's own rounding is u·|dS|, where 3u(1 + u)·T (check_bf16_gradients) charges u·P·(|dP| + Σ P·|dP|):
// the cancellation in dP − δ is what lets this bound see a 1% error in dQ.
struct Bf16HeadGradients {
  AttentionGradients want;
  std::vector<double> dq_bound, dk_bound, dv_bound;
};
inline Bf16HeadGradients bf16_head_gradients(const float* q, const float* k, const float* v, const float* dout,
                                             const float* out, std::int64_t nq, std::int64_t nk, std::int64_t d,
                                             const MaskFn& mask) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d)), u = kBf16Roundoff;
  Bf16HeadGradients g{reference_attention_backward(q, k, v, dout, nq, nk, d, scale, mask), {}, {}, {}};
  const auto exact_out = reference_attention(q, k, v, nq, nk, d, scale, mask);
  const auto probs = masked_probabilities(q, k, nq, nk, d, mask);
  std::vector<double> delta_error(static_cast<std::size_t>(nq));  // Δδ per row
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t c = 0; c < d; ++c) {
      const double error = std::fabs(out[i * d + c] - exact_out[static_cast<std::size_t>(i * d + c)]);
      delta_error[static_cast<std::size_t>(i)] +=
          std::fabs(dout[i * d + c]) * (error + 2 * d * kFloatEps * std::fabs(out[i * d + c]));
    }
  std::vector<double> dq_extra(static_cast<std::size_t>(nq * d)), dk_extra(static_cast<std::size_t>(nk * d));
  for (std::int64_t i = 0; i < nq; ++i)
    for (std::int64_t j = 0; j < nk; ++j) {
      const double shift =
          scale * probs[static_cast<std::size_t>(i * nk + j)] * delta_error[static_cast<std::size_t>(i)];
      if (shift == 0) continue;
      for (std::int64_t c = 0; c < d; ++c) {
        dq_extra[static_cast<std::size_t>(i * d + c)] += shift * std::fabs(k[j * d + c]);
        dk_extra[static_cast<std::size_t>(j * d + c)] += shift * std::fabs(q[i * d + c]);
      }
    }
  const double fp32 = gradient_error_factor(q, k, nq, nk, d, scale);
  const auto bound = [&](const std::vector<double>& want, const std::vector<double>& terms,
                         const std::vector<double>& rounded, const std::vector<double>* extra) {
    std::vector<double> b(want.size());
    for (std::size_t e = 0; e < b.size(); ++e)
      b[e] = (1 + 2 * u) * (fp32 * terms[e] + u * rounded[e] + (extra ? (*extra)[e] : 0.0)) + u * std::fabs(want[e]) +
             1e-30;
    return b;
  };
  g.dq_bound = bound(g.want.dq, g.want.dq_terms, g.want.dq_abs_ds, &dq_extra);
  g.dk_bound = bound(g.want.dk, g.want.dk_terms, g.want.dk_abs_ds, &dk_extra);
  g.dv_bound = bound(g.want.dv, g.want.dv_terms, g.want.dv_terms, nullptr);
  return g;
}

// A model's bf16 training step (run_bf16_gradients) against bf16_head_gradients under each head's
// mask. With dq_rows_from > 0, only dq rows from there are checked, and dK, dV not at all (rows the
// mask does not describe: longformer's global rows, through their projections).
// check_bf16_run_gradients takes a finished run (a model whose mask comes from its own state, such as
// cluster-former's sorted chunks); check_bf16_masked_gradients runs the model first.
inline void check_bf16_run_gradients(const Bf16GradientRun& run, const Problem& p,
                                     const std::function<MaskFn(std::int64_t head)>& mask_of_head,
                                     const std::string& label, std::int64_t dq_rows_from = 0) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const Bf16Inputs& in = run.in;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const Bf16HeadGradients ref =
          bf16_head_gradients(in.widened.q.head(b, h), in.widened.k.head(b, h), in.widened.v.head(b, h),
                              run.dout_widened.head(b, h), run.out.head(b, h), n, n, d, mask_of_head(h));
      const float* got[3] = {run.dq.head(b, h), run.dk.head(b, h), run.dv.head(b, h)};
      const std::vector<double>* want[3] = {&ref.want.dq, &ref.want.dk, &ref.want.dv};
      const std::vector<double>* bound[3] = {&ref.dq_bound, &ref.dk_bound, &ref.dv_bound};
      const std::int64_t first = std::min(dq_rows_from, n) * d;
      for (int g = 0; g < (dq_rows_from > 0 ? 1 : 3); ++g)
        check_bf16_elements(
            got[g] + first, std::vector<double>(want[g]->begin() + first, want[g]->end()), n * d - first,
            [&](std::int64_t e) { return (*bound[g])[static_cast<std::size_t>(first + e)]; },
            label + " d" + std::string(1, "qkv"[g]) + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

inline void check_bf16_masked_gradients(const std::string& model, const Problem& p,
                                        const std::vector<std::string>& params, std::uint64_t seed,
                                        const std::function<MaskFn(std::int64_t head)>& mask_of_head,
                                        const std::string& label, std::int64_t dq_rows_from = 0) {
  check_bf16_run_gradients(run_bf16_gradients(model, p, params, seed), p, mask_of_head, label, dq_rows_from);
}

}  // namespace xfb::test
