// memory-compressed in bf16 (taxonomy/fixed_patterns/memory_compressed.hpp), in two parts so each
// bound is the plain one of its rounding points (u = 2⁻⁸, ε the fp32 unit roundoff):
//   - the compressed memories K̂, V̂ the model keeps, against the float64 convolution of the same bf16
//     rows with the fp32 weights: a slot element is an fp32 sum of c·D products, rounded once, so
//     |K̂ − K̂*| ≤ (1 + u)·1.01·c·D·ε·T + u·|K̂*|, T the sum of the products' magnitudes;
//   - the output against float64 softmax attention over what each head's queries see — the bf16 rows
//     of its block (local heads) or the model's own bf16 slots (compressed heads) — with the mask of
//     the pattern, within the softmax bound 2u(1 + u)·max|v| + the fp32 bound (tests/support/bf16_check.hpp).
// The gradients (tests/support/bf16_level.hpp) on the tensors the model stored: a local head's dq, dk, dv
// are one level over its block, each within the level's bound + u·|computed| (the one rounding; δ's
// error is the stored output's actual error, as every query sees one level); a
// compressed head's dq likewise over its slots, whose fp32 dK̂, dV̂ (within the level's bound B) go
// through the convolution's backward in double:
//   dk[t·c + u, i] = Σ_o W[o, i, u]·dK̂[t, o]: within Σ_o |W|·B + 1.01·D·ε·Σ_o |W|·(|dK̂| + B), then u·|computed|;
//   dW[o, i, u] = Σ_b Σ_t k[t·c + u, i]·dK̂[t, o] (fp32, not rounded): within Σ |k|·B + 1.01·(B·N_c + 2)·ε·Σ |k|·(|dK̂| +
//   B).
// Decoding against the bf16 causal forward (check_bf16_decode): a completed window's slot is the
// forward's bit for bit (compress_slot), the steps round P and O as the tiles do.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "taxonomy/fixed_patterns/memory_compressed.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/bf16_level.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

struct Case {
  std::int64_t block = 256, compression = 3;
  std::string mode = "split";
  std::int64_t tile = 64;
  std::vector<std::string> params() const {
    return {"block=" + std::to_string(block), "compression=" + std::to_string(compression), "mode=" + mode,
            "tile=" + std::to_string(tile)};
  }
  std::int64_t local_heads(std::int64_t heads) const {
    return mode == "local" ? heads : mode == "compressed" ? 0 : (heads + 1) / 2;
  }
};

// One compressed head's memory [slots, D] against the float64 convolution of its bf16 rows x [n, D]
// with its weights w [D_out, D_in, c]; returns the memory widened.
std::vector<float> check_memory(const bf16* got, const float* x, const float* w, std::int64_t n, std::int64_t d,
                                std::int64_t c, const std::string& label) {
  const std::int64_t slots = (n + c - 1) / c;
  std::vector<float> memory(static_cast<std::size_t>(slots * d));
  std::vector<double> want(memory.size());
  for (std::int64_t t = 0; t < slots; ++t)
    for (std::int64_t o = 0; o < d; ++o) {
      double sum = 0, terms = 0;
      for (std::int64_t u = 0; u < c && t * c + u < n; ++u)
        for (std::int64_t i = 0; i < d; ++i) {
          const double product = static_cast<double>(w[(o * d + i) * c + u]) * x[(t * c + u) * d + i];
          sum += product;
          terms += std::fabs(product);
        }
      const std::size_t at = static_cast<std::size_t>(t * d + o);
      want[at] = sum;
      memory[at] = to_float(got[at]);
      const double bound = (1 + kU) * 1.01 * static_cast<double>(c * d) * kFloatEps * terms + kU * std::fabs(sum);
      if (!(std::fabs(memory[at] - sum) <= bound))
        FAIL_CHECK(label << " slot " << t << " feature " << o << ": got " << memory[at] << ", want " << sum
                         << " (bound " << bound << ")");
    }
  return memory;
}

