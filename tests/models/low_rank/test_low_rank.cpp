// Linformer and Synthesizer against their own formulas computed naively in double (with the
// parameter tensors the mechanism reports), the settings that make them exact softmax attention,
// and the scaling of their counters.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/models/low_rank/synthesizer_reference.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

// P·X for one head: P [k, N] (row stride N), X [N, D]; in float so reference_attention can use it.
std::vector<float> project(const float* projection, const float* x, std::int64_t k, std::int64_t n, std::int64_t d) {
  std::vector<float> out(static_cast<std::size_t>(k * d));
  for (std::int64_t i = 0; i < k; ++i)
    for (std::int64_t c = 0; c < d; ++c) {
      double s = 0;
      for (std::int64_t j = 0; j < n; ++j) s += static_cast<double>(projection[i * n + j]) * x[j * d + c];
      out[i * d + c] = static_cast<float>(s);
    }
  return out;
}

struct LinformerMatrices {
  const float* e;
  const float* f;
};

LinformerMatrices linformer_matrices(const MechanismRun& run, const std::string& sharing, std::int64_t head,
                                     std::int64_t k, std::int64_t n) {
  if (sharing == "key-value") {
    const float* ef = run.parameter("projection_ef").data();
    return {ef, ef};
  }
  const std::int64_t offset = sharing == "per-head" ? head * k * n : 0;
  return {run.parameter("projection_e").data() + offset, run.parameter("projection_f").data() + offset};
}

}  // namespace

