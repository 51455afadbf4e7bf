// The encoder layer and its mixture of experts in bf16 (issue 31; taxonomy/layer/encoder_layer.hpp,
// moe_ffn.hpp): every tensor the bf16 layer stores is checked as one step computed in double from the
// tensors the layer stored before it (so the whole chain is covered, each link with its own bound), the
// mechanism inside against its own bf16 form on the layer's q, k, v, and the rows: FLOPs equal to the
// fp32 layer's formulas, inputs, activations and weights in bf16, every byte estimate exact.
//
// Bounds, with u = 2⁻⁸ (bf16) and ε = 2⁻²⁴ (fp32 unit roundoff), γ_K = Kε/(1 − Kε):
//   a product of bf16 operands accumulated in fp32 over K terms (+ the accumulated C₀) and rounded once:
//     |c − c_ref| ≤ u·|c_ref| + (1 + u)·γ_{K+1}·(Σ|a||b| + |c₀|); without the rounding (fp32 results) u = 0;
//   a LayerNorm row in fp32 (mean and variance of E values), rounded once: u·|y_ref| + 8(E + 4)ε·(|x̂| + 1 +
//     |μ|/σ)·|γ| + ε|β|;
//   GELU and GELU' in fp32 (oneDNN's erf form): 16ε·(1 + |z|) on top of the rounding, relative to the
//     value or the gradient they scale;
//   a LayerNorm backward row in fp32: its input's error carried through the linear map (rstd·|γ| and the two
//     means), plus 16(E + 8)ε times the row's magnitudes.
// A 1% error in any stored element of a stage fails its check (the bounds are u + O(Kε) relative).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/layer/encoder_layer.hpp"
#include "taxonomy/layer/moe_ffn.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/layer_reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;
constexpr double kFp32 = 1.0 / 16777216;  // 2⁻²⁴
double gamma_of(std::int64_t k) { return static_cast<double>(k) * kFp32 / (1 - static_cast<double>(k) * kFp32); }

using Values = std::vector<double>;
Values values_of(const Tensor& t) {
  const Tensor f = to_f32(t);
  return {f.values().begin(), f.values().end()};
}

const Tensor& named(const std::vector<NamedTensor>& all, const std::string& name) {
  for (const auto& t : all)
    if (t.name == name) return *t.tensor;
  FAIL("no tensor " << name);
  throw std::logic_error(name);
}

// got[i] against ref[i] within bound[i]; names the first element off.
void check_within(const std::string& what, const Values& got, const Values& ref, const Values& bound) {
  REQUIRE(got.size() == ref.size());
  std::int64_t off = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::abs(got[i] - ref[i]) <= bound[i]) continue;
    if (off++ == 0)
      FAIL_CHECK(what << ": element " << i << " is " << got[i] << ", the double step gives " << ref[i] << " (bound "
                      << bound[i] << ")");
  }
  CHECK_MESSAGE(off == 0, what << ": " << off << " of " << got.size() << " elements off");
}

// op(A)·op(B) in double, A [m, k] (or [k, m] when trans_a), B [k, n] (or [n, k]), with Σ|a||b|.
struct Product {
  Values value, magnitude;
};
Product product(const Values& a, const Values& b, std::int64_t m, std::int64_t n, std::int64_t k, bool trans_a = false,
                bool trans_b = false) {
  Product p{Values(m * n, 0.0), Values(m * n, 0.0)};
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t l = 0; l < k; ++l) {
      const double av = trans_a ? a[l * m + i] : a[i * k + l];
      for (std::int64_t j = 0; j < n; ++j) {
        const double bv = trans_b ? b[j * k + l] : b[l * n + j];
        p.value[i * n + j] += av * bv;
        p.magnitude[i * n + j] += std::abs(av * bv);
      }
    }
  return p;
}

// A product stored after one rounding (rounded) or in fp32, optionally accumulated onto c0.
void check_product(const std::string& what, const Values& got, Product p, std::int64_t k, bool rounded,
                   const Values* c0 = nullptr) {
  Values bound(got.size());
  const double u = rounded ? kU : 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double start = c0 ? (*c0)[i] : 0.0;
    p.value[i] += start;
    bound[i] = u * std::abs(p.value[i]) + (1 + u) * gamma_of(k + 1) * (p.magnitude[i] + std::abs(start));
  }
  check_within(what, got, p.value, bound);
}

// LayerNorm rows in double: x̂ and the rows' mean and 1/σ.
struct Normalised {
  Values hat, mean, rstd;
};
Normalised normalise(const Values& x, std::int64_t rows, std::int64_t e) {
  Normalised n{Values(x.size()), Values(rows), Values(rows)};
  for (std::int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (std::int64_t c = 0; c < e; ++c) mean += x[r * e + c] / static_cast<double>(e);
    for (std::int64_t c = 0; c < e; ++c) var += (x[r * e + c] - mean) * (x[r * e + c] - mean) / static_cast<double>(e);
    n.mean[r] = mean;
    n.rstd[r] = 1 / std::sqrt(var + 1e-5);
    for (std::int64_t c = 0; c < e; ++c) n.hat[r * e + c] = (x[r * e + c] - mean) * n.rstd[r];
  }
  return n;
}

