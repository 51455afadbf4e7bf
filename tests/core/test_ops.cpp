// Every op against a naive double-precision loop, at sizes that are not multiples of any block.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using xfb::test::kFloatEps;

namespace {
Tensor random_tensor(Shape shape, const char* stream, float stddev = 1.0f) {
  Tensor t(std::move(shape));
  CounterRng(7, stream).fill_normal(t, 0.0f, stddev);
  return t;
}

// Element (r, c) of op(X) for a stored row-major matrix with row stride ld.
double at(const float* x, std::int64_t ld, bool trans, std::int64_t r, std::int64_t c) {
  return trans ? x[c * ld + r] : x[r * ld + c];
}

// Entry (i, j) of op(A)·op(B) over depth k in double, and the sum of its terms' magnitudes.
struct NaiveDot {
  double sum = 0, magnitude = 0;
};
NaiveDot naive_dot(const float* a, std::int64_t lda, bool ta, const float* b, std::int64_t ldb, bool tb, std::int64_t i,
                   std::int64_t j, std::int64_t k) {
  NaiveDot dot;
  for (std::int64_t p = 0; p < k; ++p) {
    const double term = at(a, lda, ta, i, p) * at(b, ldb, tb, p, j);
    dot.sum += term;
    dot.magnitude += std::fabs(term);
  }
  return dot;
}
}  // namespace

