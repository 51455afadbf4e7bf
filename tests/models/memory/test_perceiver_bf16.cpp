// perceiver in bf16 (storage only: taxonomy/memory/perceiver.hpp), u = 2⁻⁸:
//   - both forms' output against the double reference on the bf16 inputs (perceiver_reference.hpp)
//     within the fp32 tolerance plus the output's rounding, u·(|o| + tol), at the fp32 tests' sizes;
//   - the gradients (dlatents and dlatent_projections too) the fp32 form's on the same values up to
//     each gradient's rounding (check_bf16_storage_gradients);
//   - decoding in two parts: the state — the cross cache holds the bf16 inputs exactly and the latent
//     ring the rounding of each position's Lk, Lv (within u·|x| + their fp32 bound, of the double
//     rows); and each step against that step computed in double from the model's own ring, within
//     the fp32 tolerance plus the output's rounding u·|o|.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/models/memory/perceiver_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/mechanism_run.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

PerceiverShape shape_of(const ParamValues& values) {
  return {values.get_int("latents"), values.get_int("cross_window")};
}
ParamValues values_of(const Problem& p, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("perceiver");
  REQUIRE(info != nullptr);
  return info->impl.resolved(p, resolve_params("perceiver", info->impl.params, params));
}

std::string label_of(const Problem& p, const std::vector<std::string>& params) {
  std::string label = std::string("perceiver bf16 ") + (p.causal ? "causal " : "") + "N=" + std::to_string(p.seq_len) +
                      " D=" + std::to_string(p.head_dim);
  for (const auto& param : params) label += " " + param;
  return label;
}

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  const ParamValues values = values_of(p, params);
  const std::int64_t m = model_output_rows("perceiver", p, params), d = p.head_dim;
  const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(p.seq_len + 3 * m));
  auto mechanism = bf16_mechanism("perceiver", p, values);
  Tensor out = Tensor::bhnd(p.batch, p.heads, m, d, DType::BF16);
  mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
  mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
  const Tensor got = to_f32(out);
  PerceiverErrors errors;
  const auto want = perceiver_reference(p, shape_of(values), named_inputs(in.widened, *mechanism), &errors);
  const double tolerance = perceiver_tolerance(p, m, errors) * (1 + kU);
  check_bf16_elements(
      got.data(), want, got.size(),
      [&](std::int64_t e) { return tolerance + kU * std::fabs(want[static_cast<std::size_t>(e)]); },
      label_of(p, params));
}

// The prefill of `context` tokens and `steps` steps (the header's decode checks).
void check_decode(std::int64_t context, std::int64_t steps, std::int64_t d, const std::vector<std::string>& params) {
  const Problem whole =
      on_test_threads({.batch = 2, .heads = 2, .seq_len = context + steps, .head_dim = d, .causal = true});
  Problem p = whole;
  p.seq_len = context;
  const std::int64_t heads = whole.batch * whole.heads, total = whole.seq_len;
  const ParamValues values = values_of(p, params);
  const PerceiverShape shape = shape_of(values);
  const Bf16Inputs in = bf16_inputs(whole, static_cast<std::uint64_t>(context + 5));
  auto mechanism = bf16_mechanism("perceiver", p, values);
  const auto prefix = [&](const Tensor& x, std::int64_t tokens) { return to_bf16(rows_of(x, 0, tokens)); };
  const Tensor q = prefix(in.widened.q, context), k = prefix(in.widened.k, context), v = prefix(in.widened.v, context);
  Tensor prefill = Tensor::bhnd(whole.batch, whole.heads, std::min(shape.latents, context), d, DType::BF16);
  mechanism->prepare(q, k, v);
  mechanism->prepare_decode(steps);
  mechanism->forward(q, k, v, prefill);
  const auto state = mechanism->decode_state();
  const Tensor& ring_keys = tensor_named(state, "latent_keys");
  const Tensor& ring_values = tensor_named(state, "latent_values");
  const std::int64_t ring = ring_keys.dim(1);
  // After `length` tokens: the ring against the double rows of the last m positions, and (after a
  // step) the step's output against the latent attention of its Lq over the ring, in double.
  auto check_state_and_step = [&](std::int64_t length, const Tensor* step_out) {
    Problem seen = whole;
    seen.seq_len = length;
    const AttentionInputs seen_in{rows_of(in.widened.q, 0, length), rows_of(in.widened.k, 0, length),
                                  rows_of(in.widened.v, 0, length)};
    PerceiverErrors errors;
    std::vector<double> latent;
    perceiver_reference(seen, shape, named_inputs(seen_in, *mechanism), &errors, &latent);
    const std::int64_t m = std::min(shape.latents, length);
    const double row_error = perceiver_row_error(seen, errors), tolerance = perceiver_tolerance(seen, m, errors);
    const std::string where = label_of(p, params) + " after " + std::to_string(length) + " tokens";
    std::int64_t failures = 0;
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      const double* lq = latent.data() + bh * 3 * m * d;
      auto ring_row = [&](const Tensor& t, std::int64_t i) {  // latent i (position length − m + i)
        return t.bf16_data() + (bh * ring + (length - m + i) % ring) * d;
      };
      for (std::int64_t i = 0; i < m; ++i)
        for (int which = 1; which <= 2; ++which)
          for (std::int64_t f = 0; f < d; ++f) {
            const double want = lq[(which * m + i) * d + f];
            const double got = to_float(ring_row(which == 1 ? ring_keys : ring_values, i)[f]);
            if (!(std::fabs(got - want) <= kU * std::fabs(want) + row_error * (1 + kU)) && failures++ < 3)
              FAIL_CHECK(where << " bh=" << bh << " ring L"
                               << "kv"[which - 1] << " latent " << i << " feature " << f << ": got " << got << ", want "
                               << want);
          }
      if (step_out == nullptr) continue;
      std::vector<double> keys(static_cast<std::size_t>(m * d)), vals(keys.size());
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t f = 0; f < d; ++f) {
          keys[i * d + f] = to_float(ring_row(ring_keys, i)[f]);
          vals[i * d + f] = to_float(ring_row(ring_values, i)[f]);
        }
      double unused = 0;
      const auto want = perceiver_attend(lq + (m - 1) * d, keys.data(), vals.data(), 0, m - 1, d, unused);
      for (std::int64_t f = 0; f < d; ++f) {
        const double got = to_float(step_out->bf16_data()[bh * d + f]);
        if (!(std::fabs(got - want[f]) <= tolerance * (1 + kU) + kU * std::fabs(want[f])) && failures++ < 3)
          FAIL_CHECK(where << " bh=" << bh << " step feature " << f << ": got " << got << ", want " << want[f]);
      }
    }
    CHECK_MESSAGE(failures == 0, where << ": " << failures << " out of the bound");
  };
  check_state_and_step(context, nullptr);
  decode_bf16_steps(*mechanism, in.widened, context, steps,
                    [&](std::int64_t length, const Tensor& out) { check_state_and_step(length, &out); });
  // The cross cache holds the bf16 inputs of the last `capacity` tokens, bit for bit.
  const Tensor& cross_keys = tensor_named(state, "cross_keys");
  const Tensor& cross_values = tensor_named(state, "cross_values");
  const Tensor k_all = to_bf16(in.widened.k), v_all = to_bf16(in.widened.v);
  const std::int64_t capacity = cross_keys.dim(1);
  std::int64_t mismatches = 0;
  for (std::int64_t bh = 0; bh < heads; ++bh)
    for (std::int64_t token = std::max<std::int64_t>(0, total - capacity); token < total; ++token)
      for (std::int64_t f = 0; f < d; ++f) {
        const std::int64_t slot = (bh * capacity + token % capacity) * d + f, at = (bh * total + token) * d + f;
        mismatches += cross_keys.bf16_data()[slot] != k_all.bf16_data()[at];
        mismatches += cross_values.bf16_data()[slot] != v_all.bf16_data()[at];
      }
  CHECK_MESSAGE(mismatches == 0, label_of(p, params) << ": cross cache differs from the inputs");
  for (const auto& named : state) CHECK(named.tensor->dtype() == DType::BF16);
}

}  // namespace

