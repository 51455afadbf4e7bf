// synthesizer in bf16 (taxonomy/low_rank/synthesizer.hpp), u = 2⁻⁸: the output against the naive
// float64 formula on the bf16 inputs (tests/models/low_rank/synthesizer_reference.hpp) within the
// bound of softmax attention in bf16 (tests/support/bf16_check.hpp) with the logits' own fp32 error:
// 2u(1 + u)·max|v| (rounding P and O) + logits_tolerance (the logits carry fp32 rounding only: the
// bf16 products are exact in fp32, the synthetic logits come from fp32 parameters). Decoding
// against the bf16 causal forward (check_bf16_decode: P rounded as the forward rounds it).
#include <doctest/doctest.h>

#include <cmath>
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

  TEST_CASE("synthesizer bf16 rows: FLOPs as fp32's, halved inputs and caches, estimates exact; no bf16 backward") {
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
    for (Pass pass : {Pass::Backward, Pass::Train}) {
      const ResultRow row = run_point(bf16_point("synthesizer", 100, false, pass));
      CHECK(row.status == Status::Unsupported);
      CHECK(row.reason.find("no bf16 backward") != std::string::npos);
    }
  }
}