void check_case(const Problem& shape, const Case& c, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, block = std::min(c.block, n),
                     slots = (n + c.compression - 1) / c.compression;
  const std::string label = "memory-compressed bf16 N=" + std::to_string(n) + " block=" + std::to_string(c.block) +
                            " c=" + std::to_string(c.compression) + " " + c.mode + (p.causal ? " causal" : "");
  const Bf16Inputs in = bf16_inputs(p, seed);
  auto mechanism = bf16_mechanism("memory-compressed", p, c.params());
  Tensor out = Tensor::bhnd(p.batch, p.heads, n, d, DType::BF16);
  mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
  mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
  const Tensor got = to_f32(out);
  const auto* memories = dynamic_cast<const MemoryCompressedMemories*>(mechanism.get());
  REQUIRE(memories != nullptr);
  const std::int64_t local = c.local_heads(p.heads), hc_count = p.heads - local;
  const double scale = 1 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float* q = in.widened.q.head(b, h);
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      std::vector<float> keys(in.widened.k.head(b, h), in.widened.k.head(b, h) + n * d),
          values(in.widened.v.head(b, h), in.widened.v.head(b, h) + n * d);
      std::int64_t count = n;
      MaskFn mask = [&](std::int64_t i, std::int64_t j) { return i / block == j / block && (!p.causal || j <= i); };
      if (h >= local) {
        const std::int64_t hc = h - local, at = (b * hc_count + hc) * slots * d;
        const float* wk = parameter(*mechanism, "compress_wk").data() + hc * d * d * c.compression;
        const float* wv = parameter(*mechanism, "compress_wv").data() + hc * d * d * c.compression;
        keys = check_memory(memories->compressed_keys().bf16_data() + at, in.widened.k.head(b, h), wk, n, d,
                            c.compression, where + " K̂");
        values = check_memory(memories->compressed_values().bf16_data() + at, in.widened.v.head(b, h), wv, n, d,
                              c.compression, where + " V̂");
        count = slots;
        mask = [&](std::int64_t i, std::int64_t t) { return !p.causal || c.compression * t + c.compression - 1 <= i; };
      }
      const auto want = reference_attention(q, keys.data(), values.data(), n, count, d, scale, mask);
      const double bound = 2 * kU * (1 + kU) * max_abs_of(values.data(), count * d) +
                           attention_tolerance(q, keys.data(), values.data(), n, count, d, scale);
      check_bf16_elements(
          got.head(b, h), want, n * d, [&](std::int64_t) { return bound; }, where);
    }
}

// |got − want| ≤ computed + u·(|want| + computed) per element: a bf16 gradient computed within
// `computed` of want and rounded once.
void check_rounded(const float* got, const std::vector<double>& want, const std::vector<double>& computed,
                   std::int64_t count, const std::string& label) {
  check_bf16_elements(
      got, want, count,
      [&](std::int64_t e) {
        const auto at = static_cast<std::size_t>(e);
        return computed[at] + kU * (std::fabs(want[at]) + computed[at]) + 1e-30;
      },
      label);
}

