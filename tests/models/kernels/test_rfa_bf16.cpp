// RFA in bf16 (issue 31): the output and the gradients (q, k, v and the fp32 parameter gradients)
// against RFA's own N×N formula in float64 on the same bf16 inputs (widened exactly) and the
// mechanism's fp32 parameters, at/±1 of the chunk and non-multiples, causal and not, gated; decoding
// on the bf16 state against the bf16 causal forward; bytes, FLOPs and the workspace estimate.
//
// The bounds, with u = 2⁻⁸ (bf16's unit roundoff). Per element, the fp32 form's own bound is
// tol32 = rel32·scale, rel32 = 4·eps·(log2 N + D + 8) and scale = (Σ_j |w|_ij·|v_jc| + |o_ic|·Σ_j |w|_ij)/den_i
// (tests/models/kernels/test_rfa.cpp; |w|_ij = Σ_m |φ_m(q_i)·φ_m(k_j)|·b_j·Π a_l). The bf16 forward is
// that fp32 computation on the bf16 values, its output rounded once (≤ u·|o|):
//   forward: |o − o_ref| ≤ u·|o_ref| + (1 + u)·tol32.
// Gradients. The backward takes the stored output O as an input (it enters G[D] = −(dO·O)/den), so
// the reference g* is the double formula's gradient with the model's bf16 O in that place (its
// distance from the exact-o gradient is ≤ u·T, T below, and not the backward's error). With T the
// terms (the formula's products in absolute value, below): the saved states' z columns are fp32, so
// the recomputed denominators are the forward's; their other entries are rounded (≤ u of the entry's
// magnitude sum), which reaches dφ(Q) = G·S0ᵀ (so dq and dσ) and, gated, the gate's ⟨R, S0⟩ term (so
// dk, dw_g, db_g) by ≤ u·T; dk, dv otherwise see no rounded value; each of dq, dk, dv is rounded
// once (≤ u·|g|), the parameter gradients stay fp32:
//   |g − g*| ≤ u(1 + u)·|g*| [dq, dk, dv] + u(1 + u)·T [where S0 reaches] + 2·rel32·T.
// Decoding: the state [S | z] is rounded after the prefill and after every step; a step answers from
// its fp32 update, so at step t the state carries r = t + 1 roundings, each entry within r·u/(1 − r·u)
// of its (decayed) magnitude sum Σ_j b_j·Π a·|φ(k_j)|·|[v_j | 1]| (a decay a ≤ 1 only shrinks earlier
// errors). Through φ(q) that moves the numerator by ≤ r'·Σ_j |w|_ij|v_j| and z by ≤ r'·Σ_j |w|_ij,
// r' = r·u/(1 − r·u), so the output by ≤ r'·scale/(1 − r'·κ); both outputs are rounded (≤ u·|o| each):
//   |o_step − o_forward| ≤ (1 + u)·(r'·scale/(1 − r'·κ) + 2u·|o|) + 2·tol32.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/memory_tracker.hpp"
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

struct Case {
  std::int64_t features = 64, chunk = 64;
  bool gate = false;
  double floor = 1e-3;
  std::vector<std::string> params() const {
    return {"features=" + std::to_string(features), "chunk=" + std::to_string(chunk),
            std::string("gate=") + (gate ? "1" : "0"), "floor=" + std::to_string(floor)};
  }
};

std::string describe(const Case& c, std::int64_t n, bool causal) {
  std::string s = "rfa N=" + std::to_string(n) + (causal ? " causal" : "");
  for (const auto& param : c.params()) s += " " + param;
  return s;
}

// One head's fp32 parameters (the mechanism's): W̃ [R, D], σ [D], and gated w_g [D], b_g.
struct HeadParams {
  const float *w, *sigma, *gate_w;
  double gate_b;
};

