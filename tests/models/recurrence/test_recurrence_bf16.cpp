// transformer-xl and compressive in bf16 (storage only: taxonomy/recurrence/segment_attention.hpp),
// u = 2⁻⁸ and ε the fp32 unit roundoff:
//   - the forward against the naive float64 recurrence on the bf16 inputs themselves
//     (segment_reference.hpp): the fp32 form's tolerance plus the output's rounding, u·(|o| + tol);
//     the memory holds the input rows bit for bit. Max pooling keeps bf16 values (a max of bf16
//     values), so its reference computes the slots; mean and conv slots are rounded once, so they
//     are checked against f_c in float64 within the fp32 slot bound plus u·|slot|, and the output's
//     reference takes the model's own slots (n_cm holds every slot made).
//   - the backward equals the fp32 form's on the same values (the bf16 inputs, the bf16 output,
//     dout) up to each gradient's rounding, u·|g|, and fp32 summation order (16·N·ε·max|g|): the
//     computation is the fp32 form's on widened rows; transformer-xl and max pooling, whose slots
//     are the same in both forms (the rounded mean and conv slots are the forward's update_memory,
//     checked above).
//   - decoding against the bf16 causal forward (check_bf16_decode) within one bf16 ulp of the
//     output (P is not rounded), across segment boundaries.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "taxonomy/recurrence/compressive.hpp"
#include "taxonomy/recurrence/segment_attention.hpp"
#include "taxonomy/recurrence/transformer_xl.hpp"
#include "taxonomy/registry.hpp"
#include "tests/models/recurrence/segment_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

SegmentAttentionConfig config_of(const std::string& model, const std::vector<std::string>& params) {
  const ParamValues values = resolve_params(model, find_model(model)->impl.params, params);
  return model == "compressive" ? compressive_config(values) : transformer_xl_config(values);
}

std::vector<float> widened_rows(const bf16* rows, std::int64_t count, std::int64_t d) {
  std::vector<float> out(static_cast<std::size_t>(count * d));
  widen(rows, out.data(), count * d);
  return out;
}

// The model's compressed memory of one head (keys or values) against f_c in float64 (`want`),
// within the fp32 slot bound plus the slot's rounding; returns the slots widened.
Rows checked_slots(const bf16* got, const Rows& want, double fp32_bound, const std::string& label) {
  Rows slots;
  const std::int64_t d = want.empty() ? 0 : static_cast<std::int64_t>(want[0].size());
  for (std::size_t t = 0; t < want.size(); ++t) {
    std::vector<double> slot(static_cast<std::size_t>(d));
    for (std::int64_t f = 0; f < d; ++f) {
      const double w = want[t][static_cast<std::size_t>(f)];
      slot[static_cast<std::size_t>(f)] = to_float(got[static_cast<std::int64_t>(t) * d + f]);
      const double bound = fp32_bound * (1 + kU) + kU * std::fabs(w);
      if (!(std::fabs(slot[static_cast<std::size_t>(f)] - w) <= bound))
        FAIL_CHECK(label << " slot " << t << " feature " << f << ": got " << slot[static_cast<std::size_t>(f)]
                         << ", want " << w << " (bound " << bound << ")");
    }
    slots.push_back(std::move(slot));
  }
  return slots;
}

void check_forward(const std::string& model, const Problem& p, const std::vector<std::string>& params) {
  const SegmentAttentionConfig c = config_of(model, params);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  std::string label = model + " bf16 N=" + std::to_string(n) + (p.causal ? " causal" : "");
  for (const auto& param : params) label += " " + param;
  const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(n * 3 + p.causal));
  auto mechanism = bf16_mechanism(model, p, params);
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  const auto& state = dynamic_cast<const SegmentAttention&>(*mechanism);
  const bool rounded_slots = c.compression == Compression::MeanPool || c.compression == Compression::Conv;
  if (rounded_slots) REQUIRE(state.compressed_length() < c.compressed_len);  // no slot was dropped
  double largest_input = 0, largest_weight = 0;
  for (const Tensor* t : {&in.widened.k, &in.widened.v})
    largest_input = std::max(largest_input, max_abs(t->data(), t->size()));
  if (c.compression == Compression::Conv)
    largest_weight =
        max_abs(parameter(*mechanism, "conv_weights").data(), parameter(*mechanism, "conv_weights").size());
  const double slot_bound = c.compression == Compression::Conv ? 2 * kFloatEps * double(c.rate * d) *
                                                                     double(c.rate * d) * largest_input * largest_weight
                                                               : 2 * kFloatEps * double(c.rate) * largest_input;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const float *q = in.widened.q.head(b, h), *k = in.widened.k.head(b, h), *v = in.widened.v.head(b, h);
      HeadParams hp = head_params(*mechanism, c, p.heads, h, d);
      Rows slots[2];
      if (rounded_slots) {
        const NaiveResult exact = naive_segments(q, k, v, n, d, c, p.causal, hp);
        REQUIRE(state.compressed_length() == static_cast<std::int64_t>(exact.compressed_k.size()));
        slots[0] = checked_slots(state.compressed_rows<bf16>(false, b, h), exact.compressed_k, slot_bound,
                                 where + " compressed keys");
        slots[1] = checked_slots(state.compressed_rows<bf16>(true, b, h), exact.compressed_v, slot_bound,
                                 where + " compressed values");
      }
      const NaiveResult want = naive_segments(q, k, v, n, d, c, p.causal, hp, rounded_slots ? slots : nullptr);
      check_bf16_elements(
          got.head(b, h), want.out, n * d,
          [&](std::int64_t e) { return want.tolerance * (1 + kU) + kU * std::fabs(want.out[static_cast<size_t>(e)]); },
          where);
      REQUIRE(state.memory_length() == static_cast<std::int64_t>(want.memory_k.size()));
      REQUIRE(state.compressed_length() == static_cast<std::int64_t>(want.compressed_k.size()));
      const std::int64_t memory = state.memory_length(), compressed = state.compressed_length();
      check_rows(widened_rows(state.memory_rows<bf16>(false, b, h), memory, d).data(), want.memory_k, 0,
                 where + " memory keys");
      check_rows(widened_rows(state.memory_rows<bf16>(true, b, h), memory, d).data(), want.memory_v, 0,
                 where + " memory values");
      if (c.compression == Compression::MaxPool) {  // bf16 values: exact
        check_rows(widened_rows(state.compressed_rows<bf16>(false, b, h), compressed, d).data(), want.compressed_k, 0,
                   where + " compressed keys");
        check_rows(widened_rows(state.compressed_rows<bf16>(true, b, h), compressed, d).data(), want.compressed_v, 0,
                   where + " compressed values");
      }
    }
}