// The bf16 training step's gradients against the float64 levels and convolution (the bound in the header).
void check_gradients(const Problem& shape, const Case& c, std::uint64_t seed) {
  const Problem p = on_test_threads(shape);
  const std::int64_t n = p.seq_len, d = p.head_dim, cw = c.compression, block = std::min(c.block, n),
                     slots = (n + cw - 1) / cw, local = c.local_heads(p.heads), hc_count = p.heads - local;
  const std::string label = "memory-compressed bf16 gradients N=" + std::to_string(n) +
                            " block=" + std::to_string(c.block) + " c=" + std::to_string(cw) + " " + c.mode +
                            (p.causal ? " causal" : "");
  const Bf16GradientRun run = run_bf16_gradients("memory-compressed", p, c.params(), seed);
  const auto* memories = dynamic_cast<const MemoryCompressedMemories*>(run.mechanism.get());
  REQUIRE(memories != nullptr);
  const Tensor memory_k = to_f32(memories->compressed_keys()), memory_v = to_f32(memories->compressed_values());
  const KeysOf block_keys = [&](std::int64_t i) {
    const std::int64_t first = i / block * block;
    return std::pair{first, p.causal ? i + 1 : std::min(first + block, n)};
  };
  const KeysOf slot_keys = [&](std::int64_t i) {
    return std::pair<std::int64_t, std::int64_t>{0, p.causal ? std::min(slots, (i + 1) / cw) : slots};
  };
  const auto gradient = [&](const std::string& name) -> const Tensor& {
    for (const auto& g : run.mechanism->parameter_gradients())
      if (g.name == name) return *g.tensor;
    FAIL("no gradient " << name);
    return run.dq;
  };
  for (std::int64_t h = 0; h < p.heads; ++h) {
    const std::int64_t hc = h - local;
    // dW of a compressed head sums over the batch: [D_out, D_in, c] each for K and V.
    std::vector<double> dw_want[2], dw_bound[2];
    for (int which = 0; which < 2; ++which) {
      dw_want[which].assign(static_cast<std::size_t>(d * d * cw), 0.0);
      dw_bound[which] = dw_want[which];
    }
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::string where = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const float* q = run.in.widened.q.head(b, h);
      const std::vector<double> dout = widened(run.dout_widened.head(b, h), n * d);
      const float* stored = run.out.head(b, h);  // δ is read off it: its actual error goes into the bound
      if (h < local) {
        const LevelGrads g = level_backward(q, run.in.widened.k.head(b, h), run.in.widened.v.head(b, h), dout, {}, {},
                                            n, n, d, block_keys, stored);
        check_rounded(run.dq.head(b, h), g.dq, g.dq_bound, n * d, where + " dq");
        check_rounded(run.dk.head(b, h), g.dk, g.dk_bound, n * d, where + " dk");
        check_rounded(run.dv.head(b, h), g.dv, g.dv_bound, n * d, where + " dv");
        continue;
      }
      const std::int64_t at = (b * hc_count + hc) * slots * d;
      const LevelGrads g =
          level_backward(q, memory_k.data() + at, memory_v.data() + at, dout, {}, {}, n, slots, d, slot_keys, stored);
      check_rounded(run.dq.head(b, h), g.dq, g.dq_bound, n * d, where + " dq");
      for (int which = 0; which < 2; ++which) {
        const std::vector<double>& dmemory = which == 0 ? g.dk : g.dv;
        const std::vector<double>& dmemory_bound = which == 0 ? g.dk_bound : g.dv_bound;
        const float* w = parameter(*run.mechanism, which == 0 ? "compress_wk" : "compress_wv").data() + hc * d * d * cw;
        const float* x = (which == 0 ? run.in.widened.k : run.in.widened.v).head(b, h);
        std::vector<double> want(static_cast<std::size_t>(n * d)), computed(want.size());
        for (std::int64_t t = 0; t < slots; ++t)
          for (std::int64_t u = 0; u < cw && t * cw + u < n; ++u)
            for (std::int64_t i = 0; i < d; ++i) {
              double sum = 0, error = 0, terms = 0;
              for (std::int64_t o = 0; o < d; ++o) {
                const auto m = static_cast<std::size_t>(t * d + o);
                const double weight = w[(o * d + i) * cw + u];
                sum += weight * dmemory[m];
                error += std::fabs(weight) * dmemory_bound[m];
                terms += std::fabs(weight) * (std::fabs(dmemory[m]) + dmemory_bound[m]);
                const auto wi = static_cast<std::size_t>((o * d + i) * cw + u);
                const double input = x[(t * cw + u) * d + i];
                dw_want[which][wi] += input * dmemory[m];
                dw_bound[which][wi] +=
                    std::fabs(input) * (dmemory_bound[m] + 1.01 * static_cast<double>(p.batch * slots + 2) * kFloatEps *
                                                               (std::fabs(dmemory[m]) + dmemory_bound[m]));
              }
              const auto e = static_cast<std::size_t>((t * cw + u) * d + i);
              want[e] = sum;
              computed[e] = error + 1.01 * static_cast<double>(d) * kFloatEps * terms;
            }
        check_rounded((which == 0 ? run.dk : run.dv).head(b, h), want, computed, n * d,
                      where + (which ? " dv" : " dk"));
      }
    }
    if (h < local) continue;
    for (int which = 0; which < 2; ++which) {
      const float* got = gradient(which == 0 ? "dcompress_wk" : "dcompress_wv").data() + hc * d * d * cw;
      check_bf16_elements(
          got, dw_want[which], d * d * cw,
          [&](std::int64_t e) { return dw_bound[which][static_cast<std::size_t>(e)] + 1e-30; },
          label + " h=" + std::to_string(h) + (which ? " dWv" : " dWk"));
    }
  }
}

}  // namespace

