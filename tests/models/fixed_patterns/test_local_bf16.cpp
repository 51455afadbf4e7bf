// The bf16 form of the single-plan block-sparse path (taxonomy/engines/block_sparse_bf16.hpp):
// `local` and `image-transformer` in bf16 against the float64 masked reference on the same bf16
// inputs, forward and gradients, on every bf16 kernel path (vdpbf16ps where the CPU has it,
// convert-and-FMA at 512 and 256 bits); decode against the bf16 causal forward; bytes, FLOPs and
// the workspace estimate.
//
// The forward bound. The reference runs in float64 on the bf16 inputs widened exactly, so only
// the computation's rounding counts (u = 2⁻⁸): the bf16 products of S are exact in fp32 and S, the
// row statistics and the P·V sums carry fp32 rounding only (attention_tolerance); P is rounded to
// bf16 after the exponent and before the division by Σ (fp32), which moves each p_j by ≤ u·p_j,
// so an output element by ≤ u·Σ_j p_j·|v_j|/Σ ≤ u·max|v|; rounding the output moves it by ≤ u·|o|
// ≤ u·max|v| more:  |o − o_ref| ≤ 2u(1 + u)·max|v| + attention_tolerance.
//
// The gradient bound is check_bf16_masked_gradients' (tests/support/bf16_check.hpp), per rounding:
// P rounded for dV (u·Σ P·|dO|), dS rounded for dQ and dK (u·scale·Σ|dS|·|K|, |Q|), the fp32 factor·T,
// δ_r = dO_r·O_r read off the stored bf16 output (its actual error carried through dS), and the
// gradient's own rounding u·|g|.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

MaskFn local_mask(std::int64_t block, bool causal) {
  return [=](std::int64_t i, std::int64_t j) { return i / block == j / block && (!causal || j <= i); };
}
MaskFn image_mask(std::int64_t query_block, std::int64_t flange, bool causal) {
  return [=](std::int64_t i, std::int64_t j) {
    const std::int64_t start = i / query_block * query_block;
    return j >= start - flange && j < start + query_block && (!causal || j <= i);
  };
}

// The cases: sizes one below, at and above the blocks and the 64-row tile.
struct Case {
  std::string model;
  std::vector<std::string> params;
  std::function<MaskFn(bool)> mask;
  std::vector<std::int64_t> sizes;
};
std::vector<Case> forward_cases() {
  return {
      {"local", {}, [](bool c) { return local_mask(50, c); }, {1, 49, 50, 51, 101}},
      {"local", {"block=16"}, [](bool c) { return local_mask(16, c); }, {15, 16, 17, 63, 64, 65}},
      {"local", {"block=70"}, [](bool c) { return local_mask(70, c); }, {69, 70, 71, 150}},
      {"image-transformer",
       {"query_block=16", "memory_flange=8"},
       [](bool c) { return image_mask(16, 8, c); },
       {1, 8, 15, 16, 17, 25, 100}},
      {"image-transformer",
       {"query_block=65", "memory_flange=30"},
       [](bool c) { return image_mask(65, 30, c); },
       {63, 64, 65, 66, 131}},
  };
}

}  // namespace