TEST_SUITE("low_rank") {
  TEST_CASE("linformer with k >= N and E = F = I is exact softmax attention, every sharing mode") {
    for (const char* sharing : {"per-head", "headwise", "key-value"})
      for (std::int64_t n : {1, 17, 64, 100}) {
        const Problem p{.batch = 2, .heads = 3, .seq_len = n, .head_dim = 16, .causal = false};
        const auto in = random_inputs(p, static_cast<std::uint64_t>(n));
        const Tensor out = run_mechanism(
            "linformer", p, in,
            {"projection=identity", "sharing=" + std::string(sharing), "k=" + std::to_string(n == 100 ? 100 : 256)});
        check_against_reference(out, in, p, full_mask,
                                std::string("linformer identity ") + sharing + " N=" + std::to_string(n));
      }
  }

  TEST_CASE("linformer equals softmax(Q(EK)ᵀ/√D)(FV) with its Gaussian projections") {
    // k = 16: N at k − 1 (k clamps to N), k, k + 1 and non-multiples.
    for (const char* sharing : {"per-head", "headwise", "key-value"})
      for (std::int64_t n : {15, 16, 17, 40, 100}) {
        const Problem p{.batch = 2, .heads = 3, .seq_len = n, .head_dim = 8, .causal = false};
        const auto in = random_inputs(p, static_cast<std::uint64_t>(n) + 7);
        const auto run = run_keeping("linformer", p, in, {"k=16", "sharing=" + std::string(sharing)});
        const std::int64_t k = std::min<std::int64_t>(16, n), d = p.head_dim;
        for (std::int64_t b = 0; b < p.batch; ++b)
          for (std::int64_t h = 0; h < p.heads; ++h) {
            const auto [e, f] = linformer_matrices(run, sharing, h, k, n);
            const auto keys = project(e, in.k.head(b, h), k, n, d), values = project(f, in.v.head(b, h), k, n, d);
            const double scale = 1.0 / std::sqrt(static_cast<double>(d));
            const auto want =
                reference_attention(in.q.head(b, h), keys.data(), values.data(), n, k, d, scale, full_mask);
            const double tolerance = attention_tolerance(in.q.head(b, h), keys.data(), values.data(), n, k, d, scale);
            check_head(run.out.head(b, h), want, n, d, tolerance,
                       std::string("linformer ") + sharing + " N=" + std::to_string(n) + " b=" + std::to_string(b) +
                           " h=" + std::to_string(h));
          }
      }
  }

  TEST_CASE("linformer gradients of q, k, v and the projections, every sharing mode (central differences)") {
    // out = softmax(Q·(E·K)ᵀ/√D)·(F·V) per (batch, head) in double; E, F by sharing mode.
    auto reference = [](const Problem& p, std::int64_t k, const std::string& sharing) {
      return [=](const NamedValues& x) {
        const std::int64_t n = p.seq_len, d = p.head_dim;
        const bool kv = sharing == "key-value", per_head = sharing == "per-head";
        const std::vector<double>& e = x.at(kv ? "projection_ef" : "projection_e");
        const std::vector<double>& f = x.at(kv ? "projection_ef" : "projection_f");
        std::vector<double> out;
        for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
          const std::int64_t offset = per_head ? head % p.heads * k * n : 0;
          auto projected = [&](const std::vector<double>& w, const char* name) {
            std::vector<double> y(static_cast<std::size_t>(k * d), 0.0);
            for (std::int64_t i = 0; i < k; ++i)
              for (std::int64_t j = 0; j < n; ++j)
                for (std::int64_t c = 0; c < d; ++c)
                  y[i * d + c] += w[offset + i * n + j] * x.at(name)[(head * n + j) * d + c];
            return y;
          };
          const auto keys = projected(e, "k"), values = projected(f, "v");
          const auto one = reference_attention(x.at("q").data() + head * n * d, keys.data(), values.data(), n, k, d,
                                               1.0 / std::sqrt(static_cast<double>(d)), full_mask);
          out.insert(out.end(), one.begin(), one.end());
        }
        return out;
      };
    };
    for (const char* sharing : {"per-head", "headwise", "key-value"})
      for (auto [n, every] : {std::pair<std::int64_t, bool>{3, true}, {4, true}, {5, true}, {40, false}}) {
        // k = 4: N one below (k clamps to N), at and above it.
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 3};
        check_composite_gradients("linformer", p, {"k=4", "sharing=" + std::string(sharing)},
                                  reference(p, std::min<std::int64_t>(4, n), sharing), every);
      }
  }

  TEST_CASE("synthesizer gradients of q, k, v and every variant's parameters, causal and not, mixed and not") {
    // L = (1 − α)·L_syn + α·Q·Kᵀ/√D; out = softmax(L restricted to j ≤ i when causal)·V, in double.
    auto reference = [](const Problem& p, const std::string& variant, double alpha) {
      return [=](const NamedValues& x) {
        const std::int64_t n = p.seq_len, d = p.head_dim;
        std::vector<double> out;
        for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
          const std::int64_t h = head % p.heads;
          const double* q = x.at("q").data() + head * n * d;
          const double* k = x.at("k").data() + head * n * d;
          const double* v = x.at("v").data() + head * n * d;
          auto synthetic = [&](std::int64_t i, std::int64_t j) {
            if (variant == "random") return x.at("r")[(h * n + i) * n + j];
            if (variant == "factorized-random") {
              const std::int64_t rank = static_cast<std::int64_t>(x.at("r1").size()) / (p.heads * n);
              double s = 0;
              for (std::int64_t c = 0; c < rank; ++c)
                s += x.at("r1")[(h * n + i) * rank + c] * x.at("r2")[(h * n + j) * rank + c];
              return s;
            }
            double s = x.at("b2")[h * n + j];
            for (std::int64_t o = 0; o < d; ++o) {
              double pre = x.at("b1")[h * d + o];
              for (std::int64_t c = 0; c < d; ++c) pre += q[i * d + c] * x.at("w1")[(h * d + c) * d + o];
              s += std::max(pre, 0.0) * x.at("w2")[(h * d + o) * n + j];
            }
            return s;
          };
          for (std::int64_t i = 0; i < n; ++i) {
            std::vector<double> logits;
            for (std::int64_t j = 0; j <= (p.causal ? i : n - 1); ++j) {
              double dot = 0;
              for (std::int64_t c = 0; c < d; ++c) dot += q[i * d + c] * k[j * d + c];
              logits.push_back((1 - alpha) * synthetic(i, j) + alpha * dot / std::sqrt(static_cast<double>(d)));
            }
            const double peak = *std::max_element(logits.begin(), logits.end());
            double total = 0;
            for (double& l : logits) total += (l = std::exp(l - peak));
            for (std::int64_t c = 0; c < d; ++c) {
              double sum = 0;
              for (std::size_t j = 0; j < logits.size(); ++j) sum += logits[j] / total * v[j * d + c];
              out.push_back(sum);
            }
          }
        }
        return out;
      };
    };
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (double alpha : {0.0, 0.5})
        for (bool causal : {false, true})
          for (auto [n, every] : {std::pair<std::int64_t, bool>{1, true}, {4, true}, {33, false}}) {
            const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 3, .causal = causal};
            check_composite_gradients(
                "synthesizer", p,
                {"variant=" + std::string(variant), "factor_rank=2", "vanilla_weight=" + std::to_string(alpha)},
                reference(p, variant, alpha), every);
          }
  }

  TEST_CASE("linformer projections: shapes per sharing mode, entries N(0, 1/k), distinct per head") {
    const Problem p{.batch = 1, .heads = 4, .seq_len = 512, .head_dim = 8, .causal = false};
    const auto in = random_inputs(p, 1);
    const auto per_head = run_keeping("linformer", p, in, {"k=64"});
    REQUIRE(per_head.parameter("projection_e").shape() == Shape{4, 64, 512});
    REQUIRE(per_head.parameter("projection_f").shape() == Shape{4, 64, 512});
    const Tensor& e = per_head.parameter("projection_e");
    double sum = 0, squares = 0;
    for (float x : e.values()) {
      sum += x;
      squares += static_cast<double>(x) * x;
    }
    const double count = static_cast<double>(e.size()), mean = sum / count;
    CHECK(std::fabs(mean) < 0.002);
    CHECK(std::fabs(squares / count - 1.0 / 64) < 0.02 / 64);  // 131072 samples: relative sd 0.4%
    CHECK(std::memcmp(e.data(), e.data() + 64 * 512, 64 * 512 * sizeof(float)) != 0);
    CHECK(std::memcmp(e.data(), per_head.parameter("projection_f").data(), 64 * 512 * sizeof(float)) != 0);
    const auto headwise = run_keeping("linformer", p, in, {"k=64", "sharing=headwise"});
    CHECK(headwise.parameter("projection_e").shape() == Shape{64, 512});
    CHECK(headwise.mechanism->parameters().size() == 2);
    const auto shared = run_keeping("linformer", p, in, {"k=64", "sharing=key-value"});
    CHECK(shared.parameter("projection_ef").shape() == Shape{64, 512});
    CHECK(shared.mechanism->parameters().size() == 1);
  }

  TEST_CASE("linformer: identity projection needs k >= N") {
    const ModelInfo* info = find_model("linformer");
    REQUIRE(info != nullptr);
    const Problem p{.batch = 1, .heads = 1, .seq_len = 300, .head_dim = 8, .causal = false};
    CHECK_THROWS_AS(validate_point(counter_point("linformer", p, {"projection=identity"})), ParamError);
    CHECK_NOTHROW(validate_point(counter_point("linformer", p, {"projection=identity", "k=300"})));
    CHECK_THROWS_AS(resolve_params("linformer", info->impl.params, {"k=0"}), ParamError);
    CHECK_THROWS_AS(resolve_params("linformer", info->impl.params, {"sharing=layerwise"}), ParamError);
  }

  TEST_CASE("linformer: FLOPs and tracked peak memory grow linearly in N") {
    const auto small = quick_row("linformer", 1024, false), mid = quick_row("linformer", 2048, false),
               large = quick_row("linformer", 4096, false);
    CHECK(large.flops == 2 * mid.flops);
    CHECK(mid.flops == 2 * small.flops);
    const double peak_ratio = static_cast<double>(large.peak_tensor_bytes) / static_cast<double>(mid.peak_tensor_bytes);
    CHECK(peak_ratio > 1.9);
    CHECK(peak_ratio < 2.1);
  }

  TEST_CASE("synthesizer variants equal their naive formulas, causal and not, with and without + Vanilla") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (double mix : {0.0, 0.3})
        for (std::int64_t n : {1, 7, 33, 100})
          for (bool causal : {false, true}) {
            const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
            const auto in = random_inputs(p, static_cast<std::uint64_t>(n) + 3);
            std::vector<std::string> params{"variant=" + std::string(variant), "vanilla_weight=" + std::to_string(mix)};
            if (n == 33) params.push_back("factor_rank=3");
            const auto run = run_keeping("synthesizer", p, in, params);
            for (std::int64_t b = 0; b < p.batch; ++b)
              for (std::int64_t h = 0; h < p.heads; ++h) {
                const auto logits =
                    synthesizer_logits(run, variant, mix, in.q.head(b, h), in.k.head(b, h), h, n, p.head_dim);
                check_head(run.out.head(b, h), softmax_times_v(logits, in.v.head(b, h), n, p.head_dim, causal), n,
                           p.head_dim, logits_tolerance(logits, in.v.head(b, h), n, p.head_dim),
                           std::string("synthesizer ") + variant + " mix=" + std::to_string(mix) +
                               " N=" + std::to_string(n) + (causal ? " causal" : "") + " b=" + std::to_string(b) +
                               " h=" + std::to_string(h));
              }
          }
  }

  TEST_CASE("synthesizer with vanilla_weight=1 is exact softmax attention") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (bool causal : {false, true}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 16, .causal = causal};
        const auto in = random_inputs(p, 4);
        const Tensor out = run_mechanism("synthesizer", p, in, {"variant=" + std::string(variant), "vanilla_weight=1"});
        check_against_reference(out, in, p, causal ? MaskFn(causal_mask) : MaskFn(full_mask),
                                std::string("synthesizer ") + variant + " vanilla_weight=1");
      }
  }

  TEST_CASE("synthesizer: random logits ignore Q and K unless mixed; dense ignores K") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 50, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 8);
    auto changed = random_inputs(p, 9);
    changed.v = in.v.clone();
    for (const char* variant : {"random", "factorized-random"}) {
      const Tensor a = run_mechanism("synthesizer", p, in, {"variant=" + std::string(variant)});
      const Tensor b = run_mechanism("synthesizer", p, changed, {"variant=" + std::string(variant)});
      CHECK(std::memcmp(a.data(), b.data(), a.bytes()) == 0);
      const Tensor c =
          run_mechanism("synthesizer", p, changed, {"variant=" + std::string(variant), "vanilla_weight=0.5"});
      CHECK(std::memcmp(a.data(), c.data(), a.bytes()) != 0);
    }
    changed.q = in.q.clone();
    const Tensor a = run_mechanism("synthesizer", p, in, {"variant=dense"});
    const Tensor b = run_mechanism("synthesizer", p, changed, {"variant=dense"});
    CHECK(std::memcmp(a.data(), b.data(), a.bytes()) == 0);
  }

  TEST_CASE("synthesizer causal: changing future tokens changes no earlier output") {
    for (const char* variant : {"dense", "random", "factorized-random"})
      for (const char* mix : {"0", "0.5"}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = 120, .head_dim = 8, .causal = true};
        auto in = random_inputs(p, 6);
        const std::vector<std::string> params{"variant=" + std::string(variant), "vanilla_weight=" + std::string(mix)};
        const Tensor before = run_mechanism("synthesizer", p, in, params);
        const std::int64_t cut = 80, d = p.head_dim;
        for (std::int64_t h = 0; h < p.heads; ++h)
          for (std::int64_t e = cut * d; e < p.seq_len * d; ++e) {
            in.k.head(0, h)[e] += 3.0f;
            in.v.head(0, h)[e] -= 5.0f;
            in.q.head(0, h)[e] *= -1.0f;
          }
        const Tensor after = run_mechanism("synthesizer", p, in, params);
        CAPTURE(variant);
        CAPTURE(mix);
        for (std::int64_t h = 0; h < p.heads; ++h) {
          CHECK(std::memcmp(before.head(0, h), after.head(0, h), cut * d * sizeof(float)) == 0);
          CHECK(std::memcmp(before.head(0, h) + cut * d, after.head(0, h) + cut * d, d * sizeof(float)) != 0);
        }
      }
  }

  TEST_CASE("synthesizer parameters are validated") {
    const ModelInfo* info = find_model("synthesizer");
    REQUIRE(info != nullptr);
    CHECK_THROWS_AS(resolve_params("synthesizer", info->impl.params, {"variant=factorized-dense"}), ParamError);
    CHECK_THROWS_AS(resolve_params("synthesizer", info->impl.params, {"vanilla_weight=1.5"}), ParamError);
    CHECK_THROWS_AS(resolve_params("synthesizer", info->impl.params, {"vanilla_weight=-0.1"}), ParamError);
    CHECK_THROWS_AS(resolve_params("synthesizer", info->impl.params, {"factor_rank=0"}), ParamError);
  }

  TEST_CASE("synthesizer is O(N²) by design: FLOPs and memory grow fourfold when N doubles") {
    for (const char* variant : {"dense", "random", "factorized-random"}) {
      const auto mid = quick_row("synthesizer", 1024, false, {"variant=" + std::string(variant)});
      const auto large = quick_row("synthesizer", 2048, false, {"variant=" + std::string(variant)});
      CAPTURE(variant);
      const double flops_ratio = static_cast<double>(large.flops) / static_cast<double>(mid.flops);
      CHECK(flops_ratio > 3.9);
      CHECK(flops_ratio < 4.1);
      const double workspace_ratio =
          static_cast<double>(large.workspace_bytes) / static_cast<double>(mid.workspace_bytes);
      CHECK(workspace_ratio > 3.5);
      CHECK(workspace_ratio < 4.2);
    }
  }
}