TEST_SUITE("memory_compressed_bf16") {
  TEST_CASE(
      "memory-compressed in bf16: the slots against the float64 convolution, the output against attention "
      "over them, every path, causal and not") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (bool causal : {false, true}) {
        // Blocks and tiles one below, at and above; N not a multiple of c (a zero-padded last window).
        for (std::int64_t n : {1, 2, 3, 4, 15, 16, 17, 50})
          check_case({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                     {.block = 16, .compression = 3, .tile = 16}, static_cast<std::uint64_t>(n));
        for (const std::string mode : {"local", "compressed"})
          check_case({.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 32, .causal = causal},
                     {.block = 32, .compression = 4, .mode = mode, .tile = 16}, 3);
        for (std::int64_t n : {255, 256, 257})  // the default block 256, c = 3, tiles of 64
          check_case({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal}, {}, 5);
      }
    });
  }

  TEST_CASE("memory-compressed in bf16: gradients and the weights' against float64 on its stored slots, every path") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (bool causal : {false, true}) {
        // Blocks and tiles one below, at and above; N not a multiple of c (a zero-padded last window).
        for (std::int64_t n : {1, 2, 3, 4, 15, 16, 17, 50})
          check_gradients({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                          {.block = 16, .compression = 3, .tile = 16}, static_cast<std::uint64_t>(n));
        for (const std::string mode : {"local", "compressed"})
          check_gradients({.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 32, .causal = causal},
                          {.block = 32, .compression = 4, .mode = mode, .tile = 16}, 3);
      }
      // More than 256 full windows: the widened input in two chunks (256, 256 ± 1 windows of c = 1).
      for (std::int64_t n : {255, 256, 257, 513})
        check_gradients({.batch = 1, .heads = 1, .seq_len = n, .head_dim = 16},
                        {.block = 16, .compression = 1, .mode = "compressed", .tile = 64}, 5);
    });
  }

  TEST_CASE("memory-compressed's bf16 decode equals its bf16 causal forward across windows and blocks") {
    for_each_bf16_path([](const std::string& path) {
      CAPTURE(path);
      for (std::int64_t context : {1, 2, 3, 14, 15, 16, 17})
        check_bf16_decode("memory-compressed", {.batch = 2, .heads = 3, .head_dim = 16}, context, 7,
                          {"block=16", "compression=3", "tile=16"});
      check_bf16_decode("memory-compressed", {.batch = 1, .heads = 2, .head_dim = 32}, 40, 9,
                        {"block=8", "compression=4", "mode=compressed"});
    });
  }

  TEST_CASE(
      "memory-compressed bf16 rows: FLOPs as fp32's, halved inputs, slots and decode state, estimates exact (every "
      "pass)") {
    for (bool causal : {false, true})
      for (std::int64_t n : {100, 257})
        for (Pass pass : {Pass::Forward, Pass::Decode}) {
          if (pass == Pass::Decode && !causal) continue;
          const auto [a, b] = check_bf16_rows("memory-compressed", n, causal, pass, {"block=64"});
          if (pass == Pass::Decode) {
            CHECK(b.state_bytes > 0);
            CHECK(2 * b.state_bytes == a.state_bytes);
          }
        }
    for (bool causal : {false, true})
      for (Pass pass : {Pass::Backward, Pass::Train})
        for (const char* mode : {"mode=split", "mode=local", "mode=compressed"})
          check_bf16_rows("memory-compressed", 100, causal, pass, {"block=64", mode});
    check_bf16_rows("memory-compressed", 1100, false, Pass::Train, {"mode=compressed"});  // > 256 full windows
    check_bf16_head_dim_unsupported("memory-compressed");
  }
}
