// Set Transformer's ISAB against a naive double-precision composition of two MABs, and its
// O(N·m) FLOP and memory scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "apps/bench/point.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/bf16_check.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

using Matrix = std::vector<double>;  // row-major, d columns

// Error bookkeeping for the tolerance: the largest |score| sum of terms and the largest
// amplification 1/σ of a layer norm (its input row's standard deviation).
struct ErrorScale {
  double score_terms = 0, inverse_std = 0;
};

// softmax(queries·keysᵀ/√d)·values; queries [nq, d], keys and values [nk, d].
Matrix naive_attention(const Matrix& queries, const Matrix& keys, const Matrix& values, std::int64_t d,
                       ErrorScale& scale_info) {
  const std::int64_t nq = static_cast<std::int64_t>(queries.size()) / d,
                     nk = static_cast<std::int64_t>(keys.size()) / d;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Matrix out(static_cast<std::size_t>(nq * d), 0.0);
  std::vector<double> scores(static_cast<std::size_t>(nk));
  for (std::int64_t i = 0; i < nq; ++i) {
    for (std::int64_t j = 0; j < nk; ++j) {
      double s = 0, terms = 0;
      for (std::int64_t f = 0; f < d; ++f) {
        s += queries[i * d + f] * keys[j * d + f];
        terms += std::fabs(queries[i * d + f] * keys[j * d + f]);
      }
      scores[j] = s * scale;
      scale_info.score_terms = std::max(scale_info.score_terms, terms * scale);
    }
    const double peak = *std::max_element(scores.begin(), scores.end());
    double sum = 0;
    for (double s : scores) sum += std::exp(s - peak);
    for (std::int64_t j = 0; j < nk; ++j)
      for (std::int64_t f = 0; f < d; ++f) out[i * d + f] += std::exp(scores[j] - peak) / sum * values[j * d + f];
  }
  return out;
}

// LN(a + b) row-wise with gain and shift (eps 1e-5).
Matrix add_norm(const Matrix& a, const Matrix& b, std::int64_t d, const double* gain, const double* shift,
                ErrorScale& scale_info) {
  Matrix out(a.size());
  for (std::size_t r = 0; r * d < a.size(); ++r) {
    double mean = 0, var = 0;
    for (std::int64_t f = 0; f < d; ++f) mean += a[r * d + f] + b[r * d + f];
    mean /= d;
    for (std::int64_t f = 0; f < d; ++f) var += std::pow(a[r * d + f] + b[r * d + f] - mean, 2);
    const double inverse_std = 1.0 / std::sqrt(var / d + 1e-5);
    scale_info.inverse_std = std::max(scale_info.inverse_std, inverse_std);
    for (std::int64_t f = 0; f < d; ++f)
      out[r * d + f] = (a[r * d + f] + b[r * d + f] - mean) * inverse_std * gain[f] + shift[f];
  }
  return out;
}

Matrix times(const Matrix& x, const double* w, std::int64_t d) {
  Matrix out(x.size(), 0.0);
  for (std::size_t r = 0; r * d < x.size(); ++r)
    for (std::int64_t i = 0; i < d; ++i)
      for (std::int64_t j = 0; j < d; ++j) out[r * d + j] += x[r * d + i] * w[i * d + j];
  return out;
}

struct MabParams {
  const double *ff_w, *ff_b, *gain0, *shift0, *gain1, *shift1;
};

// The paper's MAB with query-side input `queries` (also the residual): LN(H + ReLU(H·W + b)),
// H = LN(queries + attention(queries, keys, values)).
Matrix naive_mab(const Matrix& queries, const Matrix& keys, const Matrix& values, std::int64_t d, const MabParams& mp,
                 ErrorScale& scale_info) {
  const Matrix h =
      add_norm(queries, naive_attention(queries, keys, values, d, scale_info), d, mp.gain0, mp.shift0, scale_info);
  Matrix ff = times(h, mp.ff_w, d);
  for (std::size_t e = 0; e < ff.size(); ++e) ff[e] = std::max(ff[e] + mp.ff_b[e % d], 0.0);
  return add_norm(h, ff, d, mp.gain1, mp.shift1, scale_info);
}