// φ(x) of one row in double (rfa.hpp) and what its pullback needs.
struct RowFeatures {
  std::vector<double> xhat, angle, phi;  // [D], [R], [2R]
  double norm;
};
RowFeatures row_features(const float* x, const HeadParams& hp, std::int64_t r, std::int64_t d) {
  RowFeatures f{std::vector<double>(d), std::vector<double>(r), std::vector<double>(2 * r), 0};
  double squares = 0;
  for (std::int64_t c = 0; c < d; ++c) squares += static_cast<double>(x[c]) * x[c];
  f.norm = std::max(std::sqrt(squares), 1e-12);
  for (std::int64_t c = 0; c < d; ++c) f.xhat[c] = x[c] / f.norm;
  const double alpha = 1.0 / std::sqrt(static_cast<double>(r));
  for (std::int64_t j = 0; j < r; ++j) {
    for (std::int64_t c = 0; c < d; ++c) f.angle[j] += static_cast<double>(hp.w[j * d + c]) * hp.sigma[c] * f.xhat[c];
    f.phi[j] = alpha * std::sin(f.angle[j]);
    f.phi[r + j] = alpha * std::cos(f.angle[j]);
  }
  return f;
}

// dx [D] and terms tx of a row from dφ and its terms tφ [2R]; adds x̂ ⊙ dx̃ into dsigma (terms into
// tsigma). dp_j = α(cos p_j·dφ_j − sin p_j·dφ_{R+j}); dx̃ = W̃ᵀdp; dx̂ = σ ⊙ dx̃; dx = (dx̂ − x̂(x̂·dx̂))/‖x‖;
// the terms the same chain with every factor in absolute value.
void pullback(const RowFeatures& f, const std::vector<double>& dphi, const std::vector<double>& tphi,
              const HeadParams& hp, std::int64_t r, std::int64_t d, double* dx, double* tx, double* dsigma,
              double* tsigma) {
  const double alpha = 1.0 / std::sqrt(static_cast<double>(r));
  std::vector<double> dscaled(d), tscaled(d);
  for (std::int64_t j = 0; j < r; ++j) {
    const double cs = std::cos(f.angle[j]), sn = std::sin(f.angle[j]);
    const double dp = alpha * (cs * dphi[j] - sn * dphi[r + j]);
    const double tp = alpha * (std::fabs(cs) * tphi[j] + std::fabs(sn) * tphi[r + j]);
    for (std::int64_t c = 0; c < d; ++c) {
      dscaled[c] += hp.w[j * d + c] * dp;
      tscaled[c] += std::fabs(hp.w[j * d + c]) * tp;
    }
  }
  double dot = 0, tdot = 0;
  std::vector<double> dhat(d), that(d);
  for (std::int64_t c = 0; c < d; ++c) {
    dsigma[c] += f.xhat[c] * dscaled[c];
    tsigma[c] += std::fabs(f.xhat[c]) * tscaled[c];
    dhat[c] = hp.sigma[c] * dscaled[c];
    that[c] = std::fabs(hp.sigma[c]) * tscaled[c];
    dot += f.xhat[c] * dhat[c];
    tdot += std::fabs(f.xhat[c]) * that[c];
  }
  for (std::int64_t c = 0; c < d; ++c) {
    dx[c] += (dhat[c] - f.xhat[c] * dot) / f.norm;
    tx[c] += (that[c] + std::fabs(f.xhat[c]) * tdot) / f.norm;
  }
}

