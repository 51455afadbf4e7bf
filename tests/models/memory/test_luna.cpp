// Luna (pack into l rows of a learned P, unpack over them) against naive double-precision
// references of both forms, its gradients against central differences, its causality and
// incremental decoding, and its O(N·l) FLOP and memory scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/memory_tracker.hpp"
#include "taxonomy/registry.hpp"
#include "tests/models/memory/luna_reference.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

void check_forward(const Problem& p, const std::vector<std::string>& params, const std::string& label) {
  const ModelInfo* info = find_model("luna");
  REQUIRE(info != nullptr);
  const std::int64_t l = resolved_rows(p, params), n = p.seq_len, d = p.head_dim;
  const auto in = random_inputs(p, static_cast<std::uint64_t>(n + 7 * l));
  auto mechanism = info->impl.create(on_test_threads(p), resolve_params("luna", info->impl.params, params), 42);
  mechanism->prepare(in.q, in.k, in.v);
  Tensor out = Tensor::bhnd(p.batch, p.heads, n, d);
  out.fill(std::nanf(""));
  mechanism->forward(in.q, in.k, in.v, out);
  const NamedValues named = named_inputs(in, *mechanism);
  REQUIRE(named.at("projected_sequence").size() == static_cast<std::size_t>(p.heads * l * d));
  std::vector<ErrorScale> scales;
  const Matrix want = luna_reference(named, p, l, &scales);
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const std::vector<double> head(want.begin() + bh * n * d, want.begin() + (bh + 1) * n * d);
    check_head(out.data() + bh * n * d, head, n, d, tolerance_of(scales[static_cast<std::size_t>(bh)], p, l),
               label + " bh=" + std::to_string(bh));
  }
}

std::string sizes(std::int64_t n, const std::vector<std::string>& params, bool causal) {
  std::string text = (causal ? "causal N=" : "N=") + std::to_string(n);
  for (const auto& param : params) text += " " + param;
  return text;
}

// Prefill of N context tokens and T single-token steps against the causal forward over N + T (the
// model resolved for the context), within twice the causal tolerance of the whole problem.
void check_decode(std::int64_t n, std::int64_t tokens, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("luna");
  REQUIRE(info != nullptr);
  const Problem context = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true});
  Problem whole_problem = context;
  whole_problem.seq_len = n + tokens;
  const ParamValues values = info->impl.resolved(context, resolve_params("luna", info->impl.params, params));
  const AttentionInputs whole = random_inputs(whole_problem, 5);
  auto reference = info->impl.create(whole_problem, values, 42);
  reference->prepare(whole.q, whole.k, whole.v);
  Tensor want = Tensor::bhnd(2, 2, whole_problem.seq_len, 16);
  reference->forward(whole.q, whole.k, whole.v, want);
  std::vector<ErrorScale> scales;
  luna_reference(named_inputs(whole, *reference), whole_problem, values.get_int("projected_length"), &scales);
  double tolerance = 0;
  for (const auto& e : scales)
    tolerance = std::max(tolerance, 2 * tolerance_of(e, whole_problem, values.get_int("projected_length")));

  const auto mechanism = check_decode_steps(*info, context, values, whole, want, tokens, tolerance);
  CHECK(mechanism->state_bytes() == 2 * 4 * values.get_int("projected_length") * 16 * 4 + 8);
}

PointConfig luna_point(std::int64_t n, bool causal, std::vector<std::string> params = {}) {
  return counter_point("luna", {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                       std::move(params));
}

}  // namespace

