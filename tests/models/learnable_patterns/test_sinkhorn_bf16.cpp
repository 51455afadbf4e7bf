// sinkhorn's bf16 form: forward and gradients against the float64 reference on the same bf16 inputs,
// on every bf16 kernel path; the sorting part; decode against the bf16 causal forward; rows' bytes,
// FLOPs and estimates.
//
// The reference runs in float64 on the bf16 inputs (widened exactly) with the soft permutation P the
// model computed (checked on its own against the network in float64): the keys of a head are
// [K; K̃] and its values [V; Ṽ], K̃_i = Σ_j P_ij·K_j in float64, and each query sees them per
// sinkhorn.hpp (a mask over the extended keys). Bounds, with u = 2⁻⁸ and s = 1/√D:
//   Forward. K̃ is stored in bf16 (relative error ≤ u per element, after fp32 sums whose own error,
//   ≤ n_B·eps relative, the doubled fp32 bound covers), so a score s·q_i·k̃_j moves by at most
//   σ = u·s·max_i‖q_i‖·max_j‖k̃_j‖ (Cauchy–Schwarz) and each normalised weight by a factor within
//   e^{±2σ}: ε_P = e^{2σ} − 1 (per query row, with its own ‖q_i‖). With the row's weights w_j, that
//   moves an output element by ≤ ε_P·Σ_j w_j|v_j|; rounding Ṽ by ≤ u·Σ_j w_j|v_j| (over its rows),
//   rounding P by ≤ u·Σ_j w_j|v_j|, rounding the output by ≤ u·|o|(1 + u):
//   |o − o_ref| ≤ (1 + u)·((ε_P + 2u)·Σ_j w_j|v_j| + u·|o_ref| + twice the fp32 bound)
//   (attention_tolerance over the extended keys; the (1 + u): the output rounding of the other
//   errors); Σ_j w_j|v_j| is the float64 reference attention of |[V; Ṽ]|.
//   Gradients, per element with terms T (reference_attention_backward's over the extended keys,
//   chained through the mixing: dK_j += Σ_i P_ij·dK̃_i, and their terms likewise): reformer's
//   (3ε_P + 7u(1 + u))·T (P through the scores and its rounding, in P and in δ, dS rounded, the
//   stored keys in dQ = dS·K̃, the gradient rounded), plus u for Ṽ in dP = dO·Ṽᵀ and u for the
//   own block's dK, dV, rounded before the mixing's share is added and rounded again:
//   |g − g_ref| ≤ (3ε_P + 9u(1 + u))·T + twice the fp32 factor·T. dK also gets the sorting network's
//   share dE (the fp32 form's, from the fp32 model on the same inputs less the float64 attention
//   and mixing part): a linear image of dP, whose entries carry the factor's relative error in
//   each of their two products, so it may move by 2·factor·max|dE share| of its head.
//   Decode: check_bf16_decode's bound (bf16_check.hpp); the step rounds as the forward's tile.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/learnable_patterns/sinkhorn.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

constexpr double kU = kBf16Roundoff;

struct Run {
  std::unique_ptr<Mechanism> mechanism;
  SinkhornAttention* model = nullptr;
  Tensor out, dq, dk, dv;
};

// The model's forward (and with dout its backward) on the inputs, in dtype.
Run run_sinkhorn(Problem p, const AttentionInputs& in, const std::vector<std::string>& params, DType dtype,
                 const Tensor* dout = nullptr) {
  p = on_test_threads(p);
  p.dtype = dtype;
  const ModelInfo* info = find_model("sinkhorn");
  REQUIRE(info != nullptr);
  Run run;
  run.mechanism = info->impl.create(p, resolve_params("sinkhorn", info->impl.params, params), 42);
  run.model = dynamic_cast<SinkhornAttention*>(run.mechanism.get());
  REQUIRE(run.model != nullptr);
  const auto bhnd = [&] { return Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, dtype); };
  run.out = bhnd();
  run.mechanism->prepare(in.q, in.k, in.v);
  if (dout != nullptr) run.mechanism->prepare_backward();
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  if (dout == nullptr) return run;
  run.dq = bhnd();
  run.dk = bhnd();
  run.dv = bhnd();
  run.mechanism->backward(in.q, in.k, in.v, run.out, *dout, run.dq, run.dk, run.dv);
  return run;
}

