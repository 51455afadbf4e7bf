// luna in bf16 (storage only: taxonomy/memory/luna.hpp), u = 2⁻⁸:
//   - both forms' output against the naive double reference on the bf16 inputs (luna_reference.hpp)
//     within the fp32 tolerance plus the output's rounding, u·(|o| + tol);
//   - the gradients (and dP) the fp32 form's on the same values (the bf16 inputs and dout) up to each
//     gradient's rounding u·|g| and fp32 summation order 16·N·ε·max|g|;
//   - decoding in two parts: the state after the prefill and s steps (r = s + 1 roundings, one per
//     entry per token) against the exact sums within r·u of their magnitude sums Σ a·|k|, Σ a·|v|;
//     and each step against that step computed in double from the model's own bf16 state, within
//     fp32 rounding plus the output's, u·|o| (check_decode).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "tests/models/memory/luna_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  const std::int64_t l = resolved_rows(p, params), n = p.seq_len, d = p.head_dim;
  std::string label = std::string("luna bf16 ") + (p.causal ? "causal " : "") + "N=" + std::to_string(n);
  for (const auto& param : params) label += " " + param;
  const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(n + 7 * l));
  auto mechanism = bf16_mechanism("luna", p, params);
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  std::vector<ErrorScale> scales;
  const Matrix want = luna_reference(named_inputs(in.widened, *mechanism), p, l, &scales);
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const double tolerance = tolerance_of(scales[static_cast<std::size_t>(bh)], p, l) * (1 + kU);
    const std::vector<double> head(want.begin() + bh * n * d, want.begin() + (bh + 1) * n * d);
    check_bf16_elements(
        got.data() + bh * n * d, head, n * d,
        [&](std::int64_t e) { return tolerance + kU * std::fabs(head[static_cast<std::size_t>(e)]); },
        label + " bh=" + std::to_string(bh));
  }
}

// The prefill of `context` tokens and `tokens` steps (the header's decode checks): each step's
// output against the step computed in double from the model's own bf16 state (read back before the
// step) and the step's token, within fp32 rounding (the scores' d-term sums and the l-term sums of
// the output: 8(d + l + 2)ε of their magnitudes, through the softmax) plus the output's rounding
// u·|o|; and the state itself against the exact sums within its drift r·u·(Ā, B̄) + fp32.
void check_decode(std::int64_t context, std::int64_t tokens, const std::vector<std::string>& params) {
  const Problem whole =
      on_test_threads({.batch = 2, .heads = 2, .seq_len = context + tokens, .head_dim = 16, .causal = true});
  Problem p = whole;
  p.seq_len = context;
  const std::int64_t d = whole.head_dim, n = whole.seq_len, heads = whole.batch * whole.heads;
  const ModelInfo* info = find_model("luna");
  const ParamValues values = info->impl.resolved(p, resolve_params("luna", info->impl.params, params));
  const std::int64_t l = values.get_int("projected_length");
  const Bf16Inputs in = bf16_inputs(whole, static_cast<std::uint64_t>(context));
  auto mechanism = bf16_mechanism("luna", p, values);
  const Tensor q = to_bf16(rows_of(in.widened.q, 0, context)), k = to_bf16(rows_of(in.widened.k, 0, context)),
               v = to_bf16(rows_of(in.widened.v, 0, context));
  Tensor prefill = Tensor::bhnd(whole.batch, whole.heads, context, d, DType::BF16);
  mechanism->prepare(q, k, v);
  mechanism->prepare_decode(tokens);
  mechanism->forward(q, k, v, prefill);
  const float* projected = parameter(*mechanism, "projected_sequence").data();
  const Tensor& state_keys = tensor_named(mechanism->decode_state(), "key_sums");
  const Tensor& state_values = tensor_named(mechanism->decode_state(), "value_sums");
  const double c = 1 / std::sqrt(double(d)), fp32 = 8 * double(d + l + 2) * kFloatEps;
  const std::size_t size = static_cast<std::size_t>(heads * l * d);
  // Exact Aᵀ, B and their magnitude sums Ā, B̄ per head [l, D], advanced token by token.
  std::vector<double> exact_keys(size, 0.0), exact_values(size, 0.0), key_terms(size, 0.0), value_terms(size, 0.0);
  auto weights = [&](std::int64_t bh, std::int64_t token) {
    const float* key = in.widened.k.data() + (bh * n + token) * d;
    std::vector<double> a(static_cast<std::size_t>(l));
    for (std::int64_t j = 0; j < l; ++j) {
      double z = 0;
      for (std::int64_t f = 0; f < d; ++f) z += double(key[f]) * projected[(bh % whole.heads * l + j) * d + f];
      a[j] = c * z > 0 ? c * z + 1 : std::exp(c * z);
    }
    return a;
  };
  auto advance = [&](std::int64_t token) {
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      const auto a = weights(bh, token);
      const float* key = in.widened.k.data() + (bh * n + token) * d;
      const float* value = in.widened.v.data() + (bh * n + token) * d;
      for (std::int64_t j = 0; j < l; ++j)
        for (std::int64_t f = 0; f < d; ++f) {
          const std::size_t at = static_cast<std::size_t>((bh * l + j) * d + f);
          exact_keys[at] += a[j] * key[f];
          exact_values[at] += a[j] * value[f];
          key_terms[at] += a[j] * std::fabs(key[f]);
          value_terms[at] += a[j] * std::fabs(value[f]);
        }
    }
  };
  auto check_state = [&](double roundings, const std::string& where) {
    std::int64_t failures = 0;
    for (std::size_t e = 0; e < size; ++e) {
      const double got[2] = {to_float(state_keys.bf16_data()[e]), to_float(state_values.bf16_data()[e])};
      const double want[2] = {exact_keys[e], exact_values[e]}, terms[2] = {key_terms[e], value_terms[e]};
      for (int t = 0; t < 2; ++t)
        if (!(std::fabs(got[t] - want[t]) <= (roundings * kBf16Roundoff + 2 * fp32) * terms[t]) && failures++ < 3)
          FAIL_CHECK(where << " state "
                           << "AB"[t] << " entry " << e << ": got " << got[t] << ", want " << want[t]);
    }
    CHECK_MESSAGE(failures == 0, where << ": state out of its drift");
  };
  for (std::int64_t token = 0; token < context; ++token) advance(token);
  check_state(1, "luna bf16 prefill context " + std::to_string(context));
  for (std::int64_t s = 1; s <= tokens; ++s) {
    const std::int64_t token = context + s - 1;
    const std::string where = "luna bf16 decode context " + std::to_string(context) + " token " + std::to_string(token);
    std::vector<double> want(static_cast<std::size_t>(heads * d)), bound(want.size());
    const double t = double(token + 1);
    for (std::int64_t bh = 0; bh < heads; ++bh) {  // the step in double from the state as it stands
      const auto a = weights(bh, token);
      const float* query = in.widened.q.data() + (bh * n + token) * d;
      const float* key = in.widened.k.data() + (bh * n + token) * d;
      const float* value = in.widened.v.data() + (bh * n + token) * d;
      std::vector<double> scores(static_cast<std::size_t>(l)), rows_b(static_cast<std::size_t>(l * d));
      double shift = 0, largest_b = 0;
      for (std::int64_t j = 0; j < l; ++j) {
        double dot = 0, terms = 0;
        for (std::int64_t f = 0; f < d; ++f) {
          const std::int64_t at = (bh * l + j) * d + f;
          const double key_sum = to_float(state_keys.bf16_data()[at]) + a[j] * key[f];
          rows_b[j * d + f] = to_float(state_values.bf16_data()[at]) + a[j] * value[f];
          largest_b = std::max(largest_b, std::fabs(rows_b[j * d + f]));
          dot += key_sum * query[f];
          terms += (std::fabs(to_float(state_keys.bf16_data()[at])) + std::fabs(a[j] * key[f])) * std::fabs(query[f]);
        }
        scores[j] = c / t * dot;
        shift = std::max(shift, fp32 * c / t * terms);
      }
      luna_softmax(scores.data(), l);
      for (std::int64_t f = 0; f < d; ++f) {
        double o = 0;
        for (std::int64_t j = 0; j < l; ++j) o += scores[j] * rows_b[j * d + f] / t;
        want[bh * d + f] = o;
        bound[bh * d + f] = (std::exp(2 * shift) * (1 + fp32) - 1) * largest_b / t + kBf16Roundoff * std::fabs(o);
      }
    }
    Tensor out = Tensor::bhnd(whole.batch, whole.heads, 1, d, DType::BF16);
    mechanism->decode_step(to_bf16(rows_of(in.widened.q, token, 1)), to_bf16(rows_of(in.widened.k, token, 1)),
                           to_bf16(rows_of(in.widened.v, token, 1)), out);
    const Tensor step = to_f32(out);
    check_bf16_elements(
        step.data(), want, heads * d, [&](std::int64_t e) { return bound[static_cast<std::size_t>(e)]; }, where);
    advance(token);
    check_state(double(s + 1), where);
  }
  for (const auto& named : mechanism->decode_state()) CHECK(named.tensor->dtype() == DType::BF16);
}

}  // namespace