// One head of RFA's N×N form in double: w_ij = φ(q_i)·φ(k_j)·c_ij, c_ij = b_j·Π_{j<l≤i} a_l (j ≤ i
// causal; c = 1 non-causal), out_i = Σ_j w_ij v_j / max(z_i, floor), z_i = Σ_j w_ij. With dout the
// gradients and their terms: dv_j = Σ_i (w_ij/den_i)·g_i; dw_ij = g_i·(v_j − o_i)/den_i (no −o_i
// when clamped); dφ(q_i) = Σ_j dw_ij·c_ij·φ(k_j), dφ(k_j) likewise; the gate through log c_ij:
// du_j −= a_j·dw_ij·w_ij, du_l += b_l·dw_ij·w_ij for j < l ≤ i; dk += du·w_g, dw_g += du·k, db_g += du.
struct HeadReference {
  std::vector<double> out, scale, z, abs_z;              // [N, D], [N, D], [N], [N]
  std::vector<double> grads[3], terms[3];                // dq, dk, dv [N, D]
  std::vector<double> dsigma, tsigma, dgate_w, tgate_w;  // [D]
  double dgate_b = 0, tgate_b = 0;
};
// stored_out: the O the backward reads, in place of o in dw_ij (nullptr: the formula's own).
HeadReference head_reference(const float* q, const float* k, const float* v, const float* dout, std::int64_t n,
                             std::int64_t d, bool causal, const Case& c, const HeadParams& hp,
                             const float* stored_out = nullptr) {
  const std::int64_t r = c.features, m = 2 * r;
  const bool gated = c.gate && causal;
  std::vector<RowFeatures> fq, fk;
  std::vector<double> a(n, 1.0), b(n, 1.0);
  for (std::int64_t t = 0; t < n; ++t) {
    fq.push_back(row_features(q + t * d, hp, r, d));
    fk.push_back(row_features(k + t * d, hp, r, d));
    if (!gated) continue;
    double u = hp.gate_b;
    for (std::int64_t e = 0; e < d; ++e) u += static_cast<double>(hp.gate_w[e]) * k[t * d + e];
    a[t] = 1.0 / (1.0 + std::exp(-u));
    b[t] = 1.0 - a[t];
  }
  auto at = [n](std::int64_t i, std::int64_t j) { return static_cast<std::size_t>(i * n + j); };
  std::vector<double> w(n * n), aw(n * n), cw(n * n);
  HeadReference ref;
  ref.out.assign(n * d, 0.0);
  ref.scale.assign(n * d, 0.0);
  ref.z.assign(n, 0.0);
  ref.abs_z.assign(n, 0.0);
  std::vector<double> den(n), abs_num(n * d);
  for (std::int64_t i = 0; i < n; ++i) {
    double decay = 1;  // Π_{j<l≤i} a_l
    for (std::int64_t j = causal ? i : n - 1; j >= 0; --j) {
      double dot = 0, abs_dot = 0;
      for (std::int64_t f = 0; f < m; ++f) {
        dot += fq[i].phi[f] * fk[j].phi[f];
        abs_dot += std::fabs(fq[i].phi[f] * fk[j].phi[f]);
      }
      cw[at(i, j)] = b[j] * decay;
      w[at(i, j)] = cw[at(i, j)] * dot;
      aw[at(i, j)] = cw[at(i, j)] * abs_dot;
      ref.z[i] += w[at(i, j)];
      ref.abs_z[i] += aw[at(i, j)];
      for (std::int64_t e = 0; e < d; ++e) {
        ref.out[i * d + e] += w[at(i, j)] * v[j * d + e];
        abs_num[i * d + e] += aw[at(i, j)] * std::fabs(v[j * d + e]);
      }
      decay *= a[j];
    }
    den[i] = std::max(ref.z[i], c.floor);
    for (std::int64_t e = 0; e < d; ++e) {
      ref.out[i * d + e] /= den[i];
      ref.scale[i * d + e] = (abs_num[i * d + e] + std::fabs(ref.out[i * d + e]) * ref.abs_z[i]) / den[i];
    }
  }
  if (dout == nullptr) return ref;
  for (int g = 0; g < 3; ++g) ref.grads[g].assign(n * d, 0.0), ref.terms[g].assign(n * d, 0.0);
  for (auto* x : {&ref.dsigma, &ref.tsigma, &ref.dgate_w, &ref.tgate_w}) x->assign(d, 0.0);
  std::vector<std::vector<double>> dfq(n, std::vector<double>(m)), tfq = dfq, dfk = dfq, tfk = dfq;
  std::vector<double> du(n), tu(n);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < (causal ? i + 1 : n); ++j) {
      const bool clamped = ref.z[i] <= c.floor;
      double dw = 0, tw = 0;
      for (std::int64_t e = 0; e < d; ++e) {
        const double g = dout[i * d + e], o = stored_out != nullptr ? stored_out[i * d + e] : ref.out[i * d + e];
        ref.grads[2][j * d + e] += w[at(i, j)] / den[i] * g;
        ref.terms[2][j * d + e] += aw[at(i, j)] / den[i] * std::fabs(g);
        dw += g * (v[j * d + e] - (clamped ? 0.0 : o));
        tw += std::fabs(g) * (std::fabs(v[j * d + e]) + std::fabs(o));
      }
      dw /= den[i];
      tw /= den[i];
      for (std::int64_t f = 0; f < m; ++f) {
        dfq[i][f] += dw * cw[at(i, j)] * fk[j].phi[f];
        tfq[i][f] += tw * cw[at(i, j)] * std::fabs(fk[j].phi[f]);
        dfk[j][f] += dw * cw[at(i, j)] * fq[i].phi[f];
        tfk[j][f] += tw * cw[at(i, j)] * std::fabs(fq[i].phi[f]);
      }
      if (!gated) continue;
      const double log_grad = dw * w[at(i, j)], log_terms = tw * aw[at(i, j)];
      du[j] -= a[j] * log_grad;
      tu[j] += a[j] * log_terms;
      for (std::int64_t l = j + 1; l <= i; ++l) {
        du[l] += b[l] * log_grad;
        tu[l] += b[l] * log_terms;
      }
    }
  for (std::int64_t t = 0; t < n; ++t) {
    pullback(fq[t], dfq[t], tfq[t], hp, r, d, ref.grads[0].data() + t * d, ref.terms[0].data() + t * d,
             ref.dsigma.data(), ref.tsigma.data());
    pullback(fk[t], dfk[t], tfk[t], hp, r, d, ref.grads[1].data() + t * d, ref.terms[1].data() + t * d,
             ref.dsigma.data(), ref.tsigma.data());
    if (!gated) continue;
    for (std::int64_t e = 0; e < d; ++e) {
      ref.grads[1][t * d + e] += du[t] * hp.gate_w[e];
      ref.terms[1][t * d + e] += tu[t] * std::fabs(hp.gate_w[e]);
      ref.dgate_w[e] += du[t] * k[t * d + e];
      ref.tgate_w[e] += tu[t] * std::fabs(k[t * d + e]);
    }
    ref.dgate_b += du[t];
    ref.tgate_b += tu[t];
  }
  return ref;
}