void check_layer_norm(const std::string& what, const Values& got, const Values& x, const Values& gain,
                      const Values& shift, std::int64_t rows, std::int64_t e) {
  const Normalised n = normalise(x, rows, e);
  Values ref(x.size()), bound(x.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < e; ++c) {
      const std::int64_t i = r * e + c;
      ref[i] = n.hat[i] * gain[c] + shift[c];
      const double spread = std::abs(n.hat[i]) + 1 + std::abs(n.mean[r]) * n.rstd[r];
      bound[i] =
          kU * std::abs(ref[i]) +
          (1 + kU) * (8 * static_cast<double>(e + 4) * kFp32 * spread * std::abs(gain[c]) + kFp32 * std::abs(shift[c]));
    }
  check_within(what, got, ref, bound);
}

double gelu(double z) { return 0.5 * z * (1 + std::erf(z / std::sqrt(2.0))); }
double gelu_slope(double z) {
  return 0.5 * (1 + std::erf(z / std::sqrt(2.0))) + z * std::exp(-z * z / 2) / std::sqrt(2 * 3.14159265358979323846);
}

void check_gelu(const std::string& what, const Values& got, const Values& z) {
  Values ref(z.size()), bound(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    ref[i] = gelu(z[i]);
    bound[i] = kU * std::abs(ref[i]) + (1 + kU) * 16 * kFp32 * (1 + std::abs(z[i]));
  }
  check_within(what, got, ref, bound);
}

// dz = round(GELU'(z)·round(g)), g = d_out·W (fp32 product of K terms): against GELU'(z)·g in double.
void check_gelu_backward(const std::string& what, const Values& got, const Values& z, const Product& g,
                         std::int64_t k) {
  Values ref(z.size()), bound(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    const double slope = gelu_slope(z[i]);
    ref[i] = slope * g.value[i];
    const double g_error = kU * std::abs(g.value[i]) + (1 + kU) * gamma_of(k) * g.magnitude[i];
    bound[i] = kU * std::abs(ref[i]) + (1 + kU) * (std::abs(slope) * g_error + 16 * kFp32 * (1 + std::abs(z[i])) *
                                                                                   (std::abs(g.value[i]) + g_error));
  }
  check_within(what, got, ref, bound);
}

// The LayerNorm backward of rows x with the gradient da of its output (da_error: da's own error bound per
// element) added to start: start + LNᵀ(da) in double with its bound; `rounded` when stored in bf16.
void check_layer_norm_backward(const std::string& what, const Values& got, const Values& x, const Values& gain,
                               const Values& da, const Values& da_error, const Values& start, std::int64_t rows,
                               std::int64_t e, bool rounded) {
  const Normalised n = normalise(x, rows, e);
  Values ref(x.size()), bound(x.size());
  const double u = rounded ? kU : 0.0, ed = static_cast<double>(e);
  for (std::int64_t r = 0; r < rows; ++r) {
    double m1 = 0, m2 = 0, mag1 = 0, mag2 = 0, err1 = 0, err2 = 0;
    for (std::int64_t c = 0; c < e; ++c) {
      const std::int64_t i = r * e + c;
      const double g = da[i] * gain[c];
      m1 += g / ed;
      m2 += g * n.hat[i] / ed;
      mag1 += std::abs(g) / ed;
      mag2 += std::abs(g * n.hat[i]) / ed;
      err1 += da_error[i] * std::abs(gain[c]) / ed;
      err2 += da_error[i] * std::abs(gain[c] * n.hat[i]) / ed;
    }
    for (std::int64_t c = 0; c < e; ++c) {
      const std::int64_t i = r * e + c;
      const double term = n.rstd[r] * (da[i] * gain[c] - m1 - n.hat[i] * m2);
      ref[i] = start[i] + term;
      const double carried = n.rstd[r] * (da_error[i] * std::abs(gain[c]) + err1 + std::abs(n.hat[i]) * err2);
      const double magnitude = n.rstd[r] * (std::abs(da[i] * gain[c]) + mag1 + std::abs(n.hat[i]) * mag2);
      bound[i] =
          u * std::abs(ref[i]) +
          (1 + u) * (carried + 16 * (ed + 8) * kFp32 * (magnitude * (1 + std::abs(n.hat[i])) + std::abs(start[i])));
    }
  }
  check_within(what, got, ref, bound);
}

