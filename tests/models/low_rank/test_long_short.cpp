// The Long-Short Transformer (dynamic projection + segment window in one softmax, DualLN) against a
// naive double-precision reference of its formula in both forms, its gradients against central
// differences, its causality and incremental decoding, and its FLOP and memory scaling.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/memory_tracker.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/mechanism_run.hpp"
#include "tests/support/reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

using Matrix = std::vector<double>;  // row-major

// The settings as they run: non-causal (segment w, rank R), causal (window w, chunk l, rank R).
struct Settings {
  bool causal = false;
  std::int64_t window = 0, rank = 0, chunk = 0;
};

Settings settings_of(const Problem& p, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("long-short");
  REQUIRE(info != nullptr);
  const ParamValues values = info->impl.resolved(p, resolve_params("long-short", info->impl.params, params));
  if (p.causal) return {true, values.get_int("window"), values.get_int("chunk_rank"), values.get_int("chunk")};
  return {false, values.get_int("segment"), values.get_int("rank"), 0};
}

// What fp32 rounding scales with: the largest |terms| sum of a score, the largest |value| averaged,
// and how much a LayerNorm amplifies its input's rounding (Σ|terms| of a compressed entry / its
// row's standard deviation).
struct ErrorScale {
  double score_terms = 0, values = 0, amplification = 1;
};

void softmax(double* x, std::int64_t n) {
  const double peak = *std::max_element(x, x + n);
  double sum = 0;
  for (std::int64_t j = 0; j < n; ++j) sum += x[j] = std::exp(x[j] - peak);
  for (std::int64_t j = 0; j < n; ++j) x[j] /= sum;
}

// LN over d features in place (gain, shift); returns 1/std.
double layer_norm(double* x, std::int64_t d, const double* gain, const double* shift) {
  double mean = 0, var = 0;
  for (std::int64_t f = 0; f < d; ++f) mean += x[f];
  mean /= static_cast<double>(d);
  for (std::int64_t f = 0; f < d; ++f) var += (x[f] - mean) * (x[f] - mean);
  const double inverse_std = 1.0 / std::sqrt(var / static_cast<double>(d) + 1e-5);
  for (std::int64_t f = 0; f < d; ++f) x[f] = (x[f] - mean) * inverse_std * gain[f] + shift[f];
  return inverse_std;
}

struct HeadParams {
  const double *projection, *long_gain, *long_shift, *short_gain, *short_shift;  // [D, R], [D] ×4
};

