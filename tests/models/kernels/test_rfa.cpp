// Random Feature Attention against its own formula in double: the N×N weighted form
//   w_ij = φ(q_i)·φ(k_j) · b_j · Π_{j<l≤i} a_l   (non-causal: a = b = 1, every j; causal: j ≤ i),
//   out_i = Σ_j w_ij v_j / max(Σ_j w_ij, floor),
// a different algorithm from the mechanism's recurrence; the gated recurrence, the clamped
// denominator, gradients by central differences, and the counters' linear scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

struct RfaCase {
  std::int64_t features = 64;
  bool gate = false;
  double floor = 1e-3;
  std::int64_t chunk = 64;
  std::vector<std::string> params() const {
    return {"features=" + std::to_string(features), std::string("gate=") + (gate ? "1" : "0"),
            "floor=" + std::to_string(floor), "chunk=" + std::to_string(chunk)};
  }
};

// The reference's output and, per element, the scale of its float rounding:
// (Σ_j |w|_ij·|v_jc| + |out_ic|·Σ_j |w|_ij) / den_i with |w|_ij = Σ_r |φ_r(q_i)·φ_r(k_j)|·b_j·Π a.
struct RfaReference {
  std::vector<double> out, scale;
  std::int64_t clamped = 0;  // rows whose denominator was clamped to the floor
};

// φ(x) of one row of head h (rfa.hpp), in double.
std::vector<double> features(const std::vector<double>& w, const std::vector<double>& sigma, std::int64_t h,
                             const double* x, std::int64_t r, std::int64_t d) {
  double norm = 0;
  for (std::int64_t c = 0; c < d; ++c) norm += x[c] * x[c];
  norm = std::max(std::sqrt(norm), 1e-12);
  std::vector<double> phi(static_cast<std::size_t>(2 * r));
  const double alpha = 1.0 / std::sqrt(static_cast<double>(r));
  for (std::int64_t j = 0; j < r; ++j) {
    double angle = 0;
    for (std::int64_t c = 0; c < d; ++c)
      angle +=
          w[static_cast<std::size_t>((h * r + j) * d + c)] * sigma[static_cast<std::size_t>(h * d + c)] * x[c] / norm;
    phi[static_cast<std::size_t>(j)] = alpha * std::sin(angle);
    phi[static_cast<std::size_t>(r + j)] = alpha * std::cos(angle);
  }
  return phi;
}

// x: "q", "k", "v", "sigma" and, gated, "gate_weight", "gate_bias"; w: W̃ [H, R, D].
RfaReference rfa_reference(const Problem& p, const RfaCase& c, const std::vector<double>& w, const NamedValues& x) {
  const std::int64_t n = p.seq_len, d = p.head_dim, r = c.features;
  RfaReference ref{std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * n * d)),
                   std::vector<double>(static_cast<std::size_t>(p.batch * p.heads * n * d)), 0};
  for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
    const std::int64_t h = head % p.heads;
    const double *q = x.at("q").data() + head * n * d, *k = x.at("k").data() + head * n * d,
                 *v = x.at("v").data() + head * n * d;
    std::vector<std::vector<double>> fq, fk;
    std::vector<double> a(static_cast<std::size_t>(n), 1.0), b(static_cast<std::size_t>(n), 1.0);
    for (std::int64_t t = 0; t < n; ++t) {
      fq.push_back(features(w, x.at("sigma"), h, q + t * d, r, d));
      fk.push_back(features(w, x.at("sigma"), h, k + t * d, r, d));
      if (!c.gate) continue;
      double u = x.at("gate_bias")[static_cast<std::size_t>(h)];
      for (std::int64_t e = 0; e < d; ++e) u += x.at("gate_weight")[static_cast<std::size_t>(h * d + e)] * k[t * d + e];
      a[static_cast<std::size_t>(t)] = 1.0 / (1.0 + std::exp(-u));
      b[static_cast<std::size_t>(t)] = 1.0 - a[static_cast<std::size_t>(t)];
    }
    for (std::int64_t i = 0; i < n; ++i) {
      std::vector<double> num(static_cast<std::size_t>(d), 0.0), abs_num(static_cast<std::size_t>(d), 0.0);
      double z = 0, abs_z = 0, decay = 1;  // decay = Π_{j<l≤i} a_l
      for (std::int64_t j = p.causal ? i : n - 1; j >= 0; --j) {
        double dot = 0, abs_dot = 0;
        for (std::int64_t m = 0; m < 2 * r; ++m) {
          const double term = fq[static_cast<std::size_t>(i)][static_cast<std::size_t>(m)] *
                              fk[static_cast<std::size_t>(j)][static_cast<std::size_t>(m)];
          dot += term;
          abs_dot += std::fabs(term);
        }
        const double weight = b[static_cast<std::size_t>(j)] * decay;
        z += weight * dot;
        abs_z += weight * abs_dot;
        for (std::int64_t e = 0; e < d; ++e) {
          num[static_cast<std::size_t>(e)] += weight * dot * v[j * d + e];
          abs_num[static_cast<std::size_t>(e)] += weight * abs_dot * std::fabs(v[j * d + e]);
        }
        decay *= a[static_cast<std::size_t>(j)];
      }
      const double den = std::max(z, c.floor);
      ref.clamped += z <= c.floor;
      for (std::int64_t e = 0; e < d; ++e) {
        const auto at = static_cast<std::size_t>((head * n + i) * d + e);
        ref.out[at] = num[static_cast<std::size_t>(e)] / den;
        ref.scale[at] = (abs_num[static_cast<std::size_t>(e)] + std::fabs(ref.out[at]) * abs_z) / den;
      }
    }
  }
  return ref;
}