// A gain's and a shift's gradient (fp32 sums over the rows): Σ_r dy·x̂ and Σ_r dy.
// dy_error: dy's own error bound per element (the fp32 product it came from).
void check_norm_parameters(const std::string& what, const Values& d_gain, const Values& d_shift, const Values& x,
                           const Values& dy, const Values& dy_error, std::int64_t rows, std::int64_t e) {
  const Normalised n = normalise(x, rows, e);
  Values gain(e, 0.0), shift(e, 0.0), gain_bound(e, 0.0), shift_bound(e, 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < e; ++c) {
      const std::int64_t i = r * e + c;
      gain[c] += dy[i] * n.hat[i];
      shift[c] += dy[i];
      gain_bound[c] += 16 * static_cast<double>(rows + e + 8) * kFp32 * std::abs(dy[i]) * (1 + std::abs(n.hat[i])) +
                       dy_error[i] * (std::abs(n.hat[i]) + 16 * static_cast<double>(e + 8) * kFp32);
      shift_bound[c] += gamma_of(rows) * std::abs(dy[i]) + (1 + gamma_of(rows)) * dy_error[i];
    }
  check_within(what + " gain", d_gain, gain, gain_bound);
  check_within(what + " shift", d_shift, shift, shift_bound);
}

Values errors_of(const Product& p, std::int64_t k) {
  Values e(p.value.size());
  for (std::size_t i = 0; i < e.size(); ++i) e[i] = gamma_of(k) * p.magnitude[i];
  return e;
}
Values zeros(std::size_t n) { return Values(n, 0.0); }
Values first_rows(const Values& all, std::int64_t count) { return Values(all.begin(), all.begin() + count); }

// Rows [B·n, parts·E] of head-major [B, H, n, D] tensors (the layer's merge), in double.
Values merged_rows(const std::vector<Values>& heads, const Problem& p, std::int64_t n) {
  const std::int64_t h = p.heads, d = p.head_dim, e = h * d, parts = static_cast<std::int64_t>(heads.size());
  Values rows(p.batch * n * parts * e);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t part = 0; part < parts; ++part)
        for (std::int64_t head = 0; head < h; ++head)
          for (std::int64_t c = 0; c < d; ++c)
            rows[(b * n + t) * parts * e + part * e + head * d + c] = heads[part][((b * h + head) * n + t) * d + c];
  return rows;
}

// A bf16 layer around `model`, trained once: x, dy seeded; everything it stored kept.
struct LayerRun {
  Problem p;
  std::int64_t f, m;
  bool residual;
  ParamValues values;
  std::unique_ptr<Mechanism> mechanism;
  std::unique_ptr<EncoderLayer> layer;
  Tensor x, y, dy, dx;

  LayerRun(const std::string& model, Problem problem, std::int64_t d_ff, const std::vector<std::string>& params,
           const MoeSettings& ffn = {})
      : p(on_test_threads(problem)), f(d_ff) {
    p.dtype = DType::BF16;
    const ModelInfo& info = *find_model(model);
    values = resolve_params(model, info.impl.params, params);
    m = output_rows_of(info.impl, p, values);
    residual = !info.impl.downsamples();
    const std::int64_t e = p.heads * p.head_dim;
    x = Tensor(Shape{p.batch, p.seq_len, e}, DType::BF16);
    CounterRng(7, "test/layer_x").fill_normal(x);
    dy = Tensor(Shape{p.batch, m, e}, DType::BF16);
    CounterRng(7, "test/layer_dy").fill_normal(dy);
    y = Tensor(Shape{p.batch, m, e}, DType::BF16);
    dx = Tensor(Shape{p.batch, p.seq_len, e}, DType::BF16);
    mechanism = info.impl.create(p, values, 9);
    layer = std::make_unique<EncoderLayer>(p, f, m, residual, 5, ffn);
    randomise_layer_norms(*layer);
    layer->prepare_training();
    layer->prepare(*mechanism, x);
    layer->prepare_backward(*mechanism);
    layer->forward(*mechanism, x, y);
    layer->backward(*mechanism, x, dy, dx);
  }
  Values saved(const std::string& name) const { return values_of(named(layer->saved(), name)); }
  Values weight(const std::string& name) const { return values_of(named(layer->parameters(), name)); }
  Values gradient(const std::string& name) const { return values_of(named(layer->parameter_gradients(), name)); }
};

// The mechanism inside: its bf16 output and gradients are what a fresh bf16 mechanism of the model gives on
// the layer's own q, k, v and output gradient (its accuracy is its own tests' matter), bit for bit.
void check_mechanism(const std::string& model, const LayerRun& run) {
  const Problem& p = run.p;
  auto fresh = find_model(model)->impl.create(p, run.values, 9);
  const Tensor &q = run.layer->q(), &k = run.layer->k(), &v = run.layer->v();
  Tensor o = Tensor::bhnd(p.batch, p.heads, run.m, p.head_dim, DType::BF16);
  fresh->prepare(q, k, v);
  fresh->prepare_backward();
  fresh->forward(q, k, v, o);
  CHECK(values_of(o) == values_of(run.layer->attention_output()));
  const auto grads = run.layer->attention_gradients();
  Tensor dq = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  Tensor dk = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  Tensor dv = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  fresh->backward(q, k, v, o, named(grads, "attention_dout"), dq, dk, dv);
  const Values dq_got = values_of(named(grads, "dq")), dq_fresh = values_of(dq);
  double worst = 0;
  for (std::size_t i = 0; i < dq_got.size(); ++i) worst = std::max(worst, std::abs(dq_got[i] - dq_fresh[i]));
  CAPTURE(worst);
  CHECK(dq_fresh == dq_got);
  CHECK(values_of(dk) == values_of(named(grads, "dk")));
  CHECK(values_of(dv) == values_of(named(grads, "dv")));
}

