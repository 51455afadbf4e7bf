// The exact baselines against the naive reference, their memory scaling, and the FLOP counter
// against every implemented model's analytic formula.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <string>
#include <vector>

#include "lib/bench/encoder_layer.hpp"
#include "lib/bench/point.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/tile_kernels.hpp"
#include "taxonomy/registry.hpp"
#include "tests/counter_point.hpp"
#include "tests/gradient_check.hpp"
#include "tests/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {
PointConfig quick_point(const std::string& model, std::int64_t n, bool causal, Scope scope = Scope::Attention,
                        std::vector<std::string> params = {}) {
  return counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal},
                       std::move(params), scope);
}
}  // namespace

TEST_SUITE("exact") {
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
          check_against_reference(out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                  std::string("exact-tiled ") + c.block_q + " D=" + std::to_string(c.head_dim) +
                                      " N=" + std::to_string(n));
          check_model_gradients("exact-tiled", p, same_for_every_head(causal ? MaskFn(causal_mask) : MaskFn(full_mask)),
                                {c.block_q, "block_k=24", c.backward_block_k});
        }
  }

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
            std::vector<float> s(static_cast<std::size_t>(rows * width), -1.0f), o(static_cast<std::size_t>(rows * d), 0.5f);
            tiles::scores(q.data(), d, rows, packed.data(), panels, d, 0.25f, s.data(), width);
            tiles::accumulate_pv(pr.data(), cols, rows, cols, v.data(), d, d, o.data(), d);
            // Pᵀ·X with alpha: X [rows, d] is q here; T [cols, d] starts at 0.25.
            std::vector<float> t(static_cast<std::size_t>(cols * d), 0.25f);
            tiles::accumulate_transposed(pr.data(), cols, rows, cols, q.data(), d, d, 0.5f, t.data(), d);
            // fp32 dot products of length L: |error| ≤ L·ε·Σ|terms|, bounded by L·ε·(typical 3²·L).
            const std::string where = kernel_isa_name(isa) + " d=" + std::to_string(d) + " rows=" +
                                      std::to_string(rows) + " cols=" + std::to_string(cols);
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
              local, in, p, [causal](std::int64_t i, std::int64_t j) { return i / 13 == j / 13 && (!causal || j <= i); },
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
                REQUIRE_MESSAGE((x[j] == kSentinel && p[j] == kSentinel && dscores[j] == kSentinel), where << " j=" << j);
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
              REQUIRE_MESSAGE(std::fabs(x[j] - want) <= tolerance, where << " j=" << j << " " << x[j] << " vs " << want);
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
          const std::string where = kernel_isa_name(isa) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
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

  TEST_CASE("the executed FLOP count equals the registry's analytic formula for every implemented model") {
    for (const auto& model : registry()) {
      for (std::int64_t n : {1, 100, 257})
        for (bool causal : {false, true})
          for (Scope scope : {Scope::Attention, Scope::Layer}) {
            if (causal && !model.decodes()) continue;
            const auto config = quick_point(model.name, n, causal, scope);
            const ResultRow row = run_point(config);
            CAPTURE(model.name);
            CAPTURE(n);
            CAPTURE(causal);
            CAPTURE(scope_name(scope));
            REQUIRE(row.status == Status::Ok);
            std::int64_t expected = model.impl.flops(config.problem, resolve_params(model.name, model.impl.params, {}));
            if (scope == Scope::Layer) expected += EncoderLayer::flops_outside_mechanism(config.problem, config.effective_d_ff());
            CHECK(row.flops == expected);
            // Inputs and output are the project's own tensors; the scratchpad is not.
            CHECK(row.peak_owned_bytes >= point_io_bytes(config));
            CHECK(row.peak_owned_bytes <= row.peak_tensor_bytes);
          }
    }
  }

  TEST_CASE("analytic workspace estimates track the measured tracked bytes") {
    for (const auto& model : registry()) {
      for (std::int64_t n : {512, 2048}) {
        DnnlContext::instance().clear_cache();
        const ResultRow row = run_point(quick_point(model.name, n, false));
        CAPTURE(model.name);
        CAPTURE(n);
        CHECK(static_cast<double>(row.workspace_bytes) <= 1.25 * static_cast<double>(row.estimated_workspace_bytes) + 65536);
        CHECK(static_cast<double>(row.workspace_bytes) >= 0.75 * static_cast<double>(row.estimated_workspace_bytes) - 65536);
      }
    }
  }

  TEST_CASE("resolved parameter values run as the requested ones, and resolving them again changes nothing") {
    // Resolution computes derived defaults (0 = from N) and clamps blocks to N: the values a dump
    // records must describe the same computation.
    for (const auto& model : registry())
      for (std::int64_t n : {1, 37, 100, 1000})
        for (bool causal : {false, true}) {
          if (causal && !model.decodes()) continue;
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal, .threads = 2};
          const ParamValues requested = resolve_params(model.name, model.impl.params, {});
          const ParamValues ran = model.impl.resolved(p, requested);
          CAPTURE(model.name);
          CAPTURE(n);
          CAPTURE(causal);
          CHECK(model.impl.flops(p, ran) == model.impl.flops(p, requested));
          CHECK(model.impl.workspace_bytes(p, ran) == model.impl.workspace_bytes(p, requested));
          CHECK(model.impl.resolved(p, ran).to_json() == ran.to_json());
        }
  }

  TEST_CASE("workspace estimates equal the tracked owned bytes at 1 and 2 threads") {
    // The estimate is what --memory-limit and estimated_workspace_bytes use; oneDNN's scratchpad
    // is outside it (library pool), so the owned pool is the one to match exactly.
    for (const auto& model : registry())
      for (int threads : {1, 2})
        for (bool causal : {false, true}) {
          if (causal && !model.decodes()) continue;
          PointConfig config = quick_point(model.name, 300, causal);
          config.problem.threads = threads;
          DnnlContext::instance().clear_cache();
          const ResultRow row = run_point(config);
          CAPTURE(model.name);
          CAPTURE(threads);
          CAPTURE(causal);
          REQUIRE(row.status == Status::Ok);
          CHECK(row.threads == threads);
          CHECK(row.peak_owned_bytes - point_io_bytes(config) == row.estimated_workspace_bytes);
        }
  }

  TEST_CASE("causal runs of models that cannot decode are unsupported rows with the reason") {
    for (const auto& model : registry()) {
      if (model.decodes()) continue;
      const ResultRow row = describe_point(quick_point(model.name, 64, true));
      CAPTURE(model.name);
      CHECK(row.status == Status::Unsupported);
      CHECK_FALSE(row.reason.empty());
      CHECK(row.reason.find("cannot decode") != std::string::npos);
    }
  }

  TEST_CASE("layer scope runs the encoder layer around the mechanism") {
    const auto row = run_point(quick_point("exact-tiled", 70, true, Scope::Layer));
    CHECK(row.status == Status::Ok);
    CHECK(row.d_ff == 4 * 2 * 32);
    CHECK(row.flops > 0);
    CHECK(row.reproducer.find("--scope layer") != std::string::npos);
  }
}
