// long-short in bf16 (storage only: taxonomy/low_rank/long_short.hpp), u = 2⁻⁸:
//   - both forms' output against the double reference on the bf16 inputs (long_short_reference.hpp)
//     within the fp32 tolerance plus the output's rounding, u·(|o| + tol);
//   - the gradients (the projection's and LayerNorms' too) the fp32 form's on the same values up to
//     each gradient's rounding (check_bf16_storage_gradients);
//   - decoding in two parts: the state — the compressed rows and the window ring within u·|x| + the
//     fp32 tolerance of the double rows, the incomplete chunk equal to the bf16 inputs — and each step
//     against that step computed in double from the model's own state, within the fp32 tolerance plus
//     the output's rounding u·|o|.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "tests/models/low_rank/long_short_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/mechanism_run.hpp"

using namespace xfb;
using namespace xfb::test;
using namespace xfb::test::long_short;

namespace {

constexpr double kU = kBf16Roundoff;

std::string label_of(const Problem& p, const std::vector<std::string>& params) {
  std::string label = std::string("long-short bf16 ") + (p.causal ? "causal " : "") + "N=" + std::to_string(p.seq_len);
  for (const auto& param : params) label += " " + param;
  return label;
}

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  const Settings s = settings_of(p, params);
  const std::int64_t nd = p.seq_len * p.head_dim;
  const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(p.seq_len + 11));
  auto mechanism = bf16_mechanism("long-short", p, params);
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  std::vector<ErrorScale> scales;
  const Matrix want = reference(named_inputs(in.widened, *mechanism), p, s, &scales);
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const double tolerance = tolerance_of(scales[static_cast<std::size_t>(bh)], p, s) * (1 + kU);
    const std::vector<double> head(want.begin() + bh * nd, want.begin() + (bh + 1) * nd);
    check_bf16_elements(
        got.data() + bh * nd, head, nd,
        [&](std::int64_t e) { return tolerance + kU * std::fabs(head[static_cast<std::size_t>(e)]); },
        label_of(p, params) + " bh=" + std::to_string(bh));
  }
}

// |got − want| ≤ u·|want| + tolerance for rows [0, count) of a bf16 state tensor's head (its rows
// at slot(row)) against the double rows; returns the failures.
template <class Slot>
std::int64_t check_state_rows(const Tensor& state, std::int64_t head, const Matrix& want, std::int64_t count,
                              std::int64_t d, const Slot& slot, double tolerance, const std::string& where) {
  std::int64_t failures = 0;
  const std::int64_t rows = state.dim(1);
  for (std::int64_t row = 0; row < count; ++row)
    for (std::int64_t f = 0; f < d; ++f) {
      const double got = to_float(state.bf16_data()[(head * rows + slot(row)) * d + f]);
      const double x = want[static_cast<std::size_t>(row * d + f)];
      if (!(std::fabs(got - x) <= kU * std::fabs(x) + tolerance) && failures++ < 3)
        FAIL_CHECK(where << " row " << row << " feature " << f << ": got " << got << ", want " << x);
    }
  return failures;
}