// One head straight from the definition (header of taxonomy/low_rank/long_short.hpp): every query's
// keys listed explicitly, no tiles.
Matrix head_reference(const double* q, const double* k, const double* v, const HeadParams& w, std::int64_t n,
                      std::int64_t d, const Settings& s, ErrorScale& e) {
  const double c = 1.0 / std::sqrt(static_cast<double>(d));
  const std::int64_t r = s.rank, len = s.causal ? s.chunk : n, groups = s.causal ? n / s.chunk : 1;
  // Compressed rows, group-major: [groups·R, D] keys and values.
  Matrix comp_k(static_cast<std::size_t>(std::max<std::int64_t>(groups * r, 1) * d), 0.0), comp_v = comp_k;
  std::vector<double> column(static_cast<std::size_t>(len));
  for (std::int64_t g = 0; g < groups; ++g)
    for (std::int64_t j = 0; j < r; ++j) {
      for (std::int64_t t = 0; t < len; ++t) {
        double z = 0;
        for (std::int64_t f = 0; f < d; ++f) z += k[(g * len + t) * d + f] * w.projection[f * r + j];
        column[static_cast<std::size_t>(t)] = z;
      }
      softmax(column.data(), len);
      double* rk = comp_k.data() + (g * r + j) * d;
      double* rv = comp_v.data() + (g * r + j) * d;
      std::vector<double> terms_k(static_cast<std::size_t>(d), 0.0), terms_v = terms_k;
      for (std::int64_t t = 0; t < len; ++t)
        for (std::int64_t f = 0; f < d; ++f) {
          const double p = column[static_cast<std::size_t>(t)];
          rk[f] += p * k[(g * len + t) * d + f], rv[f] += p * v[(g * len + t) * d + f];
          terms_k[static_cast<std::size_t>(f)] += p * std::fabs(k[(g * len + t) * d + f]);
          terms_v[static_cast<std::size_t>(f)] += p * std::fabs(v[(g * len + t) * d + f]);
        }
      const double ak = layer_norm(rk, d, w.long_gain, w.long_shift);
      const double av = layer_norm(rv, d, w.long_gain, w.long_shift);
      for (std::int64_t f = 0; f < d; ++f)
        e.amplification = std::max(
            {e.amplification, ak * terms_k[static_cast<std::size_t>(f)], av * terms_v[static_cast<std::size_t>(f)]});
    }
  Matrix win_k(k, k + n * d), win_v(v, v + n * d);
  for (std::int64_t i = 0; i < n; ++i) {
    layer_norm(win_k.data() + i * d, d, w.short_gain, w.short_shift);
    layer_norm(win_v.data() + i * d, d, w.short_gain, w.short_shift);
  }
  for (double x : comp_v) e.values = std::max(e.values, std::fabs(x));
  for (double x : win_v) e.values = std::max(e.values, std::fabs(x));
  Matrix out(static_cast<std::size_t>(n * d), 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t comp_rows = groups * r, first, last;  // window keys [first, last)
    if (s.causal) {
      comp_rows = i / s.chunk * r;
      first = std::max<std::int64_t>(0, i - s.window + 1), last = i + 1;
    } else {
      const std::int64_t segment = i / s.window, ext = std::max<std::int64_t>(s.window / 2, 1);
      first = std::max<std::int64_t>(0, segment * s.window - ext);
      last = std::min(n, segment * s.window + s.window + ext);
    }
    std::vector<const double*> keys, values;
    for (std::int64_t j = 0; j < comp_rows; ++j)
      keys.push_back(comp_k.data() + j * d), values.push_back(comp_v.data() + j * d);
    for (std::int64_t j = first; j < last; ++j)
      keys.push_back(win_k.data() + j * d), values.push_back(win_v.data() + j * d);
    std::vector<double> scores(keys.size());
    for (std::size_t j = 0; j < keys.size(); ++j) {
      double dot = 0, terms = 0;
      for (std::int64_t f = 0; f < d; ++f)
        dot += q[i * d + f] * keys[j][f], terms += std::fabs(q[i * d + f] * keys[j][f]);
      scores[j] = c * dot;
      e.score_terms = std::max(e.score_terms, c * terms);
    }
    softmax(scores.data(), static_cast<std::int64_t>(scores.size()));
    for (std::size_t j = 0; j < keys.size(); ++j)
      for (std::int64_t f = 0; f < d; ++f) out[static_cast<std::size_t>(i * d + f)] += scores[j] * values[j][f];
  }
  return out;
}

// Every head's reference output ([B, H, N, D] order) from the named inputs.
Matrix reference(const NamedValues& x, const Problem& p, const Settings& s, std::vector<ErrorScale>* scales = nullptr) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  Matrix all;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const std::int64_t at = (b * p.heads + h) * n * d;
      const HeadParams w{x.at("projection").data() + h * d * s.rank, x.at("long_gain").data() + h * d,
                         x.at("long_shift").data() + h * d, x.at("short_gain").data() + h * d,
                         x.at("short_shift").data() + h * d};
      ErrorScale e;
      const Matrix o =
          head_reference(x.at("q").data() + at, x.at("k").data() + at, x.at("v").data() + at, w, n, d, s, e);
      all.insert(all.end(), o.begin(), o.end());
      if (scales != nullptr) scales->push_back(e);
    }
  return all;
}

// fp32 tolerance of one head's output: the scores' rounding (their |terms|), the d-term products,
// the softmaxes over N and the tile's keys, amplified by the compressed rows' LayerNorm, relative to
// the averaged values.
double tolerance_of(const ErrorScale& e, const Problem& p, const Settings& s) {
  const double n = static_cast<double>(p.seq_len);
  return 8 * kFloatEps * (e.score_terms + std::log2(n + 1) + static_cast<double>(p.head_dim + s.rank) + 1) *
         e.amplification * std::max(1.0, e.values);
}

std::string label_of(const Problem& p, const std::vector<std::string>& params) {
  std::string text = (p.causal ? "causal N=" : "N=") + std::to_string(p.seq_len);
  for (const auto& param : params) text += " " + param;
  return text;
}

void check_forward(const Problem& p, const std::vector<std::string>& params) {
  const Settings s = settings_of(p, params);
  const std::string label = label_of(p, params);
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len + 11));
  const MechanismRun run = run_keeping("long-short", p, in, params);
  const NamedValues named = named_inputs(in, *run.mechanism);
  REQUIRE(named.at("projection").size() == static_cast<std::size_t>(p.heads * p.head_dim * s.rank));
  std::vector<ErrorScale> scales;
  const Matrix want = reference(named, p, s, &scales);
  const std::int64_t nd = p.seq_len * p.head_dim;
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const std::vector<double> head(want.begin() + bh * nd, want.begin() + (bh + 1) * nd);
    check_head(run.out.data() + bh * nd, head, p.seq_len, p.head_dim,
               tolerance_of(scales[static_cast<std::size_t>(bh)], p, s), label + " bh=" + std::to_string(bh));
  }
}

