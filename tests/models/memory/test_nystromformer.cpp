// Nyströmformer against a naive double-precision evaluation of its own formula (segment-mean
// landmarks, the three softmax kernels, the iterative pseudo-inverse, (F·Z)·(B·v) and the
// depthwise convolution), its exact-attention fallback, its gradients and its O(N) scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/params.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

using Matrix = std::vector<double>;  // row-major

struct Settings {
  std::int64_t landmarks = 64, conv_kernel = 35, iterations = 6;
};

std::vector<std::string> params_of(const Settings& s) {
  return {"landmarks=" + std::to_string(s.landmarks), "conv_kernel=" + std::to_string(s.conv_kernel),
          "iterations=" + std::to_string(s.iterations)};
}

// c = a [r, n] · b [n, c].
Matrix product(const Matrix& a, const Matrix& b, std::int64_t rows, std::int64_t inner, std::int64_t cols) {
  Matrix c(static_cast<std::size_t>(rows * cols), 0.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t l = 0; l < inner; ++l)
      for (std::int64_t j = 0; j < cols; ++j) c[i * cols + j] += a[i * inner + l] * b[l * cols + j];
  return c;
}

// softmax(x·yᵀ/√d) over rows: x [rx, d], y [ry, d].
Matrix softmax_kernel(const double* x, const double* y, std::int64_t rx, std::int64_t ry, std::int64_t d) {
  Matrix p(static_cast<std::size_t>(rx * ry));
  for (std::int64_t i = 0; i < rx; ++i) {
    double peak = -INFINITY;
    for (std::int64_t j = 0; j < ry; ++j) {
      double s = 0;
      for (std::int64_t f = 0; f < d; ++f) s += x[i * d + f] * y[j * d + f];
      p[i * ry + j] = s / std::sqrt(static_cast<double>(d));
      peak = std::max(peak, p[i * ry + j]);
    }
    double sum = 0;
    for (std::int64_t j = 0; j < ry; ++j) sum += p[i * ry + j] = std::exp(p[i * ry + j] - peak);
    for (std::int64_t j = 0; j < ry; ++j) p[i * ry + j] /= sum;
  }
  return p;
}

// The segment of row i: with N = m·L + r, rows below r·(L + 1) are in segments of L + 1 rows,
// the others in segments of L.
std::int64_t segment_of(std::int64_t i, std::int64_t n, std::int64_t m) {
  const std::int64_t length = n / m, longer = n % m;
  return i < longer * (length + 1) ? i / (length + 1) : longer + (i - longer * (length + 1)) / length;
}

Matrix segment_means(const double* x, std::int64_t n, std::int64_t m, std::int64_t d) {
  Matrix mean(static_cast<std::size_t>(m * d), 0.0);
  std::vector<double> count(static_cast<std::size_t>(m), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t j = segment_of(i, n, m);
    count[j] += 1;
    for (std::int64_t f = 0; f < d; ++f) mean[j * d + f] += x[i * d + f];
  }
  for (std::int64_t j = 0; j < m; ++j)
    for (std::int64_t f = 0; f < d; ++f) mean[j * d + f] /= count[j];
  return mean;
}

// What a head's rounding scales with (for the forward's tolerance).
struct ErrorScale {
  double score_terms = 0;  // largest Σ_f |x_f·y_f|/√d of a kernel's logit
  double output = 0;       // largest |out| or |v|
  double condition = 0;    // ‖A‖∞·‖Z‖∞
  double conv = 0;         // Σ_t |w_t|·max|v|
};

// Σ_f |x_f·y_f|/√d, largest over the rows of x and y.
double largest_terms(const double* x, const double* y, std::int64_t rx, std::int64_t ry, std::int64_t d) {
  double largest = 0;
  for (std::int64_t i = 0; i < rx; ++i)
    for (std::int64_t j = 0; j < ry; ++j) {
      double terms = 0;
      for (std::int64_t f = 0; f < d; ++f) terms += std::fabs(x[i * d + f] * y[j * d + f]);
      largest = std::max(largest, terms / std::sqrt(static_cast<double>(d)));
    }
  return largest;
}

double infinity_norm(const Matrix& a, std::int64_t rows, std::int64_t cols) {
  double largest = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    double sum = 0;
    for (std::int64_t j = 0; j < cols; ++j) sum += std::fabs(a[i * cols + j]);
    largest = std::max(largest, sum);
  }
  return largest;
}