const Tensor& named(const std::vector<NamedTensor>& all, const std::string& name) {
  for (const auto& x : all)
    if (x.name == name) return *x.tensor;
  FAIL("no tensor " << name);
  return *all.front().tensor;
}

HeadParams head_params(const Mechanism& mechanism, const Case& c, std::int64_t h, std::int64_t d) {
  const auto params = mechanism.parameters();
  const Tensor &w = named(params, "random_features"), &sigma = named(params, "sigma");
  HeadParams hp{w.data() + h * c.features * d, sigma.data() + h * d, nullptr, 0};
  if (c.gate) {
    hp.gate_w = named(params, "gate_weight").data() + h * d;
    hp.gate_b = named(params, "gate_bias")[h];
  }
  return hp;
}

Problem bf16_problem(Problem p) {
  p = on_test_threads(p);
  p.dtype = DType::BF16;
  return p;
}

double fp32_relative(std::int64_t n, std::int64_t d) {
  return 4 * kFloatEps * (std::log2(static_cast<double>(std::max<std::int64_t>(n, 2))) + static_cast<double>(d) + 8);
}

// Counts elements of got outside bound(i) from want (reporting the first three); returns the count.
template <class Bound>
std::int64_t count_outside(const std::string& label, const float* got, const std::vector<double>& want,
                           std::int64_t count, Bound bound) {
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < count; ++e) {
    const double error = std::fabs(got[e] - want[static_cast<std::size_t>(e)]), limit = bound(e);
    if (!(error <= limit) && failures++ < 3)
      FAIL_CHECK(label << " element " << e << ": got " << got[e] << ", want " << want[static_cast<std::size_t>(e)]
                       << " (bound " << limit << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of the bf16 bound");
  return failures;
}

// The bf16 forward of one case on the fp32 draws of the seed (q and k scaled by input_scale) rounded
// to bf16, against the formula; returns the largest error over the fp32 bound.
double check_forward(const Case& c, const Problem& p, std::uint64_t seed, float input_scale = 1.0f) {
  AttentionInputs f32 = random_inputs(p, seed);
  for (Tensor* x : {&f32.q, &f32.k})
    for (float& value : x->values()) value *= input_scale;
  const AttentionInputs bf{to_bf16(f32.q), to_bf16(f32.k), to_bf16(f32.v)};
  const AttentionInputs in{to_f32(bf.q), to_f32(bf.k), to_f32(bf.v)};
  auto mechanism = bf16_mechanism("rfa", p, c.params());
  Tensor out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  mechanism->prepare(bf.q, bf.k, bf.v);
  mechanism->forward(bf.q, bf.k, bf.v, out);
  const Tensor got = to_f32(out);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double rel32 = fp32_relative(n, d);
  double over_fp32 = 0;
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const std::int64_t bi = bh / p.heads, h = bh % p.heads;
    const auto ref = head_reference(in.q.head(bi, h), in.k.head(bi, h), in.v.head(bi, h), nullptr, n, d, p.causal, c,
                                    head_params(*mechanism, c, h, d));
    const float* o = got.head(bi, h);
    count_outside(describe(c, n, p.causal) + " h=" + std::to_string(h), o, ref.out, n * d, [&](std::int64_t e) {
      const double tol32 = rel32 * (ref.scale[static_cast<std::size_t>(e)] + 1e-30);
      over_fp32 = std::max(over_fp32, std::fabs(o[e] - ref.out[static_cast<std::size_t>(e)]) / tol32);
      return kU * std::fabs(ref.out[static_cast<std::size_t>(e)]) + (1 + kU) * tol32;
    });
  }
  return over_fp32;
}

