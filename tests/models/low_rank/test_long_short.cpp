// The Long-Short Transformer (dynamic projection + segment window in one softmax, DualLN) against a
// naive double-precision reference of its formula in both forms, its gradients against central
// differences, its causality and incremental decoding, and its FLOP and memory scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/memory_tracker.hpp"
#include "taxonomy/registry.hpp"
#include "tests/models/low_rank/long_short_reference.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;
using namespace xfb::test::long_short;

namespace {

std::string label_of(const Problem& p, const std::vector<std::string>& params) {
  std::string text = (p.causal ? "causal N=" : "N=") + std::to_string(p.seq_len);
  for (const auto& param : params) text += " " + param;
  return text;
}

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  const Settings s = settings_of(p, params);
  const std::string label = label_of(p, params);
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len + 11));
  const MechanismRun run = run_keeping("long-short", p, in, params);
  const NamedValues named = named_inputs(in, *run.mechanism);
  REQUIRE(named.at("projection").size() == static_cast<std::size_t>(p.heads * p.head_dim * s.rank));
  std::vector<ErrorScale> scales;
  const Matrix want = reference(named, p, s, &scales);
  const std::int64_t nd = p.seq_len * p.head_dim;
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const std::vector<double> head(want.begin() + bh * nd, want.begin() + (bh + 1) * nd);
    check_head(run.out.data() + bh * nd, head, p.seq_len, p.head_dim,
               tolerance_of(scales[static_cast<std::size_t>(bh)], p, s), label + " bh=" + std::to_string(bh));
  }
}

// Prefill of N context tokens and T single-token steps against the causal forward over N + T.
void check_decode(std::int64_t n, std::int64_t tokens, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("long-short");
  REQUIRE(info != nullptr);
  const Problem context = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true});
  Problem whole_problem = context;
  whole_problem.seq_len = n + tokens;
  const ParamValues values = info->impl.resolved(context, resolve_params("long-short", info->impl.params, params));
  const AttentionInputs whole = random_inputs(whole_problem, 5);
  auto reference_model = info->impl.create(whole_problem, values, 42);
  reference_model->prepare(whole.q, whole.k, whole.v);
  Tensor want = Tensor::bhnd(2, 2, whole_problem.seq_len, 16);
  reference_model->forward(whole.q, whole.k, whole.v, want);
  std::vector<ErrorScale> scales;
  const Settings s = settings_of(whole_problem, params);
  reference(named_inputs(whole, *reference_model), whole_problem, s, &scales);
  double tolerance = 0;
  for (const auto& e : scales) tolerance = std::max(tolerance, 2 * tolerance_of(e, whole_problem, s));

  check_decode_steps(*info, context, values, whole, want, tokens, tolerance);
}

PointConfig point(std::int64_t n, bool causal, std::vector<std::string> params = {}) {
  return counter_point("long-short", {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                       std::move(params));
}

}  // namespace

