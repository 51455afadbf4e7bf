// The tile kernels of every ISA the host runs (key panels, score and P·V blocks, row softmax
// pieces, padded and unpadded) against double-precision loops at the vectors' edges.
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

TEST_SUITE("tile_kernels") {
  TEST_CASE("key panels of every ISA the host runs hold K transposed per 16 keys, zeros past the keys") {
    // d = 8 and 24 take the scalar packing, the others the register transposes (16 × 16 blocks on
    // AVX-512, 8 × 8 on AVX2); keys one below, at and above panel edges; row stride ldk > d.
    const KernelIsa original = kernel_isa();
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      for (std::int64_t d : {8, 16, 24, 32, 64})
        for (std::int64_t cols : {1, 7, 8, 9, 15, 16, 17, 33, 50}) {
          const std::int64_t ldk = d + 3, panels = tiles::panels_for(cols);
          Tensor k(Shape{cols, ldk});
          CounterRng(9, "pack/k").fill_normal(k);
          std::vector<float> packed(static_cast<std::size_t>(panels * d * tiles::kPanel),
                                    std::numeric_limits<float>::quiet_NaN());
          tiles::pack_key_panels(k.data(), ldk, cols, d, packed.data());
          std::int64_t wrong = 0;
          for (std::int64_t p = 0; p < panels; ++p)
            for (std::int64_t c = 0; c < d; ++c)
              for (std::int64_t t = 0; t < tiles::kPanel; ++t) {
                const std::int64_t key = p * tiles::kPanel + t;
                const float want = key < cols ? k.data()[key * ldk + c] : 0.0f;
                wrong += packed[static_cast<std::size_t>((p * d + c) * tiles::kPanel + t)] == want ? 0 : 1;
              }
          CHECK_MESSAGE(wrong == 0, kernel_isa_name(isa) << " d=" << d << " cols=" << cols);
        }
    }
    force_kernel_isa(original);
  }

  TEST_CASE("tile kernels of every ISA the host runs equal double-precision loops") {
    // Register blocks: AVX2 6 rows × 16 columns, AVX-512 12 rows × 32 columns (two panels), so
    // rows and panel counts run one below, at and above both, and d covers 16-column remainders.
    // Remainders of at most a third of a block (AVX2 1–2 rows, AVX-512 1–4) take blocks twice as
    // wide (2 panels on AVX2, 4 on AVX-512; 32 or 64 columns of d) where whole ones fit: rows 8, 14
    // and 16 reach them. The transposed product's register blocks run over the columns (keys).
    const KernelIsa original = kernel_isa();
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      for (std::int64_t d : {16, 32, 48, 64})
        for (std::int64_t rows : {1, 5, 6, 7, 8, 11, 12, 13, 14, 16, 25})
          for (std::int64_t cols : {1, 15, 16, 17, 31, 33, 48, 50}) {
            const std::int64_t panels = tiles::panels_for(cols), width = panels * tiles::kPanel;
            Tensor q(Shape{rows, d}), k(Shape{cols, d}), pr(Shape{rows, cols}), v(Shape{cols, d});
            CounterRng(7, "tile/q").fill_normal(q);
            CounterRng(7, "tile/k").fill_normal(k);
            CounterRng(7, "tile/p").fill_normal(pr);
            CounterRng(7, "tile/v").fill_normal(v);
            std::vector<float> packed(static_cast<std::size_t>(panels * d * tiles::kPanel));
            tiles::pack_key_panels(k.data(), d, cols, d, packed.data());
            std::vector<float> s(static_cast<std::size_t>(rows * width), -1.0f),
                o(static_cast<std::size_t>(rows * d), 0.5f);
            tiles::scores(q.data(), d, rows, packed.data(), panels, d, 0.25f, s.data(), width);
            tiles::accumulate_pv(pr.data(), cols, rows, cols, v.data(), d, d, o.data(), d);
            // Pᵀ·X with alpha: X [rows, d] is q here; T [cols, d] starts at 0.25.
            std::vector<float> t(static_cast<std::size_t>(cols * d), 0.25f);
            tiles::accumulate_transposed(pr.data(), cols, rows, cols, q.data(), d, d, 0.5f, t.data(), d);
            // fp32 dot products of length L: |error| ≤ L·ε·Σ|terms|, bounded by L·ε·(typical 3²·L).
            const std::string where = kernel_isa_name(isa) + " d=" + std::to_string(d) +
                                      " rows=" + std::to_string(rows) + " cols=" + std::to_string(cols);
            for (std::int64_t r = 0; r < rows; ++r) {
              for (std::int64_t j = 0; j < width; ++j) {
                double want = 0, magnitude = 0;
                for (std::int64_t c = 0; j < cols && c < d; ++c) {
                  want += double(q.data()[r * d + c]) * k.data()[j * d + c];
                  magnitude += std::fabs(double(q.data()[r * d + c]) * k.data()[j * d + c]);
                }
                const double got = s[static_cast<std::size_t>(r * width + j)];
                REQUIRE_MESSAGE(std::fabs(got - 0.25 * want) <= 0.25 * d * 1.2e-7 * magnitude + 1e-30,
                                where << " S[" << r << "," << j << "] " << got << " vs " << 0.25 * want);
              }
              for (std::int64_t c = 0; c < d; ++c) {
                double want = 0.5, magnitude = 0.5;
                for (std::int64_t j = 0; j < cols; ++j) {
                  want += double(pr.data()[r * cols + j]) * v.data()[j * d + c];
                  magnitude += std::fabs(double(pr.data()[r * cols + j]) * v.data()[j * d + c]);
                }
                const double got = o[static_cast<std::size_t>(r * d + c)];
                REQUIRE_MESSAGE(std::fabs(got - want) <= (cols + 1) * 1.2e-7 * magnitude,
                                where << " O[" << r << "," << c << "] " << got << " vs " << want);
              }
            }
            for (std::int64_t j = 0; j < cols; ++j)
              for (std::int64_t c = 0; c < d; ++c) {
                double want = 0.25, magnitude = 0.25;
                for (std::int64_t r = 0; r < rows; ++r) {
                  want += 0.5 * double(pr.data()[r * cols + j]) * q.data()[r * d + c];
                  magnitude += std::fabs(0.5 * double(pr.data()[r * cols + j]) * q.data()[r * d + c]);
                }
                const double got = t[static_cast<std::size_t>(j * d + c)];
                REQUIRE_MESSAGE(std::fabs(got - want) <= (rows + 2) * 1.2e-7 * magnitude,
                                where << " T[" << j << "," << c << "] " << got << " vs " << want);
              }
          }
      // The whole mechanism on this path: exact-tiled against naive attention, odd block sizes.
      for (std::int64_t n : {11, 12, 13, 47, 100})
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          const auto in = random_inputs(p, 5);
          const Tensor out = run_mechanism("exact-tiled", p, in, {"block_q=13", "block_k=40"});
          check_against_reference(out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                  "exact-tiled " + kernel_isa_name(isa) + " N=" + std::to_string(n));
          // The block-sparse engine's row softmax on this path: block-local attention, block 13.
          const Tensor local = run_mechanism("local", p, in, {"block=13"});
          check_against_reference(
              local, in, p,
              [causal](std::int64_t i, std::int64_t j) { return i / 13 == j / 13 && (!causal || j <= i); },
              "local " + kernel_isa_name(isa) + " N=" + std::to_string(n));
        }
    }
    force_kernel_isa(original);
  }

  TEST_CASE("row softmax pieces of every ISA equal double-precision loops at the vectors' edges") {
    // Intervals start and end one below, at and above both vector widths (8, 16); the padding past
    // `width` holds NaN (it must not leak into the results) and the floats past the padded row a
    // sentinel (they must not be written).
    constexpr float kSentinel = 12345.0f;
    const KernelIsa original = kernel_isa();
    std::int64_t cases = 0;
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      for (std::int64_t width : {1, 7, 8, 9, 15, 16, 17, 31, 33, 50, 64})
        for (std::int64_t lo : {0, 1, 7, 8, 9, 16, 17})
          for (std::int64_t hi : {lo, lo + 1, lo + 7, lo + 8, lo + 9, width}) {
            if (hi < lo || hi > width) continue;
            ++cases;
            const std::int64_t padded = (width + 15) / 16 * 16;
            std::vector<float> x(static_cast<std::size_t>(padded + 16), kSentinel);
            std::vector<float> g(x.size(), kSentinel);
            Tensor values(Shape{2, width});
            CounterRng(11, "rows/" + std::to_string(width)).fill_normal(values);
            for (std::int64_t j = 0; j < padded; ++j) {
              x[j] = j < width ? 4.0f * values.data()[j] : std::nanf("");
              g[j] = j < width ? values.data()[width + j] : std::nanf("");
            }
            const std::string where = kernel_isa_name(isa) + " width=" + std::to_string(width) +
                                      " lo=" + std::to_string(lo) + " hi=" + std::to_string(hi);
            float want_peak = -1.5f;
            for (std::int64_t j = lo; j < hi; ++j) want_peak = std::max(want_peak, x[j]);
            const float peak = tiles::interval_max(x.data(), lo, hi, -1.5f);
            REQUIRE_MESSAGE(peak == want_peak, where);
            const float dot = 0.3f;
            std::vector<float> p = x, dscores = g;
            tiles::softmax_grad_interval(p.data(), dscores.data(), lo, hi, width, peak, dot);
            const std::vector<float> original_x = x;
            const float sum = tiles::exp_interval(x.data(), lo, hi, width, peak);
            double want_sum = 0;
            for (std::int64_t j = 0; j < padded + 16; ++j) {
              if (j >= padded) {
                REQUIRE_MESSAGE((x[j] == kSentinel && p[j] == kSentinel && dscores[j] == kSentinel),
                                where << " j=" << j);
                continue;
              }
              if (j >= width) continue;  // padding: scratch
              if (j < lo || j >= hi) {
                REQUIRE_MESSAGE((x[j] == 0.0f && p[j] == 0.0f && dscores[j] == 0.0f), where << " j=" << j);
                continue;
              }
              // exp of a float difference: ε·|x − peak| from the subtraction, a few ε from the polynomial.
              const double shifted = double(original_x[j]) - double(peak), want = std::exp(shifted);
              const double tolerance = (4.0 + std::fabs(shifted)) * 1.2e-7 * want;
              REQUIRE_MESSAGE(std::fabs(x[j] - want) <= tolerance,
                              where << " j=" << j << " " << x[j] << " vs " << want);
              REQUIRE_MESSAGE(p[j] == x[j], where << " j=" << j);
              const double want_grad = double(x[j]) * (double(g[j]) - dot);
              REQUIRE_MESSAGE(std::fabs(dscores[j] - want_grad) <= 2.4e-7 * x[j] * (std::fabs(g[j]) + dot),
                              where << " j=" << j << " " << dscores[j] << " vs " << want_grad);
              want_sum += x[j];
            }
            REQUIRE_MESSAGE(std::fabs(sum - want_sum) <= (hi - lo + 1) * 1.2e-7 * want_sum, where);
          }
    }
    force_kernel_isa(original);
    CHECK(cases > 100);
  }

  TEST_CASE("unpadded row pieces of every ISA equal double-precision loops and write nothing past the row") {
    // Lengths one below, at and above both vector widths (8, 16), aligned and unaligned starts; a
    // sentinel before and after the row must survive (the last part-vector is masked).
    constexpr float kSentinel = 12345.0f;
    const KernelIsa original = kernel_isa();
    for (KernelIsa isa : supported_kernel_isas()) {
      force_kernel_isa(isa);
      for (std::int64_t n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 50})
        for (std::int64_t offset : {0, 3}) {
          Tensor values(Shape{n + 1});
          CounterRng(13, "unpadded/" + std::to_string(n)).fill_normal(values);
          std::vector<float> buffer(static_cast<std::size_t>(offset + n + 32), kSentinel);
          float* x = buffer.data() + offset;
          for (std::int64_t j = 0; j < n; ++j) x[j] = 4.0f * values.data()[j];
          const std::string where =
              kernel_isa_name(isa) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
          float want_peak = -2.0f;
          for (std::int64_t j = 0; j < n; ++j) want_peak = std::max(want_peak, x[j]);
          REQUIRE_MESSAGE(tiles::row_max(x, n, -2.0f) == want_peak, where);
          const std::vector<float> original_x(x, x + n);
          const float sum = tiles::exp_and_sum(x, n, want_peak);
          double want_sum = 0;
          for (std::int64_t j = 0; j < n; ++j) {
            // As for the padded pieces: ε·|x − peak| from the subtraction, a few ε from the polynomial.
            const double shifted = double(original_x[j]) - double(want_peak), want = std::exp(shifted);
            REQUIRE_MESSAGE(std::fabs(x[j] - want) <= (4.0 + std::fabs(shifted)) * 1.2e-7 * want, where << " j=" << j);
            want_sum += x[j];
          }
          for (std::size_t j = 0; j < buffer.size(); ++j)
            if (j < static_cast<std::size_t>(offset) || j >= static_cast<std::size_t>(offset + n))
              REQUIRE_MESSAGE(buffer[j] == kSentinel, where << " index " << j);
          REQUIRE_MESSAGE(std::fabs(sum - want_sum) <= (n + 1) * 1.2e-7 * want_sum, where);
        }
    }
    force_kernel_isa(original);
  }
}