TEST_SUITE("local_bf16") {
  TEST_CASE("local and image-transformer in bf16 equal the float64 masked reference, every path, causal and not") {
    for_each_bf16_path([](const std::string& path) {
      for (const Case& c : forward_cases())
        for (std::int64_t n : c.sizes)
          for (bool causal : {false, true}) {
            const Problem p = on_test_threads({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal});
            const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(n) + 3);
            auto mechanism = bf16_mechanism(c.model, p, c.params);
            Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
            mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
            mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
            const Tensor got = to_f32(out);
            const std::string label = c.model + " N=" + std::to_string(n) + (causal ? " causal " : " ") + path;
            double over_fp32 = 0;
            for (std::int64_t h = 0; h < 2; ++h) {
              const float *q = in.widened.q.head(0, h), *k = in.widened.k.head(0, h), *v = in.widened.v.head(0, h);
              const auto want = reference_attention(q, k, v, n, n, 32, 1.0 / std::sqrt(32.0), c.mask(causal));
              const double fp32 = attention_tolerance(q, k, v, n, n, 32, 1.0 / std::sqrt(32.0));
              const double bound = bf16_forward_bound(q, k, v, n, 32);
              check_bf16_elements(
                  got.head(0, h), want, n * 32, [&](std::int64_t) { return bound; }, label);
              for (std::int64_t e = 0; e < n * 32; ++e)
                over_fp32 =
                    std::max(over_fp32, std::fabs(got.head(0, h)[e] - want[static_cast<std::size_t>(e)]) / fp32);
            }
            // Not fp32 in disguise: past a few keys, the bf16 rounding of P and O shows.
            if (n >= 15) CHECK_MESSAGE(over_fp32 > 1, label << ": the error never exceeds the fp32 bound");
          }
    });
  }

  TEST_CASE("bf16 gradients equal the float64 reference's within the bf16 bound, every path, causal and not") {
    for_each_bf16_path([](const std::string& path) {
      for (const Case& c : forward_cases())
        for (std::int64_t n : c.sizes)
          for (bool causal : {false, true}) {
            const Problem p = on_test_threads({.batch = 2, .heads = 1, .seq_len = n, .head_dim = 16, .causal = causal});
            const MaskFn mask = c.mask(causal);
            check_bf16_masked_gradients(
                c.model, p, c.params, static_cast<std::uint64_t>(n) + 11, [&mask](std::int64_t) { return mask; },
                c.model + " N=" + std::to_string(n) + (causal ? " causal " : " ") + path);
          }
    });
  }

  TEST_CASE("the bf16 decode, on its bf16 window ring, equals the bf16 causal forward") {
    // check_bf16_decode's bound (tests/support/bf16_check.hpp): the step rounds the forward tile's fp32
    // quantities (scores, exponent, P and O to bf16) in another summation order.
    struct DecodeCase {
      std::string model;
      std::vector<std::string> params;
      std::int64_t window;
    };
    for (const DecodeCase& c : std::vector<DecodeCase>{
             {"local", {"block=16"}, 16}, {"image-transformer", {"query_block=16", "memory_flange=8"}, 24}})
      for (std::int64_t context : {16, 17, 31, 33}) {  // ≥ the block, which is clamped to the context's N
        const std::int64_t state =
            check_bf16_decode(c.model, {.batch = 1, .heads = 3, .head_dim = 16}, context, 20, c.params);
        CHECK(state == 2 * 3 * c.window * 16 * 2);  // the key and value rings, bf16
      }
  }

  TEST_CASE("bf16 rows: FLOPs as fp32's, bytes halved where they should be, the workspace estimate exact") {
    struct RowCase {
      std::string model;
      std::vector<std::string> params;
    };
    for (const RowCase& c : std::vector<RowCase>{{"local", {}},
                                                 {"local", {"block=70"}},
                                                 {"image-transformer", {}},
                                                 {"image-transformer", {"query_block=16", "memory_flange=8"}}})
      for (std::int64_t n : {100, 257})
        for (bool causal : {false, true})
          for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
            if (pass == Pass::Decode && !causal) continue;
            const auto [a, b] = check_bf16_rows(c.model, n, causal, pass, c.params);
            if (pass == Pass::Backward || pass == Pass::Train) CHECK(b.saved_bytes == a.saved_bytes);  // fp32 L
            if (pass == Pass::Decode) {
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes == a.state_bytes);
            }
          }
  }

  TEST_CASE("a head dimension the bf16 tiles cannot take is an unsupported bf16 row, not fp32") {
    for (const std::string model : {"local", "image-transformer"}) check_bf16_head_dim_unsupported(model);
  }
}