// Prefill of N context tokens and T single-token steps against the causal forward over N + T.
void check_decode(std::int64_t n, std::int64_t tokens, const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("long-short");
  REQUIRE(info != nullptr);
  const Problem context = on_test_threads({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true});
  Problem whole_problem = context;
  whole_problem.seq_len = n + tokens;
  const ParamValues values = info->impl.resolved(context, resolve_params("long-short", info->impl.params, params));
  const AttentionInputs whole = random_inputs(whole_problem, 5);
  auto reference_model = info->impl.create(whole_problem, values, 42);
  reference_model->prepare(whole.q, whole.k, whole.v);
  Tensor want = Tensor::bhnd(2, 2, whole_problem.seq_len, 16);
  reference_model->forward(whole.q, whole.k, whole.v, want);
  std::vector<ErrorScale> scales;
  const Settings s = settings_of(whole_problem, params);
  reference(named_inputs(whole, *reference_model), whole_problem, s, &scales);
  double tolerance = 0;
  for (const auto& e : scales) tolerance = std::max(tolerance, 2 * tolerance_of(e, whole_problem, s));

  check_decode_steps(*info, context, values, whole, want, tokens, tolerance);
}

PointConfig point(std::int64_t n, bool causal, std::vector<std::string> params = {}) {
  return counter_point("long-short", {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal},
                       std::move(params));
}

}  // namespace