// Every stage of a dense-FFN bf16 layer's forward and backward, each from the stored tensors before it.
void check_dense_layer(const std::string& model, const Problem& problem, std::int64_t f,
                       const std::vector<std::string>& params = {}) {
  const LayerRun run(model, problem, f, params);
  const Problem& p = run.p;
  const std::int64_t e = p.heads * p.head_dim, tokens = p.batch * p.seq_len, rows = p.batch * run.m;
  const Values x = values_of(run.x), dy = values_of(run.dy);
  const Values g1 = run.weight("layer_ln1_gain"), b1 = run.weight("layer_ln1_shift");
  const Values g2 = run.weight("layer_ln2_gain"), b2 = run.weight("layer_ln2_shift");
  const Values w_qkv = run.weight("layer_w_qkv"), w_o = run.weight("layer_w_o");
  const Values w_1 = run.weight("layer_w_1"), w_2 = run.weight("layer_w_2");
  for (const auto& w : run.layer->parameters())
    if (w.name.find("_w_") != std::string::npos) CHECK(w.tensor->dtype() == DType::BF16);
  // Forward.
  const Values a1 = run.saved("layer_ln1_out");
  check_layer_norm("a1 = LN1(x)", a1, x, g1, b1, tokens, e);
  const Values qkv = merged_rows({run.saved("layer_q"), run.saved("layer_k"), run.saved("layer_v")}, p, p.seq_len);
  check_product("qkv = a1 W_qkv", qkv, product(a1, w_qkv, tokens, 3 * e, e), e, true);
  check_mechanism(model, run);
  const Values merged = run.saved("layer_merged");
  CHECK(merged == merged_rows({values_of(run.layer->attention_output())}, p, run.m));
  const Values hidden = run.saved("layer_hidden");
  check_product("h = x + merge(o) W_o", hidden, product(merged, w_o, rows, e, e), e, true, run.residual ? &x : nullptr);
  // The LayerNorm buffer holds LN₁ of the N tokens outside training, LN₂ of the M rows after the forward.
  const Values a2 = first_rows(run.saved("layer_ln2_out"), rows * e);
  check_layer_norm("a2 = LN2(h)", a2, hidden, g2, b2, rows, e);
  const Values z = run.saved("layer_ffn_pre");
  check_product("z = a2 W1", z, product(a2, w_1, rows, f, e), e, true);
  const Values activation = run.saved("layer_ffn");
  check_gelu("GELU(z)", activation, z);
  check_product("y = h + GELU(z) W2", values_of(run.y), product(activation, w_2, rows, e, f), f, true, &hidden);
  // Backward.
  const auto intermediates = run.layer->backward_intermediates();
  check_product("dW2", run.gradient("dlayer_w_2"), product(activation, dy, f, e, rows, true), rows, false);
  const Values dz = values_of(named(intermediates, "layer_dffn_pre"));
  check_gelu_backward("dz", dz, z, product(dy, w_2, rows, f, e, false, true), e);
  check_product("dW1", run.gradient("dlayer_w_1"), product(a2, dz, e, f, rows, true), rows, false);
  const Product da2 = product(dz, w_1, rows, e, f, false, true);
  const Values dh = values_of(named(intermediates, "layer_dhidden"));
  check_layer_norm_backward("dh = dy + LN2'(dz W1')", dh, hidden, g2, da2.value, errors_of(da2, f), dy, rows, e, false);
  check_norm_parameters("LN2", run.gradient("dlayer_ln2_gain"), run.gradient("dlayer_ln2_shift"), hidden, da2.value,
                        errors_of(da2, f), rows, e);
  const Values dh_rounded = values_of(named(intermediates, "layer_dhidden_rounded"));
  CHECK(dh_rounded == values_of(to_bf16(named(intermediates, "layer_dhidden"))));
  check_product("dW_o", run.gradient("dlayer_w_o"), product(merged, dh_rounded, e, e, rows, true), rows, false);
  const auto grads = run.layer->attention_gradients();
  const Values d_merged = merged_rows({values_of(named(grads, "attention_dout"))}, p, run.m);
  check_product("do = dh W_o'", d_merged, product(dh_rounded, w_o, rows, e, e, false, true), e, true);
  const Values d_qkv = merged_rows(
      {values_of(named(grads, "dq")), values_of(named(grads, "dk")), values_of(named(grads, "dv"))}, p, p.seq_len);
  check_product("dW_qkv", run.gradient("dlayer_w_qkv"), product(a1, d_qkv, e, 3 * e, tokens, true), tokens, false);
  const Product da1 = product(d_qkv, w_qkv, tokens, e, 3 * e, false, true);
  check_layer_norm_backward("dx = dh + LN1'(dqkv W_qkv')", values_of(run.dx), x, g1, da1.value, errors_of(da1, 3 * e),
                            run.residual ? dh_rounded : zeros(x.size()), tokens, e, true);
  check_norm_parameters("LN1", run.gradient("dlayer_ln1_gain"), run.gradient("dlayer_ln1_shift"), x, da1.value,
                        errors_of(da1, 3 * e), tokens, e);
}