void check_gradients(const Case& c, const Problem& p, std::uint64_t seed) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  REQUIRE(p.batch == 1);  // the parameter gradients per head are then one head's sums
  const auto in = bf16_inputs(p, seed);
  Tensor dout32 = Tensor::bhnd(1, p.heads, n, d);
  CounterRng(seed + 1, "dout").fill_normal(dout32);
  const Tensor dout = to_bf16(dout32), dout_widened = to_f32(dout);
  auto mechanism = bf16_mechanism("rfa", p, c.params());
  const auto bhnd = [&] { return Tensor::bhnd(1, p.heads, n, d, DType::BF16); };
  Tensor out = bhnd(), dq = bhnd(), dk = bhnd(), dv = bhnd();
  mechanism->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
  mechanism->prepare_backward();
  mechanism->forward(in.bf16.q, in.bf16.k, in.bf16.v, out);
  mechanism->backward(in.bf16.q, in.bf16.k, in.bf16.v, out, dout, dq, dk, dv);
  const Tensor got[3] = {to_f32(dq), to_f32(dk), to_f32(dv)}, stored_out = to_f32(out);
  const auto parameter_grads = mechanism->parameter_gradients();
  const std::string label = describe(c, n, p.causal);
  for (std::int64_t h = 0; h < p.heads; ++h) {
    const auto ref = head_reference(in.widened.q.head(0, h), in.widened.k.head(0, h), in.widened.v.head(0, h),
                                    dout_widened.head(0, h), n, d, p.causal, c, head_params(*mechanism, c, h, d),
                                    stored_out.head(0, h));
    const double rounding = kU * (1 + kU), factor = rounding + 2 * fp32_relative(n, d);
    const std::string head = label + " h=" + std::to_string(h);
    for (int g = 0; g < 3; ++g) {
      const bool reaches = g == 0 || (g == 1 && c.gate && p.causal);  // a rounded saved entry reaches it
      count_outside(head + " d" + "qkv"[g], got[g].head(0, h), ref.grads[g], n * d, [&](std::int64_t e) {
        const auto i = static_cast<std::size_t>(e);
        return rounding * std::fabs(ref.grads[g][i]) + (reaches ? factor : factor - rounding) * ref.terms[g][i] + 1e-30;
      });
    }
    count_outside(head + " dsigma", named(parameter_grads, "dsigma").data() + h * d, ref.dsigma, d,
                  [&](std::int64_t e) { return factor * ref.tsigma[static_cast<std::size_t>(e)] + 1e-30; });
    if (!c.gate) continue;
    count_outside(head + " dgate_weight", named(parameter_grads, "dgate_weight").data() + h * d, ref.dgate_w, d,
                  [&](std::int64_t e) { return factor * ref.tgate_w[static_cast<std::size_t>(e)] + 1e-30; });
    count_outside(head + " dgate_bias", named(parameter_grads, "dgate_bias").data() + h, {ref.dgate_b}, 1,
                  [&](std::int64_t) { return factor * ref.tgate_b + 1e-30; });
  }
}

}  // namespace

