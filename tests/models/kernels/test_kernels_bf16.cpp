// Performer and Linear Transformer in bf16 (issue 31) on the chunked linear-attention engine: the
// output and the gradients against the float64 kernel formula on the same bf16 inputs (widened
// exactly), at sizes around the chunk, causal and not; decoding on the bf16 state against the bf16
// causal forward; bytes, FLOPs and the workspace estimate.
//
// The bounds, with u = 2⁻⁸ (bf16's unit roundoff). The engine computes in fp32 from the bf16 values
// (features, chunk products, the fp32 running state, z), so its fp32 error is the fp32 tests' own
// bound tol32 = 8·eps·(weight error + log2 N + log2 M + 1)·max|v| (tests/models/kernels/
// test_kernels.cpp: a relative weight error becomes an absolute output error times |v|, the output
// being a convex combination of the rows of V). Rounding the output to bf16 adds ≤ u·|o|:
//   forward: |o − o_ref| ≤ u·|o_ref| + (1 + u)·tol32.
// Gradients, per element with T its reference terms (every product of the double formula taken in
// absolute value, below): the backward reads the bf16 output O (≤ u·|o| per element, entering
// G'[D] = −(dO·O)/z, so ≤ u·T) and rounds each gradient (≤ u·|g| ≤ u·T):
//   |g − g_ref| ≤ (2u(1 + u) + 2·rel32)·T,  rel32 = tol32 / max|v|.
// Decoding: the state S' is stored in bf16 and rounded once per token (the prefill's narrowing,
// then every step), so after r roundings each entry is within r·u of its magnitude sum (Σ φ(k)|v|
// for the numerator columns, Σ φ(k) for z; the shift rescales scale both alike); the ratio
// num/z then moves by ≤ r·u·(a + |o|)/(1 − r·u), a = Σ_j w_ij|v_j|/Z_i (≤ max|v|), and both
// outputs round to bf16 (≤ u·|o| each):
//   |o_step − o_forward| ≤ (1 + u)·(r·u/(1 − r·u)·(a + |o|) + 2u·|o|) + 2·tol32, r = step + 1.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/kernels/performer.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

enum class Map { Favor, Relu, Elu };

struct Case {
  const char* model;
  Map map;
  std::vector<std::string> params;
};

std::string describe(const Case& c, std::int64_t n, bool causal) {
  std::string s = c.model;
  for (const auto& param : c.params) s += " " + param;
  return s + " N=" + std::to_string(n) + (causal ? " causal" : "");
}

Problem in_bf16(Problem p) {
  p = on_test_threads(p);
  p.dtype = DType::BF16;
  return p;
}

std::unique_ptr<Mechanism> create_bf16(const Case& c, const Problem& p) {
  const ModelInfo* info = find_model(c.model);
  REQUIRE(info != nullptr);
  REQUIRE(info->impl.bf16_forward);
  return info->impl.create(in_bf16(p), resolve_params(c.model, info->impl.params, c.params), 42);
}

const Tensor* random_features(const Mechanism& mechanism) {
  for (const auto& named : mechanism.parameters())
    if (named.name == "random_features") return named.tensor;
  return nullptr;
}

// φ in double as the model headers define it (no stabilisers), with its Jacobian for the gradients.
class DoubleMap {
 public:
  DoubleMap(Map map, const Tensor* omega, std::int64_t d)
      : map_(map), omega_(omega), d_(d), m_(omega != nullptr ? omega->dim(0) : d) {
    if (map_ != Map::Elu) REQUIRE(omega_ != nullptr);
  }
  std::int64_t dim() const { return m_; }