TEST_SUITE("luna_bf16") {
  TEST_CASE("luna bf16 forward against the double reference, both forms, around l and the chunk") {
    for (bool causal : {false, true})
      for (std::int64_t n : {1, 7, 8, 9, 16, 17, 40}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        check_forward(p, {"projected_length=8", "chunk=8"});
      }
    check_forward({.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 24}, {"projected_length=16", "chunk=16"});
  }

  TEST_CASE("luna bf16 backward: the fp32 form's gradients on the same values, rounded, both forms") {
    for (bool causal : {false, true})
      for (std::int64_t n : {1, 8, 9, 33})
        check_bf16_storage_gradients(
            "luna", {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
            {"projected_length=8", "chunk=8"}, static_cast<std::uint64_t>(n) + 3,
            std::string("luna bf16 backward ") + (causal ? "causal " : "") + "N=" + std::to_string(n));
  }

  TEST_CASE("luna bf16 decode: the state within its rounding drift, each step exact on it up to fp32 and u·|o|") {
    for (std::int64_t context : {1, 7, 8, 9, 30}) check_decode(context, 12, {"projected_length=8", "chunk=8"});
  }

  TEST_CASE("luna bf16 rows: FLOPs as fp32's, halved inputs and state, estimates exact") {
    for (bool causal : {false, true})
      for (std::int64_t n : {100, 257})
        for (Pass pass : {Pass::Forward, Pass::Decode, Pass::Backward, Pass::Train}) {
          if (pass == Pass::Decode && !causal) continue;
          const auto [a, b] = check_bf16_rows("luna", n, causal, pass, {"projected_length=32", "chunk=64"});
          CHECK(b.saved_bytes == a.saved_bytes);  // the saved probabilities and weights stay fp32
          if (pass == Pass::Decode) {
            CHECK(b.state_bytes > 0);
            CHECK(2 * (b.state_bytes - 8) == a.state_bytes - 8);  // Aᵀ and B halved; the step count stays
          }
        }
  }
}