// One head's extended keys and values [K; K̃], [V; Ṽ] (K̃ from the model's P in float64, stored as
// floats for the reference functions), and which of them each query sees (sinkhorn.hpp).
struct Extended {
  std::int64_t n = 0, bs = 0, nb = 0, rows = 0, keys = 0, cut = 0;
  bool causal = false;
  std::vector<double> perm;
  std::vector<float> k, v;
  bool sees(std::int64_t i, std::int64_t j) const {
    const std::int64_t block = i / bs;
    if (j < n) return cut == 0 && j / bs == block && (!causal || j <= i);
    return cut > 0 || ((j - n) / bs == block && (!causal || block > 0));
  }
  MaskFn mask() const {
    return [this](std::int64_t i, std::int64_t j) { return sees(i, j); };
  }
  // Key row j < n's gradient from the extended gradient g: its own entry plus Σ_i P_ij·g[K̃_i's row].
  std::vector<double> chained(const std::vector<double>& g, std::int64_t d) const {
    std::vector<double> out(g.begin(), g.begin() + n * d);
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t c = 0; c < d; ++c) out[t * d + c] += perm[i * nb + t / bs] * g[(n + i * bs + t % bs) * d + c];
    return out;
  }
};

Extended extend(const SinkhornAttention& model, const Problem& p, const float* k, const float* v, std::int64_t b,
                std::int64_t h) {
  Extended x;
  const std::int64_t d = p.head_dim;
  x.n = p.seq_len;
  x.bs = model.block();
  x.nb = model.blocks();
  x.cut = model.sortcut_blocks();
  x.rows = x.cut > 0 ? x.cut : x.nb;
  x.keys = x.n + x.rows * x.bs;
  x.causal = p.causal;
  const auto perm = model.permutation(b, h);
  x.perm.assign(perm.begin(), perm.end());
  std::vector<double> k64(static_cast<std::size_t>(x.keys * d), 0.0), v64 = k64;
  for (std::int64_t e = 0; e < x.n * d; ++e) {
    k64[e] = k[e];
    v64[e] = v[e];
  }
  for (std::int64_t i = 0; i < x.rows; ++i)
    for (std::int64_t t = 0; t < x.n; ++t)
      for (std::int64_t c = 0; c < d; ++c) {
        const double w = x.perm[i * x.nb + t / x.bs];
        k64[(x.n + i * x.bs + t % x.bs) * d + c] += w * k[t * d + c];
        v64[(x.n + i * x.bs + t % x.bs) * d + c] += w * v[t * d + c];
      }
  x.k.assign(k64.begin(), k64.end());
  x.v.assign(v64.begin(), v64.end());
  return x;
}

double largest_norm(const float* x, std::int64_t rows, std::int64_t d) {
  double largest = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    double squares = 0;
    for (std::int64_t c = 0; c < d; ++c) squares += static_cast<double>(x[i * d + c]) * x[i * d + c];
    largest = std::max(largest, std::sqrt(squares));
  }
  return largest;
}

// ε_P of the header for one head.
double score_shift(const float* q, const Extended& x, std::int64_t d) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  return std::expm1(2 * kU * scale * largest_norm(q, x.n, d) * largest_norm(x.k.data() + x.n * d, x.rows * x.bs, d));
}

std::string label_of(const Problem& p, const std::vector<std::string>& params, const std::string& path) {
  std::string label = "sinkhorn bf16 [" + path + "] N=" + std::to_string(p.seq_len) +
                      " D=" + std::to_string(p.head_dim) + (p.causal ? " causal" : "");
  for (const auto& param : params) label += " " + param;
  return label;
}