std::vector<double> widen(const Tensor& t) { return widened(t.data(), t.size()); }

NamedValues named_inputs(const AttentionInputs& in, const MechanismRun& run, bool gate) {
  NamedValues x{{"q", widen(in.q)}, {"k", widen(in.k)}, {"v", widen(in.v)}, {"sigma", widen(run.parameter("sigma"))}};
  if (gate) {
    x["gate_weight"] = widen(run.parameter("gate_weight"));
    x["gate_bias"] = widen(run.parameter("gate_bias"));
  }
  return x;
}

std::string describe(const Problem& p, const RfaCase& c) {
  std::string label =
      "rfa N=" + std::to_string(p.seq_len) + " D=" + std::to_string(p.head_dim) + (p.causal ? " causal" : "");
  for (const auto& param : c.params()) label += " " + param;
  return label;
}

// Every element within 4·eps·(log2 N + D + 8) of its rounding scale (the features' angle sums
// over D, the dot products over 2R are pairwise-bounded by the |w| sums, the state over N).
// Returns the reference (for its clamp count).
RfaReference check_rfa(const Problem& p, const RfaCase& c, std::uint64_t seed, float input_scale = 1.0f) {
  auto in = random_inputs(p, seed);
  for (float& value : in.q.values()) value *= input_scale;
  for (float& value : in.k.values()) value *= input_scale;
  const auto run = run_keeping("rfa", p, in, c.params());
  const RfaReference ref = rfa_reference(p, c, widen(run.parameter("random_features")), named_inputs(in, run, c.gate));
  const double factor =
      4 * kFloatEps *
      (std::log2(static_cast<double>(std::max<std::int64_t>(p.seq_len, 2))) + static_cast<double>(p.head_dim) + 8);
  std::int64_t failures = 0;
  const std::string label = describe(p, c);
  for (std::int64_t e = 0; e < run.out.size(); ++e) {
    const double want = ref.out[static_cast<std::size_t>(e)],
                 tolerance = factor * (ref.scale[static_cast<std::size_t>(e)] + 1e-30);
    if (!(std::fabs(run.out[e] - want) <= tolerance) && failures++ < 3)
      FAIL_CHECK(label << ": element " << e << " (token " << (e / p.head_dim) % p.seq_len << "): got " << run.out[e]
                       << ", want " << want << " (tolerance " << tolerance << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
  return ref;
}

ModelReference gradient_reference(const Problem& p, const RfaCase& c) {
  // The random features of the gradient check's run (seed 7): they are drawn, not learned.
  const auto in = random_inputs(p, 7);
  const auto run = run_keeping("rfa", p, in, c.params(), 7);
  const std::vector<double> w = widen(run.parameter("random_features"));
  return [=](const NamedValues& x) {
    NamedValues all = x;
    if (!all.count("sigma")) all["sigma"] = std::vector<double>(static_cast<std::size_t>(p.heads * p.head_dim), 1.0);
    return rfa_reference(p, c, w, all).out;
  };
}

}  // namespace

TEST_SUITE("rfa") {
  TEST_CASE("rfa equals its N×N formula, non-causal and causal, at/±1 of the chunk and non-multiples") {
    for (bool causal : {false, true}) {
      for (std::int64_t n : {1, 2, 7, 8, 9, 16, 17, 23})
        check_rfa({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal}, {.features = 16, .chunk = 8},
                  static_cast<std::uint64_t>(n));
      for (std::int64_t n : {63, 64, 65, 129, 300})
        check_rfa({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal}, {},
                  static_cast<std::uint64_t>(n + 1));
    }
  }

  TEST_CASE("gated rfa (RFA-Gate) equals its decayed N×N formula, at/±1 of the chunk and non-multiples") {
    for (std::int64_t n : {1, 2, 7, 8, 9, 16, 17, 23})
      check_rfa({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = true},
                {.features = 16, .gate = true, .chunk = 8}, static_cast<std::uint64_t>(n + 100));
    for (std::int64_t n : {63, 64, 65, 300})
      check_rfa({.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true}, {.gate = true},
                static_cast<std::uint64_t>(n + 200));
  }

  TEST_CASE("rfa: denominators at and below the floor are clamped as the formula says") {
    // One or two random features: φ(q)·φ(k) = mean of cos(w·(q̂ − k̂)) is often ≤ 0, so rows clamp.
    std::int64_t clamped = 0;
    for (bool causal : {false, true})
      for (std::int64_t features : {1, 2})
        for (double floor : {1e-3, 1.0})
          for (std::int64_t n : {1, 2, 3, 5}) {
            const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal};
            clamped += check_rfa(p, {.features = features, .floor = floor, .chunk = 2},
                                 static_cast<std::uint64_t>(n + 10 * features), 3.0f)
                           .clamped;
          }
    CHECK(clamped > 10);  // the case is exercised
    // Gated: z_t is a convex combination of φ(q)·φ(k) terms, so it sits near 0 as well.
    for (std::int64_t n : {1, 4, 9})
      check_rfa({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = true},
                {.features = 2, .gate = true, .chunk = 4}, static_cast<std::uint64_t>(n + 50));
  }

  TEST_CASE("rfa's error against softmax attention on the normalised q, k falls as the feature count grows") {
    // With σ = 1: E[φ(q)·φ(k)] = exp(−‖q̂ − k̂‖²/2) = exp(q̂·k̂ − 1), so RFA estimates softmax(q̂·k̂ᵀ)·V.
    const Problem p{.batch = 1, .heads = 2, .seq_len = 128, .head_dim = 16, .causal = false};
    const auto in = random_inputs(p, 78);
    std::vector<std::vector<double>> exact;
    for (std::int64_t h = 0; h < p.heads; ++h) {
      std::vector<double> q = widened(in.q.head(0, h), p.seq_len * p.head_dim),
                          k = widened(in.k.head(0, h), p.seq_len * p.head_dim);
      for (auto* rows : {&q, &k})
        for (std::int64_t i = 0; i < p.seq_len; ++i) {
          double norm = 0;
          for (std::int64_t c = 0; c < p.head_dim; ++c)
            norm += (*rows)[i * p.head_dim + c] * (*rows)[i * p.head_dim + c];
          for (std::int64_t c = 0; c < p.head_dim; ++c) (*rows)[i * p.head_dim + c] /= std::sqrt(norm);
        }
      const std::vector<double> v = widened(in.v.head(0, h), p.seq_len * p.head_dim);
      exact.push_back(reference_attention(q.data(), k.data(), v.data(), p.seq_len, p.seq_len, p.head_dim, 1.0,
                                          [](std::int64_t, std::int64_t) { return true; }));
    }
    std::vector<double> errors;
    for (std::int64_t r : {16, 64, 256, 1024}) {
      double total = 0;
      for (std::uint64_t seed = 1; seed <= 4; ++seed) {
        const auto run = run_keeping("rfa", p, in, {"features=" + std::to_string(r)}, seed);
        for (std::int64_t h = 0; h < p.heads; ++h)
          for (std::int64_t e = 0; e < p.seq_len * p.head_dim; ++e)
            total += std::fabs(run.out.head(0, h)[e] - exact[static_cast<std::size_t>(h)][static_cast<std::size_t>(e)]);
      }
      errors.push_back(total / (4.0 * p.heads * p.seq_len * p.head_dim));
    }
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CAPTURE(errors[2]);
    CAPTURE(errors[3]);
    // Monte-Carlo error ~ 1/√R: each fourfold R should roughly halve it.
    for (std::size_t i = 1; i < errors.size(); ++i) CHECK(errors[i] < 0.8 * errors[i - 1]);
    CHECK(errors.back() < 0.35 * errors.front());
  }

  TEST_CASE("rfa: parameters per head, σ initialised to 1, the gate's tensors only with gate=1") {
    const Problem p{.batch = 1, .heads = 3, .seq_len = 5, .head_dim = 4, .causal = true};
    const auto in = random_inputs(p, 3);
    const auto run = run_keeping("rfa", p, in, {"features=6", "gate=1"});
    const Tensor& w = run.parameter("random_features");
    REQUIRE(w.rank() == 3);
    CHECK(w.dim(0) == 3);
    CHECK(w.dim(1) == 6);
    CHECK(w.dim(2) == 4);
    CHECK(std::memcmp(w.data(), w.data() + 24, 24 * sizeof(float)) != 0);  // heads draw their own
    for (float s : run.parameter("sigma").values()) CHECK(s == 1.0f);
    CHECK(run.parameter("gate_weight").size() == 12);
    CHECK(run.parameter("gate_bias").size() == 3);
    const auto plain = run_keeping("rfa", p, in, {"features=6"});
    CHECK(plain.mechanism->parameters().size() == 2);
  }

  TEST_CASE("rfa gradients (q, k, v, σ; gated also w_g, b_g) against central differences of the formula") {
    for (bool causal : {false, true})
      for (bool gate : {false, true}) {
        if (gate && !causal) continue;
        const RfaCase tiny{.features = 4, .gate = gate, .chunk = 2};
        for (std::int64_t n : {1, 2, 3, 5}) {  // every element: chunk 2 at/±1 and a partial last chunk
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 3, .causal = causal};
          check_composite_gradients("rfa", p, tiny.params(), gradient_reference(p, tiny), true);
        }
        const RfaCase c{.features = 16, .gate = gate, .chunk = 16};
        const Problem p{.batch = 2, .heads = 2, .seq_len = 50, .head_dim = 8, .causal = causal};
        check_composite_gradients("rfa", p, c.params(), gradient_reference(p, c), false);
      }
  }

  TEST_CASE("rfa causal: changing future tokens changes no earlier output") {
    for (const char* gate : {"gate=0", "gate=1"}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 150, .head_dim = 16, .causal = true};
      auto in = random_inputs(p, 5);
      const Tensor before = run_keeping("rfa", p, in, {gate}).out.clone();
      const std::int64_t cut = 100, d = p.head_dim;
      for (std::int64_t h = 0; h < p.heads; ++h)
        for (std::int64_t e = cut * d; e < p.seq_len * d; ++e) {
          in.k.head(0, h)[e] = 3.0f * in.k.head(0, h)[e] + 1.0f;
          in.v.head(0, h)[e] -= 5.0f;
          in.q.head(0, h)[e] *= -1.0f;
        }
      const Tensor after = run_keeping("rfa", p, in, {gate}).out.clone();
      CAPTURE(gate);
      for (std::int64_t h = 0; h < p.heads; ++h) {
        CHECK(std::memcmp(before.head(0, h), after.head(0, h), cut * d * sizeof(float)) == 0);
        CHECK(std::memcmp(before.head(0, h) + cut * d, after.head(0, h) + cut * d, d * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("rfa: FLOPs and tracked peak memory grow linearly in N; the state does not grow") {
    for (const char* gate : {"gate=0", "gate=1"})
      for (bool causal : {false, true}) {
        if (std::string(gate) == "gate=1" && !causal) continue;
        CAPTURE(gate);
        CAPTURE(causal);
        check_linear_counters("rfa", causal, {gate});
      }
  }

  TEST_CASE("rfa: gate=1 without --causal is an unsupported row; bad values are parameter errors") {
    const Problem full{.batch = 1, .heads = 1, .seq_len = 16, .head_dim = 8, .causal = false};
    const ResultRow row = run_point(counter_point("rfa", full, {"gate=1"}));
    CHECK(row.status == Status::Unsupported);
    CHECK(row.reason.find("causal only") != std::string::npos);
    CHECK(run_point(counter_point("rfa", full, {"gate=0"})).status == Status::Ok);
    const ModelInfo* info = find_model("rfa");
    REQUIRE(info != nullptr);
    for (const char* bad : {"features=0", "chunk=0", "floor=0", "floor=-1", "gate=maybe"})
      CHECK_THROWS_AS(resolve_params("rfa", info->impl.params, {bad}), ParamError);
  }
}