// The ISAB of head (b, h) in double from named values: q, k, v and the dumped parameters.
Matrix isab_head(const NamedValues& x, const Problem& p, std::int64_t m, std::int64_t b, std::int64_t h,
                 ErrorScale& scale_info) {
  const std::int64_t d = p.head_dim, n = p.seq_len, heads = p.heads, at = (b * heads + h) * n * d;
  auto ln = [&](const char* name, std::int64_t index) { return x.at(name).data() + (index * heads + h) * d; };
  const double* ff_w = x.at("ff_weights").data();
  const double* projections = x.at("kv_projections").data();
  const MabParams first{ff_w + h * d * d,   ln("ff_biases", 0), ln("ln_gains", 0),
                        ln("ln_shifts", 0), ln("ln_gains", 1),  ln("ln_shifts", 1)};
  const MabParams second{ff_w + (heads + h) * d * d, ln("ff_biases", 1), ln("ln_gains", 2),
                         ln("ln_shifts", 2),         ln("ln_gains", 3),  ln("ln_shifts", 3)};
  auto slice = [&](const char* name) { return Matrix(x.at(name).begin() + at, x.at(name).begin() + at + n * d); };
  const double* inducing = x.at("inducing_points").data() + h * m * d;
  const Matrix summary = naive_mab(Matrix(inducing, inducing + m * d), slice("k"), slice("v"), d, first, scale_info);
  const Matrix keys = times(summary, projections + h * d * d, d);
  const Matrix vals = times(summary, projections + (heads + h) * d * d, d);
  return naive_mab(slice("q"), keys, vals, d, second, scale_info);
}

// In bf16 the inputs are the fp32 draws rounded and the output is rounded once; everything between
// runs in fp32 on the widened rows, so the bound is the fp32 one plus u·|o|.
void check_isab(const Problem& p, const std::vector<std::string>& params, const std::string& label,
                DType dtype = DType::F32) {
  const ModelInfo* info = find_model("set-transformer");
  REQUIRE(info != nullptr);
  const ParamValues values = resolve_params("set-transformer", info->impl.params, params);
  const std::int64_t m = values.get_int("inducing_points"), d = p.head_dim, n = p.seq_len, heads = p.heads;
  const bool bf16 = dtype == DType::BF16;
  const std::uint64_t seed = static_cast<std::uint64_t>(n + 3 * m);
  const Bf16Inputs rounded = bf16_inputs(p, seed);
  const AttentionInputs drawn = random_inputs(p, seed);
  const AttentionInputs& in = bf16 ? rounded.bf16 : drawn;
  const AttentionInputs& exact = bf16 ? rounded.widened : drawn;
  Problem run = on_test_threads(p);
  run.dtype = dtype;
  auto mechanism = info->impl.create(run, values, 42);
  mechanism->prepare(in.q, in.k, in.v);
  Tensor out = Tensor::bhnd(p.batch, heads, n, d, dtype);
  if (!bf16) out.fill(std::nanf(""));
  mechanism->forward(in.q, in.k, in.v, out);
  const Tensor result = bf16 ? to_f32(out) : std::move(out);
  NamedValues named = named_inputs(exact);
  for (const auto& parameter : mechanism->parameters())
    named[parameter.name] = widened(parameter.tensor->data(), parameter.tensor->size());
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h) {
      ErrorScale scale_info;
      const Matrix want = isab_head(named, p, m, b, h, scale_info);
      // fp32 error: attention as in attention_tolerance plus d-term sums in the products and the
      // layer norms, relative to the output size, amplified by the largest 1/σ of a normalised row.
      double largest_out = 0;
      for (double x : want) largest_out = std::max(largest_out, std::fabs(x));
      const double tolerance = 8 * kFloatEps *
                               (scale_info.score_terms + std::log2(static_cast<double>(std::max(n, m))) + d + 1) *
                               std::max(1.0, scale_info.inverse_std) * std::max(1.0, largest_out);
      const float* got = result.head(b, h);
      std::int64_t failures = 0;
      for (std::int64_t e = 0; e < n * d; ++e) {
        const double error = std::fabs(got[e] - want[e]);
        const double bound = bf16 ? tolerance * (1 + kBf16Roundoff) + kBf16Roundoff * std::fabs(want[e]) : tolerance;
        if (!(error <= bound) && failures++ < 3)
          FAIL_CHECK(label << " b=" << b << " h=" << h << " token " << e / d << " feature " << e % d << ": got "
                           << got[e] << ", want " << want[e] << " (tolerance " << bound << ")");
      }
      CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
    }
}

PointConfig quick_point(std::int64_t n, std::vector<std::string> params = {}) {
  return counter_point("set-transformer", {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false},
                       std::move(params));
}

}  // namespace

