// local, image-transformer, sparse-transformer and axial against dense naive attention restricted
// to each model's pattern (masks written here from the papers, independently of the mechanisms),
// future-token invariance of the causal forms, and the scaling of their FLOP and memory counters.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <tuple>

#include "apps/bench/point.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/factorised_reference.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

std::int64_t naive_ceil_sqrt(std::int64_t n) {
  std::int64_t root = 1;
  while (root * root < n) ++root;
  return root;
}

std::string describe(const std::string& model, const Problem& p, const std::vector<std::string>& params) {
  std::ostringstream text;
  text << model << " N=" << p.seq_len << (p.causal ? " causal" : "");
  for (const auto& param : params) text << " " << param;
  return text.str();
}

// Every element of one head within `tolerance` of `want`; reports the first few misses.
void check_head(const float* got, const std::vector<double>& want, std::int64_t n, std::int64_t d, double tolerance,
                const std::string& label) {
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < n * d; ++e) {
    const double error = std::fabs(static_cast<double>(got[e]) - want[static_cast<std::size_t>(e)]);
    if (!(error <= tolerance) && failures++ < 3)
      FAIL_CHECK(label << ": token " << e / d << " feature " << e % d << ": got " << got[e] << ", want "
                       << want[static_cast<std::size_t>(e)] << " (tolerance " << tolerance << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
}

void check_pattern(const std::string& model, const Problem& p, const std::vector<std::string>& params,
                   const HeadMask& allowed, std::uint64_t seed = 7) {
  const auto in = random_inputs(p, seed);
  const Tensor out = run_mechanism(model, p, in, params);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto want = reference_attention(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale,
                                            [&](std::int64_t i, std::int64_t j) { return allowed(h, i, j); });
      const double tolerance = attention_tolerance(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale);
      check_head(out.head(b, h), want, n, d, tolerance,
                 describe(model, p, params) + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

HeadMask local_mask(std::int64_t block, bool causal) {
  return [=](std::int64_t, std::int64_t i, std::int64_t j) { return i / block == j / block && (!causal || j <= i); };
}

HeadMask image_mask(std::int64_t query_block, std::int64_t flange, bool causal) {
  return [=](std::int64_t, std::int64_t i, std::int64_t j) {
    const std::int64_t start = i / query_block * query_block;
    return j >= start - flange && j < start + query_block && (!causal || j <= i);
  };
}

void check_axial(const Problem& p, const std::vector<std::string>& params, std::int64_t cols) {
  const auto in = random_inputs(p, 9);
  const Tensor out = run_mechanism("axial", p, in, params);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto want = axial_reference(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, d, cols, p.causal);
      // Two softmax stages in fp32; the row outputs are bounded by max|v|, so each stage's error
      // is within one single-stage tolerance.
      const double tolerance =
          2 * attention_tolerance(in.q.head(b, h), in.k.head(b, h), in.v.head(b, h), n, n, d, scale);
      check_head(out.head(b, h), want, n, d, tolerance,
                 describe("axial", p, params) + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

// Perturbs q, k, v of every token ≥ cut and checks that outputs before cut are bit-identical.
void check_future_invariance(const std::string& model, const std::vector<std::string>& params, std::int64_t n,
                             std::int64_t cut) {
  const Problem p{.batch = 1, .heads = 3, .seq_len = n, .head_dim = 16, .causal = true};
  auto in = random_inputs(p, 5);
  const Tensor before = run_mechanism(model, p, in, params);
  for (std::int64_t h = 0; h < p.heads; ++h)
    for (std::int64_t e = cut * p.head_dim; e < n * p.head_dim; ++e) {
      in.k.head(0, h)[e] += 3.0f;
      in.v.head(0, h)[e] -= 5.0f;
      in.q.head(0, h)[e] *= -1.0f;
    }
  const Tensor after = run_mechanism(model, p, in, params);
  const std::size_t prefix = static_cast<std::size_t>(cut * p.head_dim) * sizeof(float);
  CAPTURE(describe(model, p, params));
  for (std::int64_t h = 0; h < p.heads; ++h) {
    CHECK(std::memcmp(before.head(0, h), after.head(0, h), prefix) == 0);
    CHECK(std::memcmp(before.head(0, h), after.head(0, h), static_cast<std::size_t>(n * p.head_dim) * sizeof(float)) !=
          0);
  }
}

PointConfig counter_point(const std::string& model, std::int64_t n, std::vector<std::string> params = {}) {
  return test::counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = false},
                             std::move(params));
}

}  // namespace

TEST_SUITE("local_factorised") {
  TEST_CASE("a head-split pattern on one head is an unsupported row, not half the mechanism") {
    const auto row_of = [](const std::string& model, std::int64_t heads, std::vector<std::string> params, Pass pass) {
      PointConfig config;
      config.model = model;
      config.pass = pass;
      config.params = std::move(params);
      config.problem = {.batch = 1, .heads = heads, .seq_len = 64, .head_dim = 16, .causal = pass == Pass::Decode};
      return describe_point(config);
    };
    for (const Pass pass : {Pass::Forward, Pass::Train, Pass::Decode}) {
      CAPTURE(pass_name(pass));
      const ResultRow sparse = row_of("sparse-transformer", 1, {}, pass);
      CHECK(sparse.status == Status::Unsupported);
      CHECK(sparse.reason.find("only A1 would run") != std::string::npos);
      const ResultRow split = row_of("memory-compressed", 1, {}, pass);
      CHECK(split.status == Status::Unsupported);
      CHECK(split.reason.find("only local attention would run") != std::string::npos);
      CHECK(row_of("sparse-transformer", 2, {}, pass).status == Status::Ok);
      CHECK(row_of("memory-compressed", 2, {}, pass).status == Status::Ok);
      for (const char* mode : {"mode=local", "mode=compressed"})
        CHECK(row_of("memory-compressed", 1, {mode}, pass).status == Status::Ok);
    }
  }

  TEST_CASE("local equals block-local naive attention at, below and above the block and the 64-row tile") {
    struct Case {
      std::vector<std::string> params;
      std::int64_t block;
      std::vector<std::int64_t> sizes;
    };
    const std::vector<Case> cases = {
        {{}, 50, {1, 49, 50, 51, 99, 100, 101, 173}},
        {{"block=16"}, 16, {15, 16, 17, 63, 64, 65, 100}},
        {{"block=70"}, 70, {63, 64, 65, 69, 70, 71, 150}},
    };
    for (const auto& c : cases)
      for (std::int64_t n : c.sizes)
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          check_pattern("local", p, c.params, local_mask(c.block, causal));
        }
  }

  TEST_CASE("local gradients against the masked reference: block and 64-row tile ± 1, causal and not, batch 2") {
    for (const auto& [params, block, sizes] :
         std::vector<std::tuple<std::vector<std::string>, std::int64_t, std::vector<std::int64_t>>>{
             {{}, 50, {1, 49, 50, 51, 101}},
             {{"block=16"}, 16, {15, 16, 17, 63, 64, 65}},
             {{"block=70"}, 70, {69, 70, 71}}})
      for (std::int64_t n : sizes)
        for (bool causal : {false, true})
          check_model_gradients("local", {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                                local_mask(block, causal), params);
  }

  TEST_CASE("image-transformer equals query-block + memory-flange naive attention") {
    struct Case {
      std::vector<std::string> params;
      std::int64_t query_block, flange;
      std::vector<std::int64_t> sizes;
    };
    const std::vector<Case> cases = {
        {{"query_block=16", "memory_flange=8"}, 16, 8, {1, 7, 8, 9, 15, 16, 17, 24, 25, 100}},
        {{"query_block=16", "memory_flange=40"}, 16, 40, {39, 40, 41, 100}},
        {{"query_block=16", "memory_flange=0"}, 16, 0, {15, 16, 17, 50}},
        {{"query_block=100", "memory_flange=30"}, 100, 30, {63, 64, 65, 99, 100, 101, 129, 250}},
        {{}, 256, 128, {127, 128, 129, 255, 256, 257, 383, 384, 385, 600}},
    };
    for (const auto& c : cases)
      for (std::int64_t n : c.sizes)
        for (bool causal : {false, true}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
          check_pattern("image-transformer", p, c.params, image_mask(c.query_block, c.flange, causal));
        }
  }

  TEST_CASE("image-transformer gradients against the masked reference") {
    for (const auto& [params, query_block, flange, sizes] :
         std::vector<std::tuple<std::vector<std::string>, std::int64_t, std::int64_t, std::vector<std::int64_t>>>{
             {{"query_block=16", "memory_flange=8"}, 16, 8, {1, 8, 15, 16, 17, 25, 100}},
             {{"query_block=100", "memory_flange=30"}, 100, 30, {63, 64, 65, 99, 100, 101, 250}}})
      for (std::int64_t n : sizes)
        for (bool causal : {false, true})
          check_model_gradients("image-transformer",
                                {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal},
                                image_mask(query_block, flange, causal), params);
  }

  TEST_CASE("sparse-transformer gradients, strided and fixed, both head groups, against the naive masks") {
    for (const auto& [params, fixed, stride, summary, sizes] :
         std::vector<std::tuple<std::vector<std::string>, bool, std::int64_t, std::int64_t, std::vector<std::int64_t>>>{
             {{"stride=8"}, false, 8, 0, {1, 7, 8, 9, 17, 65}},
             {{"stride=2"}, false, 2, 0, {129, 130}},
             {{"pattern=fixed", "stride=8", "summary=2"}, true, 8, 2, {1, 7, 8, 9, 17, 100}},
             {{"pattern=fixed", "stride=70", "summary=5"}, true, 70, 5, {64, 65, 70, 71, 150}}})
      for (std::int64_t n : sizes)
        for (bool causal : {false, true})
          for (std::int64_t heads : {1, 3}) {
            const Problem p{.batch = 2, .heads = heads, .seq_len = n, .head_dim = 8, .causal = causal};
            check_model_gradients("sparse-transformer", p,
                                  sparse_mask(fixed, stride, std::min(summary, stride), heads, causal), params);
          }
  }

  TEST_CASE("sparse-transformer strided and fixed patterns, split across heads, equal their naive masks") {
    struct Case {
      std::vector<std::string> params;
      bool fixed;
      std::int64_t stride, summary;  // stride 0: ⌈√N⌉ (summary then clamped to it)
      std::vector<std::int64_t> sizes;
    };
    const std::vector<Case> cases = {
        {{"stride=8"}, false, 8, 0, {1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100}},
        {{"stride=2"}, false, 2, 0, {127, 128, 129, 130}},  // residue classes longer than a 64-row tile
        {{"stride=40"}, false, 40, 0, {39, 40, 41, 150}},
        {{}, false, 0, 0, {2, 100, 257}},
        {{"pattern=fixed", "stride=8", "summary=2"}, true, 8, 2, {1, 7, 8, 9, 15, 16, 17, 100}},
        {{"pattern=fixed", "stride=8", "summary=8"}, true, 8, 8, {17, 40}},
        {{"pattern=fixed", "stride=70", "summary=5"}, true, 70, 5, {64, 65, 69, 70, 71, 200}},
        {{"pattern=fixed"}, true, 0, 8, {3, 30, 100, 257}},
    };
    for (const auto& c : cases)
      for (std::int64_t n : c.sizes)
        for (bool causal : {false, true})
          for (std::int64_t heads : {1, 3}) {
            const Problem p{.batch = 2, .heads = heads, .seq_len = n, .head_dim = 8, .causal = causal};
            const std::int64_t l = c.stride > 0 ? c.stride : naive_ceil_sqrt(n);
            check_pattern("sparse-transformer", p, c.params,
                          sparse_mask(c.fixed, l, std::min(c.summary, l), heads, causal));
          }
  }

  TEST_CASE("axial gradients: both stages, causal union, partial last grid row (central differences)") {
    for (bool causal : {false, true})
      for (auto [n, cols, every] : std::vector<std::tuple<std::int64_t, std::int64_t, bool>>{
               {1, 1, true}, {5, 2, true}, {7, 3, true}, {9, 3, true}, {70, 8, false}, {150, 0, false}}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = every ? 3 : 8, .causal = causal};
        const std::int64_t grid_cols = cols > 0 ? cols : naive_ceil_sqrt(n);
        check_composite_gradients(
            "axial", p, {"cols=" + std::to_string(cols)},
            [=](const NamedValues& x) {
              const std::int64_t size = n * p.head_dim;
              std::vector<double> out;
              for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
                const auto one = axial_reference(x.at("q").data() + head * size, x.at("k").data() + head * size,
                                                 x.at("v").data() + head * size, n, p.head_dim, grid_cols, causal);
                out.insert(out.end(), one.begin(), one.end());
              }
              return out;
            },
            every);
      }
  }

  TEST_CASE("axial equals rows-then-columns naive attention on the padded grid") {
    struct Case {
      std::vector<std::string> params;
      std::int64_t cols;  // 0: ⌈√N⌉
      std::vector<std::int64_t> sizes;
    };
    const std::vector<Case> cases = {
        {{}, 0, {1, 2, 3, 15, 16, 17, 63, 64, 65, 100}},
        {{"cols=8"}, 8, {7, 8, 9, 63, 64, 65, 70}},
        {{"cols=2"}, 2, {127, 128, 129, 131}},  // columns longer than a 64-row tile
        {{"cols=70"}, 70, {69, 70, 71, 150}},   // rows longer than a 64-row tile
    };
    for (const auto& c : cases)
      for (std::int64_t n : c.sizes)
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
          check_axial(p, c.params, c.cols > 0 ? std::min(c.cols, n) : naive_ceil_sqrt(n));
        }
  }

  TEST_CASE("rows whose scores would overflow a naive exp stay finite and exact") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 150, .head_dim = 16, .causal = causal};
      auto in = random_inputs(p, 11);
      for (std::int64_t i = 0; i < p.seq_len; i += 7)
        for (std::int64_t e = 0; e < p.head_dim; ++e) in.q.head(0, 1)[i * p.head_dim + e] *= 100.0f;
      const Tensor out = run_mechanism("image-transformer", p, in, {"query_block=32", "memory_flange=16"});
      for (float value : out.values()) REQUIRE(std::isfinite(value));
      check_against_reference(
          out, in, p, [&](std::int64_t i, std::int64_t j) { return image_mask(32, 16, causal)(0, i, j); },
          "image-transformer overflow rows");
    }
  }

  TEST_CASE("causal: changing future tokens changes no earlier output") {
    check_future_invariance("local", {}, 173, 120);
    check_future_invariance("local", {"block=16"}, 100, 37);
    check_future_invariance("image-transformer", {"query_block=16", "memory_flange=8"}, 100, 41);
    check_future_invariance("image-transformer", {}, 600, 300);
    check_future_invariance("sparse-transformer", {}, 257, 130);
    check_future_invariance("sparse-transformer", {"stride=2"}, 150, 77);
    check_future_invariance("sparse-transformer", {"pattern=fixed", "stride=8", "summary=3"}, 100, 45);
    check_future_invariance("axial", {}, 100, 55);
    check_future_invariance("axial", {"cols=8"}, 70, 20);
    check_future_invariance("axial", {"cols=2"}, 150, 99);
  }

  TEST_CASE("sparse-transformer rejects a summary wider than the stride") {
    const ModelInfo* info = find_model("sparse-transformer");
    REQUIRE(info != nullptr);
    const Problem p{.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 8, .causal = false};
    CHECK_THROWS_AS(validate_point(counter_point(info->name, p, {"pattern=fixed", "stride=4", "summary=5"})),
                    ParamError);
    CHECK_NOTHROW(validate_point(counter_point(info->name, p, {"pattern=fixed", "stride=4", "summary=4"})));
  }

  TEST_CASE("counters scale as the survey says: O(N·b) local and image-transformer, O(N√N) sparse and axial") {
    DnnlContext::instance().clear_cache();
    auto run = [](const std::string& model, std::int64_t n, std::vector<std::string> params = {}) {
      return run_point(counter_point(model, n, std::move(params)));
    };
    auto ratio = [](std::int64_t a, std::int64_t b) { return static_cast<double>(a) / static_cast<double>(b); };
    const auto vanilla = run("vanilla", 4096);
    for (const std::string model : {"local", "image-transformer"}) {
      CAPTURE(model);
      const auto small = run(model, 1024), large = run(model, 4096);
      // Linear work (image-transformer's first block has no flange: a few % above 4); workspace
      // (per-thread tiles) independent of N; peak linear (inputs, output).
      CHECK(ratio(large.flops, small.flops) > 3.9);
      CHECK(ratio(large.flops, small.flops) < 4.4);
      CHECK(large.workspace_bytes == small.workspace_bytes);
      CHECK(ratio(large.peak_tensor_bytes, small.peak_tensor_bytes) == doctest::Approx(4.0).epsilon(0.1));
      CHECK(large.flops < vanilla.flops / 8);
      CHECK(large.peak_tensor_bytes < vanilla.peak_tensor_bytes / 8);
    }
    const std::vector<std::pair<std::string, std::vector<std::string>>> root_models = {
        {"sparse-transformer", {}}, {"sparse-transformer", {"pattern=fixed"}}, {"axial", {}}};
    for (const auto& [model, settings] : root_models) {
      CAPTURE(describe(model, counter_point(model, 4096).problem, settings));
      // N√N work: ×8 for ×4 tokens (⌈√N⌉ is exact at these sizes); memory at most linear.
      const auto small = run(model, 1024, settings), large = run(model, 4096, settings);
      CHECK(ratio(large.flops, small.flops) == doctest::Approx(8.0).epsilon(0.1));
      CHECK(ratio(large.peak_tensor_bytes, small.peak_tensor_bytes) < 4.2);
      CHECK(large.flops < vanilla.flops / 5);
      CHECK(large.peak_tensor_bytes < vanilla.peak_tensor_bytes / 8);
    }
  }
}
