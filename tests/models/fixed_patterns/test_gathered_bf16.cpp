// The bf16 form of the gathered-attention engine (taxonomy/engines/gathered_attention_bf16.hpp):
// `etc`, `bigbird` and `longformer` in bf16 against the float64 reference restricted to their
// masks on the same bf16 inputs, forward and gradients, on every bf16 kernel path of the host;
// longformer's global rows against the float64 projections; its decode against its bf16 causal
// forward; FLOPs, bytes and the workspace estimate.
//
// Bounds: the window/pattern rows use tests/support/bf16_check.hpp's (check_bf16_masked,
// check_bf16_masked_gradients): the rounding points are those of the block-sparse bf16 path (P
// after the exponent, before the division by Σ; O once; P and dS in the backward; dK/dV summed in
// fp32 and rounded once). Longformer's global rows add the rounding of q̃ and the projections; their
// bound is derived at global_row_bound below.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

MaskFn etc_mask(std::int64_t globals, std::int64_t radius) {
  return [=](std::int64_t i, std::int64_t j) { return i < globals || j < globals || std::abs(i - j) <= radius; };
}

// Longformer's non-global rows: window of s = w/2 dilated steps each side (causal: the past), plus the globals.
MaskFn longformer_mask(std::int64_t window, std::int64_t dilation, std::int64_t globals, bool causal) {
  return [=](std::int64_t i, std::int64_t j) {
    if (causal && j > i) return false;
    if (j < globals) return true;
    const std::int64_t offset = i - j, reach = window / 2 * dilation;
    if (offset % dilation != 0) return false;
    return causal ? offset >= 0 && offset <= reach : std::abs(offset) <= reach;
  };
}

// BigBird's pattern of head h from the random blocks the mechanism exposes ([H, nb, r], −1 unused).
MaskFn bigbird_mask(const Tensor& random, std::int64_t n, std::int64_t block, std::int64_t window, std::int64_t globals,
                    std::int64_t h) {
  const std::int64_t blocks = (n + block - 1) / block, front = (globals + 1) / 2, back = globals / 2;
  const std::int64_t before = (window - 1) / 2, after = window / 2, r = random.dim(2);
  std::vector<std::set<std::int64_t>> chosen(static_cast<std::size_t>(blocks));
  for (std::int64_t qb = 0; qb < blocks; ++qb)
    for (std::int64_t t = 0; t < r; ++t)
      if (random[(h * blocks + qb) * r + t] >= 0)
        chosen[static_cast<std::size_t>(qb)].insert(static_cast<std::int64_t>(random[(h * blocks + qb) * r + t]));
  const auto global = [=](std::int64_t blk) { return front + back >= blocks || blk < front || blk >= blocks - back; };
  return [=](std::int64_t i, std::int64_t j) {
    const std::int64_t qb = i / block, kb = j / block;
    return global(qb) || global(kb) || (kb >= qb - before && kb <= qb + after) ||
           chosen[static_cast<std::size_t>(qb)].count(kb) > 0;
  };
}

std::vector<std::string> bigbird_params(std::int64_t block, std::int64_t window, std::int64_t random,
                                        std::int64_t globals) {
  return {"block=" + std::to_string(block), "window_blocks=" + std::to_string(window),
          "random_blocks=" + std::to_string(random), "global_blocks=" + std::to_string(globals)};
}

struct LongformerCase {
  std::int64_t window, dilation, globals, tile;
  std::vector<std::string> params() const {
    return {"window=" + std::to_string(window), "dilation=" + std::to_string(dilation), "dilated_heads=1",
            "globals=" + std::to_string(globals), "tile=" + std::to_string(tile)};
  }
  std::int64_t dilation_of(std::int64_t h, std::int64_t heads) const { return h == heads - 1 ? dilation : 1; }
};

// The bf16 forward of a model, the mechanism kept (for its parameters).
struct Ran {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out;  // widened
};
Ran run(const std::string& model, const Problem& p, const AttentionInputs& in, const std::vector<std::string>& params) {
  Ran ran{bf16_mechanism(model, p, params), {}};
  Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  ran.mechanism->prepare(in.q, in.k, in.v);
  ran.mechanism->forward(in.q, in.k, in.v, out);
  ran.out = to_f32(out);
  return ran;
}

