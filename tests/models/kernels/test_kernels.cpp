// Performer and Linear Transformer against their own kernelised formula (naive N×N and the
// token-by-token prefix-sum recurrence, both in double), FAVOR+ against exact softmax attention as
// the feature count grows, the random features themselves, and linear scaling of the counters.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "taxonomy/kernels/performer.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

enum class Kernel { Favor, Relu, Elu };

struct KernelCase {
  const char* model;
  Kernel kernel;
  std::vector<std::string> params;
};

// φ(x) of one row, in double, exactly as the headers define it (no stabilisers).
template <class T>
std::vector<double> features(Kernel kernel, const Tensor* omega, const T* x, std::int64_t d) {
  if (kernel == Kernel::Elu) {
    std::vector<double> phi(static_cast<std::size_t>(d));
    for (std::int64_t c = 0; c < d; ++c) phi[c] = x[c] > 0 ? x[c] + 1.0 : std::exp(static_cast<double>(x[c]));
    return phi;
  }
  const std::int64_t m = omega->dim(0);
  const double scale = std::pow(static_cast<double>(d), -0.25);
  double half_norm = 0;
  for (std::int64_t c = 0; c < d; ++c) half_norm += 0.5 * scale * scale * x[c] * x[c];
  std::vector<double> phi(static_cast<std::size_t>(m));
  for (std::int64_t f = 0; f < m; ++f) {
    double dot = 0;
    for (std::int64_t c = 0; c < d; ++c) dot += static_cast<double>((*omega)[f * d + c]) * x[c];
    phi[f] = kernel == Kernel::Favor
                 ? std::exp(scale * dot - half_norm) / std::sqrt(static_cast<double>(m))
                 : std::max(dot / std::sqrt(static_cast<double>(m)), 0.0) + kPerformerReluStabiliser;
  }
  return phi;
}

template <class T>
std::vector<std::vector<double>> all_features(Kernel kernel, const Tensor* omega, const T* x, std::int64_t n,
                                              std::int64_t d) {
  std::vector<std::vector<double>> rows;
  for (std::int64_t i = 0; i < n; ++i) rows.push_back(features(kernel, omega, x + i * d, d));
  return rows;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The N×N form: weights φ(q_i)·φ(k_j) over allowed j, row-normalised, times V.
template <class T>
std::vector<double> naive_kernel_attention(Kernel kernel, const Tensor* omega, const T* q, const T* k, const T* v,
                                           std::int64_t n, std::int64_t d, bool causal) {
  const auto fq = all_features(kernel, omega, q, n, d), fk = all_features(kernel, omega, k, n, d);
  std::vector<double> out(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    double total = 0;
    for (std::int64_t j = 0; j < (causal ? i + 1 : n); ++j) {
      const double w = dot(fq[i], fk[j]);
      total += w;
      for (std::int64_t c = 0; c < d; ++c) out[i * d + c] += w * v[j * d + c];
    }
    for (std::int64_t c = 0; c < d; ++c) out[i * d + c] /= total;
  }
  return out;
}

// The causal recurrence, one token at a time: S += φ(k_i)v_iᵀ, z += φ(k_i), out_i = φ(q_i)ᵀS / φ(q_i)ᵀz.
std::vector<double> recurrent_kernel_attention(Kernel kernel, const Tensor* omega, const float* q, const float* k,
                                               const float* v, std::int64_t n, std::int64_t d) {
  std::vector<double> out(static_cast<std::size_t>(n * d)), state, z;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto fk = features(kernel, omega, k + i * d, d), fq = features(kernel, omega, q + i * d, d);
    const std::size_t m = fk.size();
    state.resize(m * d, 0.0);
    z.resize(m, 0.0);
    for (std::size_t f = 0; f < m; ++f) {
      z[f] += fk[f];
      for (std::int64_t c = 0; c < d; ++c) state[f * d + c] += fk[f] * v[i * d + c];
    }
    const double denominator = dot(fq, z);
    for (std::int64_t c = 0; c < d; ++c) {
      double numerator = 0;
      for (std::size_t f = 0; f < m; ++f) numerator += fq[f] * state[f * d + c];
      out[i * d + c] = numerator / denominator;
    }
  }
  return out;
}