  std::vector<double> phi(const float* x) const {
    std::vector<double> out(static_cast<std::size_t>(m_));
    if (map_ == Map::Elu) {
      for (std::int64_t c = 0; c < d_; ++c) out[c] = x[c] > 0 ? x[c] + 1.0 : std::exp(static_cast<double>(x[c]));
      return out;
    }
    const double a = alpha(), half_norm = 0.5 * a * a * squares(x);
    for (std::int64_t f = 0; f < m_; ++f) {
      const double dot = projection(f, x);
      out[f] = map_ == Map::Favor ? std::exp(a * dot - half_norm) / std::sqrt(static_cast<double>(m_))
                                  : std::max(a * dot, 0.0) + kPerformerReluStabiliser;
    }
    return out;
  }

  // dx[c] = Σ_f dphi[f]·∂φ_f/∂x_c and terms[c] = Σ_f dphi_terms[f]·|∂φ_f/∂x_c|. FAVOR+:
  // ∂φ_f/∂x = φ_f·(α·ω_f − α²·x); ReLU: [ω_f·x > 0]·α·ω_f; elu + 1: diagonal, 1 or e^x.
  void pullback(const float* x, const std::vector<double>& phi, const std::vector<double>& dphi,
                const std::vector<double>& dphi_terms, double* dx, double* terms) const {
    if (map_ == Map::Elu) {
      for (std::int64_t c = 0; c < d_; ++c) {
        const double slope = x[c] > 0 ? 1.0 : phi[c];
        dx[c] = dphi[c] * slope;
        terms[c] = dphi_terms[c] * slope;
      }
      return;
    }
    const double a = alpha();
    for (std::int64_t c = 0; c < d_; ++c) dx[c] = terms[c] = 0;
    for (std::int64_t f = 0; f < m_; ++f) {
      const bool active = map_ == Map::Favor || projection(f, x) > 0;
      if (!active) continue;
      for (std::int64_t c = 0; c < d_; ++c) {
        const double w = (*omega_)[f * d_ + c];
        const double slope = map_ == Map::Favor ? phi[f] * (a * w - a * a * x[c]) : a * w;
        const double magnitude =
            map_ == Map::Favor ? phi[f] * (a * std::fabs(w) + a * a * std::fabs(x[c])) : a * std::fabs(w);
        dx[c] += dphi[f] * slope;
        terms[c] += dphi_terms[f] * magnitude;
      }
    }
  }

  // The fp32 forms' bound on the relative error of a weight φ(q_i)·φ(k_j), in units of eps (as the
  // fp32 tests derive it): FAVOR+ 2·(Σ|α·ω_f·x| + α²‖x‖²/2) at its largest, for q plus for k;
  // ReLU Σ_f (t_q,f·φ_f(k) + φ_f(q)·t_k,f)/w_ij with t the projection's terms; elu + 1 two ulp.
  double weight_error(const float* q, const float* k, std::int64_t n) const {
    if (map_ == Map::Elu) return 2.0;
    const double a = alpha();
    auto terms = [&](const float* x) {
      std::vector<double> t(static_cast<std::size_t>(m_));
      for (std::int64_t f = 0; f < m_; ++f)
        for (std::int64_t c = 0; c < d_; ++c) t[f] += std::fabs(a * (*omega_)[f * d_ + c] * x[c]);
      return t;
    };
    if (map_ == Map::Favor) {
      double total = 0;
      for (const float* x : {q, k}) {
        double largest = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          const auto t = terms(x + i * d_);
          largest = std::max(largest, *std::max_element(t.begin(), t.end()) + 0.5 * a * a * squares(x + i * d_));
        }
        total += 2 * largest;
      }
      return total;
    }
    std::vector<std::vector<double>> tk, fk;
    for (std::int64_t j = 0; j < n; ++j) {
      tk.push_back(terms(k + j * d_));
      fk.push_back(phi(k + j * d_));
    }
    double largest = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto tq = terms(q + i * d_), fq = phi(q + i * d_);
      for (std::int64_t j = 0; j < n; ++j) {
        double spread = 0, weight = 0;
        for (std::int64_t f = 0; f < m_; ++f) {
          spread += tq[f] * fk[j][f] + fq[f] * tk[j][f];
          weight += fq[f] * fk[j][f];
        }
        largest = std::max(largest, spread / weight);
      }
    }
    return largest;
  }

  // tol32 / max|v|: the fp32 form's bound relative to max|v| (see the file comment).
  double fp32_relative(const float* q, const float* k, std::int64_t n) const {
    return 8 * kFloatEps *
           (weight_error(q, k, n) + std::log2(static_cast<double>(n)) + std::log2(static_cast<double>(m_)) + 1);
  }

 private:
  double alpha() const {
    return map_ == Map::Favor ? std::pow(static_cast<double>(d_), -0.25) : 1.0 / std::sqrt(static_cast<double>(m_));
  }
  double projection(std::int64_t f, const float* x) const {
    double dot = 0;
    for (std::int64_t c = 0; c < d_; ++c) dot += static_cast<double>((*omega_)[f * d_ + c]) * x[c];
    return dot;
  }
  double squares(const float* x) const {
    double s = 0;
    for (std::int64_t c = 0; c < d_; ++c) s += static_cast<double>(x[c]) * x[c];
    return s;
  }

  Map map_;
  const Tensor* omega_;
  std::int64_t d_, m_;
};