// y = x·w (x [n, d], w [d, d]) and y = x·wᵀ in double; |x|·|w| likewise (the magnitudes).
std::vector<double> times(const std::vector<double>& x, const float* w, std::int64_t n, std::int64_t d, bool transpose,
                          bool absolute = false) {
  std::vector<double> y(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < d; ++c)
      for (std::int64_t o = 0; o < d; ++o) {
        const double weight = transpose ? w[o * d + c] : w[c * d + o];
        y[static_cast<std::size_t>(i * d + o)] += absolute ? std::fabs(x[static_cast<std::size_t>(i * d + c)] * weight)
                                                           : x[static_cast<std::size_t>(i * d + c)] * weight;
      }
  return y;
}

// Longformer's global rows i < g against the float64 model out_i = softmax(scale·q̃*_i·Kᵀ)·V·Wv,
// q̃* = q_i·Wq·Wkᵀ (exact), causal: j ≤ i. The bound of the bf16 form's roundings (u = 2⁻⁸, ε =
// fp32's unit roundoff):
//   q̃ = bf16(fl(fl(q·Wq)·Wkᵀ)): |Δq̃_c| ≤ (u + 2D·ε)(1 + u)·M_c, M = |q|·|Wq|·|Wk|ᵀ (|q̃*| ≤ M);
//   so a score moves by ≤ e_j = scale·Σ_c |Δq̃_c|·|k_jc|, E = max_j e_j, and each p_j by a factor
//   within e^{±2E}: the attention output A by ≤ (e^{2E} − 1)·max|v|; rounding P adds u·max|v| and
//   the fp32 attention its bound (attention_tolerance at q̃*): ε_A;
//   out = bf16(fl(A·Wv)): |Δout_o| ≤ (ε_A + (u + D·ε)(1 + u)·max|v|)·Σ_c |Wv_co|  (|A_c| ≤ max|v|).
void check_global_rows(const Ran& ran, const AttentionInputs& widened, const Problem& p, std::int64_t globals,
                       const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim, g = std::min(globals, n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d)), eps = kFloatEps;
  const Tensor &wq = parameter(*ran.mechanism, "global_wq"), &wk = parameter(*ran.mechanism, "global_wk"),
               &wv = parameter(*ran.mechanism, "global_wv");
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float *q = widened.q.head(b, h), *k = widened.k.head(b, h), *v = widened.v.head(b, h);
      const float *wq_h = wq.data() + h * d * d, *wk_h = wk.data() + h * d * d, *wv_h = wv.data() + h * d * d;
      const std::vector<double> rows(q, q + g * d);
      const auto query = times(times(rows, wq_h, g, d, false), wk_h, g, d, true);
      std::vector<double> magnitude(static_cast<std::size_t>(g * d));
      for (std::size_t e = 0; e < magnitude.size(); ++e) magnitude[e] = std::fabs(rows[e]);
      magnitude = times(times(magnitude, wq_h, g, d, false, true), wk_h, g, d, true, true);
      const std::vector<float> query_f(query.begin(), query.end());
      const bool causal = p.causal;
      const MaskFn mask = [=](std::int64_t i, std::int64_t j) { return !causal || j <= i; };
      const auto attended = reference_attention(query_f.data(), k, v, g, n, d, scale, mask);
      const auto want = times(attended, wv_h, g, d, false);
      const double largest_v = max_abs_of(v, n * d);
      for (std::int64_t i = 0; i < g; ++i) {
        double worst_score = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          double e = 0;
          for (std::int64_t c = 0; c < d; ++c)
            e += (kU + 2 * d * eps) * (1 + kU) * magnitude[static_cast<std::size_t>(i * d + c)] *
                 std::fabs(k[j * d + c]);
          worst_score = std::max(worst_score, scale * e);
        }
        const double e_attended = (std::exp(2 * worst_score) - 1) * largest_v + kU * largest_v +
                                  attention_tolerance(query_f.data() + i * d, k, v, 1, n, d, scale);
        for (std::int64_t o = 0; o < d; ++o) {
          double column = 0;
          for (std::int64_t c = 0; c < d; ++c) column += std::fabs(wv_h[c * d + o]);
          const double bound = 1.01 * (e_attended + (kU + d * eps) * (1 + kU) * largest_v) * column;
          const double got = ran.out.head(b, h)[i * d + o], expected = want[static_cast<std::size_t>(i * d + o)];
          if (!(std::fabs(got - expected) <= bound))
            FAIL_CHECK(label << " global row " << i << " b=" << b << " h=" << h << " feature " << o << ": got " << got
                             << ", want " << expected << " (bound " << bound << ")");
        }
      }
    }
}

}  // namespace

