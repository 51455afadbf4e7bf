// routing in bf16 (taxonomy/learnable_patterns/routing.hpp: bf16 storage, fp32 computation on rows
// widened as read), u = 2⁻⁸:
//   - the pattern the bf16 model exposed is the routing of the bf16 inputs (routing_reference.hpp:
//     top-w or nearest centroids by the double cosine affinities of the widened inputs), and its
//     output is the double attention over that pattern within the fp32 tolerance·(1 + u) plus the
//     output's rounding u·|o|;
//   - the gradients (and the updated centroids) the fp32 form's on the same values up to each
//     gradient's rounding (check_bf16_storage_gradients): the backward is the fp32 one on widened rows;
//   - decoding against the bf16 causal forward within one bf16 ulp of the output (P stays fp32);
//   - FLOPs as fp32's, inputs, outputs and decode rings at half the bytes, estimates exact.
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "tests/models/learnable_patterns/routing_reference.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  std::string label =
      "routing bf16 N=" + std::to_string(p.seq_len) + " D=" + std::to_string(p.head_dim) + (p.causal ? " causal" : "");
  for (const auto& param : params) label += " " + param;
  const Bf16Inputs in = bf16_inputs(p, static_cast<std::uint64_t>(p.seq_len * 3 + 1));
  auto mechanism = bf16_mechanism("routing", p, params);
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  const auto* model = dynamic_cast<const RoutingAttention*>(mechanism.get());
  REQUIRE(model != nullptr);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const AttentionInputs& x = in.widened;
      check_routing_pattern(*model, p, x, b, h);
      const auto lists = routing_key_lists(*model, p, b, h);
      const std::vector<double> want =
          list_attention(widened(x.q.head(b, h), n * d), widened(x.k.head(b, h), n * d), widened(x.v.head(b, h), n * d),
                         n, d, [&](std::int64_t i) { return lists[i]; });
      const double tolerance =
          attention_tolerance(x.q.head(b, h), x.k.head(b, h), x.v.head(b, h), n, n, d, scale) * (1 + kU);
      check_bf16_elements(
          got.head(b, h), want, n * d,
          [&](std::int64_t e) { return tolerance + kU * std::fabs(want[static_cast<std::size_t>(e)]); },
          label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

}  // namespace

TEST_SUITE("routing_bf16") {
  TEST_CASE("routing bf16 against its double cluster attention: balanced and causal, local heads, at w ± 1") {
    for (bool causal : {false, true}) {
      // clusters=4: w = 3, 4, 4, 4, 5 (a short last block, exact, one over).
      for (std::int64_t n : {11, 12, 13, 16, 17})
        check_forward({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal}, {"clusters=4"});
      check_forward({.batch = 2, .heads = 2, .seq_len = 40, .head_dim = 32, .causal = causal}, {});
      check_forward({.batch = 1, .heads = 4, .seq_len = 90, .head_dim = 16, .causal = causal},
                    {"clusters=5", "local_heads=true"});
      check_forward({.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 12, .causal = causal},  // affinity blocks
                    {"clusters=3"});
      check_forward({.batch = 1, .heads = 2, .seq_len = 1, .head_dim = 24, .causal = causal}, {});
    }
  }

  TEST_CASE("routing bf16 backward: the fp32 form's gradients and centroid update on the same values, rounded") {
    for (bool causal : {false, true})
      for (const auto& [n, params] : {std::pair<std::int64_t, std::vector<std::string>>{11, {"clusters=4"}},
                                      {13, {"clusters=4", "local_heads=true"}},
                                      {40, {"clusters=5", "local_heads=true"}},
                                      {300, {"clusters=3"}}}) {
        std::string label = "routing bf16 backward N=" + std::to_string(n) + (causal ? " causal" : "");
        for (const auto& param : params) label += " " + param;
        check_bf16_storage_gradients("routing", {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal},
                                     params, static_cast<std::uint64_t>(n) + 7, label);
      }
  }

  TEST_CASE("routing bf16 decode equals its bf16 causal forward (same clusters and window)") {
    // ⌈N/C⌉ = ⌈(N + T)/C⌉ and unfitted centroids: the context's model is the whole forward's.
    check_bf16_decode("routing", {.batch = 2, .heads = 2, .head_dim = 16}, 13, 3, {"clusters=4", "kmeans_updates=0"},
                      false);
    check_bf16_decode("routing", {.batch = 1, .heads = 4, .head_dim = 16}, 10, 2,
                      {"clusters=3", "kmeans_updates=0", "local_heads=true"}, false);
    check_bf16_decode("routing", {.batch = 1, .heads = 2, .head_dim = 24}, 61, 3, {"clusters=8", "kmeans_updates=0"},
                      false);
  }

  TEST_CASE("routing bf16 rows: FLOPs as fp32's, halved inputs and rings, estimates exact") {
    for (bool causal : {false, true})
      for (std::int64_t n : {100, 257, 300})
        for (Pass pass : {Pass::Forward, Pass::Decode, Pass::Backward, Pass::Train}) {
          if (pass == Pass::Decode && !causal) continue;
          for (const std::vector<std::string>& params :
               {std::vector<std::string>{}, std::vector<std::string>{"local_heads=true"}}) {
            const auto [a, b] = check_bf16_rows("routing", n, causal, pass, params);
            if (pass == Pass::Decode) {  // the rings halve; the counts [routed heads, C] stay int32
              const Problem& shape = bf16_point("routing", n, causal, pass, params).problem;
              const std::int64_t routed = shape.batch * (shape.heads - (params.empty() ? 0 : shape.heads / 2));
              const std::int64_t counts = 4 * routed * routing_clusters(shape, RoutingConfig{});
              CHECK(b.state_bytes > counts);
              CHECK(2 * (b.state_bytes - counts) == a.state_bytes - counts);
            }
            if (pass == Pass::Backward || pass == Pass::Train) {
              // Causal: the key-sorted K, V copies are bf16; L and the pattern stay 4-byte.
              if (causal)
                CHECK(b.saved_bytes < a.saved_bytes);
              else
                CHECK(b.saved_bytes == a.saved_bytes);
            }
          }
        }
  }
}