// The Nyström pseudo-inverse of A [m, m]: Z₀ = Aᵀ/max column sum, then the iterations.
Matrix pseudo_inverse(const Matrix& a, std::int64_t m, std::int64_t iterations) {
  double largest = 0;
  for (std::int64_t j = 0; j < m; ++j) {
    double sum = 0;
    for (std::int64_t i = 0; i < m; ++i) sum += a[i * m + j];
    largest = std::max(largest, sum);
  }
  Matrix z(static_cast<std::size_t>(m * m));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < m; ++j) z[i * m + j] = a[j * m + i] / largest;
  auto identity_minus = [m](double c, Matrix x) {
    for (double& e : x) e = -e;
    for (std::int64_t i = 0; i < m; ++i) x[i * m + i] += c;
    return x;
  };
  for (std::int64_t it = 0; it < iterations; ++it) {
    const Matrix az = product(a, z, m, m, m);
    const Matrix inner = identity_minus(15, product(az, identity_minus(7, az), m, m, m));
    Matrix next = product(z, identity_minus(13, product(az, inner, m, m, m)), m, m, m);
    for (double& e : next) e *= 0.25;
    z = std::move(next);
  }
  return z;
}

// One head's output [N, D] from q, k, v [N, D] and the head's taps w [k] (nullptr: none).
Matrix nystrom_head(const double* q, const double* k, const double* v, const double* w, std::int64_t n, std::int64_t d,
                    const Settings& s, ErrorScale& scale) {
  const std::int64_t m = std::min(s.landmarks, n);
  Matrix out;
  double largest_v = 0;
  for (std::int64_t e = 0; e < n * d; ++e) largest_v = std::max(largest_v, std::fabs(v[e]));
  if (m == n) {  // the fallback: exact attention
    out = product(softmax_kernel(q, k, n, n, d), Matrix(v, v + n * d), n, n, d);
    scale.score_terms = largest_terms(q, k, n, n, d);
  } else {
    const Matrix lq = segment_means(q, n, m, d), lk = segment_means(k, n, m, d);
    const Matrix f = softmax_kernel(q, lk.data(), n, m, d);
    const Matrix a = softmax_kernel(lq.data(), lk.data(), m, m, d);
    const Matrix b = softmax_kernel(lq.data(), k, m, n, d);
    const Matrix z = pseudo_inverse(a, m, s.iterations);
    const Matrix fz = product(f, z, n, m, m);
    const Matrix bv = product(b, Matrix(v, v + n * d), m, n, d);
    out = product(fz, bv, n, m, d);
    scale.score_terms = std::max({largest_terms(q, lk.data(), n, m, d), largest_terms(lq.data(), lk.data(), m, m, d),
                                  largest_terms(lq.data(), k, m, n, d)});
    scale.condition = infinity_norm(a, m, m) * infinity_norm(z, m, m);
  }
  if (w != nullptr) {
    double taps = 0;
    for (std::int64_t t = 0; t < s.conv_kernel; ++t) taps += std::fabs(w[t]);
    scale.conv = taps * largest_v;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t t = 0; t < s.conv_kernel; ++t) {
        const std::int64_t src = i + t - s.conv_kernel / 2;
        if (src < 0 || src >= n) continue;
        for (std::int64_t f = 0; f < d; ++f) out[i * d + f] += w[t] * v[src * d + f];
      }
  }
  scale.output = largest_v;
  for (double e : out) scale.output = std::max(scale.output, std::fabs(e));
  return out;
}

// Every head of the model from named values: q, k, v [B, H, N, D] and conv_weights [H, k].
Matrix nystrom_all(const NamedValues& x, const Problem& p, const Settings& s) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  Matrix out;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const double* w = s.conv_kernel > 0 ? x.at("conv_weights").data() + h * s.conv_kernel : nullptr;
      ErrorScale unused;
      const Matrix o =
          nystrom_head(x.at("q").data() + at, x.at("k").data() + at, x.at("v").data() + at, w, n, d, s, unused);
      out.insert(out.end(), o.begin(), o.end());
    }
  return out;
}

// fp32 rounding of one head, relative to the output's size (the largest |out| or |v|): each kernel's
// logits and softmax (the score terms, log2 of the row), the products' sums (log2 N·m), times
// 1 + log2(1 + κ), κ = ‖A‖∞‖Z‖∞, for the pseudo-inverse (the iteration corrects its own earlier
// rounding, so only the last iterations' rounding, amplified by A's conditioning, remains), plus the
// convolution's sums of k terms (log2(k + 1)) relative to Σ|w|·max|v|.
double head_tolerance(const ErrorScale& scale, std::int64_t n, const Settings& s) {
  const std::int64_t m = std::min(s.landmarks, n);
  const double sums = scale.score_terms + std::log2(static_cast<double>(n * m)) + 1;
  const double pinv = 1.0 + std::log2(1.0 + scale.condition);
  return 8 * kFloatEps * (sums * pinv * scale.output + std::log2(static_cast<double>(s.conv_kernel + 1)) * scale.conv);
}