// One head of the kernel formula in double: out_i = Σ_j w_ij v_j / Z_i, w_ij = φ(q_i)·φ(k_j), Z_i = Σ_j w_ij
// (j ≤ i when causal); with dout, the gradients and their terms:
//   dv_j = Σ_i (w_ij/Z_i)·g_i;  dw_ij = g_i·(v_j − o_i)/Z_i;  dφ(q_i) = Σ_j dw_ij φ(k_j);  dφ(k_j) = Σ_i dw_ij φ(q_i);
// the terms the same sums of absolute values (|g_i|·|v_j| + |g_i|·|o_i| for dw_ij).
struct HeadReference {
  std::vector<double> out, magnitude;      // magnitude: Σ_j w_ij|v_j| / Z_i per element
  std::vector<double> grads[3], terms[3];  // dq, dk, dv
};
HeadReference kernel_reference(const DoubleMap& map, const float* q, const float* k, const float* v, const float* dout,
                               std::int64_t n, std::int64_t d, bool causal) {
  const std::int64_t m = map.dim();
  std::vector<std::vector<double>> fq, fk;
  for (std::int64_t i = 0; i < n; ++i) {
    fq.push_back(map.phi(q + i * d));
    fk.push_back(map.phi(k + i * d));
  }
  auto dot = [&](const std::vector<double>& a, const std::vector<double>& b) {
    double s = 0;
    for (std::int64_t f = 0; f < m; ++f) s += a[f] * b[f];
    return s;
  };
  std::vector<double> w(static_cast<std::size_t>(n * n), 0.0), z(static_cast<std::size_t>(n), 0.0);
  HeadReference ref;
  ref.out.assign(static_cast<std::size_t>(n * d), 0.0);
  ref.magnitude = ref.out;
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < (causal ? i + 1 : n); ++j) {
      w[i * n + j] = dot(fq[i], fk[j]);
      z[i] += w[i * n + j];
      for (std::int64_t c = 0; c < d; ++c) {
        ref.out[i * d + c] += w[i * n + j] * v[j * d + c];
        ref.magnitude[i * d + c] += w[i * n + j] * std::fabs(v[j * d + c]);
      }
    }
    for (std::int64_t c = 0; c < d; ++c) {
      ref.out[i * d + c] /= z[i];
      ref.magnitude[i * d + c] /= z[i];
    }
  }
  if (dout == nullptr) return ref;
  for (auto* g : {ref.grads, ref.terms})
    for (int t = 0; t < 3; ++t) g[t].assign(static_cast<std::size_t>(n * d), 0.0);
  std::vector<std::vector<double>> dfq(n, std::vector<double>(m)), dfq_terms = dfq, dfk = dfq, dfk_terms = dfq;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < (causal ? i + 1 : n); ++j) {
      const double p = w[i * n + j] / z[i];
      double dw = 0, dw_terms = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        const double g = dout[i * d + c], o = ref.out[i * d + c];
        ref.grads[2][j * d + c] += p * g;
        ref.terms[2][j * d + c] += p * std::fabs(g);
        dw += g * (v[j * d + c] - o);
        dw_terms += std::fabs(g) * (std::fabs(v[j * d + c]) + std::fabs(o));
      }
      dw /= z[i];
      dw_terms /= z[i];
      for (std::int64_t f = 0; f < m; ++f) {
        dfq[i][f] += dw * fk[j][f];
        dfq_terms[i][f] += dw_terms * fk[j][f];
        dfk[j][f] += dw * fq[i][f];
        dfk_terms[j][f] += dw_terms * fq[i][f];
      }
    }
  for (std::int64_t i = 0; i < n; ++i) {
    map.pullback(q + i * d, fq[i], dfq[i], dfq_terms[i], ref.grads[0].data() + i * d, ref.terms[0].data() + i * d);
    map.pullback(k + i * d, fk[i], dfk[i], dfk_terms[i], ref.grads[1].data() + i * d, ref.terms[1].data() + i * d);
  }
  return ref;
}

