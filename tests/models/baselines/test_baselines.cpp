// The exact baselines (vanilla, exact-tiled) against the naive reference, causal and not, at and
// around their blocks; overflow-safe rows, future-token invariance and their memory scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/tile_kernels.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

TEST_SUITE("baselines") {
  TEST_CASE("vanilla and exact-tiled equal naive attention, causal and not, at and around block sizes") {
    // exact-tiled defaults: block_q 64, block_k 1024 (forward strips of 32 rows on the tile kernels).
    for (std::int64_t n : {1, 7, 31, 33, 63, 64, 65, 129, 255, 256, 257, 511, 512, 513, 1000, 1023, 1024, 1025})
      for (bool causal : {false, true})
        for (const char* model : {"vanilla", "exact-tiled"}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          const auto in = random_inputs(p, static_cast<std::uint64_t>(n));
          const Tensor out = run_mechanism(model, p, in);
          check_against_reference(out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                  std::string(model) + " N=" + std::to_string(n) + (causal ? " causal" : ""));
        }
  }

  TEST_CASE("exact-tiled forward and gradients with small uneven blocks, block ± 1 and non-multiples") {
    struct Case {
      std::int64_t head_dim;
      const char* block_q;
      const char* backward_block_k;
      std::vector<std::int64_t> lengths;
    };
    // D = 8 runs oneDNN sgemm tiles with block_k 24 and backward_block_k 17 exactly; D = 16 runs the
    // tile kernels, where block_k 24 becomes 32 (two 16-key panels) and backward_block_k 16 stays.
    for (const Case& c : {Case{8, "block_q=16", "backward_block_k=17", {15, 16, 17, 18, 23, 24, 25, 100}},
                          Case{16, "block_q=7", "backward_block_k=16", {6, 7, 8, 15, 16, 17, 31, 32, 33, 100}}})
      for (std::int64_t n : c.lengths)
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = c.head_dim, .causal = causal};
          const auto in = random_inputs(p, 3);
          const Tensor out = run_mechanism("exact-tiled", p, in, {c.block_q, "block_k=24", c.backward_block_k});
          check_against_reference(
              out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
              std::string("exact-tiled ") + c.block_q + " D=" + std::to_string(c.head_dim) + " N=" + std::to_string(n));
          check_model_gradients("exact-tiled", p, same_for_every_head(causal ? MaskFn(causal_mask) : MaskFn(full_mask)),
                                {c.block_q, "block_k=24", c.backward_block_k});
        }
  }

  TEST_CASE("rows whose scores would overflow a naive exp stay finite and exact") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16, .causal = false};
    for (bool causal : {false, true})
      for (const char* model : {"vanilla", "exact-tiled"}) {
        Problem problem = p;
        problem.causal = causal;
        auto in = random_inputs(problem, 11);
        for (std::int64_t i = 0; i < problem.seq_len; i += 7)  // scores reach ~±400: exp overflows float
          for (std::int64_t c = 0; c < problem.head_dim; ++c) in.q.head(0, 1)[i * problem.head_dim + c] *= 100.0f;
        const Tensor out = run_mechanism(model, problem, in);
        for (float value : out.values()) REQUIRE(std::isfinite(value));
        check_against_reference(out, in, problem, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                std::string(model) + " overflow rows");
      }
  }

  TEST_CASE("causal: changing future tokens changes no earlier output") {
    for (const char* model : {"vanilla", "exact-tiled"}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 333, .head_dim = 16, .causal = true};
      auto in = random_inputs(p, 5);
      const Tensor before = run_mechanism(model, p, in);
      const std::int64_t cut = 200;
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t e = cut * 16; e < p.seq_len * 16; ++e) {
          in.k.head(0, h)[e] += 3.0f;
          in.v.head(0, h)[e] -= 5.0f;
          in.q.head(0, h)[e] *= -1.0f;
        }
      const Tensor after = run_mechanism(model, p, in);
      for (std::int64_t h = 0; h < 2; ++h) {
        CHECK(std::memcmp(before.head(0, h), after.head(0, h), cut * 16 * sizeof(float)) == 0);
        CHECK(std::memcmp(before.head(0, h) + cut * 16, after.head(0, h) + cut * 16, 16 * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("tracked peak memory: vanilla grows with N², exact-tiled with N") {
    DnnlContext::instance().clear_cache();
    auto workspace = [](const char* model, std::int64_t n) {
      return static_cast<double>(run_point(quick_point(model, n, false)).workspace_bytes);
    };
    auto peak = [](const char* model, std::int64_t n) {
      return static_cast<double>(run_point(quick_point(model, n, false)).peak_tensor_bytes);
    };
    const double vanilla_ratio = workspace("vanilla", 2048) / workspace("vanilla", 1024);
    CHECK(vanilla_ratio > 3.8);
    CHECK(vanilla_ratio < 4.2);
    // exact-tiled: workspace = per-thread tiles + the packed copy of K (B·H·N·D floats, here
    // 1·2·N·32), and the peak exactly linear in N.
    CHECK(workspace("exact-tiled", 4096) - workspace("exact-tiled", 1024) == 2.0 * 3072 * 32 * sizeof(float));
    const double p1 = peak("exact-tiled", 1024), p2 = peak("exact-tiled", 2048), p4 = peak("exact-tiled", 4096);
    CHECK(p4 - p2 == 2 * (p2 - p1));
    CHECK(peak("exact-tiled", 4096) < 0.1 * peak("vanilla", 4096));
  }
}
