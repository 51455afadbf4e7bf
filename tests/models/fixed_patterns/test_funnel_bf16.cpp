// funnel in bf16 (taxonomy/fixed_patterns/funnel.hpp), in two parts so each bound is the plain one of
// its rounding points (u = 2⁻⁸, ε the fp32 unit roundoff):
//   - the pooled queries Q̃ the model keeps, against the float64 mean of the same bf16 rows: a
//     two-source row is (a + b)·½ in fp32 (one rounding) and then rounded to bf16, so
//     |Q̃ − Q̃*| ≤ (u + ε(1 + u))·|Q̃*|; a one-source row is the bf16 row itself, exactly;
//   - the output against float64 softmax attention of the model's own Q̃ over the bf16 keys and
//     values, within the softmax bound 2u(1 + u)·max|v| + the fp32 bound (tests/support/bf16_check.hpp);
//   - the gradients against float64 attention gradients of that Q̃ (dK, dV; dQ̃ unpooled into dq:
//     a two-source row gets dQ̃/2, exact in binary), within the per-rounding bound of exact-tiled's
//     online backward (bf16_head_gradients; halved for a two-source row).
#include <doctest/doctest.h>

#include <cmath>
#include <string>
#include <vector>

#include "lib/core/bf16.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

struct Pooling {
  bool separate_cls = false, truncate_seq = false;
  std::vector<std::string> params() const {
    return {"separate_cls=" + std::string(separate_cls ? "true" : "false"),
            "truncate_seq=" + std::string(truncate_seq ? "true" : "false"), "block_q=16", "block_k=32",
            "backward_block_k=32"};
  }
  std::string name() const { return separate_cls ? (truncate_seq ? "cls+truncate" : "cls") : "plain"; }
};

// The float64 Q̃ of one head's bf16 query rows q [N, D] (funnel.hpp's pooling sources).
std::vector<double> pooled_reference(const float* q, std::int64_t n, std::int64_t d, const Pooling& pooling) {
  const std::int64_t length = pooling.separate_cls && !pooling.truncate_seq ? n + 1 : n;
  const std::int64_t m = (length + 1) / 2;
  std::vector<double> pooled(static_cast<std::size_t>(m * d));
  for (std::int64_t i = 0; i < m; ++i) {
    std::int64_t first = 2 * i, count = std::min<std::int64_t>(2, n - 2 * i);
    if (pooling.separate_cls) {
      first = i == 0 ? 0 : 2 * i - 1;
      count = i == 0 ? 1 : (2 * i + 1 < length ? 2 : 1);
    }
    for (std::int64_t c = 0; c < d; ++c) {
      double sum = 0;
      for (std::int64_t r = 0; r < count; ++r) sum += q[(first + r) * d + c];
      pooled[static_cast<std::size_t>(i * d + c)] = sum / static_cast<double>(count);
    }
  }
  return pooled;
}

void check_case(const Problem& shape, const Pooling& pooling, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const std::string label = "funnel bf16 N=" + std::to_string(n) + " D=" + std::to_string(d) + " " + pooling.name();
  const Bf16Inputs in = bf16_inputs(p, seed);
  auto mechanism = bf16_mechanism("funnel", p, pooling.params());
  const std::vector<double> first_head = pooled_reference(in.widened.q.head(0, 0), n, d, pooling);
  const std::int64_t m = static_cast<std::int64_t>(first_head.size()) / d;
  Tensor out = Tensor::bhnd(p.batch, p.heads, m, d, DType::BF16);
  mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
  mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
  const Tensor got = to_f32(out);
  const Tensor& pooled = *mechanism->saved().at(0).tensor;
  REQUIRE(mechanism->saved().at(0).name == "pooled_queries");
  REQUIRE(pooled.dtype() == DType::BF16);
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const std::vector<double> want_pooled = pooled_reference(in.widened.q.head(b, h), n, d, pooling);
      std::vector<float> queries(static_cast<std::size_t>(m * d));
      for (std::int64_t e = 0; e < m * d; ++e)
        queries[static_cast<std::size_t>(e)] = to_float(pooled.bf16_data()[(b * p.heads + h) * m * d + e]);
      check_bf16_elements(
          queries.data(), want_pooled, m * d,
          [&](std::int64_t e) {
            return (kU + kFloatEps * (1 + kU)) * std::fabs(want_pooled[static_cast<std::size_t>(e)]);
          },
          where + " Q̃");
      const float *k = in.widened.k.head(b, h), *v = in.widened.v.head(b, h);
      const auto want = reference_attention(queries.data(), k, v, m, n, d, scale, MaskFn(full_mask));
      const double bound =
          2 * kU * (1 + kU) * max_abs_of(v, n * d) + attention_tolerance(queries.data(), k, v, m, n, d, scale);
      check_bf16_elements(
          got.data() + (b * p.heads + h) * m * d, want, m * d, [&](std::int64_t) { return bound; }, where);
    }
}

