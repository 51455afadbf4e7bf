// adaptive-sparse in bf16 (storage only: taxonomy/sparse_models/adaptive_sparse.hpp), u = 2⁻⁸:
//   - the output against the double reference on the bf16 inputs (adaptive_sparse_reference.hpp)
//     within the fp32 form's tolerance plus the output's rounding, u·(|o| + tol);
//   - the gradients (and the learned α's) the fp32 form's on the same values (the bf16 inputs and
//     dout) up to each gradient's rounding u·|g| and fp32 summation order 16·N·ε·max|g|: the backward
//     is the fp32 one on widened rows;
//   - decoding against the bf16 causal forward within one bf16 ulp of the output (P stays fp32).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "tests/models/sparse_models/adaptive_sparse_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

std::vector<std::string> params_of(double alpha, bool learn = false) {
  std::vector<std::string> params{"alpha=" + std::to_string(alpha), "block_q=16"};
  if (learn) params.push_back("learn_alpha=true");
  return params;
}

void check_forward(double alpha, const Problem& p) {
  const std::string label = "adaptive-sparse bf16 alpha=" + std::to_string(alpha) + " N=" + std::to_string(p.seq_len) +
                            (p.causal ? " causal" : "");
  const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(p.seq_len * 5 + p.causal));
  const Tensor got = run_bf16("adaptive-sparse", p, in.bf16, params_of(alpha));
  const std::vector<double> want = reference_model(named(in.widened), p, alpha);
  const std::int64_t per_head = p.seq_len * p.head_dim;
  for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
    const double tolerance = output_tolerance(in.widened, p, head, alpha) * (1 + kU);
    const std::vector<double> head_want(want.begin() + head * per_head, want.begin() + (head + 1) * per_head);
    check_bf16_elements(
        got.data() + head * per_head, head_want, per_head,
        [&](std::int64_t e) { return tolerance + kU * std::fabs(head_want[static_cast<std::size_t>(e)]); },
        label + " head " + std::to_string(head));
  }
}

}  // namespace

TEST_SUITE("adaptive_sparse_bf16") {
  TEST_CASE("adaptive-sparse bf16 against the double reference: sort and bisection, blocks ±1, causal and not") {
    for (double alpha : {1.5, 2.0, 1.2})
      for (std::int64_t n : {1, 15, 16, 17, 50})
        for (bool causal : {false, true})
          check_forward(alpha, {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal});
    check_forward(1.5, {.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 24, .causal = true});  // any D
  }

  TEST_CASE("adaptive-sparse bf16 backward: the fp32 form's gradients on the same values, rounded") {
    for (double alpha : {1.5, 1.2})
      for (std::int64_t n : {5, 16, 17, 40})
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          for (bool learn : {false, true}) {
            if (learn && alpha != 1.5) continue;
            check_bf16_storage_gradients(
                "adaptive-sparse", p, params_of(alpha, learn), static_cast<std::uint64_t>(n) + 1,
                "adaptive-sparse bf16 backward alpha=" + std::to_string(alpha) + (learn ? " learned" : "") +
                    " N=" + std::to_string(n) + (causal ? " causal" : ""));
          }
        }
  }

  TEST_CASE("adaptive-sparse bf16 decode equals its bf16 causal forward") {
    for (double alpha : {1.5, 2.0, 1.2})
      for (std::int64_t context : {1, 15, 16, 17})
        check_bf16_decode("adaptive-sparse", {.batch = 2, .heads = 2, .head_dim = 16}, context, 9, params_of(alpha),
                          false);
  }

  TEST_CASE("adaptive-sparse bf16 rows: FLOPs as fp32's, halved inputs and cache, estimates exact") {
    for (bool causal : {false, true})
      for (std::int64_t n : {100, 257})
        for (Pass pass : {Pass::Forward, Pass::Decode, Pass::Backward, Pass::Train}) {
          if (pass == Pass::Decode && !causal) continue;
          const auto [a, b] = check_bf16_rows("adaptive-sparse", n, causal, pass, {"block_q=64"});
          CHECK(b.saved_bytes == a.saved_bytes);  // the thresholds stay fp32
          if (pass == Pass::Decode) {
            CHECK(b.state_bytes > 0);
            CHECK(2 * b.state_bytes == a.state_bytes);
          }
        }
  }
}