TEST_SUITE("long_short") {
  TEST_CASE("long-short: the non-causal form equals the double reference around the segment") {
    // Defaults w = 8, r = 32: N below, at and above w and its multiples, and non-multiples.
    for (std::int64_t n : {1, 2, 7, 8, 9, 15, 16, 17, 31, 40, 100, 300})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false}, {});
    for (std::int64_t n : {3, 4, 5, 6, 9, 10, 11, 23}) {
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = false}, {"segment=5", "rank=3"});
    }
    for (const char* segment : {"segment=1", "segment=2", "segment=3"})
      check_forward({.batch = 1, .heads = 2, .seq_len = 13, .head_dim = 8, .causal = false}, {segment, "rank=2"});
  }

  TEST_CASE("long-short: the causal form equals its definition around the chunk and the window") {
    for (std::int64_t n : {1, 15, 16, 17, 33, 300})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = true}, {});
    const std::vector<std::string> small{"window=5", "chunk=4", "chunk_rank=2"};
    for (std::int64_t n : {1, 3, 4, 5, 6, 7, 8, 9, 13, 23})
      check_forward({.batch = 2, .heads = 2, .seq_len = n, .head_dim = 8, .causal = true}, small);
    check_forward({.batch = 1, .heads = 2, .seq_len = 12, .head_dim = 8, .causal = true},
                  {"window=1", "chunk=1", "chunk_rank=1"});
    check_forward({.batch = 1, .heads = 2, .seq_len = 40, .head_dim = 8, .causal = true},
                  {"window=3", "chunk=7", "chunk_rank=3"});
    check_forward({.batch = 1, .heads = 2, .seq_len = 70, .head_dim = 16, .causal = true},
                  {"window=32", "chunk=16", "chunk_rank=4"});
    // A chunk longer than N: no chunk completes, the window alone.
    check_forward({.batch = 1, .heads = 2, .seq_len = 20, .head_dim = 8, .causal = true},
                  {"window=8", "chunk=64", "chunk_rank=2"});
  }

  TEST_CASE("long-short gradients of q, k, v, W_P and the DualLN gains and shifts, both forms") {
    for (const auto& [n, causal, params] :
         {std::tuple<std::int64_t, bool, std::vector<std::string>>{5, false, {"segment=2", "rank=2"}},
          {9, false, {"segment=4", "rank=3"}},
          {40, false, {"segment=8", "rank=4"}},
          {7, true, {"window=3", "chunk=2", "chunk_rank=2"}},
          {9, true, {"window=4", "chunk=4", "chunk_rank=1"}},
          {40, true, {"window=6", "chunk=5", "chunk_rank=2"}}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 4, .causal = causal};
      const Settings s = settings_of(p, params);
      check_composite_gradients(
          "long-short", p, params, [&](const NamedValues& x) { return reference(x, p, s); }, n <= 9);
    }
  }

  TEST_CASE("long-short causal: changing a token changes no earlier output") {
    const Problem p{.batch = 2, .heads = 2, .seq_len = 50, .head_dim = 8, .causal = true};
    const std::vector<std::string> params{"window=6", "chunk=8", "chunk_rank=2"};
    for (std::int64_t changed : {0, 7, 8, 15, 16, 49}) {
      auto in = random_inputs(p, 3);
      const Tensor before = run_mechanism("long-short", p, in, params);
      for (std::int64_t bh = 0; bh < 4; ++bh)
        for (std::int64_t f = 0; f < 8; ++f) {
          in.q.data()[(bh * 50 + changed) * 8 + f] += 1.5f;
          in.k.data()[(bh * 50 + changed) * 8 + f] -= 0.25f * static_cast<float>(f + 1);
          in.v.data()[(bh * 50 + changed) * 8 + f] += f % 2 == 0 ? 2.0f : -1.0f;
        }
      const Tensor after = run_mechanism("long-short", p, in, params);
      for (std::int64_t bh = 0; bh < 4; ++bh) {
        CHECK(std::memcmp(before.data() + bh * 400, after.data() + bh * 400,
                          static_cast<std::size_t>(changed * 8) * sizeof(float)) == 0);
        CHECK(std::memcmp(before.data() + bh * 400 + changed * 8, after.data() + bh * 400 + changed * 8,
                          8 * sizeof(float)) != 0);
      }
    }
  }

  TEST_CASE("long-short: not causal, every output depends on the last token (through the projection)") {
    const Problem p{.batch = 1, .heads = 1, .seq_len = 40, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 2);
    const Tensor before = run_mechanism("long-short", p, in);
    // Not a uniform shift of the row: the LayerNorms of V and of the compressed V̄ remove those.
    for (std::int64_t f = 0; f < 8; ++f) in.v.data()[39 * 8 + f] += f % 2 == 0 ? 1.0f : -0.5f * static_cast<float>(f);
    const Tensor after = run_mechanism("long-short", p, in);
    for (std::int64_t i = 0; i < 39; ++i)
      CHECK_MESSAGE(std::memcmp(before.data() + i * 8, after.data() + i * 8, 8 * sizeof(float)) != 0, "row " << i);
  }

  TEST_CASE("long-short decodes: prefill + steps equal the causal forward, contexts around the chunk and window") {
    const std::vector<std::string> small{"window=5", "chunk=4", "chunk_rank=2"};
    for (std::int64_t n : {1, 3, 4, 5, 6, 7, 8, 9}) check_decode(n, 13, small);
    for (std::int64_t n : {15, 16, 17}) check_decode(n, 20, {});
    check_decode(2, 9, {"window=1", "chunk=1", "chunk_rank=3"});
    // Compressed rows one below, at and above 128, where a step attends to them as one block.
    for (std::int64_t n : {126, 129}) check_decode(n, 4, {"window=4", "chunk=1"});
  }

  TEST_CASE("long-short: executed FLOPs equal the analytic count at non-default settings, forward and backward") {
    const ModelInfo* info = find_model("long-short");
    REQUIRE(info != nullptr);
    for (const bool causal : {false, true})
      for (std::int64_t n : {1, 37, 300}) {
        const std::vector<std::string> params{"segment=6", "rank=5", "window=7", "chunk=6", "chunk_rank=2"};
        PointConfig config = point(n, causal, params);
        const ParamValues values =
            info->impl.resolved(config.problem, resolve_params("long-short", info->impl.params, params));
        CHECK(run_point(config).flops == info->impl.flops(config.problem, values));
        config.pass = Pass::Backward;
        CHECK(run_point(config).flops == info->impl.backward_flops(config.problem, values));
      }
  }

  TEST_CASE("long-short: non-causal FLOPs and workspace grow linearly in N; causal memory too") {
    const auto small = run_point(point(2048, false));
    const auto large = run_point(point(8192, false));
    const double flop_ratio = static_cast<double>(large.flops) / static_cast<double>(small.flops);
    CHECK(flop_ratio > 3.95);
    CHECK(flop_ratio <= 4.0);
    CHECK(static_cast<double>(large.workspace_bytes) / static_cast<double>(small.workspace_bytes) <= 4.01);
    CHECK(large.workspace_bytes < 2 * 8192 * 8192 * 4 / 64);
    // Causal: the compressed memory grows as N/l·r rows, so FLOPs are N·(N·r/l + w)·D (superlinear
    // with a 1/(2l) slope at the defaults) and memory stays linear.
    const auto causal_small = run_point(point(2048, true));
    const auto causal_large = run_point(point(8192, true));
    CHECK(static_cast<double>(causal_large.workspace_bytes) / static_cast<double>(causal_small.workspace_bytes) <=
          4.01);
    CHECK(static_cast<double>(causal_large.flops) / static_cast<double>(causal_small.flops) < 6.0);
  }
}