// Σ_d |α·ω_fd·x_d| for every row and feature ([n][M]): what an fp32 evaluation of ωx rounds.
std::vector<std::vector<double>> projection_terms(const Tensor* omega, double alpha, const float* x, std::int64_t n,
                                                  std::int64_t d) {
  const std::int64_t m = omega->dim(0);
  std::vector<std::vector<double>> terms(static_cast<std::size_t>(n), std::vector<double>(static_cast<std::size_t>(m)));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t f = 0; f < m; ++f)
      for (std::int64_t c = 0; c < d; ++c) terms[i][f] += std::fabs(alpha * (*omega)[f * d + c] * x[i * d + c]);
  return terms;
}

// Bound, in units of eps, on the relative error of one weight φ(q_i)·φ(k_j).
//   FAVOR+: a feature's relative error is the absolute error of its exponent, Σ|α·ω_f·x| + ‖x'‖²/2
//   (twice: the max shift is rounded too); the weight's is at most the largest for q plus for k.
//   ReLU: a feature's absolute error is Σ|ω_f·x|/√M, so the weight's relative error is
//   Σ_f (t_q,f·φ_f(k) + φ_f(q)·t_k,f) / w_ij, taken at its largest over (i, j).
//   elu + 1: a few ulp of exp.
double weight_error(Kernel kernel, const Tensor* omega, const float* q, const float* k, std::int64_t n,
                    std::int64_t d) {
  if (kernel == Kernel::Elu) return 2.0;
  const std::int64_t m = omega->dim(0);
  if (kernel == Kernel::Favor) {
    const double alpha = std::pow(static_cast<double>(d), -0.25);
    double largest = 0;
    for (const float* x : {q, k}) {
      const auto terms = projection_terms(omega, alpha, x, n, d);
      double row_largest = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        double half_norm = 0;
        for (std::int64_t c = 0; c < d; ++c) half_norm += 0.5 * alpha * alpha * x[i * d + c] * x[i * d + c];
        row_largest = std::max(row_largest, *std::max_element(terms[i].begin(), terms[i].end()) + half_norm);
      }
      largest += 2 * row_largest;
    }
    return largest;
  }
  const double alpha = 1.0 / std::sqrt(static_cast<double>(m));
  const auto tq = projection_terms(omega, alpha, q, n, d), tk = projection_terms(omega, alpha, k, n, d);
  const auto fq = all_features(kernel, omega, q, n, d), fk = all_features(kernel, omega, k, n, d);
  double largest = 0;
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double spread = 0;
      for (std::int64_t f = 0; f < m; ++f) spread += tq[i][f] * fk[j][f] + fq[i][f] * tk[j][f];
      largest = std::max(largest, spread / dot(fq[i], fk[j]));
    }
  return largest;
}

// Tolerance for one head: 8·eps·(weight error + log2 N + log2 M + 1)·max|v| — the output is a
// convex combination of the rows of V, so relative weight errors become absolute errors times |v|.
double kernel_tolerance(Kernel kernel, const Tensor* omega, const float* q, const float* k, const float* v,
                        std::int64_t n, std::int64_t d) {
  const double m = omega ? static_cast<double>(omega->dim(0)) : static_cast<double>(d);
  return 8 * kFloatEps *
         (weight_error(kernel, omega, q, k, n, d) + std::log2(static_cast<double>(n)) + std::log2(m) + 1) *
         max_abs(v, n * d);
}

const Tensor* omega_of(const MechanismRun& run, Kernel kernel) {
  return kernel == Kernel::Elu ? nullptr : &run.parameter("random_features");
}

using Reference = std::vector<double> (*)(Kernel, const Tensor*, const float*, const float*, const float*, std::int64_t,
                                          std::int64_t, bool);

std::vector<double> recurrence(Kernel kernel, const Tensor* omega, const float* q, const float* k, const float* v,
                               std::int64_t n, std::int64_t d, bool) {
  return recurrent_kernel_attention(kernel, omega, q, k, v, n, d);
}