// The bf16 training step's dq, dk, dv against float64 attention gradients of the model's own Q̃.
void check_gradients(const Problem& shape, const Pooling& pooling, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const std::string label = "funnel bf16 gradients N=" + std::to_string(n) + " " + pooling.name();
  const Bf16GradientRun run = run_bf16_gradients("funnel", p, pooling.params(), seed);
  const Tensor& pooled = *run.mechanism->saved().at(0).tensor;
  const std::int64_t m = pooled.dim(1);
  const Tensor pooled_widened = to_f32(pooled);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const float* queries = pooled_widened.data() + (b * p.heads + h) * m * d;
      const float *k = run.in.widened.k.head(b, h), *v = run.in.widened.v.head(b, h);
      const Bf16HeadGradients ref = bf16_head_gradients(queries, k, v, run.dout_widened.head(b, h), run.out.head(b, h),
                                                        m, n, d, MaskFn(full_mask));
      check_bf16_elements(
          run.dk.head(b, h), ref.want.dk, n * d, [&](std::int64_t e) { return ref.dk_bound[e]; }, where + " dk");
      check_bf16_elements(
          run.dv.head(b, h), ref.want.dv, n * d, [&](std::int64_t e) { return ref.dv_bound[e]; }, where + " dv");
      // dq: the pooled row's gradient and bound over its sources (halved for two), 0 for a row in no
      // pooled row.
      std::vector<double> dq(static_cast<std::size_t>(n * d), 0.0), bound(dq.size(), 1e-30);
      const std::vector<double> first = pooled_reference(run.in.widened.q.head(b, h), n, d, pooling);
      for (std::int64_t i = 0; i < m; ++i) {
        std::int64_t start = 2 * i, count = std::min<std::int64_t>(2, n - 2 * i);
        if (pooling.separate_cls) {
          const std::int64_t length = pooling.truncate_seq ? n : n + 1;
          start = i == 0 ? 0 : 2 * i - 1;
          count = i == 0 ? 1 : (2 * i + 1 < length ? 2 : 1);
        }
        for (std::int64_t r = start; r < start + count; ++r)
          for (std::int64_t c = 0; c < d; ++c) {
            dq[r * d + c] = ref.want.dq[i * d + c] / static_cast<double>(count);
            bound[r * d + c] = ref.dq_bound[i * d + c] / static_cast<double>(count);
          }
      }
      CHECK(static_cast<std::int64_t>(first.size()) == m * d);
      check_bf16_elements(
          run.dq.head(b, h), dq, n * d, [&](std::int64_t e) { return bound[e]; }, where + " dq");
    }
}

}  // namespace

TEST_SUITE("funnel_bf16") {
  TEST_CASE("funnel in bf16: Q̃ against the float64 pooling, the output against attention of Q̃, every path") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const Pooling pooling : {Pooling{}, Pooling{true, false}, Pooling{true, true}}) {
        // Pooled rows one below, at and above block_q = 16; keys one below, at and above block_k = 32
        // and a panel; odd N (a one-source last row).
        for (std::int64_t n : {1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100})
          check_case({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16}, pooling, static_cast<std::uint64_t>(n));
        check_case({.batch = 1, .heads = 3, .seq_len = 129, .head_dim = 64}, pooling, 7);
      }
    });
  }

  TEST_CASE("funnel in bf16: gradients against float64 attention gradients of Q̃, at awkward sizes, every path") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (const Pooling pooling : {Pooling{}, Pooling{true, false}, Pooling{true, true}})
        // Keys one below, at and above a panel and the backward's key block of 32; pooled rows around
        // the backward's 128-row strip (N = 255–257).
        for (std::int64_t n : {1, 2, 15, 16, 17, 31, 32, 33, 100, 255, 256, 257})
          check_gradients({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16}, pooling,
                          static_cast<std::uint64_t>(n));
      check_gradients({.batch = 1, .heads = 3, .seq_len = 129, .head_dim = 64}, Pooling{}, 7);
    });
  }

  TEST_CASE("funnel bf16 rows: FLOPs as fp32's, halved inputs and output, estimates exact (forward, backward, train)") {
    for (std::int64_t n : {100, 257})
      for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train}) check_bf16_rows("funnel", n, false, pass);
    check_bf16_head_dim_unsupported("funnel");
  }
}