MoeSettings moe(FfnKind kind, std::int64_t experts, double cf, std::int64_t group = 0) {
  return {.kind = kind, .experts = experts, .capacity_factor = cf, .group_size = group};
}

// Every stage of a bf16 MoeFfn's forward (y starts at a seeded h) and backward, from its stored tensors.
void check_moe(const MoeSettings& s, std::int64_t t, std::int64_t d, std::int64_t f) {
  const std::int64_t x = s.experts, k = ffn_top_k(s.kind);
  Tensor a(Shape{t, d}, DType::BF16), y(Shape{t, d}, DType::BF16), dy(Shape{t, d}, DType::BF16), da(Shape{t, d});
  CounterRng(3, "test/moe_a").fill_normal(a);
  CounterRng(3, "test/moe_h").fill_normal(y);
  CounterRng(3, "test/moe_dy").fill_normal(dy);
  const Values h = values_of(y), av = values_of(a), dyv = values_of(dy);
  MoeFfn ffn(s, t, d, f, kTestThreads, 11, DType::BF16);
  ffn.prepare_training();
  ffn.forward(a.bf16_data(), y.bf16_data());
  ffn.backward(a.bf16_data(), dy.bf16_data(), da.data());
  const auto params = ffn.parameters(), saved = ffn.saved(), grads = ffn.parameter_gradients();
  const auto inner = ffn.backward_intermediates();
  CHECK(named(params, "moe_w_router").dtype() == DType::F32);
  CHECK(named(params, "moe_w_1").dtype() == DType::BF16);
  const Values w_r = values_of(named(params, "moe_w_router")), w_1 = values_of(named(params, "moe_w_1")),
               w_2 = values_of(named(params, "moe_w_2"));
  const Values choice = values_of(named(params, "moe_choice")), slot = values_of(named(params, "moe_slot")),
               gate = values_of(named(params, "moe_gate"));
  // The router in fp32 on the widened rows: probabilities within fp32 rounding of the double softmax.
  const Product logits = product(av, w_r, t, x, d);
  const Values probs = values_of(named(saved, "moe_probabilities"));
  Values p_ref(t * x), p_bound(t * x);
  for (std::int64_t r = 0; r < t; ++r) {
    double peak = -1e300, sum = 0, spread = 0;
    for (std::int64_t e = 0; e < x; ++e) peak = std::max(peak, logits.value[r * x + e]);
    for (std::int64_t e = 0; e < x; ++e) sum += p_ref[r * x + e] = std::exp(logits.value[r * x + e] - peak);
    for (std::int64_t e = 0; e < x; ++e) spread = std::max(spread, logits.magnitude[r * x + e]);
    for (std::int64_t e = 0; e < x; ++e) {
      p_ref[r * x + e] /= sum;
      p_bound[r * x + e] = p_ref[r * x + e] * (2 * gamma_of(d) * spread + 32 * static_cast<double>(x) * kFp32);
    }
  }
  check_within("router probabilities", probs, p_ref, p_bound);
  // The experts on their rows: inputs are the routed rows exactly, then two rounded products and GELU.
  const Values in = values_of(named(saved, "moe_expert_in")), pre = values_of(named(saved, "moe_expert_pre")),
               hidden = values_of(named(saved, "moe_expert_hidden")), out = values_of(named(saved, "moe_expert_out"));
  const std::int64_t slots = in.size() / static_cast<std::size_t>(x * d);
  const auto& counts = ffn.expert_counts();
  auto rows_of = [](const Values& all, std::int64_t e, std::int64_t slots_per, std::int64_t rows, std::int64_t width) {
    return Values(all.begin() + e * slots_per * width, all.begin() + (e * slots_per + rows) * width);
  };
  auto block = [](const Values& all, std::int64_t e, std::int64_t size) {
    return Values(all.begin() + e * size, all.begin() + (e + 1) * size);
  };
  for (std::int64_t r = 0; r < t; ++r)
    for (std::int64_t j = 0; j < k; ++j)
      if (slot[r * k + j] >= 0) {
        const auto e = static_cast<std::int64_t>(choice[r * k + j]), row = static_cast<std::int64_t>(slot[r * k + j]);
        CHECK(Values(in.begin() + (e * slots + row) * d, in.begin() + (e * slots + row + 1) * d) ==
              Values(av.begin() + r * d, av.begin() + (r + 1) * d));
      }
  const Values d_out = values_of(named(inner, "moe_d_expert_out")), d_pre = values_of(named(inner, "moe_d_expert_pre")),
               d_in = values_of(named(inner, "moe_d_expert_in"));
  const Values dw_1 = values_of(named(grads, "dmoe_w_1")), dw_2 = values_of(named(grads, "dmoe_w_2"));
  for (std::int64_t e = 0; e < x; ++e) {
    const std::int64_t c = counts[e];
    CAPTURE(e);
    if (c == 0) continue;
    const Values ein = rows_of(in, e, slots, c, d), epre = rows_of(pre, e, slots, c, f);
    const Values ehidden = rows_of(hidden, e, slots, c, f), ed_out = rows_of(d_out, e, slots, c, d);
    const Values ed_pre = rows_of(d_pre, e, slots, c, f);
    const Values w1 = block(w_1, e, d * f), w2 = block(w_2, e, f * d);
    check_product("expert pre = in W1", epre, product(ein, w1, c, f, d), d, true);
    check_gelu("expert GELU", ehidden, epre);
    check_product("expert out = GELU W2", rows_of(out, e, slots, c, d), product(ehidden, w2, c, d, f), f, true);
    check_product("dW2", block(dw_2, e, f * d), product(ehidden, ed_out, f, d, c, true), c, false);
    check_gelu_backward("expert dz", ed_pre, epre, product(ed_out, w2, c, f, d, false, true), d);
    check_product("dW1", block(dw_1, e, d * f), product(ein, ed_pre, d, f, c, true), c, false);
    check_product("expert d in = dz W1'", rows_of(d_in, e, slots, c, d), product(ed_pre, w1, c, d, f, false, true), f,
                  true);
  }
  // Combine y = round(h + Σ g·out), the experts' output gradients round(g·dy), and da = Σ d in + dlogits·W_r'.
  const Values d_logits = values_of(named(inner, "moe_d_logits"));
  Values y_ref = h, y_bound(t * d), dout_ref(d_out.size(), 0.0), da_ref(t * d, 0.0), da_bound(t * d, 0.0);
  for (std::int64_t r = 0; r < t; ++r)
    for (std::int64_t j = 0; j < k; ++j)
      if (slot[r * k + j] >= 0) {
        const auto e = static_cast<std::int64_t>(choice[r * k + j]), row = static_cast<std::int64_t>(slot[r * k + j]);
        for (std::int64_t i = 0; i < d; ++i) {
          const std::int64_t at = (e * slots + row) * d + i;
          y_ref[r * d + i] += gate[r * k + j] * out[at];
          y_bound[r * d + i] += std::abs(gate[r * k + j] * out[at]);
          dout_ref[at] = gate[r * k + j] * dyv[r * d + i];
          da_ref[r * d + i] += d_in[at];
          da_bound[r * d + i] += std::abs(d_in[at]);
        }
      }
  for (std::int64_t i = 0; i < t * d; ++i)
    y_bound[i] = kU * std::abs(y_ref[i]) + (1 + kU) * gamma_of(k + 2) * (y_bound[i] + std::abs(h[i]));
  check_within("y = h + sum g out", values_of(y), y_ref, y_bound);
  Values dout_bound(d_out.size());
  for (std::size_t i = 0; i < d_out.size(); ++i)
    dout_bound[i] = kU * std::abs(dout_ref[i]) + kFp32 * std::abs(dout_ref[i]);
  check_within("expert d out = g dy", d_out, dout_ref, dout_bound);
  const Product router_back = product(d_logits, w_r, t, d, x, false, true);
  for (std::int64_t i = 0; i < t * d; ++i) {
    da_ref[i] += router_back.value[i];
    da_bound[i] = gamma_of(k + x + 1) * (da_bound[i] + router_back.magnitude[i]);
  }
  check_within("da = sum d in + dlogits W_r'", values_of(da), da_ref, da_bound);
  check_product("dW_r = a' dlogits", values_of(named(grads, "dmoe_w_router")), product(av, d_logits, d, x, t, true), t,
                false);
  // dlogits: dg_j = ⟨dy, out_j⟩ through the gates and the aux loss, then the softmax backward (fp32 rows).
  const std::int64_t size = s.group_size > 0 ? std::min(s.group_size, t) : t, groups = (t + size - 1) / size;
  Values dl_ref(t * x), dl_bound(t * x);
  for (std::int64_t r = 0; r < t; ++r) {
    Values dp(x, 0.0), dp_mag(x, 0.0);
    double dg[2] = {0, 0}, dg_mag[2] = {0, 0};
    for (std::int64_t j = 0; j < k; ++j) {
      if (slot[r * k + j] < 0) continue;
      const auto e = static_cast<std::int64_t>(choice[r * k + j]), row = static_cast<std::int64_t>(slot[r * k + j]);
      for (std::int64_t i = 0; i < d; ++i) {
        dg[j] += dyv[r * d + i] * out[(e * slots + row) * d + i];
        dg_mag[j] += std::abs(dyv[r * d + i] * out[(e * slots + row) * d + i]);
      }
    }
    const auto first = static_cast<std::int64_t>(choice[r * k]);
    if (k == 1) {
      dp[first] = dg[0];
      dp_mag[first] = dg_mag[0];
    } else {
      const auto second = static_cast<std::int64_t>(choice[r * k + 1]);
      const double p1 = probs[r * x + first], p2 = probs[r * x + second], sum = p1 + p2;
      dp[first] = p2 * (dg[0] - dg[1]) / (sum * sum);
      dp[second] = -p1 * (dg[0] - dg[1]) / (sum * sum);
      dp_mag[first] = p2 * (dg_mag[0] + dg_mag[1]) / (sum * sum);
      dp_mag[second] = p1 * (dg_mag[0] + dg_mag[1]) / (sum * sum);
    }
    const std::int64_t g = r / size, group_rows = std::min(t, (g + 1) * size) - g * size;
    double first_fraction[64] = {};
    for (std::int64_t q = g * size; q < g * size + group_rows; ++q)
      first_fraction[static_cast<std::int64_t>(choice[q * k])] += 1.0 / static_cast<double>(group_rows);
    double dot = 0, dot_mag = 0;
    for (std::int64_t e = 0; e < x; ++e) {
      dp[e] += 0.01 * static_cast<double>(x) * first_fraction[e] / static_cast<double>(groups * group_rows);
      dot += probs[r * x + e] * dp[e];
      dot_mag += probs[r * x + e] * (std::abs(dp[e]) + dp_mag[e]);
    }
    for (std::int64_t e = 0; e < x; ++e) {
      dl_ref[r * x + e] = probs[r * x + e] * (dp[e] - dot);
      dl_bound[r * x + e] =
          probs[r * x + e] * 16 * static_cast<double>(d + x) * kFp32 * (std::abs(dp[e]) + dp_mag[e] + dot_mag + 1e-3);
    }
  }
  check_within("dlogits", d_logits, dl_ref, dl_bound);
}

}  // namespace