TEST_SUITE("gathered_bf16") {
  TEST_CASE("etc in bf16 equals the float64 masked reference at/±1 of the radius, globals and tile, every path") {
    for_each_bf16_path([](const std::string& path) {
      struct Shape {
        std::int64_t globals, radius, tile;
        std::vector<std::int64_t> sizes;
      };
      for (const Shape& s : {Shape{0, 3, 16, {1, 15, 16, 17, 40}}, Shape{5, 3, 16, {1, 4, 5, 6, 33}},
                             Shape{17, 15, 16, {16, 17, 18, 50, 70}}, Shape{230, 84, 64, {229, 231, 300}}})
        for (std::int64_t n : s.sizes) {
          const Problem p = on_test_threads({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32});
          const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n + s.globals));
          const std::vector<std::string> params{"globals=" + std::to_string(s.globals),
                                                "radius=" + std::to_string(s.radius), "tile=" + std::to_string(s.tile)};
          const std::string label = "etc N=" + std::to_string(n) + " g=" + std::to_string(s.globals) + " " + path;
          const double over = check_bf16_masked(
              run("etc", p, in.bf16, params).out, in.widened, p,
              [&](std::int64_t) { return etc_mask(s.globals, s.radius); }, 0, label);
          if (n >= 15) CHECK_MESSAGE(over > 1, label << ": the error never exceeds the fp32 bound");
        }
    });
  }

  TEST_CASE("bigbird in bf16 equals the float64 reference with its exposed random blocks, every path") {
    for_each_bf16_path([](const std::string& path) {
      struct Shape {
        std::int64_t block, window, random, globals;
      };
      for (const Shape& s : {Shape{16, 3, 2, 2}, Shape{16, 4, 3, 1}, Shape{17, 1, 1, 0}, Shape{64, 3, 3, 2}})
        for (std::int64_t n : {1, 15, 16, 17, 63, 64, 65, 100, 200}) {
          const Problem p = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16});
          const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n));
          const auto params = bigbird_params(s.block, s.window, s.random, s.globals);
          const Ran ran = run("bigbird", p, in.bf16, params);
          const Tensor& random = parameter(*ran.mechanism, "random_blocks");
          const std::string label = "bigbird N=" + std::to_string(n) + " b=" + std::to_string(s.block) + " " + path;
          const double over = check_bf16_masked(
              ran.out, in.widened, p,
              [&](std::int64_t h) { return bigbird_mask(random, n, s.block, s.window, s.globals, h); }, 0, label);
          if (n >= 15) CHECK_MESSAGE(over > 1, label << ": the error never exceeds the fp32 bound");
        }
    });
  }

  TEST_CASE("longformer in bf16: window rows against the masked reference, global rows against the projections") {
    for_each_bf16_path([](const std::string& path) {
      for (const LongformerCase& c : {LongformerCase{16, 1, 0, 16}, LongformerCase{16, 3, 3, 16},
                                      LongformerCase{32, 2, 17, 16}, LongformerCase{512, 2, 1, 64}})
        for (std::int64_t n : {1, 15, 16, 17, 33, 100, 257, 600})
          for (bool causal : {false, true}) {
            if (c.window == 512 && n < 257) continue;
            const Problem p = on_test_threads({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal});
            const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n * 7 + c.globals));
            const Ran ran = run("longformer", p, in.bf16, c.params());
            const std::string label = "longformer N=" + std::to_string(n) + " w=" + std::to_string(c.window) +
                                      " g=" + std::to_string(c.globals) + (causal ? " causal " : " ") + path;
            const double over = check_bf16_masked(
                ran.out, in.widened, p,
                [&](std::int64_t h) { return longformer_mask(c.window, c.dilation_of(h, 2), c.globals, causal); },
                c.globals, label);
            check_global_rows(ran, in.widened, p, c.globals, label);
            if (n - c.globals >= 15) CHECK_MESSAGE(over > 1, label << ": the error never exceeds the fp32 bound");
          }
    });
  }

  TEST_CASE("etc and bigbird bf16 gradients equal the float64 reference's within the bf16 bound") {
    for_each_bf16_path([](const std::string& path) {
      for (std::int64_t n : {1, 15, 16, 17, 40, 70}) {
        const Problem p = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16});
        for (std::int64_t globals : {0, 5, 17})
          check_bf16_masked_gradients(
              "etc", p, {"globals=" + std::to_string(globals), "radius=3", "tile=16"}, static_cast<std::uint64_t>(n),
              [&](std::int64_t) { return etc_mask(globals, 3); },
              "etc N=" + std::to_string(n) + " g=" + std::to_string(globals) + " " + path);
        const auto params = bigbird_params(16, 3, 2, 2);
        // The random blocks the same seed draws (bf16_mechanism's 42): read from a forward's mechanism.
        const auto in = bf16_inputs(p, 1);
        const Ran ran = run("bigbird", p, in.bf16, params);
        const Tensor& random = parameter(*ran.mechanism, "random_blocks");
        check_bf16_masked_gradients(
            "bigbird", p, params, static_cast<std::uint64_t>(n),
            [&](std::int64_t h) { return bigbird_mask(random, n, 16, 3, 2, h); },
            "bigbird N=" + std::to_string(n) + " " + path);
      }
    });
  }

  TEST_CASE("longformer bf16 gradients without globals equal the float64 masked reference's, causal and not") {
    for_each_bf16_path([](const std::string& path) {
      for (const LongformerCase& c : {LongformerCase{16, 1, 0, 16}, LongformerCase{16, 3, 0, 16}})
        for (std::int64_t n : {1, 15, 16, 17, 40, 70})
          for (bool causal : {false, true}) {
            const Problem p = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal});
            check_bf16_masked_gradients(
                "longformer", p, c.params(), static_cast<std::uint64_t>(n),
                [&](std::int64_t h) { return longformer_mask(c.window, c.dilation_of(h, 2), 0, causal); },
                "longformer N=" + std::to_string(n) + " dilation " + std::to_string(c.dilation) +
                    (causal ? " causal " : " ") + path);
          }
    });
  }

  TEST_CASE("longformer bf16 gradients with globals: window rows' dq elementwise, the rest against fp32's") {
    // dq of a non-global row depends on its own window softmax only: the masked reference's bound.
    // dK, dV and the projection gradients mix the global rows' chain (q̃, dA, the saved P1 and A
    // rounded to bf16, besides the kernel's P, dS and the result): they are compared with the fp32
    // model's on the same inputs in the 2-norm, within 8u·‖g‖ — at most six bf16 roundings on any
    // path of the chain, each ≤ u relative on the terms it touches, here of the size of the result.
    // A normwise check, weaker than the elementwise ones above.
    const LongformerCase c{16, 3, 3, 16};
    for (std::int64_t n : {4, 17, 40, 70})
      for (bool causal : {false, true}) {
        const Problem p = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal});
        const std::string label = "longformer globals N=" + std::to_string(n) + (causal ? " causal" : "");
        check_bf16_masked_gradients(
            "longformer", p, c.params(), 5,
            [&](std::int64_t h) { return longformer_mask(c.window, c.dilation_of(h, 2), c.globals, causal); }, label,
            c.globals);
        const auto in = bf16_inputs(p, 5);
        Tensor dout32 = Tensor::bhnd(p.batch, p.heads, n, 16);
        CounterRng(9, "dout").fill_normal(dout32);
        const Tensor dout = to_bf16(dout32), dout_wide = to_f32(dout);
        std::vector<Tensor> grads[2];
        for (DType dtype : {DType::F32, DType::BF16}) {
          const bool half = dtype == DType::BF16;
          auto mechanism = half ? bf16_mechanism("longformer", p, c.params()) : [&] {
            const ModelInfo* info = find_model("longformer");
            return info->impl.create(p, resolve_params("longformer", info->impl.params, c.params()), 42);
          }();
          const AttentionInputs& x = half ? in.bf16 : in.widened;
          const auto bhnd = [&] { return Tensor::bhnd(p.batch, p.heads, n, 16, dtype); };
          Tensor out = bhnd(), dq = bhnd(), dk = bhnd(), dv = bhnd();
          mechanism->prepare(x.q, x.k, x.v);
          mechanism->prepare_backward();
          mechanism->forward(x.q, x.k, x.v, out);
          mechanism->backward(x.q, x.k, x.v, out, half ? dout : dout_wide, dq, dk, dv);
          for (Tensor* t : {&dq, &dk, &dv}) grads[half].push_back(half ? to_f32(*t) : std::move(*t));
          for (const auto& named : mechanism->parameter_gradients()) {
            Tensor copy(named.tensor->shape());
            std::copy_n(named.tensor->data(), copy.size(), copy.data());
            grads[half].push_back(std::move(copy));
          }
        }
        REQUIRE(grads[0].size() == 6);
        for (std::size_t g = 0; g < 6; ++g) {
          double diff = 0, norm = 0;
          for (std::int64_t e = 0; e < grads[0][g].size(); ++e) {
            const double a = grads[0][g].data()[e], b = grads[1][g].data()[e];
            diff += (a - b) * (a - b);
            norm += a * a;
          }
          CHECK_MESSAGE(std::sqrt(diff) <= 8 * kU * std::sqrt(norm),
                        label << " gradient " << g << ": ‖Δ‖ " << std::sqrt(diff) << ", ‖g‖ " << std::sqrt(norm));
        }
      }
  }

  TEST_CASE("longformer's bf16 decode, on bf16 global rows and window ring, equals its bf16 causal forward") {
    // check_bf16_decode's bound: the step rounds the forward tile's fp32 quantities in another order.
    struct DecodeCase {
      LongformerCase c;
      std::int64_t ring;  // s·d_max + 1
    };
    for (const DecodeCase& dc :
         {DecodeCase{{16, 1, 0, 16}, 9}, DecodeCase{{16, 3, 3, 16}, 25}, DecodeCase{{8, 2, 17, 16}, 9}})
      for (std::int64_t context : {17, 24, 25, 26, 40}) {
        const std::int64_t state =
            check_bf16_decode("longformer", {.batch = 1, .heads = 3, .head_dim = 16}, context, 20, dc.c.params());
        CHECK(state == 2 * 3 * (dc.c.globals + dc.ring) * 16 * 2);  // keys and values of globals and ring, bf16
      }
  }

  TEST_CASE("bf16 rows: FLOPs as fp32's, bytes halved where they should be, the workspace estimate exact") {
    struct RowCase {
      std::string model;
      std::vector<std::string> params;
      bool causal;
    };
    for (const RowCase& c :
         std::vector<RowCase>{{"etc", {}, false},
                              {"etc", {"globals=5", "radius=7", "tile=16"}, false},
                              {"bigbird", {}, false},
                              {"bigbird", {"block=16", "random_blocks=2"}, false},
                              {"longformer", {}, false},
                              {"longformer", {}, true},
                              {"longformer", {"window=16", "dilation=3", "globals=3", "tile=16"}, true}})
      for (std::int64_t n : {100, 257})
        for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
          if (pass == Pass::Decode && !c.causal) continue;
          const auto [a, b] = check_bf16_rows(c.model, n, c.causal, pass, c.params);
          if ((pass == Pass::Backward || pass == Pass::Train) && c.model != "longformer")
            CHECK(b.saved_bytes == a.saved_bytes);  // the fp32 log-sum-exp only
          if ((pass == Pass::Backward || pass == Pass::Train) && c.model == "longformer") {
            const std::int64_t lse = 4 * 1 * 2 * n;                   // quick_point: B = 1, H = 2
            CHECK(2 * (b.saved_bytes - lse) == a.saved_bytes - lse);  // the global projections in bf16
          }
          if (pass == Pass::Decode) {
            CHECK(b.state_bytes > 0);
            CHECK(2 * b.state_bytes == a.state_bytes);
          }
        }
  }

  TEST_CASE("a head dimension the bf16 tiles cannot take is an unsupported bf16 row, not fp32") {
    for (const std::string model : {"etc", "bigbird", "longformer"}) check_bf16_head_dim_unsupported(model);
  }
}