TEST_SUITE("perceiver_bf16") {
  TEST_CASE("forward: latents around N, tiles around M and N, cross_window, both forms") {
    for (bool causal : {false, true}) {
      for (std::int64_t n : {15, 16, 17})
        check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal},
                      {"latents=16", "block_rows=4", "block_keys=8"});
      for (std::int64_t n : {7, 9, 23})
        for (const char* rows : {"block_rows=4", "block_rows=5", "block_rows=6"})
          for (const char* keys : {"block_keys=7", "block_keys=8", "block_keys=9"})
            check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal},
                          {"latents=5", rows, keys});
    }
    for (const char* window : {"cross_window=1", "cross_window=8", "cross_window=13"})
      check_forward({.batch = 2, .heads = 2, .seq_len = 30, .head_dim = 8, .causal = true},
                    {"latents=7", "block_rows=3", "block_keys=4", window});
  }

  TEST_CASE("forward at the default tiles, D = 64, N = 600, M = 100") {
    for (bool causal : {false, true})
      check_forward({.batch = 1, .heads = 2, .seq_len = 600, .head_dim = 64, .causal = causal}, {"latents=100"});
  }

  TEST_CASE("gradients: the fp32 form's on the same values, rounded once") {
    for (bool causal : {false, true}) {
      for (const auto& params :
           std::vector<std::vector<std::string>>{{"latents=5", "block_rows=2", "block_keys=3"},
                                                 {"latents=7", "block_rows=3", "block_keys=4", "cross_window=3"},
                                                 {"latents=9", "block_rows=4", "block_keys=4"}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = 8, .head_dim = 4, .causal = causal};
        check_bf16_storage_gradients("perceiver", p, params, 7, label_of(p, params));
      }
      const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16, .causal = causal};
      check_bf16_storage_gradients("perceiver", p, {"latents=40"}, 9, label_of(p, {"latents=40"}));
    }
  }

  TEST_CASE("decode: the cross cache and latent ring, and each step exact on its own state") {
    for (const auto& params :
         std::vector<std::vector<std::string>>{{"latents=6", "block_rows=4", "block_keys=5"},
                                               {"latents=6", "block_rows=4", "block_keys=5", "cross_window=4"},
                                               {"latents=6", "block_rows=4", "block_keys=5", "cross_window=1"},
                                               {"latents=3", "cross_window=20"}})
      for (std::int64_t context : {1, 5, 6, 7, 13}) check_decode(context, 9, 8, params);
    check_decode(40, 6, 16, {"latents=16"});
  }

  TEST_CASE("rows: FLOPs as fp32's, halved inputs and decode state, saved C and statistics fp32, estimates exact") {
    for (bool causal : {false, true})
      for (std::int64_t n : {100, 257})
        for (Pass pass : {Pass::Forward, Pass::Decode, Pass::Backward, Pass::Train}) {
          if (pass == Pass::Decode && !causal) continue;
          const auto [a, b] = check_bf16_rows("perceiver", n, causal, pass, {"latents=40", "block_rows=16"});
          CHECK(b.saved_bytes == a.saved_bytes);
          if (pass == Pass::Decode) {
            CHECK(b.state_bytes > 0);
            CHECK(2 * b.state_bytes == a.state_bytes);
          }
        }
  }
}