const std::vector<Case>& all_cases() {
  static const std::vector<Case> cases = {
      {"performer", Map::Favor, {}}, {"performer", Map::Relu, {"kernel=relu"}}, {"linear-transformer", Map::Elu, {}}};
  return cases;
}

}  // namespace

TEST_SUITE("kernels_bf16") {
  TEST_CASE("performer and linear-transformer in bf16 equal the float64 kernel formula, causal and not") {
    // Default chunks 64 (performer) and 32 (linear-transformer): one below, at and above one and two
    // chunks, and non-multiples.
    for (const auto& c : all_cases())
      for (std::int64_t n : {1, 2, 31, 32, 33, 63, 64, 65, 127, 129, 200})
        for (bool causal : {false, true}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n + 3));
          auto mechanism = create_bf16(c, p);
          Tensor out = Tensor::bhnd(1, 2, n, 16, DType::BF16);
          mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
          mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
          const Tensor got = to_f32(out);
          const DoubleMap map(c.map, random_features(*mechanism), 16);
          const std::string label = describe(c, n, causal);
          double over_fp32 = 0;
          for (std::int64_t h = 0; h < 2; ++h) {
            const float *q = in.widened.q.head(0, h), *k = in.widened.k.head(0, h), *v = in.widened.v.head(0, h);
            const auto ref = kernel_reference(map, q, k, v, nullptr, n, 16, causal);
            const double tol32 = map.fp32_relative(q, k, n) * max_abs(v, n * 16);
            std::int64_t failures = 0;
            for (std::int64_t e = 0; e < n * 16; ++e) {
              const double want = ref.out[static_cast<std::size_t>(e)], error = std::fabs(got.head(0, h)[e] - want);
              const double bound = kBf16Roundoff * std::fabs(want) + (1 + kBf16Roundoff) * tol32;
              over_fp32 = std::max(over_fp32, error / tol32);
              if (!(error <= bound) && failures++ < 3)
                FAIL_CHECK(label << " h=" << h << " token " << e / 16 << " feature " << e % 16 << ": got "
                                 << got.head(0, h)[e] << ", want " << want << " (bound " << bound << ")");
            }
            CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of the bf16 bound");
          }
          // Not fp32 in disguise: the bf16 rounding of the output shows past the fp32 bound (where that
          // bound is tight: ReLU's weight error, through features down at the 10⁻³ stabiliser, is not).
          if (n >= 31 && c.map != Map::Relu)
            CHECK_MESSAGE(over_fp32 > 1, label << ": the error never exceeds the fp32 bound");
        }
  }

  TEST_CASE("performer and linear-transformer bf16 gradients equal the float64 formula's, causal and not") {
    struct Size {
      std::int64_t n;
      const char* chunk;
    };
    for (const auto& base : all_cases())
      for (const Size size :
           {Size{1, ""}, Size{3, "chunk=4"}, Size{4, "chunk=4"}, Size{5, "chunk=4"}, Size{9, "chunk=4"}, Size{31, ""},
            Size{33, ""}, Size{63, ""}, Size{64, ""}, Size{65, ""}, Size{129, ""}})
        for (bool causal : {false, true}) {
          Case c = base;
          if (*size.chunk) c.params.push_back(size.chunk);
          const std::int64_t n = size.n, d = 16;
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = d, .causal = causal};
          const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n) + 11);
          Tensor dout32 = Tensor::bhnd(1, 2, n, d);
          CounterRng(13, "dout").fill_normal(dout32);
          const Tensor dout = to_bf16(dout32), dout_widened = to_f32(dout);
          auto mechanism = create_bf16(c, p);
          Tensor out = Tensor::bhnd(1, 2, n, d, DType::BF16), dq = Tensor::bhnd(1, 2, n, d, DType::BF16),
                 dk = Tensor::bhnd(1, 2, n, d, DType::BF16), dv = Tensor::bhnd(1, 2, n, d, DType::BF16);
          mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
          mechanism->prepare_backward();
          mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
          mechanism->backward(in.bf16.q, in.bf16.k, in.bf16.v, out, dout, dq, dk, dv);
          const Tensor got[3] = {to_f32(dq), to_f32(dk), to_f32(dv)};
          const DoubleMap map(c.map, random_features(*mechanism), d);
          const std::string label = describe(c, n, causal);
          for (std::int64_t h = 0; h < 2; ++h) {
            const float *q = in.widened.q.head(0, h), *k = in.widened.k.head(0, h), *v = in.widened.v.head(0, h);
            const auto ref = kernel_reference(map, q, k, v, dout_widened.head(0, h), n, d, causal);
            const double factor = 2 * kBf16Roundoff * (1 + kBf16Roundoff) + 2 * map.fp32_relative(q, k, n);
            for (int g = 0; g < 3; ++g) {
              std::int64_t failures = 0;
              for (std::int64_t e = 0; e < n * d; ++e) {
                const auto i = static_cast<std::size_t>(e);
                const double error = std::fabs(got[g].head(0, h)[e] - ref.grads[g][i]);
                if (!(error <= factor * ref.terms[g][i] + 1e-30) && failures++ < 3)
                  FAIL_CHECK(label << " d"
                                   << "qkv"[g] << " h=" << h << " element " << e << ": got " << got[g].head(0, h)[e]
                                   << ", want " << ref.grads[g][i] << " (bound " << factor * ref.terms[g][i] << ")");
              }
              CHECK_MESSAGE(failures == 0, label << " d"
                                                 << "qkv"[g] << ": " << failures << " out of the bound");
            }
          }
        }
  }

  TEST_CASE("decoding on the bf16 state equals the bf16 causal forward within the per-token rounding bound") {
    constexpr std::int64_t kTokens = 12, kHeads = 2, kDim = 16;
    std::vector<Case> cases = all_cases();
    cases.push_back({"performer", Map::Favor, {"features=48", "chunk=8"}});
    cases.push_back({"linear-transformer", Map::Elu, {"chunk=8"}});
    for (const auto& c : cases)
      for (std::int64_t context : {1, 7, 8, 9, 31, 32, 33, 64, 65}) {
        const Problem whole{
            .batch = 1, .heads = kHeads, .seq_len = context + kTokens, .head_dim = kDim, .causal = true};
        const auto in = bf16_inputs(whole, static_cast<std::uint64_t>(context) + 70);
        auto reference = create_bf16(c, whole);
        Tensor forward_out = Tensor::bhnd(1, kHeads, whole.seq_len, kDim, DType::BF16);
        reference->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
        reference->forward(in.bf16.q, in.bf16.k, in.bf16.v, forward_out);
        const Tensor forward = to_f32(forward_out);
        const DoubleMap map(c.map, random_features(*reference), kDim);

        Problem p = whole;
        p.seq_len = context;
        auto mechanism = create_bf16(c, p);
        auto rows = [&](const Tensor& t, std::int64_t first, std::int64_t count) {
          return to_bf16(rows_of(t, first, count));
        };
        const Tensor q = rows(in.widened.q, 0, context), k = rows(in.widened.k, 0, context),
                     v = rows(in.widened.v, 0, context);
        Tensor prefill = Tensor::bhnd(1, kHeads, context, kDim, DType::BF16);
        mechanism->prepare(q, k, v);
        const std::int64_t before = MemoryTracker::instance().current_bytes();
        mechanism->prepare_decode(kTokens);
        const Implementation& impl = find_model(c.model)->impl;
        CHECK(MemoryTracker::instance().current_bytes() - before ==
              impl.decode_workspace_bytes(in_bf16(p), resolve_params(c.model, impl.params, c.params), kTokens));
        mechanism->forward(q, k, v, prefill);
        const std::string label = describe(c, context, true);
        std::vector<double> magnitude[kHeads];
        double tol32[kHeads];
        for (std::int64_t h = 0; h < kHeads; ++h) {
          const float *qh = in.widened.q.head(0, h), *kh = in.widened.k.head(0, h), *vh = in.widened.v.head(0, h);
          magnitude[h] = kernel_reference(map, qh, kh, vh, nullptr, whole.seq_len, kDim, true).magnitude;
          tol32[h] = map.fp32_relative(qh, kh, whole.seq_len) * max_abs(vh, whole.seq_len * kDim);
        }
        for (std::int64_t t = 0; t < kTokens; ++t) {
          const std::int64_t token = context + t;
          Tensor out = Tensor::bhnd(1, kHeads, 1, kDim, DType::BF16);
          mechanism->decode_step(rows(in.widened.q, token, 1), rows(in.widened.k, token, 1),
                                 rows(in.widened.v, token, 1), out);
          const Tensor step = to_f32(out);
          const double r = static_cast<double>(t + 1), ru = r * kBf16Roundoff;
          for (std::int64_t h = 0; h < kHeads; ++h)
            for (std::int64_t f = 0; f < kDim; ++f) {
              const double want = forward.head(0, h)[token * kDim + f], got = step.head(0, h)[f];
              const double a = magnitude[h][static_cast<std::size_t>(token * kDim + f)];
              const double bound =
                  (1 + kBf16Roundoff) * (ru / (1 - ru) * (a + std::fabs(want)) + 2 * kBf16Roundoff * std::fabs(want)) +
                  2 * tol32[h];
              CHECK_MESSAGE(std::fabs(got - want) <= bound, label << " step " << t << " head " << h << " feature " << f
                                                                  << ": got " << got << ", want " << want << " (bound "
                                                                  << bound << ")");
            }
        }
        // The state: S' in bf16 (the stored [B·H, M, ld_v] sums), the key shift fp32.
        for (const auto& named : mechanism->decode_state())
          CHECK(named.tensor->dtype() == (named.name == "state" ? DType::BF16 : DType::F32));
      }
  }

  TEST_CASE("bf16 rows: FLOPs as fp32's, q/k/v/out and the decode state halved, z and shifts fp32, estimate exact") {
    for (const char* model : {"performer", "linear-transformer"})
      for (bool causal : {false, true})
        for (std::int64_t n : {100, 257})
          for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
            if (pass == Pass::Decode && !causal) continue;
            const auto [a, b] = check_bf16_rows(model, n, causal, pass);
            CHECK(b.peak_owned_bytes < a.peak_owned_bytes);
            // The saved normalisers z and chunk shifts are softmax-like statistics: fp32 in both.
            CHECK(b.saved_bytes == a.saved_bytes);
            if (pass == Pass::Decode) {
              // S' halves; the one fp32 key shift per head does not: 2·bf16 − f32 = B·H·4 bytes.
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes - a.state_bytes == 2 * 4);
            }
          }
  }
}