TEST_SUITE("ops") {
  TEST_CASE("matmul: transposes, batches, scale, accumulate, broadcast, padded strides") {
    struct Case {
      std::int64_t batch, m, n, k;
      bool ta, tb, accumulate, broadcast_b;
      float alpha;
      std::int64_t pad;
    };
    const Case cases[] = {{1, 1, 1, 1, false, false, false, false, 1.0f, 0},
                          {3, 7, 5, 33, false, true, false, false, 0.125f, 0},
                          {2, 65, 17, 64, true, false, true, false, 1.0f, 3},
                          {4, 31, 100, 9, true, true, false, true, 2.0f, 5},
                          {1, 129, 63, 257, false, false, true, false, -0.5f, 16}};
    for (const auto& c : cases) {
      CAPTURE(c.batch);
      CAPTURE(c.m);
      CAPTURE(c.n);
      CAPTURE(c.k);
      const std::int64_t rows_a = c.ta ? c.k : c.m, cols_a = c.ta ? c.m : c.k;
      const std::int64_t rows_b = c.tb ? c.n : c.k, cols_b = c.tb ? c.k : c.n;
      const std::int64_t lda = cols_a + c.pad, ldb = cols_b + c.pad, ldc = c.n + c.pad;
      Tensor a = random_tensor({c.batch, rows_a, lda}, "a");
      Tensor b = random_tensor({c.broadcast_b ? 1 : c.batch, rows_b, ldb}, "b");
      Tensor out = random_tensor({c.batch, c.m, ldc}, "c");
      const Tensor before = out.clone();
      ops::MatmulShape shape{.batch = c.batch,
                             .m = c.m,
                             .n = c.n,
                             .k = c.k,
                             .trans_a = c.ta,
                             .trans_b = c.tb,
                             .lda = lda,
                             .ldb = ldb,
                             .ldc = ldc,
                             .stride_b = c.broadcast_b ? 0 : -1,
                             .alpha = c.alpha,
                             .accumulate = c.accumulate};
      FlopCounter::reset();
      ops::matmul(shape, a.data(), b.data(), out.data());
      CHECK(FlopCounter::total() == c.batch * 2 * c.m * c.n * c.k);
      for (std::int64_t bi = 0; bi < c.batch; ++bi) {
        const float* pa = a.data() + bi * rows_a * lda;
        const float* pb = b.data() + (c.broadcast_b ? 0 : bi) * rows_b * ldb;
        for (std::int64_t i = 0; i < c.m; ++i)
          for (std::int64_t j = 0; j < c.n; ++j) {
            const auto [sum, magnitude] = naive_dot(pa, lda, c.ta, pb, ldb, c.tb, i, j, c.k);
            double want = c.alpha * sum;
            const std::int64_t e = bi * c.m * ldc + i * ldc + j;
            if (c.accumulate) want += before[e];
            const double tolerance =
                2 * kFloatEps * (static_cast<double>(c.k) * std::fabs(c.alpha) * magnitude + std::fabs(before[e]) + 1);
            REQUIRE(std::fabs(out[e] - want) <= tolerance);
          }
        // Padding columns are untouched.
        for (std::int64_t i = 0; i < c.m; ++i)
          for (std::int64_t j = c.n; j < ldc; ++j)
            REQUIRE(out[bi * c.m * ldc + i * ldc + j] == before[bi * c.m * ldc + i * ldc + j]);
      }
    }
  }

  TEST_CASE("bf16 matmul and its widening fallback: fp32 and bf16 outputs, at the fallback's tile edges") {
    // The fallback's tiles are 64 rows × 256 columns over depth blocks of 256: shapes one below, at
    // and one above each. The reference sums the bf16 operands' exact products in double; the fp32
    // output is within the fp32 summation bound, the bf16 output within that plus its rounding u·|c|.
    struct Case {
      std::int64_t batch, m, n, k;
      bool ta, tb, accumulate, broadcast_b;
      float alpha;
    };
    const Case cases[] = {{1, 1, 1, 1, false, false, false, false, 1.0f},
                          {3, 63, 255, 33, false, true, false, false, 0.125f},
                          {2, 64, 256, 256, true, false, true, false, 1.0f},
                          {2, 65, 257, 257, true, true, false, true, 2.0f},
                          {1, 129, 17, 513, false, false, true, false, -0.5f}};
    const bool fallbacks[] = {false, true};
    for (const auto& c : cases)
      for (bool fallback : fallbacks)
        for (bool bf16_out : {false, true}) {
          CAPTURE(c.m);
          CAPTURE(c.n);
          CAPTURE(c.k);
          CAPTURE(fallback);
          CAPTURE(bf16_out);
          const std::int64_t rows_a = c.ta ? c.k : c.m, cols_a = c.ta ? c.m : c.k;
          const std::int64_t rows_b = c.tb ? c.n : c.k, cols_b = c.tb ? c.k : c.n;
          const Tensor a = to_bf16(random_tensor({c.batch, rows_a, cols_a}, "a"));
          const Tensor b = to_bf16(random_tensor({c.broadcast_b ? 1 : c.batch, rows_b, cols_b}, "b"));
          Tensor out = to_bf16(random_tensor({c.batch, c.m, c.n}, "c"));
          const Tensor before = to_f32(out);
          Tensor out_f32 = before.clone();
          const ops::MatmulShape shape{.batch = c.batch,
                                       .m = c.m,
                                       .n = c.n,
                                       .k = c.k,
                                       .trans_a = c.ta,
                                       .trans_b = c.tb,
                                       .stride_b = c.broadcast_b ? 0 : -1,
                                       .alpha = c.alpha,
                                       .accumulate = c.accumulate};
          if (!fallback) ops::prepare_bf16_matmul(shape, bf16_out);
          FlopCounter::reset();
          if (bf16_out) {
            if (fallback)
              ops::widened_bf16_matmul(shape, a.bf16_data(), b.bf16_data(), out.bf16_data());
            else
              ops::matmul(shape, a.bf16_data(), b.bf16_data(), out.bf16_data());
          } else if (fallback) {
            ops::widened_bf16_matmul(shape, a.bf16_data(), b.bf16_data(), out_f32.data());
          } else {
            ops::matmul(shape, a.bf16_data(), b.bf16_data(), out_f32.data());
          }
          CHECK(FlopCounter::total() == c.batch * 2 * c.m * c.n * c.k);
          const Tensor got = bf16_out ? to_f32(out) : out_f32.clone();
          const Tensor wide_a = to_f32(a), wide_b = to_f32(b);
          for (std::int64_t bi = 0; bi < c.batch; ++bi) {
            const float* pa = wide_a.data() + bi * rows_a * cols_a;
            const float* pb = wide_b.data() + (c.broadcast_b ? 0 : bi) * rows_b * cols_b;
            for (std::int64_t i = 0; i < c.m; ++i)
              for (std::int64_t j = 0; j < c.n; ++j) {
                const auto [sum, magnitude] = naive_dot(pa, cols_a, c.ta, pb, cols_b, c.tb, i, j, c.k);
                const std::int64_t e = (bi * c.m + i) * c.n + j;
                const double want = c.alpha * sum + (c.accumulate ? before[e] : 0.0);
                double tolerance =
                    2 * kFloatEps *
                    (static_cast<double>(c.k) * std::fabs(c.alpha) * magnitude + std::fabs(before[e]) + 1);
                if (bf16_out) tolerance += test::kBf16Roundoff * (std::fabs(want) + tolerance);
                REQUIRE(std::fabs(got[e] - want) <= tolerance);
              }
          }
        }
  }

  TEST_CASE("gemm (single-thread sgemm) matches the naive product") {
    for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 1, 1}, {63, 65, 64}, {17, 129, 3}}) {
      Tensor a = random_tensor({m, k}, "ga"), b = random_tensor({n, k}, "gb"), c = random_tensor({m, n}, "gc");
      const Tensor before = c.clone();
      ops::gemm(false, true, m, n, k, 0.5f, a.data(), k, b.data(), k, 1.0f, c.data(), n);
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double want = 0, magnitude = 0;
          for (std::int64_t p = 0; p < k; ++p) {
            want += static_cast<double>(a[i * k + p]) * b[j * k + p];
            magnitude += std::fabs(static_cast<double>(a[i * k + p]) * b[j * k + p]);
          }
          want = 0.5 * want + before[i * n + j];
          REQUIRE(std::fabs(c[i * n + j] - want) <=
                  2 * kFloatEps * (static_cast<double>(k) * magnitude + std::fabs(before[i * n + j]) + 1));
        }
    }
  }

  TEST_CASE("fast_exp is accurate to a few ulp over the softmax range and 0 below it") {
    double worst = 0;
    for (double x = -87.0; x <= 88.0; x += 0.01) {
      const float xf = static_cast<float>(x);
      const double want = std::exp(static_cast<double>(xf));
      worst = std::max(worst, std::fabs(ops::fast_exp(xf) - want) / want);
    }
    CHECK(worst < 8 * kFloatEps);
    CHECK(ops::fast_exp(-100.0f) == 0.0f);
    CHECK(ops::fast_exp(-INFINITY) == 0.0f);
    CHECK(ops::fast_exp(0.0f) == 1.0f);
  }

  TEST_CASE("softmax (oneDNN) and masked softmax (project kernel) match the naive formula") {
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 33}, {65, 1000}}) {
      Tensor x = random_tensor({rows, cols}, "sx", 10.0f);
      const Tensor input = x.clone();
      FlopCounter::reset();
      ops::softmax(x.data(), rows, cols);
      CHECK(FlopCounter::total() == kSoftmaxFlopsPerElement * rows * cols);
      for (std::int64_t r = 0; r < rows; ++r) {
        double peak = -INFINITY, sum = 0;
        for (std::int64_t j = 0; j < cols; ++j) peak = std::max(peak, static_cast<double>(input[r * cols + j]));
        for (std::int64_t j = 0; j < cols; ++j) sum += std::exp(input[r * cols + j] - peak);
        for (std::int64_t j = 0; j < cols; ++j) {
          const double want = std::exp(input[r * cols + j] - peak) / sum;
          REQUIRE(std::fabs(x[r * cols + j] - want) <= 8 * kFloatEps * (want * std::log2(cols + 1.0) + 1e-30) + 1e-12);
        }
      }
    }
    for (bool causal : {false, true})
      for (std::int64_t offset : {0, 5}) {
        const std::int64_t batch = 2, rows = 9, cols = 13, ld = 16;
        Tensor x = random_tensor({batch, rows, ld}, "mx", 30.0f);
        const Tensor input = x.clone();
        FlopCounter::reset();
        ops::softmax_rows_masked(x.data(), batch, rows, cols, ld, causal, offset);
        std::int64_t expected_flops = 0;
        for (std::int64_t b = 0; b < batch; ++b)
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::int64_t valid = causal ? std::min(cols, r + 1 + offset) : cols;
            expected_flops += kSoftmaxFlopsPerElement * valid;
            const float* in = input.data() + (b * rows + r) * ld;
            const float* got = x.data() + (b * rows + r) * ld;
            double peak = -INFINITY, sum = 0;
            for (std::int64_t j = 0; j < valid; ++j) peak = std::max(peak, static_cast<double>(in[j]));
            for (std::int64_t j = 0; j < valid; ++j) sum += std::exp(in[j] - peak);
            for (std::int64_t j = 0; j < cols; ++j) {
              const double want = j < valid ? std::exp(in[j] - peak) / sum : 0.0;
              REQUIRE(std::fabs(got[j] - want) <= 8 * kFloatEps * (want + 1e-30) * 4 + 1e-12);
            }
            for (std::int64_t j = cols; j < ld; ++j) REQUIRE(got[j] == in[j]);
          }
        CHECK(FlopCounter::total() == expected_flops);
      }
  }

  TEST_CASE("layer_norm, gelu and add match their formulas") {
    const std::int64_t rows = 5, cols = 37;
    Tensor x = random_tensor({rows, cols}, "lx", 3.0f), y({rows, cols});
    Tensor gain = random_tensor({cols}, "lg"), shift = random_tensor({cols}, "ls");
    FlopCounter::reset();
    ops::layer_norm(x.data(), y.data(), rows, cols, gain.data(), shift.data(), 1e-5f);
    CHECK(FlopCounter::total() == kLayerNormFlopsPerElement * rows * cols);
    for (std::int64_t r = 0; r < rows; ++r) {
      double mean = 0, var = 0;
      for (std::int64_t j = 0; j < cols; ++j) mean += x[r * cols + j];
      mean /= cols;
      for (std::int64_t j = 0; j < cols; ++j) var += (x[r * cols + j] - mean) * (x[r * cols + j] - mean);
      var /= cols;
      for (std::int64_t j = 0; j < cols; ++j) {
        const double normalised = (x[r * cols + j] - mean) / std::sqrt(var + 1e-5);
        const double want = normalised * gain[j] + shift[j];
        REQUIRE(std::fabs(y[r * cols + j] - want) <=
                16 * kFloatEps * (std::fabs(normalised * gain[j]) + std::fabs(shift[j]) + 1) * std::log2(cols));
      }
    }
    const std::int64_t n = 1001;
    Tensor g = random_tensor({n}, "gx", 3.0f);
    const Tensor g_in = g.clone();
    ops::gelu(g.data(), n);
    for (std::int64_t i = 0; i < n; ++i) {
      const double v = g_in[i];
      const double want = 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
      REQUIRE(std::fabs(g[i] - want) <= 16 * kFloatEps * (std::fabs(v) + 1));
    }
    Tensor a = random_tensor({n}, "aa"), b = random_tensor({n}, "ab"), c({n});
    FlopCounter::reset();
    ops::add(a.data(), b.data(), c.data(), n);
    CHECK(FlopCounter::total() == n);
    for (std::int64_t i = 0; i < n; ++i) REQUIRE(c[i] == a[i] + b[i]);
  }

  TEST_CASE("padded_ld avoids multiples of 256 floats") {
    for (std::int64_t n : {1, 15, 16, 255, 256, 512, 4096, 4097}) {
      const auto ld = ops::padded_ld(n);
      CHECK(ld >= n);
      CHECK(ld % 16 == 0);
      CHECK(ld % 256 != 0);
    }
  }
}
