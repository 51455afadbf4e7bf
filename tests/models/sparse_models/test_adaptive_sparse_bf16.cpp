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

// |got − want| ≤ (rounded ? u·|want| : 0) + 16·N·ε·max|want| per element.
void check_close_to(const float* got, const float* want, std::int64_t count, std::int64_t n, bool rounded,
                    const std::string& label) {
  const double largest = max_abs_of(want, count);
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < count; ++e) {
    const double bound = (rounded ? kU * std::fabs(want[e]) : 0.0) + 16 * double(n) * kFloatEps * largest;
    if (!(std::fabs(got[e] - want[e]) <= bound) && failures++ < 3)
      FAIL_CHECK(label << " element " << e << ": got " << got[e] << ", want " << want[e] << " (bound " << bound << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " out of the bound");
}

void check_backward(double alpha, bool learn, const Problem& shape) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const std::string label = "adaptive-sparse bf16 backward alpha=" + std::to_string(alpha) + (learn ? " learned" : "") +
                            " N=" + std::to_string(n) + (p.causal ? " causal" : "");
  const auto params = params_of(alpha, learn);
  const Bf16GradientRun run = run_bf16_gradients("adaptive-sparse", p, params, static_cast<std::uint64_t>(n) + 1);
  const ModelInfo* info = find_model("adaptive-sparse");
  auto f32 = info->impl.create(p, resolve_params("adaptive-sparse", info->impl.params, params), 42);
  const AttentionInputs& in = run.in.widened;
  const auto bhnd = [&] { return Tensor::bhnd(p.batch, p.heads, n, d); };
  Tensor out = bhnd(), dq = bhnd(), dk = bhnd(), dv = bhnd();
  f32->prepare(in.q, in.k, in.v);
  f32->prepare_backward();
  f32->forward(in.q, in.k, in.v, out);
  check_close_to(run.out.data(), out.data(), out.size(), n, true, label + " out");
  f32->backward(in.q, in.k, in.v, out, run.dout_widened, dq, dk, dv);
  check_close_to(run.dq.data(), dq.data(), dq.size(), n, true, label + " dq");
  check_close_to(run.dk.data(), dk.data(), dk.size(), n, true, label + " dk");
  check_close_to(run.dv.data(), dv.data(), dv.size(), n, true, label + " dv");
  const auto want = f32->parameter_gradients(), got = run.mechanism->parameter_gradients();
  REQUIRE(want.size() == got.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    check_close_to(got[i].tensor->data(), want[i].tensor->data(), want[i].tensor->size(), n, false,
                   label + " " + want[i].name);
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
          check_backward(alpha, false, p);
          if (alpha == 1.5) check_backward(alpha, true, p);
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