TEST_SUITE("long_short") {
  TEST_CASE("long-short: the non-causal form equals the double reference around the segment") {
    // Defaults w = 8, r = 32: N below, at and above w and its multiples, and non-multiples.
    for (std::int64_t n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 40, 100, 300})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false}, {});
    for (std::int64_t n : {3, 4, 5, 6, 9, 10, 11, 23}) {
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false}, {"segment=5", "rank=3"});
    }
    for (const char* segment : {"segment=1", "segment=2", "segment=3"})
      check_forward({.batch = 1, .heads = 2, .seq_len = 13, .head_dim = 8, .causal = false}, {segment, "rank=2"});
  }

  TEST_CASE("long-short: the causal form equals its definition around the chunk and the window") {
    for (std::int64_t n : {1, 15, 16, 17, 33, 300})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true}, {});
    const std::vector<std::string> small{"window=5", "chunk=4", "chunk_rank=2"};
    for (std::int64_t n : {1, 3, 4, 5, 6, 7, 8, 9, 13, 23})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = true}, small);
    check_forward({.batch = 1, .heads = 2, .seq_len = 12, .head_dim = 8, .causal = true},
                  {"window=1", "chunk=1", "chunk_rank=1"});
    check_forward({.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 8, .causal = true},
                  {"window=3", "chunk=7", "chunk_rank=3"});
    check_forward({.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 16, .causal = true},
                  {"window=32", "chunk=16", "chunk_rank=4"});
    // A chunk longer than N: no chunk completes, the window alone.
    check_forward({.batch = 1, .heads = 2, .seq_len = 20, .head_dim = 8, .causal = true},
                  {"window=8", "chunk=64", "chunk_rank=2"});
  }

  TEST_CASE("long-short gradients of q, k, v, W_P and the DualLN gains and shifts, both forms") {
    for (const auto& [n, causal, params] :
         {std::tuple<std::int64_t, bool, std::vector<std::string>>{5, false, {"segment=2", "rank=2"}},
          {9, false, {"segment=4", "rank=3"}},
          {40, false, {"segment=8", "rank=4"}},
          {7, true, {"window=3", "chunk=2", "chunk_rank=2"}},
          {9, true, {"window=4", "chunk=4", "chunk_rank=1"}},
          {40, true, {"window=6", "chunk=5", "chunk_rank=2"}}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
      const Settings s = settings_of(p, params);
      check_composite_gradients(
          "long-short", p, params, [&](const NamedValues& x) { return reference(x, p, s); }, n <= 9);
    }
  }

  TEST_CASE("long-short causal: changing a token changes no earlier output") {
    const Problem p{.batch = 2, .heads = 2, .seq_len = 50, .head_dim = 8, .causal = true};
    const std::vector<std::string> params{"window=6", "chunk=8", "chunk_rank=2"};
    for (std::int64_t changed : {0, 7, 8, 15, 16, 49}) {
      auto in = random_inputs(p, 3);
      const Tensor before = run_mechanism("long-short", p, in, params);
      for (std::int64_t bh = 0; bh < 4; ++bh)
        for (std::int64_t f = 0; f < 8; ++f) {
          in.q.data()[(bh * 50 + changed) * 8 + f] += 1.5f;
          in.k.data()[(bh * 50 + changed) * 8 + f] -= 0.25f * static_cast<float>(f + 1);
          in.v.data()[(bh * 50 + changed) * 8 + f] += f % 2 == 0 ? 2.0f : -1.0f;
        }
      const Tensor after = run_mechanism("long-short", p, in, params);
      for (std::int64_t bh = 0; bh < 4; ++bh) {
        CHECK(std::memcmp(before.data() + bh * 400, after.data() + bh * 400,
                          static_cast<std::size_t>(changed * 8) * sizeof(float)) == 0);
        CHECK(std::memcmp(before.data() + bh * 400 + changed * 8, after.data() + bh * 400 + changed * 8,
                          8 * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("long-short: not causal, every output depends on the last token (through the projection)") {
    const Problem p{.batch = 1, .heads = 1, .seq_len = 40, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 2);
    const Tensor before = run_mechanism("long-short", p, in);
    // Not a uniform shift of the row: the LayerNorms of V and of the compressed V̄ remove those.
    for (std::int64_t f = 0; f < 8; ++f) in.v.data()[39 * 8 + f] += f % 2 == 0 ? 1.0f : -0.5f * static_cast<float>(f);
    const Tensor after = run_mechanism("long-short", p, in);
    for (std::int64_t i = 0; i < 39; ++i)
      CHECK_MESSAGE(std::memcmp(before.data() + i * 8, after.data() + i * 8, 8 * sizeof(float)) != 0, "row " << i);
  }

  TEST_CASE("long-short decodes: prefill + steps equal the causal forward, contexts around the chunk and window") {
    const std::vector<std::string> small{"window=5", "chunk=4", "chunk_rank=2"};
    for (std::int64_t n : {1, 3, 4, 5, 6, 7, 8, 9}) check_decode(n, 13, small);
    for (std::int64_t n : {15, 16, 17}) check_decode(n, 20, {});
    check_decode(2, 9, {"window=1", "chunk=1", "chunk_rank=3"});
    // Compressed rows one below, at and above 128, where a step attends to them as one block.
    for (std::int64_t n : {126, 129}) check_decode(n, 4, {"window=4", "chunk=1"});
  }

  TEST_CASE("long-short: executed FLOPs equal the analytic count at non-default settings, forward and backward") {
    const ModelInfo* info = find_model("long-short");
    REQUIRE(info != nullptr);
    for (const bool causal : {false, true})
      for (std::int64_t n : {1, 37, 300}) {
        const std::vector<std::string> params{"segment=6", "rank=5", "window=7", "chunk=6", "chunk_rank=2"};
        PointConfig config = point(n, causal, params);
        const ParamValues values =
            info->impl.resolved(config.problem, resolve_params("long-short", info->impl.params, params));
        CHECK(run_point(config).flops == info->impl.flops(config.problem, values));
        config.pass = Pass::Backward;
        CHECK(run_point(config).flops == info->impl.backward_flops(config.problem, values));
      }
  }

  TEST_CASE("long-short: non-causal FLOPs and workspace grow linearly in N; causal memory too") {
    const auto small = run_point(point(2048, false));
    const auto large = run_point(point(8192, false));
    const double flop_ratio = static_cast<double>(large.flops) / static_cast<double>(small.flops);
    CHECK(flop_ratio > 3.95);
    CHECK(flop_ratio <= 4.0);
    CHECK(static_cast<double>(large.workspace_bytes) / static_cast<double>(small.workspace_bytes) <= 4.01);
    CHECK(large.workspace_bytes < 2 * 8192 * 8192 * 4 / 64);
    // Causal: the compressed memory grows as N/l·r rows, so FLOPs are N·(N·r/l + w)·D (superlinear
    // with a 1/(2l) slope at the defaults) and memory stays linear.
    const auto causal_small = run_point(point(2048, true));
    const auto causal_large = run_point(point(8192, true));
    CHECK(static_cast<double>(causal_large.workspace_bytes) / static_cast<double>(causal_small.workspace_bytes) <=
          4.01);
    CHECK(static_cast<double>(causal_large.flops) / static_cast<double>(causal_small.flops) < 6.0);
  }
}