TEST_SUITE("memory") {
  TEST_CASE("set-transformer: ISAB equals a naive composition of two MABs, at and around the query block") {
    // Defaults m = 32, block_q = 256.
    for (std::int64_t n : {1, 7, 31, 32, 33, 255, 256, 257, 600}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_isab(p, {}, "ISAB N=" + std::to_string(n));
    }
  }

  TEST_CASE("set-transformer: other inducing-point counts and small uneven query blocks") {
    for (std::int64_t m : {1, 5, 64})
      for (std::int64_t n : {15, 16, 17, 40}) {
        const Problem p{.batch = 1, .heads = 3, .seq_len = n, .head_dim = 8, .causal = false};
        check_isab(p, {"inducing_points=" + std::to_string(m), "block_q=16"},
                   "ISAB m=" + std::to_string(m) + " N=" + std::to_string(n));
      }
  }

  TEST_CASE("set-transformer in bf16: ISAB within the fp32 bound plus the output's rounding, around the chunks") {
    // N one below, at and above the 256-key widening chunk and the query block.
    for (std::int64_t m : {1, 5, 32})
      for (std::int64_t n : {1, 15, 16, 17, 255, 256, 257, 300}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
        check_isab(p, {"inducing_points=" + std::to_string(m), "block_q=16"},
                   "ISAB bf16 m=" + std::to_string(m) + " N=" + std::to_string(n), DType::BF16);
      }
  }

  TEST_CASE("set-transformer bf16 backward: the fp32 form's gradients on the same values, rounded (storage only)") {
    for (std::int64_t m : {1, 5})
      for (std::int64_t n : {1, 16, 17, 40}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
        check_bf16_storage_gradients(
            "set-transformer", p, {"inducing_points=" + std::to_string(m), "block_q=16"}, static_cast<std::uint64_t>(n),
            "set-transformer bf16 backward m=" + std::to_string(m) + " N=" + std::to_string(n));
      }
  }

  TEST_CASE("set-transformer bf16 rows: FLOPs as fp32's, halved inputs and gradients, estimates exact") {
    for (std::int64_t n : {100, 300})
      for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train}) {
        const auto [a, b] = check_bf16_rows("set-transformer", n, false, pass);
        CHECK(b.saved_bytes == a.saved_bytes);  // the saved activations stay fp32
      }
  }

  TEST_CASE("set-transformer gradients of q, k, v, the inducing points and every projection, LN and rFF") {
    for (const auto& [n, params] :
         {std::pair<std::int64_t, std::vector<std::string>>{5, {"inducing_points=3", "block_q=2"}},
          {8, {"inducing_points=4", "block_q=8"}},
          {9, {"inducing_points=2", "block_q=4"}},
          {40, {"inducing_points=5", "block_q=16"}}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = false};
      const std::int64_t m = std::stoll(params[0].substr(params[0].find('=') + 1));
      check_composite_gradients(
          "set-transformer", p, params,
          [&](const NamedValues& x) {
            std::vector<double> out;
            for (std::int64_t b = 0; b < p.batch; ++b)
              for (std::int64_t h = 0; h < p.heads; ++h) {
                ErrorScale unused;
                const Matrix o = isab_head(x, p, m, b, h, unused);
                out.insert(out.end(), o.begin(), o.end());
              }
            return out;
          },
          n <= 9);
    }
  }

  TEST_CASE("set-transformer: not causal, every output depends on the last token") {
    const Problem p{.batch = 1, .heads = 1, .seq_len = 50, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 2);
    const Tensor before = run_mechanism("set-transformer", p, in);
    // Not a constant shift of the row: layer norm removes those.
    for (std::int64_t f = 0; f < 8; ++f) in.v.head(0, 0)[49 * 8 + f] += static_cast<float>(f) - 3.5f;
    const Tensor after = run_mechanism("set-transformer", p, in);
    for (std::int64_t i = 0; i < 49; ++i)
      CHECK_MESSAGE(std::memcmp(before.data() + i * 8, after.data() + i * 8, 8 * sizeof(float)) != 0, "row " << i);
  }

  TEST_CASE("set-transformer: executed FLOPs equal the analytic count at non-default settings") {
    const ModelInfo* info = find_model("set-transformer");
    for (std::int64_t n : {1, 37, 300}) {
      const std::vector<std::string> params{"inducing_points=5", "block_q=16"};
      const auto config = quick_point(n, params);
      CHECK(run_point(config).flops ==
            info->impl.flops(config.problem, resolve_params("set-transformer", info->impl.params, params)));
    }
  }

  TEST_CASE("set-transformer: FLOPs and workspace grow linearly in N (O(N·m))") {
    const auto small = run_point(quick_point(2048));
    const auto large = run_point(quick_point(8192));
    const double flop_ratio = static_cast<double>(large.flops) / static_cast<double>(small.flops);
    CHECK(flop_ratio > 3.9);
    CHECK(flop_ratio <= 4.0);
    const double memory_ratio = static_cast<double>(large.workspace_bytes) / static_cast<double>(small.workspace_bytes);
    CHECK(memory_ratio < 4.1);
    // Far below vanilla's N² scores at the larger size: B·H·N·N floats.
    CHECK(large.workspace_bytes < 2 * 8192 * 8192 * 4 / 32);
  }
}