void check_formula(const Problem& p, const Settings& s, const std::string& label, std::uint64_t seed = 11) {
  const auto in = random_inputs(p, seed);
  const MechanismRun run = run_keeping("nystromformer", p, in, params_of(s));
  NamedValues x{{"q", widened(in.q.data(), in.q.size())},
                {"k", widened(in.k.data(), in.k.size())},
                {"v", widened(in.v.data(), in.v.size())}};
  if (s.conv_kernel > 0) {
    const Tensor& w = run.parameter("conv_weights");
    REQUIRE(w.shape() == Shape{p.heads, s.conv_kernel});
    x["conv_weights"] = widened(w.data(), w.size());
  }
  const std::int64_t n = p.seq_len, d = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const double* w = s.conv_kernel > 0 ? x["conv_weights"].data() + h * s.conv_kernel : nullptr;
      ErrorScale scale;
      const Matrix want = nystrom_head(x["q"].data() + at, x["k"].data() + at, x["v"].data() + at, w, n, d, s, scale);
      check_head(run.out.head(b, h), want, n, d, head_tolerance(scale, n, s),
                 label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

// The bf16 form on bf16 inputs against the formula on the same values widened: it computes in fp32
// on the widened rows and rounds the output once, so the bound is the fp32 tolerance plus u·|o|.
void check_formula_bf16(const Problem& p, const Settings& s, const std::string& label, std::uint64_t seed) {
  const Bf16Inputs in = bf16_inputs(p, seed);
  auto mechanism = bf16_mechanism("nystromformer", p, params_of(s));
  const Tensor got = run_bf16(*mechanism, p, in.bf16);
  NamedValues x = named_inputs(in.widened);
  for (const auto& named : mechanism->parameters()) x[named.name] = widened(named.tensor->data(), named.tensor->size());
  const std::int64_t n = p.seq_len, d = p.head_dim;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const double* w = s.conv_kernel > 0 ? x["conv_weights"].data() + h * s.conv_kernel : nullptr;
      ErrorScale scale;
      const Matrix want = nystrom_head(x["q"].data() + at, x["k"].data() + at, x["v"].data() + at, w, n, d, s, scale);
      const double tolerance = head_tolerance(scale, n, s);
      check_bf16_elements(
          got.head(b, h), want, n * d,
          [&](std::int64_t e) {
            return (1 + kBf16Roundoff) * tolerance + kBf16Roundoff * std::fabs(want[static_cast<std::size_t>(e)]);
          },
          label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

std::string size_label(std::int64_t n, const Settings& s) {
  return "N=" + std::to_string(n) + " m=" + std::to_string(s.landmarks) + " k=" + std::to_string(s.conv_kernel) +
         " iterations=" + std::to_string(s.iterations);
}

}  // namespace

TEST_SUITE("nystromformer") {
  TEST_CASE("nystromformer equals its formula at, one below and one above multiples of the landmark count") {
    const Settings s{.landmarks = 8, .conv_kernel = 5, .iterations = 6};
    for (std::int64_t n : {7, 8, 9, 15, 16, 17, 23, 24, 25, 61, 100}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_formula(p, s, size_label(n, s));
    }
  }

  TEST_CASE("nystromformer in bf16 equals its formula within the fp32 bound plus the output's rounding") {
    for (const Settings& s :
         {Settings{.landmarks = 8, .conv_kernel = 5, .iterations = 6}, Settings{.landmarks = 3, .conv_kernel = 0}})
      for (std::int64_t n : {1, 2, 7, 8, 9, 25, 100}) {  // m ≥ N (exact attention) and m < N, around multiples
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
        check_formula_bf16(p, s, "bf16 " + size_label(n, s), static_cast<std::uint64_t>(n));
      }
  }

  TEST_CASE("nystromformer bf16 backward: the fp32 form's gradients on the same values, rounded (storage only)") {
    for (const Settings& s :
         {Settings{.landmarks = 8, .conv_kernel = 5, .iterations = 6}, Settings{.landmarks = 3, .conv_kernel = 0}})
      for (std::int64_t n : {2, 8, 9, 25}) {  // m ≥ N (exact attention) and m < N
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
        check_bf16_storage_gradients("nystromformer", p, params_of(s), static_cast<std::uint64_t>(n),
                                     "nystromformer bf16 backward " + size_label(n, s));
      }
  }

  TEST_CASE("nystromformer bf16 rows: FLOPs as fp32's, halved inputs and gradients, estimates exact") {
    for (std::int64_t n : {50, 200})
      for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train}) {
        const auto [a, b] = check_bf16_rows("nystromformer", n, false, pass);
        CHECK(b.saved_bytes == a.saved_bytes);  // the saved kernels stay fp32
      }
  }

  TEST_CASE("nystromformer at its defaults (64 landmarks, 35 taps) around N = m and 2m") {
    const Settings s{};
    for (std::int64_t n : {63, 64, 65, 127, 128, 129, 200}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_formula(p, s, size_label(n, s));
    }
  }

  TEST_CASE("nystromformer: landmark counts that do not divide N, other iteration counts, no convolution") {
    for (const Settings& s : {Settings{.landmarks = 3, .conv_kernel = 0, .iterations = 6},
                              Settings{.landmarks = 5, .conv_kernel = 3, .iterations = 1},
                              Settings{.landmarks = 7, .conv_kernel = 1, .iterations = 10},
                              Settings{.landmarks = 16, .conv_kernel = 35, .iterations = 6}})
      for (std::int64_t n : {10, 22, 37, 50}) {
        const Problem p{.batch = 1, .heads = 3, .seq_len = n, .head_dim = 8, .causal = false};
        check_formula(p, s, size_label(n, s));
      }
  }

  TEST_CASE("nystromformer's saved landmarks are the segment means, the first N mod m segments one row longer") {
    // N = 10, m = 4: segments of 3, 3, 2, 2 rows.
    const Problem p{.batch = 1, .heads = 1, .seq_len = 10, .head_dim = 4, .causal = false};
    const auto in = random_inputs(p, 3);
    const ModelInfo* info = find_model("nystromformer");
    REQUIRE(info != nullptr);
    auto mechanism =
        info->impl.create(on_test_threads(p), resolve_params("nystromformer", info->impl.params, {"landmarks=4"}), 42);
    mechanism->prepare(in.q, in.k, in.v);
    mechanism->prepare_backward();
    Tensor out = Tensor::bhnd(1, 1, 10, 4);
    mechanism->forward(in.q, in.k, in.v, out);
    const Tensor* saved = nullptr;
    for (const auto& named : mechanism->saved())
      if (named.name == "landmarks_bv_zbv") saved = named.tensor;
    REQUIRE(saved != nullptr);
    const std::int64_t first[] = {0, 3, 6, 8, 10};
    for (std::int64_t j = 0; j < 4; ++j)
      for (std::int64_t f = 0; f < 4; ++f) {
        double mean_q = 0, mean_k = 0;
        for (std::int64_t i = first[j]; i < first[j + 1]; ++i) mean_q += in.q[i * 4 + f], mean_k += in.k[i * 4 + f];
        const double rows = static_cast<double>(first[j + 1] - first[j]);
        CHECK((*saved)[j * 4 + f] == doctest::Approx(mean_q / rows).epsilon(4 * kFloatEps));
        CHECK((*saved)[16 + j * 4 + f] == doctest::Approx(mean_k / rows).epsilon(4 * kFloatEps));
      }
  }

  TEST_CASE("nystromformer with m >= N is exact softmax attention (no convolution)") {
    for (const auto& [n, m] :
         {std::pair<std::int64_t, std::int64_t>{1, 64}, {5, 64}, {63, 64}, {64, 64}, {8, 8}, {3, 8}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      const auto in = random_inputs(p, 5);
      const Tensor out = run_mechanism("nystromformer", p, in, {"landmarks=" + std::to_string(m), "conv_kernel=0"});
      check_against_reference(out, in, p, full_mask, "exact fallback N=" + std::to_string(n));
    }
  }

  TEST_CASE("nystromformer gradients of q, k, v and the convolution taps, through the pseudo-inverse") {
    for (const auto& [n, s] : {std::pair<std::int64_t, Settings>{5, {.landmarks = 2, .conv_kernel = 3}},
                               {7, {.landmarks = 3, .conv_kernel = 5}},
                               {8, {.landmarks = 4, .conv_kernel = 3, .iterations = 2}},
                               {9, {.landmarks = 4, .conv_kernel = 35}},
                               {4, {.landmarks = 4, .conv_kernel = 3}},
                               {3, {.landmarks = 8, .conv_kernel = 0}},
                               {40, {.landmarks = 6, .conv_kernel = 7}}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = false};
      check_composite_gradients(
          "nystromformer", p, params_of(s), [&](const NamedValues& x) { return nystrom_all(x, p, s); }, n <= 9);
    }
  }

  TEST_CASE(
      "nystromformer: a sequence's output ignores the other sequences of its batch, and depends on its last token") {
    // The pseudo-inverse's scale α is per (batch, head): the code's global maximum would couple them.
    const Problem p{.batch = 2, .heads = 2, .seq_len = 100, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 9);
    const Tensor before = run_mechanism("nystromformer", p, in, {"landmarks=8"});
    for (Tensor* t : {&in.q, &in.k, &in.v})
      for (std::int64_t e = 0; e < 2 * 100 * 8; ++e) t->head(1, 0)[e] *= 3.0f;
    in.k.head(0, 1)[99 * 8] += 1.0f;  // the last key of head 1 of sequence 0
    const Tensor after = run_mechanism("nystromformer", p, in, {"landmarks=8"});
    CHECK(std::equal(before.head(0, 0), before.head(0, 0) + 100 * 8, after.head(0, 0)));
    for (std::int64_t i = 0; i < 100; ++i)
      CHECK_MESSAGE(!std::equal(before.head(0, 1) + i * 8, before.head(0, 1) + (i + 1) * 8, after.head(0, 1) + i * 8),
                    "row " << i);
  }

  TEST_CASE("nystromformer: causal points are unsupported, even taps are a parameter error") {
    const ModelInfo* info = find_model("nystromformer");
    REQUIRE(info != nullptr);
    const ParamValues defaults = resolve_params("nystromformer", info->impl.params, {});
    Problem p{.batch = 1, .heads = 2, .seq_len = 128, .head_dim = 16, .causal = true};
    REQUIRE(info->impl.unsupported);
    CHECK(info->impl.unsupported(p, defaults) ==
          "Nyströmformer has no causal form: the landmarks average over all tokens");
    p.causal = false;
    CHECK(info->impl.unsupported(p, defaults).empty());
    CHECK_THROWS_AS(info->impl.validate(p, resolve_params("nystromformer", info->impl.params, {"conv_kernel=4"})),
                    ParamError);
    CHECK_NOTHROW(info->impl.validate(p, resolve_params("nystromformer", info->impl.params, {"conv_kernel=0"})));
  }

  TEST_CASE("nystromformer: executed FLOPs equal the analytic count, landmark and fallback paths") {
    const ModelInfo* info = find_model("nystromformer");
    for (const auto& [n, params] :
         {std::pair<std::int64_t, std::vector<std::string>>{37, {"landmarks=5", "conv_kernel=3"}},
          {300, {}},
          {40, {"conv_kernel=0", "iterations=3"}},
          {64, {}},
          {9, {"conv_kernel=35"}}}) {
      const auto config = quick_point("nystromformer", n, false, Scope::Attention, params);
      CHECK_MESSAGE(run_point(config).flops ==
                        info->impl.flops(config.problem, resolve_params("nystromformer", info->impl.params, params)),
                    "N=" << n);
    }
  }

  TEST_CASE("nystromformer: FLOPs and workspace are affine in N (O(N·m·D + m³)), far below N²") {
    // FLOPs: exactly a + b·N once N ≥ k; workspace: the same up to the row padding of [m, N].
    const auto n1 = run_point(quick_point("nystromformer", 2048, false));
    const auto n2 = run_point(quick_point("nystromformer", 4096, false));
    const auto n4 = run_point(quick_point("nystromformer", 8192, false));
    CHECK(n4.flops - n2.flops == 2 * (n2.flops - n1.flops));
    const double growth = static_cast<double>(n4.workspace_bytes - n2.workspace_bytes) /
                          static_cast<double>(n2.workspace_bytes - n1.workspace_bytes);
    CHECK(growth == doctest::Approx(2.0).epsilon(0.01));
    CHECK(n4.flops < 2 * n2.flops);
    CHECK(n4.workspace_bytes < 2 * n2.workspace_bytes);
    // B·H·N·N floats would be the dense scores; H = 2 here.
    CHECK(n4.workspace_bytes < 2LL * 8192 * 8192 * 4 / 32);
  }
}