// The prefill of `context` tokens and `steps` steps (the header's decode checks).
void check_decode(std::int64_t context, std::int64_t steps, const std::vector<std::string>& params) {
  const Problem whole =
      on_test_threads({.batch = 2, .heads = 2, .seq_len = context + steps, .head_dim = 16, .causal = true});
  Problem p = whole;
  p.seq_len = context;
  const std::int64_t heads = whole.batch * whole.heads, d = whole.head_dim, total = whole.seq_len;
  const ModelInfo* info = find_model("long-short");
  REQUIRE(info != nullptr);
  const ParamValues values = info->impl.resolved(p, resolve_params("long-short", info->impl.params, params));
  const Settings s = settings_of(p, params);
  const Bf16Inputs in = bf16_inputs(whole, static_cast<std::uint64_t>(context + 2));
  auto mechanism = bf16_mechanism("long-short", p, values);
  const auto prefix = [&](const Tensor& x, std::int64_t tokens) { return to_bf16(rows_of(x, 0, tokens)); };
  const Tensor q = prefix(in.widened.q, context), k = prefix(in.widened.k, context), v = prefix(in.widened.v, context);
  Tensor prefill = Tensor::bhnd(whole.batch, whole.heads, context, d, DType::BF16);
  mechanism->prepare(q, k, v);
  mechanism->prepare_decode(steps);
  mechanism->forward(q, k, v, prefill);
  const auto state = mechanism->decode_state();
  const Tensor &comp_k = tensor_named(state, "compressed_keys"), &comp_v = tensor_named(state, "compressed_values");
  const Tensor &ring_k = tensor_named(state, "key_window"), &ring_v = tensor_named(state, "value_window");
  const Tensor &chunk_k = tensor_named(state, "chunk_keys"), &chunk_v = tensor_named(state, "chunk_values");
  const Tensor k_all = to_bf16(in.widened.k), v_all = to_bf16(in.widened.v);
  const std::int64_t cap = ring_k.dim(1), l = s.chunk;
  // After `length` tokens: the state against the double rows of that prefix, and (after a step) the
  // step's output against its query over the state in double.
  auto check_state_and_step = [&](std::int64_t length, const Tensor* step_out) {
    Problem seen = whole;
    seen.seq_len = length;
    const AttentionInputs seen_in{rows_of(in.widened.q, 0, length), rows_of(in.widened.k, 0, length),
                                  rows_of(in.widened.v, 0, length)};
    std::vector<ErrorScale> scales;
    std::vector<HeadRows> rows;
    reference(named_inputs(seen_in, *mechanism), seen, s, &scales, &rows);
    const std::string where = label_of(p, params) + " after " + std::to_string(length) + " tokens";
    const std::int64_t pos = length - 1, first = std::max<std::int64_t>(0, length - s.window);
    const std::int64_t stored = length / l * s.rank, visible = pos / l * s.rank, kept = std::min(cap, length);
    std::int64_t failures = 0, mismatches = 0;
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      const HeadRows& r = rows[static_cast<std::size_t>(bh)];
      const double tolerance = tolerance_of(scales[static_cast<std::size_t>(bh)], seen, s);
      const auto same = [](std::int64_t row) { return row; };
      const auto ring_slot = [&](std::int64_t row) { return (length - kept + row) % cap; };
      const Matrix win_k(r.win_k.begin() + (length - kept) * d, r.win_k.end());
      const Matrix win_v(r.win_v.begin() + (length - kept) * d, r.win_v.end());
      failures += check_state_rows(comp_k, bh, r.comp_k, stored, d, same, tolerance, where + " compressed keys");
      failures += check_state_rows(comp_v, bh, r.comp_v, stored, d, same, tolerance, where + " compressed values");
      failures += check_state_rows(ring_k, bh, win_k, kept, d, ring_slot, tolerance, where + " window keys");
      failures += check_state_rows(ring_v, bh, win_v, kept, d, ring_slot, tolerance, where + " window values");
      for (std::int64_t token = length / l * l; token < length; ++token)
        for (std::int64_t f = 0; f < d; ++f) {
          const std::int64_t slot = (bh * l + token % l) * d + f, at = (bh * total + token) * d + f;
          mismatches += chunk_k.bf16_data()[slot] != k_all.bf16_data()[at];
          mismatches += chunk_v.bf16_data()[slot] != v_all.bf16_data()[at];
        }
      if (step_out == nullptr) continue;
      // The step in double: its query over the visible compressed rows and window, as the state holds them.
      const float* query = in.widened.q.data() + (bh * total + pos) * d;
      std::vector<const bf16*> keys, vals;
      for (std::int64_t row = 0; row < visible; ++row) {
        keys.push_back(comp_k.bf16_data() + (bh * comp_k.dim(1) + row) * d);
        vals.push_back(comp_v.bf16_data() + (bh * comp_v.dim(1) + row) * d);
      }
      for (std::int64_t token = first; token < length; ++token) {
        keys.push_back(ring_k.bf16_data() + (bh * cap + token % cap) * d);
        vals.push_back(ring_v.bf16_data() + (bh * cap + token % cap) * d);
      }
      std::vector<double> scores(keys.size());
      for (std::size_t j = 0; j < keys.size(); ++j) {
        double dot = 0;
        for (std::int64_t f = 0; f < d; ++f) dot += double(query[f]) * to_float(keys[j][f]);
        scores[j] = dot / std::sqrt(double(d));
      }
      softmax(scores.data(), static_cast<std::int64_t>(scores.size()));
      for (std::int64_t f = 0; f < d; ++f) {
        double want = 0;
        for (std::size_t j = 0; j < keys.size(); ++j) want += scores[j] * to_float(vals[j][f]);
        const double got = to_float(step_out->bf16_data()[bh * d + f]);
        if (!(std::fabs(got - want) <= tolerance * (1 + kU) + kU * std::fabs(want)) && failures++ < 3)
          FAIL_CHECK(where << " bh=" << bh << " step feature " << f << ": got " << got << ", want " << want);
      }
    }
    CHECK_MESSAGE(failures == 0, where << ": " << failures << " out of the bound");
    CHECK_MESSAGE(mismatches == 0, where << ": the chunk's raw rows differ from the inputs");
  };
  check_state_and_step(context, nullptr);
  decode_bf16_steps(*mechanism, in.widened, context, steps,
                    [&](std::int64_t length, const Tensor& out) { check_state_and_step(length, &out); });
  for (const auto& named : state) CHECK(named.tensor->dtype() == DType::BF16);
}