TEST_SUITE("luna") {
  TEST_CASE("luna: the non-causal form equals the double reference around l and the query block") {
    // Defaults l = 16, chunk = 256: N below, at and above both (N < l uses the first N rows of P).
    for (std::int64_t n : {1, 2, 15, 16, 17, 255, 256, 257, 600})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false}, {}, sizes(n, {}, false));
    for (std::int64_t n : {4, 5, 6, 7, 8, 9, 23}) {
      const std::vector<std::string> params{"projected_length=5", "chunk=8"};
      check_forward({.batch = 2, .heads = 3, .seq_len = n, .head_dim = 8, .causal = false}, params,
                    sizes(n, params, false));
    }
  }

  TEST_CASE("luna: the causal form equals its definition around l and the chunk") {
    for (std::int64_t n : {1, 2, 15, 16, 17, 255, 256, 257, 420})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true}, {}, sizes(n, {}, true));
    for (std::int64_t n : {3, 5, 7, 8, 9, 16, 17, 23}) {
      const std::vector<std::string> params{"projected_length=6", "chunk=8"};
      check_forward({.batch = 2, .heads = 3, .seq_len = n, .head_dim = 8, .causal = true}, params,
                    sizes(n, params, true));
    }
    const std::vector<std::string> wide{"projected_length=128", "chunk=32"};
    check_forward({.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 16, .causal = true}, wide, sizes(70, wide, true));
  }

  TEST_CASE("luna gradients of q, k, v and P against central differences, both forms") {
    for (const bool causal : {false, true})
      for (const auto& [n, params] :
           {std::pair<std::int64_t, std::vector<std::string>>{5, {"projected_length=3", "chunk=2"}},
            {9, {"projected_length=16", "chunk=4"}},
            {8, {"projected_length=4", "chunk=8"}},
            {40, {"projected_length=5", "chunk=16"}}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
        const std::int64_t l = resolved_rows(p, params);
        check_composite_gradients(
            "luna", p, params, [&](const NamedValues& x) { return luna_reference(x, p, l); }, n <= 9);
      }
  }

  TEST_CASE("luna causal: changing a token changes no earlier output") {
    const Problem p{.batch = 2, .heads = 2, .seq_len = 50, .head_dim = 8, .causal = true};
    const std::vector<std::string> params{"projected_length=6", "chunk=16"};
    for (std::int64_t changed : {0, 15, 16, 31, 49}) {
      auto in = random_inputs(p, 3);
      const Tensor before = run_mechanism("luna", p, in, params);
      for (std::int64_t bh = 0; bh < 4; ++bh)
        for (std::int64_t f = 0; f < 8; ++f) {
          in.q.data()[(bh * 50 + changed) * 8 + f] += 1.5f;
          in.k.data()[(bh * 50 + changed) * 8 + f] -= 0.75f;
          in.v.data()[(bh * 50 + changed) * 8 + f] += 2.0f;
        }
      const Tensor after = run_mechanism("luna", p, in, params);
      for (std::int64_t bh = 0; bh < 4; ++bh) {
        CHECK(std::memcmp(before.data() + bh * 400, after.data() + bh * 400,
                          static_cast<std::size_t>(changed * 8) * sizeof(float)) == 0);
        CHECK(std::memcmp(before.data() + bh * 400 + changed * 8, after.data() + bh * 400 + changed * 8,
                          8 * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("luna: not causal, every output depends on the last token") {
    const Problem p{.batch = 1, .heads = 1, .seq_len = 40, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 2);
    const Tensor before = run_mechanism("luna", p, in);
    for (std::int64_t f = 0; f < 8; ++f) in.v.data()[39 * 8 + f] += 1.0f;
    const Tensor after = run_mechanism("luna", p, in);
    for (std::int64_t i = 0; i < 39; ++i)
      CHECK_MESSAGE(std::memcmp(before.data() + i * 8, after.data() + i * 8, 8 * sizeof(float)) != 0, "row " << i);
  }

  TEST_CASE("luna decodes: prefill + steps equal the causal forward, at contexts around l and the chunk") {
    for (std::int64_t n : {1, 4, 5, 6, 7, 8, 9, 20}) check_decode(n, 19, {"projected_length=5", "chunk=8"});
    for (std::int64_t n : {15, 16, 17}) check_decode(n, 12, {});
    check_decode(3, 30, {"projected_length=40", "chunk=2"});
  }

  TEST_CASE("luna: executed FLOPs equal the analytic count at non-default settings, forward and backward") {
    const ModelInfo* info = find_model("luna");
    REQUIRE(info != nullptr);
    for (const bool causal : {false, true})
      for (std::int64_t n : {1, 37, 300}) {
        const std::vector<std::string> params{"projected_length=7", "chunk=16"};
        PointConfig config = luna_point(n, causal, params);
        const ParamValues values = resolve_params("luna", info->impl.params, params);
        CHECK(run_point(config).flops == info->impl.flops(config.problem, values));
        config.pass = Pass::Backward;
        CHECK(run_point(config).flops == info->impl.backward_flops(config.problem, values));
      }
  }

  TEST_CASE("luna: FLOPs and workspace grow linearly in N (O(N·l)), both forms") {
    for (const bool causal : {false, true}) {
      CAPTURE(causal);
      const auto small = run_point(luna_point(2048, causal));
      const auto large = run_point(luna_point(8192, causal));
      const double flop_ratio = static_cast<double>(large.flops) / static_cast<double>(small.flops);
      CHECK(flop_ratio > 3.99);
      CHECK(flop_ratio <= 4.0);
      const double memory_ratio =
          static_cast<double>(large.workspace_bytes) / static_cast<double>(small.workspace_bytes);
      CHECK(memory_ratio <= 4.01);
      // Far below vanilla's B·H·N² scores at the larger size.
      CHECK(large.workspace_bytes < 2 * 8192 * 8192 * 4 / 64);
    }
  }
}