TEST_SUITE("rfa_bf16") {
  TEST_CASE("rfa in bf16 equals its float64 N×N formula, causal and not, gated, at/±1 of the chunk") {
    for (bool causal : {false, true})
      for (bool gate : {false, true}) {
        if (gate && !causal) continue;
        for (std::int64_t n : {1, 2, 7, 8, 9, 16, 17, 23}) {
          const Case c{.features = 16, .chunk = 8, .gate = gate};
          check_forward(c, {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                        static_cast<std::uint64_t>(n + 300));
        }
        for (std::int64_t n : {31, 63, 64, 65, 127, 129, 200}) {
          const Case c{.gate = gate};
          const double over_fp32 =
              check_forward(c, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                            static_cast<std::uint64_t>(n));
          // Not fp32 in disguise: the output's bf16 rounding shows past the fp32 bound.
          CHECK_MESSAGE(over_fp32 > 1, describe(c, n, causal) << ": the error never exceeds the fp32 bound");
        }
      }
  }

  TEST_CASE("rfa in bf16: denominators at and below the floor are clamped as the formula says") {
    // One or two random features and inputs ×3 (as test_rfa): φ(q)·φ(k) is often ≤ 0, rows clamp.
    for (bool causal : {false, true})
      for (std::int64_t features : {1, 2})
        for (double floor : {1e-3, 1.0})
          for (std::int64_t n : {1, 2, 3, 5})
            check_forward({.features = features, .chunk = 2, .floor = floor},
                          {.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                          static_cast<std::uint64_t>(n + 10 * features), 3.0f);
  }

  TEST_CASE("rfa bf16 gradients (q, k, v, σ; gated w_g, b_g) equal the float64 formula's, causal and not") {
    struct Size {
      std::int64_t n, chunk;
    };
    for (bool causal : {false, true})
      for (bool gate : {false, true}) {
        if (gate && !causal) continue;
        for (const Size size : {Size{1, 4}, Size{3, 4}, Size{4, 4}, Size{5, 4}, Size{9, 4}, Size{31, 64}, Size{63, 64},
                                Size{64, 64}, Size{65, 64}, Size{129, 64}}) {
          const Case c{.features = size.chunk == 4 ? 8 : 64, .chunk = size.chunk, .gate = gate};
          check_gradients(c, {.batch = 1, .heads = 2, .seq_len = size.n, .head_dim = 16, .causal = causal},
                          static_cast<std::uint64_t>(size.n + 40));
        }
      }
  }

  TEST_CASE("rfa decoding on the bf16 state equals the bf16 causal forward within the per-token rounding bound") {
    constexpr std::int64_t kTokens = 12, kHeads = 2, kDim = 16;
    std::int64_t checked_rows = 0, near_floor = 0;
    for (bool gate : {false, true})
      for (const Case c : {Case{.gate = gate}, Case{.features = 24, .chunk = 8, .gate = gate}})
        for (std::int64_t context : {1, 7, 8, 9, 31, 32, 33, 63, 64, 65}) {
          const Problem whole{
              .batch = 1, .heads = kHeads, .seq_len = context + kTokens, .head_dim = kDim, .causal = true};
          const auto in = bf16_inputs(whole, static_cast<std::uint64_t>(context) + 70);
          auto reference = bf16_mechanism("rfa", whole, c.params());
          Tensor forward_out = Tensor::bhnd(1, kHeads, whole.seq_len, kDim, DType::BF16);
          reference->prepare(in.bf16.q, in.bf16.k, in.bf16.v);
          reference->forward(in.bf16.q, in.bf16.k, in.bf16.v, forward_out);
          const Tensor forward = to_f32(forward_out);

          Problem p = whole;
          p.seq_len = context;
          auto mechanism = bf16_mechanism("rfa", p, c.params());
          auto rows = [&](const Tensor& t, std::int64_t first, std::int64_t count) {
            return to_bf16(rows_of(t, first, count));
          };
          const Tensor q = rows(in.widened.q, 0, context), k = rows(in.widened.k, 0, context),
                       v = rows(in.widened.v, 0, context);
          Tensor prefill = Tensor::bhnd(1, kHeads, context, kDim, DType::BF16);
          mechanism->prepare(q, k, v);
          const std::int64_t before = MemoryTracker::instance().current_bytes();
          mechanism->prepare_decode(kTokens);
          const Implementation& impl = find_model("rfa")->impl;
          CHECK(MemoryTracker::instance().current_bytes() - before ==
                impl.decode_workspace_bytes(bf16_problem(p), resolve_params("rfa", impl.params, c.params()), kTokens));
          mechanism->forward(q, k, v, prefill);
          const std::string label = describe(c, context, true);
          std::vector<HeadReference> refs;
          for (std::int64_t h = 0; h < kHeads; ++h)
            refs.push_back(head_reference(in.widened.q.head(0, h), in.widened.k.head(0, h), in.widened.v.head(0, h),
                                          nullptr, whole.seq_len, kDim, true, c, head_params(*mechanism, c, h, kDim)));
          const double rel32 = fp32_relative(whole.seq_len, kDim);
          for (std::int64_t t = 0; t < kTokens; ++t) {
            const std::int64_t token = context + t;
            Tensor out = Tensor::bhnd(1, kHeads, 1, kDim, DType::BF16);
            mechanism->decode_step(rows(in.widened.q, token, 1), rows(in.widened.k, token, 1),
                                   rows(in.widened.v, token, 1), out);
            const Tensor step = to_f32(out);
            const double r = static_cast<double>(t + 1), ru = r * kU / (1 - r * kU);
            for (std::int64_t h = 0; h < kHeads; ++h) {
              const HeadReference& ref = refs[static_cast<std::size_t>(h)];
              // κ as in the bound while both walks' z stay on one side of the floor (clamped: den = floor
              // in both, κ = 0); a row within r'·Σ|w| of the floor may flip its clamp and is skipped.
              const double z = ref.z[token], spread = ru * ref.abs_z[token];
              const bool clamped = z + spread <= c.floor;
              ++checked_rows;
              if (!clamped && z - spread <= c.floor) {
                ++near_floor;
                continue;
              }
              const double kappa = clamped ? 0.0 : ref.abs_z[token] / z;
              std::vector<double> want(forward.head(0, h) + token * kDim, forward.head(0, h) + (token + 1) * kDim);
              count_outside(label + " step " + std::to_string(t) + " h=" + std::to_string(h), step.head(0, h), want,
                            kDim, [&](std::int64_t f) {
                              const double scale = ref.scale[static_cast<std::size_t>(token * kDim + f)];
                              return (1 + kU) * (ru * scale / (1 - ru * kappa) +
                                                 2 * kU * std::fabs(want[static_cast<std::size_t>(f)])) +
                                     2 * rel32 * scale;
                            });
            }
          }
          for (const auto& state : mechanism->decode_state()) CHECK(state.tensor->dtype() == DType::BF16);
        }
    CHECK(near_floor * 50 < checked_rows);  // the bound covers nearly every step
  }

  TEST_CASE("rfa bf16 rows: FLOPs as fp32's, q/k/v/out, saved and decode states halved, estimate exact") {
    for (const char* gate : {"gate=0", "gate=1"})
      for (bool causal : {false, true})
        for (std::int64_t n : {100, 257})
          for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
            if ((pass == Pass::Decode || std::string(gate) == "gate=1") && !causal) continue;
            CAPTURE(gate);
            const auto [a, b] = check_bf16_rows("rfa", n, causal, pass, {gate});
            CHECK(b.peak_owned_bytes < a.peak_owned_bytes);
            if (pass == Pass::Backward || pass == Pass::Train) {
              // The saved states halve but their fp32 z columns [B·H·slots, M] do not (M = 128, chunk 64).
              const std::int64_t slots = 2 * (causal ? (n + 63) / 64 : 1);
              CHECK(b.saved_bytes > 0);
              CHECK(2 * b.saved_bytes - a.saved_bytes == 2 * slots * 128 * 4);
            } else {
              CHECK(b.saved_bytes == a.saved_bytes);
            }
            if (pass == Pass::Decode) {
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes == a.state_bytes);
            }
          }
  }
}