void check_case(const KernelCase& c, const Problem& p, const AttentionInputs& in, Reference reference,
                const std::string& label) {
  const auto run = run_keeping(c.model, p, in, c.params);
  const Tensor* omega = omega_of(run, c.kernel);
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float *q = in.q.head(b, h), *k = in.k.head(b, h), *v = in.v.head(b, h);
      const auto want = reference(c.kernel, omega, q, k, v, p.seq_len, p.head_dim, p.causal);
      check_head(run.out.head(b, h), want, p.seq_len, p.head_dim,
                 kernel_tolerance(c.kernel, omega, q, k, v, p.seq_len, p.head_dim),
                 label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
}

std::string describe(const KernelCase& c, const Problem& p) {
  std::string s = std::string(c.model);
  for (const auto& param : c.params) s += " " + param;
  return s + " N=" + std::to_string(p.seq_len) + (p.causal ? " causal" : "");
}

const std::vector<KernelCase>& default_cases() {
  static const std::vector<KernelCase> cases = {{"performer", Kernel::Favor, {}},
                                                {"performer", Kernel::Relu, {"kernel=relu"}},
                                                {"performer", Kernel::Favor, {"features=100"}},
                                                {"linear-transformer", Kernel::Elu, {}}};
  return cases;
}

}  // namespace