// Counts elements of got outside bound(e) of want, reporting the first three; returns the count.
template <class Bound>
std::int64_t count_failures(const float* got, const std::vector<double>& want, std::int64_t count, const Bound& bound,
                            const std::string& label) {
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < count; ++e) {
    const double error = std::fabs(got[e] - want[static_cast<std::size_t>(e)]);
    if (!(error <= bound(e)) && failures++ < 3)
      FAIL_CHECK(label << " element " << e << ": got " << got[e] << ", want " << want[static_cast<std::size_t>(e)]
                       << " (bound " << bound(e) << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of the bf16 bound");
  return failures;
}

// The bf16 forward against the float64 reference; returns the largest error over the fp32 bound.
double check_forward(const Problem& p, const std::vector<std::string>& params, const std::string& label) {
  const auto in = bf16_inputs(p, static_cast<std::uint64_t>(p.seq_len * 5 + 3));
  const Run run = run_sinkhorn(p, in.bf16, params, DType::BF16);
  const Tensor out = to_f32(run.out);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double over_fp32 = 0;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float* q = in.widened.q.head(b, h);
      const Extended x = extend(*run.model, p, in.widened.k.head(b, h), in.widened.v.head(b, h), b, h);
      const auto want = reference_attention(q, x.k.data(), x.v.data(), n, x.keys, d, scale, x.mask());
      std::vector<float> magnitudes(x.v.size());
      std::transform(x.v.begin(), x.v.end(), magnitudes.begin(), [](float e) { return std::fabs(e); });
      const auto spread = reference_attention(q, x.k.data(), magnitudes.data(), n, x.keys, d, scale, x.mask());
      const double fp32_bound = 2 * attention_tolerance(q, x.k.data(), x.v.data(), n, x.keys, d, scale);
      const double sorted_norm = largest_norm(x.k.data() + x.n * d, x.rows * x.bs, d);
      const float* got = out.head(b, h);
      for (std::int64_t e = 0; e < n * d; ++e)
        over_fp32 = std::max(over_fp32, std::fabs(got[e] - want[static_cast<std::size_t>(e)]) / fp32_bound);
      // Per element: (ε_P of the row + 2u(1 + u))·Σ_j w_j|v_j| + u·|o| + the fp32 bound (header).
      count_failures(
          got, want, n * d,
          [&](std::int64_t e) {
            const double shift = std::expm1(2 * kU * scale * largest_norm(q + e / d * d, 1, d) * sorted_norm);
            const auto i = static_cast<std::size_t>(e);
            return (1 + kU) * ((shift + 2 * kU) * spread[i] + kU * std::fabs(want[i]) + fp32_bound);
          },
          label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
  return over_fp32;
}

// The bf16 gradients against the float64 reference (header), dE's share from the fp32 model.
void check_gradients(const Problem& p, const std::vector<std::string>& params, const std::string& label) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n) + 11);
  Tensor dout32 = Tensor::bhnd(p.batch, p.heads, n, d);
  CounterRng(9, "dout").fill_normal(dout32);
  const Tensor dout = to_bf16(dout32), dout_widened = to_f32(dout);
  const Run run = run_sinkhorn(p, in.bf16, params, DType::BF16, &dout);
  const Run fp32 = run_sinkhorn(p, in.widened, params, DType::F32, &dout_widened);
  const Tensor got[3] = {to_f32(run.dq), to_f32(run.dk), to_f32(run.dv)};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::string head = label + " b=" + std::to_string(b) + " h=" + std::to_string(h);
      const float* q = in.widened.q.head(b, h);
      const Extended x = extend(*run.model, p, in.widened.k.head(b, h), in.widened.v.head(b, h), b, h);
      const Extended x32 = extend(*fp32.model, p, in.widened.k.head(b, h), in.widened.v.head(b, h), b, h);
      if (!p.causal) CHECK(x.perm == x32.perm);  // the same sorting of the same E (causal: E's prefixes in bf16)
      const auto ref = reference_attention_backward(q, x.k.data(), x.v.data(), dout_widened.head(b, h), n, x.keys, d,
                                                    scale, x.mask());
      const auto ref32 = reference_attention_backward(q, x32.k.data(), x32.v.data(), dout_widened.head(b, h), n,
                                                      x32.keys, d, scale, x32.mask());
      const double factor =
          3 * score_shift(q, x, d) + 9 * kU * (1 + kU) + 2 * gradient_error_factor(q, x.k.data(), n, x.keys, d, scale);
      const std::vector<double> dk = x.chained(ref.dk, d), dk_terms = x.chained(ref.dk_terms, d);
      const std::vector<double> dv = x.chained(ref.dv, d), dv_terms = x.chained(ref.dv_terms, d);
      // dK's network share: the fp32 form's dK less the float64 attention and mixing part of its own P.
      const std::vector<double> dk32_part = x32.chained(ref32.dk, d);
      const float* dk32 = fp32.dk.head(b, h);
      std::vector<double> dk_want(dk);
      double share = 0;
      for (std::int64_t e = 0; e < n * d; ++e) {
        dk_want[e] += dk32[e] - dk32_part[e];
        share = std::max(share, std::fabs(dk32[e] - dk32_part[e]));
      }
      count_failures(
          got[0].head(b, h), ref.dq, n * d, [&](std::int64_t e) { return factor * ref.dq_terms[e]; }, head + " dq");
      count_failures(
          got[1].head(b, h), dk_want, n * d, [&](std::int64_t e) { return factor * (dk_terms[e] + 2 * share); },
          head + " dk");
      count_failures(
          got[2].head(b, h), dv, n * d, [&](std::int64_t e) { return factor * dv_terms[e]; }, head + " dv");
    }
}

}  // namespace