const std::vector<std::string> kSmall{"window=5", "chunk=4", "chunk_rank=2"};

}  // namespace

TEST_SUITE("long_short_bf16") {
  TEST_CASE("forward: both forms around the segment, chunk and window, non-multiples") {
    for (std::int64_t n : {1, 7, 8, 9, 20, 33})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16}, {"segment=8", "rank=4"});
    for (std::int64_t n : {1, 3, 4, 5, 9, 17, 40})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true}, kSmall);
    check_forward({.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 24, .causal = true}, {"window=64"});
    check_forward({.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 24}, {});
  }

  TEST_CASE("gradients: the fp32 form's on the same values, rounded once") {
    for (std::int64_t n : {1, 8, 9, 21}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8};
      check_bf16_storage_gradients("long-short", p, {"segment=8", "rank=3"}, 5, label_of(p, {}));
      Problem causal = p;
      causal.causal = true;
      check_bf16_storage_gradients("long-short", causal, kSmall, 6, label_of(causal, kSmall));
    }
  }

  TEST_CASE("decode: the state within its rounding, each step exact on it; contexts around the chunk and window") {
    for (std::int64_t context : {1, 3, 4, 5, 8, 9}) check_decode(context, 11, kSmall);
    check_decode(2, 7, {"window=1", "chunk=1", "chunk_rank=3"});
    check_decode(140, 3, {"window=4", "chunk=1"});  // from 128 compressed rows
  }

  TEST_CASE("rows: FLOPs as fp32's, halved inputs and decode state, saved statistics fp32, estimates exact") {
    for (bool causal : {false, true})
      for (std::int64_t n : {100, 257})
        for (Pass pass : {Pass::Forward, Pass::Decode, Pass::Backward, Pass::Train}) {
          if (pass == Pass::Decode && !causal) continue;
          const auto [a, b] = check_bf16_rows("long-short", n, causal, pass, {"window=64"});
          CHECK(b.saved_bytes == a.saved_bytes);
          if (pass == Pass::Decode) {
            CHECK(b.state_bytes > 0);
            CHECK(2 * (b.state_bytes - 8) == a.state_bytes - 8);  // every row halved; the length stays
          }
        }
  }
}
