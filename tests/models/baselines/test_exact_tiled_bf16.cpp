// exact-tiled in bf16 (issue 31): the forward, the gradients and the split-K decode on the bf16
// tile kernels against the float64 reference (bounds in tests/support/bf16_check.hpp), on every
// kernel path the host runs (vdpbf16ps, convert-and-FMA at 512 and 256 bits), at sizes one below,
// at and above the query block, the key tile, the 32-row strip and the 128-row backward strip;
// its FLOPs equal to fp32's, its bytes, and its estimate exact.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/tile_kernels.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

// Runs f(path name) with each bf16 kernel path of the host forced, restoring the host's choice.
template <class F>
void on_every_bf16_path(F f) {
  const KernelIsa isa = kernel_isa();
  const bool dot = bf16_dot_product();
  for (KernelIsa forced : supported_kernel_isas())
    for (bool use_dot : {false, true}) {
      if (use_dot && !(forced == KernelIsa::Avx512 && cpu_has_bf16_dot())) continue;
      force_kernel_isa(forced);
      force_bf16_dot(use_dot);
      f(bf16_kernels_name());
    }
  force_kernel_isa(isa);
  force_bf16_dot(dot);
}

const std::vector<std::string> kSmallBlocks = {"block_q=16", "block_k=32", "backward_block_k=32"};

}  // namespace

TEST_SUITE("exact_tiled_bf16") {
  TEST_CASE("exact-tiled in bf16 equals the float64 reference within the bf16 bound, on every kernel path") {
    on_every_bf16_path([](const std::string& path) {
      for (std::int64_t d : {16, 64})
        for (std::int64_t n : {1, 2, 15, 16, 17, 31, 32, 33, 63, 65, 97})
          for (bool causal : {false, true}) {
            const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = d, .causal = causal};
            const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n + d));
            const std::string label =
                path + " N=" + std::to_string(n) + " D=" + std::to_string(d) + (causal ? " causal" : "");
            const double over =
                check_bf16_head_errors(run_bf16("exact-tiled", p, in.bf16, kSmallBlocks), in.widened, p, causal, label);
            if (n >= 31) CHECK_MESSAGE(over > 1, label << ": the error never exceeds the fp32 bound");
          }
      // The default blocks (64 query rows, 1024-key tiles): one tile and past it.
      for (std::int64_t n : {1023, 1025})
        for (bool causal : {false, true}) {
          const Problem p{.batch = 1, .heads = 1, .seq_len = n, .head_dim = 64, .causal = causal};
          const auto in = bf16_inputs(p, 7);
          check_bf16_head_errors(run_bf16("exact-tiled", p, in.bf16), in.widened, p, causal,
                                 path + " default blocks N=" + std::to_string(n));
        }
    });
  }

  // The per-rounding bound of check_bf16_masked_gradients: the online backward forms P and dS in fp32
  // and rounds each once, as the block-sparse engine does.
  TEST_CASE("exact-tiled's bf16 gradients equal the float64 reference's within the bf16 bound, on every path") {
    const auto check = [](const Problem& p, const std::vector<std::string>& params, std::uint64_t seed,
                          const std::string& label) {
      const MaskFn mask = p.causal ? MaskFn(causal_mask) : MaskFn(full_mask);
      check_bf16_masked_gradients(
          "exact-tiled", p, params, seed, [&mask](std::int64_t) { return mask; }, label);
    };
    on_every_bf16_path([&check](const std::string& path) {
      for (std::int64_t n : {1, 17, 33, 127, 128, 129, 200})
        for (bool causal : {false, true})
          check({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal}, kSmallBlocks,
                static_cast<std::uint64_t>(n) + 5, path + " N=" + std::to_string(n) + (causal ? " causal" : ""));
      check({.batch = 1, .heads = 1, .seq_len = 600, .head_dim = 64, .causal = true}, {}, 3,
            path + " default blocks N=600 causal");
    });
  }

  TEST_CASE("exact-tiled's bf16 split-K decode equals its bf16 causal forward, with half the state") {
    on_every_bf16_path([](const std::string& path) {
      CAPTURE(path);
      // block_k=32 gives several splits per head from a context of 64 on (2 threads, 1 head).
      for (std::int64_t context : {1, 15, 16, 17, 70, 200})
        check_bf16_decode("exact-tiled", {.batch = 1, .heads = 1, .head_dim = 64}, context, 6, {"block_k=32"});
      check_bf16_decode("exact-tiled", {.batch = 2, .heads = 2, .head_dim = 16}, 40, 5);
    });
  }

  TEST_CASE("exact-tiled bf16 rows: FLOPs as fp32's, halved inputs and state, the estimate exact") {
    for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode})
      for (bool causal : {false, true}) {
        if (pass == Pass::Decode && !causal) continue;
        for (std::int64_t n : {100, 257}) {
          const auto [a, b] = check_bf16_rows("exact-tiled", n, causal, pass);
          if (pass == Pass::Decode) {  // the cache in bf16 panels and pairs: half fp32's, to the panel padding
            const std::int64_t tokens = n + 5, heads = 2, d = 32;
            CHECK(b.state_bytes == heads * (tiles::panels_for(tokens) * 16 + (tokens + 1) / 2 * 2) * d * 2);
            CHECK(a.state_bytes == 2 * heads * tokens * d * 4);
          }
        }
      }
  }

  TEST_CASE("exact-tiled in bf16 with a head size its kernels do not take is unsupported, saying why") {
    check_bf16_head_dim_unsupported("exact-tiled");
  }
}