TEST_SUITE("sinkhorn_bf16") {
  TEST_CASE("sinkhorn in bf16 equals the float64 sorted-block reference within the bf16 bound, on every path") {
    for_each_bf16_path([](const std::string& path) {
      for (bool causal : {false, true}) {
        double over_fp32 = 0;
        for (std::int64_t n : {1, 15, 16, 17, 40, 48, 100}) {  // block 16: one below, at, above; short last blocks
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const std::vector<std::string> params{"block=16", "sinkhorn_iters=3"};
          over_fp32 = std::max(over_fp32, check_forward(p, params, label_of(p, params, path)));
        }
        for (std::int64_t n : {61, 64, 65, 68, 133}) {  // 16 to 34 blocks of 4, whole and short last ones
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const std::vector<std::string> params{"block=4", "sinkhorn_iters=3"};
          check_forward(p, params, label_of(p, params, path));
        }
        for (std::int64_t n : {49, 50, 51, 130}) {  // the default block of 50 (b·D = 1600: chunks of 256 and 64)
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          check_forward(p, {}, label_of(p, {}, path));
        }
        CHECK_MESSAGE(over_fp32 > 1, path << (causal ? " causal" : "") << ": never past the fp32 bound");
      }
      for (std::int64_t n : {31, 32, 33, 70}) {  // SortCut (encoder only)
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
        const std::vector<std::string> params{"block=8", "sinkhorn_iters=3", "sortcut_blocks=2"};
        check_forward(p, params, label_of(p, params, path));
      }
    });
  }

  TEST_CASE("sinkhorn's bf16 sorting: E from the bf16 keys (causal: bf16 prefixes), P from E by the network") {
    for (bool causal : {false, true})
      for (std::int64_t n : {17, 64, 70}) {
        const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
        const auto in = bf16_inputs(p, 5);
        const Run run = run_sinkhorn(p, in.bf16, {"block=8"}, DType::BF16);
        const Run fp32 = run_sinkhorn(p, in.widened, {"block=8"}, DType::F32);
        const Tensor* e = nullptr;
        const Tensor* e32 = nullptr;
        for (const auto& named : run.mechanism->saved())
          if (named.name == "embeddings") e = named.tensor;
        for (const auto& named : fp32.mechanism->saved())
          if (named.name == "embeddings") e32 = named.tensor;
        REQUIRE(e != nullptr);
        REQUIRE(e32 != nullptr);
        const std::int64_t nb = run.model->blocks(), d = 16;
        for (std::int64_t head = 0; head < 2; ++head)
          for (std::int64_t i = 0; i < nb; ++i)
            for (std::int64_t c = 0; c < d; ++c) {
              const std::int64_t at = (head * nb + i) * d + c;
              const float got = e->data()[at], want = e32->data()[at];
              if (!causal) {
                CHECK(got == want);  // the same fp32 sums of the same values
                continue;
              }
              // E_i = bf16(E_{i−1} + s_{i−1}): each of the i roundings moves it by ≤ u of a prefix.
              double bound = 0;  // and the fp32 prefix's own rounding (1e-6 relative, ≫ its n_B·eps)
              for (std::int64_t m = 1; m <= i; ++m)
                bound += (kU * (1 + kU) + 1e-6) * std::fabs(e32->data()[(head * nb + m) * d + c]);
              CHECK(round_to_bf16(got) == got);
              CHECK(std::fabs(got - want) <= bound);
            }
        if (!causal)
          for (std::int64_t h = 0; h < 2; ++h) CHECK(run.model->permutation(0, h) == fp32.model->permutation(0, h));
      }
  }

  TEST_CASE("sinkhorn's bf16 K̃, Ṽ: the fp32 form's mixing of the same values, rounded once") {
    // Non-causal, where both forms have the same P. Both sum in fp32 (oneDNN's batched matmul, and
    // sgemm per head on the widened rows), so within δ = 2·n_B·ε·max|x| (Σ_j P_ij ≤ 1) of each
    // other; then one rounding, u·(|K̃| + δ).
    for (const auto& [n, d, params] :
         {std::tuple<std::int64_t, std::int64_t, std::vector<std::string>>{68, 16, {"block=4", "sinkhorn_iters=3"}},
          {133, 16, {"block=4", "sinkhorn_iters=3"}},
          {130, 32, {}}}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = d, .causal = false};
      const auto in = bf16_inputs(p, 11);
      const Run run = run_sinkhorn(p, in.bf16, params, DType::BF16);
      const Run fp32 = run_sinkhorn(p, in.widened, params, DType::F32);
      for (std::int64_t h = 0; h < 2; ++h) REQUIRE(run.model->permutation(0, h) == fp32.model->permutation(0, h));
      const auto saved = [](const Run& r, const std::string& name) {
        for (const auto& named : r.mechanism->saved())
          if (named.name == name) return named.tensor;
        FAIL("no saved " << name);
        return static_cast<const Tensor*>(nullptr);
      };
      for (const auto& [name, x] : {std::pair<std::string, const Tensor*>{"sorted_k", &in.widened.k},
                                    std::pair<std::string, const Tensor*>{"sorted_v", &in.widened.v}}) {
        const Tensor got = to_f32(*saved(run, name));
        const Tensor& want = *saved(fp32, name);
        REQUIRE(got.size() == want.size());
        const double delta =
            2.0 * static_cast<double>(run.model->blocks()) * kFloatEps * max_abs_of(x->data(), x->size());
        std::int64_t failures = 0;
        for (std::int64_t e = 0; e < got.size(); ++e) {
          const double bound = kU * (std::fabs(want.data()[e]) + delta) + delta;
          if (!(std::fabs(got.data()[e] - want.data()[e]) <= bound) && failures++ < 3)
            FAIL_CHECK(name << " N=" << n << " element " << e << ": got " << got.data()[e] << ", want "
                            << want.data()[e]);
        }
        CHECK_MESSAGE(failures == 0, name << " N=" << n);
      }
    }
  }

  TEST_CASE("sinkhorn's bf16 gradients equal the float64 reference's within the bf16 bound, at block ± 1") {
    for_each_bf16_path([](const std::string& path) {
      for (bool causal : {false, true})
        for (std::int64_t n : {7, 8, 9, 20, 33}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const std::vector<std::string> params{"block=8", "sinkhorn_iters=3"};
          check_gradients(p, params, label_of(p, params, path));
          if (!causal) {
            const std::vector<std::string> cut{"block=8", "sinkhorn_iters=3", "sortcut_blocks=2"};
            check_gradients(p, cut, label_of(p, cut, path));
          }
        }
      const Problem p{.batch = 2, .heads = 2, .seq_len = 101, .head_dim = 32, .causal = true};
      check_gradients(p, {}, label_of(p, {}, path));
    });
  }

  TEST_CASE("sinkhorn's bf16 decode, on its bf16 block cache, equals its bf16 causal forward") {
    for (std::int64_t context : {8, 9, 15, 16, 17, 23}) {  // ≥ the block, which is clamped to the context's N
      const std::int64_t tokens = 20, b = 8, heads = 2, d = 16;
      const std::int64_t state =
          check_bf16_decode("sinkhorn", {.batch = 1, .heads = heads, .head_dim = d}, context, tokens, {"block=8"});
      const std::int64_t blocks = (context + tokens + b - 1) / b;
      CHECK(state == 2 * (2 * heads * blocks * b * d + heads * 2 * b * d + heads * d));  // cache, K̃ and Ṽ, E
    }
  }

  TEST_CASE("sinkhorn bf16 rows: FLOPs as fp32's, K̃, Ṽ and the decode state half, every estimate exact") {
    for (const auto& params : {std::vector<std::string>{"block=16"}, std::vector<std::string>{},
                               std::vector<std::string>{"block=8", "sortcut_blocks=3"}})
      for (bool causal : {false, true})
        for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
          const bool cut = params.size() > 1;
          if ((pass == Pass::Decode && !causal) || (cut && (causal || pass == Pass::Decode))) continue;
          for (std::int64_t n : {47, 48, 100}) {
            CAPTURE(params.size());
            const auto [a, b] = check_bf16_rows("sinkhorn", n, causal, pass, params);
            if (pass == Pass::Backward || pass == Pass::Train) {
              const std::int64_t block = std::min<std::int64_t>(params.empty() ? 50 : (cut ? 8 : 16), n);
              const std::int64_t blocks = (n + block - 1) / block,
                                 rows = cut ? std::min<std::int64_t>(3, blocks) : blocks;
              CHECK(a.saved_bytes - b.saved_bytes == 2 * 2 * rows * block * 32 * 2);  // K̃, Ṽ of 2 heads
            }
            if (pass == Pass::Decode) {
              CHECK(b.state_bytes > 0);
              CHECK(2 * b.state_bytes == a.state_bytes);
            }
          }
        }
  }

  TEST_CASE("sinkhorn's bf16 form needs a head size the bf16 kernels tile: others are unsupported rows") {
    check_bf16_head_dim_unsupported("sinkhorn");
  }
}