TEST_SUITE("kernels") {
  TEST_CASE("performer and linear-transformer equal their naive N×N kernel formula, causal and not") {
    // Default chunks 64 (performer) and 32 (linear-transformer): sizes at, one below and one above
    // one and two chunks, and non-multiples.
    for (const auto& c : default_cases())
      for (std::int64_t n : {1, 2, 31, 32, 33, 63, 64, 65, 127, 129, 200})
        for (bool causal : {false, true}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const auto in = random_inputs(p, static_cast<std::uint64_t>(n));
          check_case(c, p, in, naive_kernel_attention, describe(c, p));
        }
  }

  TEST_CASE("causal chunked walk equals the token-by-token prefix-sum recurrence") {
    for (const auto& c : default_cases())
      for (const auto& [n, chunk] : std::vector<std::pair<std::int64_t, std::int64_t>>{
               {15, 16}, {16, 16}, {17, 16}, {31, 16}, {33, 16}, {50, 16}, {20, 1}, {20, 7}, {21, 20}, {40, 39}}) {
        KernelCase with_chunk = c;
        with_chunk.params.push_back("chunk=" + std::to_string(chunk));
        const Problem p{.batch = 1, .heads = 3, .seq_len = n, .head_dim = 8, .causal = true};
        const auto in = random_inputs(p, static_cast<std::uint64_t>(100 + n));
        check_case(with_chunk, p, in, recurrence, describe(with_chunk, p) + " vs recurrence");
      }
  }

  TEST_CASE("non-causal chunk size does not change the K–V summary result") {
    for (const auto& c : default_cases())
      for (std::int64_t chunk : {1, 5, 64, 300}) {
        KernelCase with_chunk = c;
        with_chunk.params.push_back("chunk=" + std::to_string(chunk));
        const Problem p{.batch = 1, .heads = 2, .seq_len = 77, .head_dim = 8, .causal = false};
        const auto in = random_inputs(p, 9);
        check_case(with_chunk, p, in, naive_kernel_attention, describe(with_chunk, p));
      }
  }

  TEST_CASE("FAVOR+ stays finite and exact to its formula where exp(ωx) overflows float") {
    for (bool causal : {false, true}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 150, .head_dim = 16, .causal = causal};
      auto in = random_inputs(p, 21);
      for (std::int64_t i = 0; i < p.seq_len; i += 5)  // exponents reach several hundred
        for (std::int64_t c = 0; c < p.head_dim; ++c) {
          in.q.head(0, 1)[i * p.head_dim + c] *= 12.0f;
          in.k.head(0, 1)[(i + 2) * p.head_dim + c] *= 12.0f;
        }
      const KernelCase c{"performer", Kernel::Favor, {}};
      const auto run = run_keeping(c.model, p, in, c.params);
      for (float value : run.out.values()) REQUIRE(std::isfinite(value));
      check_case(c, p, in, naive_kernel_attention, "performer large exponents" + std::string(causal ? " causal" : ""));
    }
  }

  TEST_CASE("causal: changing future tokens changes no earlier output") {
    // Default chunks 64 and 32: the change at 150 falls in the chunk starting at 128.
    // Chunks wholly before the change are bit-identical; inside the changed chunk the performer's
    // shared key stabiliser may move, which changes earlier rows of that chunk only by rounding.
    for (const auto& c : default_cases()) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = 300, .head_dim = 16, .causal = true};
      auto in = random_inputs(p, 5);
      const Tensor before = run_keeping(c.model, p, in, c.params).out.clone();
      const std::int64_t cut = 150, chunk_start = 128, d = p.head_dim;
      for (std::int64_t h = 0; h < p.heads; ++h)
        for (std::int64_t e = cut * d; e < p.seq_len * d; ++e) {
          in.k.head(0, h)[e] = 3.0f * in.k.head(0, h)[e] + 1.0f;
          in.v.head(0, h)[e] -= 5.0f;
          in.q.head(0, h)[e] *= -1.0f;
        }
      const Tensor after = run_keeping(c.model, p, in, c.params).out.clone();
      CAPTURE(describe(c, p));
      for (std::int64_t h = 0; h < p.heads; ++h) {
        CHECK(std::memcmp(before.head(0, h), after.head(0, h), chunk_start * d * sizeof(float)) == 0);
        for (std::int64_t e = chunk_start * d; e < cut * d; ++e)
          CHECK(std::fabs(before.head(0, h)[e] - after.head(0, h)[e]) <=
                64 * kFloatEps * (1 + std::fabs(before.head(0, h)[e])));
        CHECK(std::memcmp(before.head(0, h) + cut * d, after.head(0, h) + cut * d, d * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("performer's error against exact softmax attention falls as the feature count grows") {
    const Problem p{.batch = 1, .heads = 2, .seq_len = 128, .head_dim = 16, .causal = false};
    auto in = random_inputs(p, 77);
    // Inputs scaled by 0.6 (‖q'‖² ≈ 1.4): the estimator's variance grows like exp(‖q'‖² + ‖k'‖² + 4q'ᵀk'),
    // and with unit-variance inputs at D = 16 the 1/√M regime starts only well beyond M = 1024.
    const float input_scale = 0.6f;
    for (float& x : in.q.values()) x *= input_scale;
    for (float& x : in.k.values()) x *= input_scale;
    std::vector<std::vector<double>> exact;
    for (std::int64_t h = 0; h < p.heads; ++h)
      exact.push_back(reference_attention(in.q.head(0, h), in.k.head(0, h), in.v.head(0, h), p.seq_len, p.seq_len,
                                          p.head_dim, 0.25, full_mask));
    std::vector<double> errors;
    for (std::int64_t m : {16, 64, 256, 1024}) {
      double total = 0;
      for (std::uint64_t seed = 1; seed <= 4; ++seed) {
        const auto run = run_keeping("performer", p, in, {"features=" + std::to_string(m)}, seed);
        for (std::int64_t h = 0; h < p.heads; ++h)
          for (std::int64_t e = 0; e < p.seq_len * p.head_dim; ++e)
            total += std::fabs(run.out.head(0, h)[e] - exact[h][e]);
      }
      errors.push_back(total / (4.0 * p.heads * p.seq_len * p.head_dim));
    }
    CAPTURE(errors[0]);
    CAPTURE(errors[1]);
    CAPTURE(errors[2]);
    CAPTURE(errors[3]);
    // Monte-Carlo error ~ 1/√M: each fourfold M should roughly halve it.
    for (std::size_t i = 1; i < errors.size(); ++i) CHECK(errors[i] < 0.8 * errors[i - 1]);
    CHECK(errors.back() < 0.35 * errors.front());
  }

  TEST_CASE("random features: orthogonal within each block of D rows, chi(D) row norms") {
    const Problem p{.batch = 1, .heads = 1, .seq_len = 4, .head_dim = 16, .causal = false};
    const auto in = random_inputs(p, 1);
    const std::int64_t m = 1000, d = p.head_dim;  // 62 full blocks and a partial one
    const auto run = run_keeping("performer", p, in, {"features=" + std::to_string(m)});
    const Tensor& omega = run.parameter("random_features");
    REQUIRE(omega.shape() == Shape{m, d});
    double squared_norms = 0, largest_cosine = 0, largest_cross_block_cosine = 0;
    auto norm = [&](std::int64_t i) {
      double s = 0;
      for (std::int64_t c = 0; c < d; ++c) s += static_cast<double>(omega[i * d + c]) * omega[i * d + c];
      return std::sqrt(s);
    };
    for (std::int64_t i = 0; i < m; ++i) {
      squared_norms += norm(i) * norm(i);
      for (std::int64_t j = i + 1; j < std::min(m, i + d); ++j) {
        double s = 0;
        for (std::int64_t c = 0; c < d; ++c) s += static_cast<double>(omega[i * d + c]) * omega[j * d + c];
        const double cosine = std::fabs(s) / (norm(i) * norm(j));
        if (i / d == j / d)
          largest_cosine = std::max(largest_cosine, cosine);
        else
          largest_cross_block_cosine = std::max(largest_cross_block_cosine, cosine);
      }
    }
    CHECK(largest_cosine < 1e-5);
    CHECK(largest_cross_block_cosine > 0.3);  // blocks are independent, not one orthogonal family
    // E‖ω‖² = D for chi(D) norms; the mean of 1000 has standard deviation √(2D/1000) ≈ 0.18.
    CHECK(std::fabs(squared_norms / m - d) < 1.0);
  }

  TEST_CASE("performer and linear-transformer gradients against central differences of the double kernel formula") {
    // Random features held fixed (read from a forward with the same seed); chunk ± 1 and two chunks
    // and a part on tiny problems (every element), the default chunks around their size (sampled).
    for (const KernelCase& c :
         {KernelCase{"performer", Kernel::Favor, {}}, KernelCase{"performer", Kernel::Relu, {"kernel=relu"}},
          KernelCase{"linear-transformer", Kernel::Elu, {}}})
      for (bool causal : {false, true})
        for (auto [n, d, chunk, every] :
             std::vector<std::tuple<std::int64_t, std::int64_t, const char*, bool>>{{1, 3, "chunk=4", true},
                                                                                    {3, 3, "chunk=4", true},
                                                                                    {4, 3, "chunk=4", true},
                                                                                    {5, 3, "chunk=4", true},
                                                                                    {9, 3, "chunk=4", true},
                                                                                    {63, 8, "", false},
                                                                                    {65, 8, "", false}}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = causal};
          std::vector<std::string> params = c.params;
          if (c.kernel != Kernel::Elu) params.push_back("features=16");
          if (*chunk) params.push_back(chunk);
          const auto ran = run_keeping(c.model, p, random_inputs(p, 7), params, 7);
          const Tensor* omega = c.kernel == Kernel::Elu ? nullptr : &ran.parameter("random_features");
          const Kernel kernel = c.kernel;
          check_composite_gradients(
              c.model, p, params,
              [&](const NamedValues& x) {
                std::vector<double> out;
                const std::int64_t size = n * d;
                for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
                  const auto one = naive_kernel_attention(kernel, omega, x.at("q").data() + head * size,
                                                          x.at("k").data() + head * size,
                                                          x.at("v").data() + head * size, n, d, causal);
                  out.insert(out.end(), one.begin(), one.end());
                }
                return out;
              },
              every);
        }
  }

  TEST_CASE("performer and linear-transformer: FLOPs and tracked peak memory grow linearly in N") {
    for (const char* model : {"performer", "linear-transformer"})
      for (bool causal : {false, true}) {
        CAPTURE(model);
        CAPTURE(causal);
        check_linear_counters(model, causal);
      }
  }

  TEST_CASE("performer and linear-transformer parameters are validated") {
    const ModelInfo* info = find_model("performer");
    REQUIRE(info != nullptr);
    CHECK_THROWS_AS(resolve_params("performer", info->impl.params, {"features=0"}), ParamError);
    CHECK_THROWS_AS(resolve_params("performer", info->impl.params, {"kernel=cosine"}), ParamError);
    CHECK_THROWS_AS(resolve_params("performer", info->impl.params, {"chunk=0"}), ParamError);
    const ModelInfo* linear = find_model("linear-transformer");
    REQUIRE(linear != nullptr);
    CHECK_THROWS_AS(resolve_params("linear-transformer", linear->impl.params, {"chunk=0"}), ParamError);
  }
}