const std::vector<std::string> kXl{"segment_len=16", "memory_len=7", "block_q=5"};

std::vector<std::string> compressive_params(const std::string& f, std::int64_t slots, std::int64_t rate = 3) {
  return {"segment_len=16",   "memory_len=7",
          "block_q=5",        "compressed_len=" + std::to_string(slots),
          "compression=" + f, "compression_rate=" + std::to_string(rate)};
}

}  // namespace

TEST_SUITE("recurrence_bf16") {
  TEST_CASE("transformer-xl and compressive bf16 forward against the float64 recurrence, slots and memory included") {
    for (bool causal : {false, true}) {
      // N at, one below and one above 1, 2 and 3 segments and ragged; whole heads per thread and
      // (B·H = 1) threads sharing a segment's tiles.
      for (std::int64_t n : {1, 15, 16, 17, 33, 47, 70}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        check_forward("transformer-xl", p, kXl);
        check_forward("compressive", p, compressive_params("max", 2));
        check_forward("compressive", p, compressive_params("mean", 64));
        check_forward("compressive", p, compressive_params("conv", 64, 4));
      }
      const Problem one{.batch = 1, .heads = 1, .seq_len = 70, .head_dim = 32, .causal = causal};
      check_forward("transformer-xl", one, kXl);
      check_forward("compressive", one, compressive_params("conv", 64, 2));
      // D not a multiple of 16: the storage-only form takes any D.
      check_forward("transformer-xl", {.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 8, .causal = causal}, kXl);
    }
  }

  TEST_CASE("transformer-xl and compressive bf16 backward: the fp32 form's gradients on the same values, rounded") {
    for (bool causal : {false, true})
      for (std::int64_t n : {5, 16, 17, 40}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        const std::string label = std::string(" bf16 backward N=") + std::to_string(n) + (causal ? " causal" : "");
        check_bf16_storage_gradients("transformer-xl", p, kXl, static_cast<std::uint64_t>(n), "transformer-xl" + label);
        check_bf16_storage_gradients("compressive", p, compressive_params("max", 2), static_cast<std::uint64_t>(n),
                                     "compressive max" + label);
      }
  }

  TEST_CASE("transformer-xl and compressive bf16 decode equal their bf16 causal forward across segments") {
    for (std::int64_t context : {1, 7, 8, 9, 20})
      check_bf16_decode("transformer-xl", {.batch = 2, .heads = 2, .head_dim = 16}, context, 11,
                        {"segment_len=8", "memory_len=5", "block_q=3"}, false);
    for (const char* f : {"max", "mean", "conv"})
      for (std::int64_t context : {3, 16, 17})
        check_bf16_decode("compressive", {.batch = 1, .heads = 2, .head_dim = 16}, context, 11,
                          {"segment_len=8", "memory_len=5", "block_q=3", "compressed_len=3", "compression_rate=2",
                           std::string("compression=") + f},
                          false);
  }

  TEST_CASE("transformer-xl and compressive bf16 rows: FLOPs as fp32's, halved inputs and windows, estimates exact") {
    for (const std::string model : {"transformer-xl", "compressive"})
      for (bool causal : {false, true})
        for (std::int64_t n : {100, 257})
          for (Pass pass : {Pass::Forward, Pass::Decode, Pass::Backward, Pass::Train}) {
            if (pass == Pass::Decode && !causal) continue;
            const std::vector<std::string> params{"segment_len=64", "memory_len=48"};
            const auto [a, b] = check_bf16_rows(model, n, causal, pass, params);
            CHECK(b.saved_bytes == a.saved_bytes);  // the log-sum-exp stays fp32
            if (pass == Pass::Decode) {
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes == a.state_bytes);
            }
          }
    // A context shorter than the decode segment with no memory: the widening scratch grows in
    // prepare_decode, and the estimate follows.
    check_bf16_rows("transformer-xl", 1, true, Pass::Decode, {"segment_len=64", "memory_len=0"});
  }
}