TEST_SUITE("layer_bf16") {
  TEST_CASE("layer_bf16: every stored tensor of a bf16 encoder layer is its step in double on the stored inputs") {
    for (bool causal : {false, true})
      for (std::int64_t n : {1, 7, 33})
        for (std::int64_t batch : {1, 2}) {
          CAPTURE(causal);
          CAPTURE(n);
          CAPTURE(batch);
          check_dense_layer("vanilla", {.batch = batch, .heads = 2, .seq_len = n, .head_dim = 8, .causal = causal}, 24);
        }
    // Tiles one below, at and one above exact-tiled's block (its bf16 tiles take D = 16k); F = 40.
    for (std::int64_t n : {63, 64, 65}) {
      CAPTURE(n);
      check_dense_layer("exact-tiled", {.batch = 1, .heads = 3, .seq_len = n, .head_dim = 16, .causal = true}, 40);
    }
    // A downsampling mechanism: no attention residual, the FFN on the M latents.
    check_dense_layer("perceiver", {.batch = 2, .heads = 2, .seq_len = 21, .head_dim = 8}, 24, {"latents=5"});
  }

  TEST_CASE("layer_bf16: the mixture of experts' every stage, Switch and GShard, across the router's blocks") {
    for (FfnKind kind : {FfnKind::Switch, FfnKind::Gshard})
      for (std::int64_t t : {1, 7, 37, 1100})
        for (std::int64_t group : {0, 17}) {
          CAPTURE(ffn_name(kind));
          CAPTURE(t);
          CAPTURE(group);
          check_moe(moe(kind, 5, 1.0, group), t, 12, 20);
        }
    check_moe(moe(FfnKind::Switch, 4, 0.5), 90, 8, 16);  // many drops
  }

  TEST_CASE("layer_bf16: a layer with experts chains the MoE between h and dx") {
    for (FfnKind kind : {FfnKind::Switch, FfnKind::Gshard}) {
      const MoeSettings s = moe(kind, 4, 1.25);
      const LayerRun run("vanilla", {.batch = 2, .heads = 2, .seq_len = 19, .head_dim = 8, .causal = true}, 16, {}, s);
      const MoeFfn& ffn = *run.layer->moe();
      CHECK(named(ffn.saved(), "moe_expert_in").dtype() == DType::BF16);
      // y = h + moe(LN₂(h)): the experts' inputs are rows of the layer's a₂ exactly.
      const Values a2 = first_rows(run.saved("layer_ln2_out"), 2 * 19 * 16),
                   in = values_of(named(ffn.saved(), "moe_expert_in"));
      const Values choice = values_of(named(ffn.parameters(), "moe_choice")),
                   slot = values_of(named(ffn.parameters(), "moe_slot"));
      const std::int64_t e = 16, k = ffn_top_k(kind), slots = static_cast<std::int64_t>(in.size()) / (4 * e);
      for (std::int64_t r = 0; r < 2 * 19; ++r)
        for (std::int64_t j = 0; j < k; ++j)
          if (slot[r * k + j] >= 0) {
            const auto x = static_cast<std::int64_t>(choice[r * k + j]),
                       row = static_cast<std::int64_t>(slot[r * k + j]);
            CHECK(Values(in.begin() + (x * slots + row) * e, in.begin() + (x * slots + row + 1) * e) ==
                  Values(a2.begin() + r * e, a2.begin() + (r + 1) * e));
          }
      // dh = dy + LN₂ᵀ(da) where da is the MoE's backward: nonzero and finite; dx bf16.
      const Values dh = values_of(named(run.layer->backward_intermediates(), "layer_dhidden"));
      CHECK(std::all_of(dh.begin(), dh.end(), [](double v) { return std::isfinite(v); }));
      CHECK(run.dx.dtype() == DType::BF16);
      check_mechanism("vanilla", run);
    }
  }

  TEST_CASE("layer_bf16 rows: FLOPs as the fp32 formulas, bf16 inputs and buffers, every estimate exact") {
    for (const std::string model : {"vanilla", "exact-tiled", "switch", "gshard", "perceiver"})
      for (Pass pass : {Pass::Forward, Pass::Train}) {
        CAPTURE(model);
        CAPTURE(pass_name(pass));
        // Large enough that the activations outweigh the fp32 scratch of a bf16 layer (GELU's chunks, the router's
        // rows).
        const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 32, .causal = true};
        PointConfig f32 = counter_point(model, p, {}, Scope::Layer), bf16 = f32;
        f32.pass = bf16.pass = pass;
        bf16.problem.dtype = DType::BF16;
        const ResultRow a = run_point(f32), b = run_point(bf16);
        REQUIRE(a.status == Status::Ok);
        REQUIRE(b.status == Status::Ok);
        CHECK(b.dtype == DType::BF16);
        CHECK(b.peak_owned_bytes - point_io_bytes(bf16) == b.estimated_workspace_bytes);
        CHECK(point_io_bytes(bf16) * 2 == point_io_bytes(f32));
        // The layer's own bytes (the mechanism's are its bf16 form's matter): activations, weights and
        // saved tensors in bf16 outweigh the fp32 scratch.
        auto layer_bytes = [&](const PointConfig& c) {
          const Point point = resolve_point(c);
          const std::int64_t rows = point_output_rows(point), f = c.effective_d_ff();
          const Problem& q = point.config.problem;
          return EncoderLayer::workspace_bytes(q, f, rows, point.config.ffn) +
                 (pass == Pass::Train ? EncoderLayer::backward_workspace_bytes(q, f, rows, point.config.ffn) : 0);
        };
        CHECK(layer_bytes(bf16) < layer_bytes(f32));
        if (pass == Pass::Train) CHECK(b.saved_bytes < a.saved_bytes);
        const std::optional<std::int64_t> flops = estimated_point_flops(resolve_point(bf16));
        if (flops) CHECK(b.flops == *flops);  // dense FFN: the fp32 formula
        if (flops) CHECK(a.flops == b.flops);
      }
    // The mixture's FLOPs follow its routing (the formula with its routed pairs), bytes its estimate.
    for (const MoeSettings& s : {moe(FfnKind::Switch, 8, 1.25), moe(FfnKind::Gshard, 8, 1.25, 64)}) {
      const std::int64_t t = 150, d = 16, f = 32;
      Tensor a(Shape{t, d}, DType::BF16), y(Shape{t, d}, DType::BF16), dy(Shape{t, d}, DType::BF16), da(Shape{t, d});
      CounterRng(3, "test/moe_a").fill_normal(a);
      CounterRng(3, "test/moe_dy").fill_normal(dy);
      auto& tracker = MemoryTracker::instance();
      const std::int64_t before = tracker.owned_current_bytes();
      MoeFfn ffn(s, t, d, f, kTestThreads, 11, DType::BF16);
      CHECK(tracker.owned_current_bytes() - before == MoeFfn::workspace_bytes(s, t, d, f, DType::BF16));
      const std::int64_t setup = tracker.owned_current_bytes();
      ffn.prepare_training();
      CHECK(tracker.owned_current_bytes() - setup == MoeFfn::backward_workspace_bytes(s, t, d, f, DType::BF16));
      FlopCounter::reset();
      ffn.forward(a.bf16_data(), y.bf16_data());
      CHECK(FlopCounter::total() == MoeFfn::flops(s, t, d, f, ffn.routed_pairs()));
      FlopCounter::reset();
      ffn.backward(a.bf16_data(), dy.bf16_data(), da.data());
      CHECK(FlopCounter::total() == MoeFfn::backward_flops(s, t, d, f, ffn.routed_pairs()));
    }
  }
}
