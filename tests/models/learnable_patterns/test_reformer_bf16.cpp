// reformer's bf16 form: forward and gradients against the float64 reference on the same bf16 inputs,
// on every bf16 kernel path; decode against the bf16 causal forward; bytes, FLOPs and estimates.
//
// The reference runs in float64 on the bf16 inputs (widened exactly), with k̂ = q/‖q‖ exact and the
// pattern (buckets, sort order) the model computed — the buckets are checked against the argmax of
// the float64 rotations of the bf16 queries, so they are a function of the bf16 queries alone.
// Bounds, with u = 2⁻⁸ and s = 1/√D:
//   k̂ is stored in bf16 (relative error ≤ u per element), so a score s·q_i·k̂_j moves by at most
//   σ = u·s·max_i‖q_i‖ (Cauchy–Schwarz, ‖k̂‖ = 1) and every probability by a factor within e^{±2σ}:
//   ε_P = e^{2σ} − 1. Rounding P to bf16 moves p_j by ≤ u·p_j (the sum is the fp32 one of the
//   unrounded p), the output by ≤ u·Σp_j|v_j|; rounding the output by ≤ u(1 + u)·max|v| more; several
//   rounds combine convexly. Forward: |o − o_ref| ≤ (ε_P + u + u(1 + u))·max|v| + twice the fp32 bound
//   (attention_tolerance on q, k̂, v, as the fp32 reformer tests use).
//   Gradients, per element with terms T (reference_attention_backward's, chained through the
//   normalisation as (T_dk̂ + |k̂|·Σ|k̂|·T_dk̂)/‖q‖): P moves by ε_P through the scores and by u
//   through its rounding, in P and in δ (which also carries the output's error ε_P + 2u(1 + u));
//   dS is rounded (u), K̂ in dQ = dS·K̂ is bf16 (u), the stored gradient is rounded (u):
//   |g − g_ref| ≤ (3ε_P + 7u(1 + u))·T + twice the fp32 factor·T.
//   Decode against the bf16 causal forward: both use the same bf16 k̂ and buckets; they differ in
//   P's rounding (each ≤ u·max|v|), the output's (≤ 2u·|o|) and fp32 summation order:
//   |step − forward| ≤ 2u·(max|v| + |o|) + 64·eps·max|v|.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/bf16.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/learnable_patterns/reformer.hpp"
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
  ReformerAttention* model = nullptr;
  Tensor out;  // bf16
};

Run run_bf16(Problem p, const AttentionInputs& in, const ParamValues& values, bool backward = false) {
  p = on_test_threads(p);
  p.dtype = DType::BF16;
  Run run;
  run.mechanism = find_model("reformer")->impl.create(p, values, 42);
  run.model = dynamic_cast<ReformerAttention*>(run.mechanism.get());
  REQUIRE(run.model != nullptr);
  run.mechanism->prepare(in.q, in.k, in.v);
  if (backward) run.mechanism->prepare_backward();
  run.out = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim, DType::BF16);
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  return run;
}

ParamValues values_of(const std::vector<std::string>& params) {
  const ModelInfo* info = find_model("reformer");
  REQUIRE(info != nullptr);
  return resolve_params("reformer", info->impl.params, params);
}
Run run_bf16(const Problem& p, const AttentionInputs& in, const std::vector<std::string>& params,
             bool backward = false) {
  return run_bf16(p, in, values_of(params), backward);
}

// k̂ = q/‖q‖ of every row of q [rows·d], in double (then fp32 for the reference functions' inputs).
std::vector<double> normalised(const float* q, std::int64_t rows, std::int64_t d) {
  std::vector<double> k(static_cast<std::size_t>(rows * d));
  for (std::int64_t i = 0; i < rows; ++i) {
    double squares = 0;
    for (std::int64_t c = 0; c < d; ++c) squares += static_cast<double>(q[i * d + c]) * q[i * d + c];
    for (std::int64_t c = 0; c < d; ++c) k[i * d + c] = squares > 0 ? q[i * d + c] / std::sqrt(squares) : 0.0;
  }
  return k;
}

// The union over rounds of the keys each token sees (reformer.hpp's rule, from the model's buckets and
// sort order): [n·n], entry i·n + j.
std::vector<char> union_mask(const ReformerAttention& model, const Problem& p, std::int64_t rounds, std::int64_t b,
                             std::int64_t h) {
  const std::int64_t n = p.seq_len, m = model.chunk();
  std::vector<char> seen(static_cast<std::size_t>(n * n), 0);
  for (std::int64_t r = 0; r < rounds; ++r) {
    const auto bucket = model.buckets(r, b, h), order = model.sort_order(r, b, h);
    std::vector<std::int64_t> at(n), rank(n, 0);
    for (std::int64_t s = 0; s < n; ++s) at[order[s]] = s;
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < i; ++j) rank[i] += bucket[j] == bucket[i];
    for (std::int64_t i = 0; i < n; ++i) {
      bool any = false;
      for (std::int64_t j = 0; j < n; ++j) {
        if (j == i || bucket[j] != bucket[i]) continue;
        const bool visible =
            p.causal ? j < i && rank[j] / m + 1 >= rank[i] / m : at[j] / m == at[i] / m || at[j] / m + 1 == at[i] / m;
        if (visible) seen[static_cast<std::size_t>(i * n + j)] = any = true;
      }
      if (!any) seen[static_cast<std::size_t>(i * n + i)] = 1;
    }
  }
  return seen;
}

// Every bucket the model chose is the argmax of [x ; −x], x = k̂·R in float64 from the bf16 queries
// (up to fp32 near-ties).
void check_buckets(const Run& run, const Tensor& q, const Problem& p, std::int64_t n_buckets, std::int64_t rounds) {
  const std::int64_t n = p.seq_len, d = p.head_dim, half = n_buckets / 2;
  if (half == 0) return;
  const Tensor& rotations = *run.mechanism->parameters().at(0).tensor;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const auto keys = normalised(q.head(b, h), n, d);
      for (std::int64_t r = 0; r < rounds; ++r) {
        const auto bucket = run.model->buckets(r, b, h);
        for (std::int64_t i = 0; i < n; ++i) {
          std::vector<double> x(static_cast<std::size_t>(2 * half), 0.0);
          for (std::int64_t j = 0; j < half; ++j) {
            for (std::int64_t c = 0; c < d; ++c) x[j] += keys[i * d + c] * rotations[(c * rounds + r) * half + j];
            x[half + j] = -x[j];
          }
          REQUIRE(bucket[i] >= 0);
          REQUIRE(bucket[i] < n_buckets);
          CHECK(x[bucket[i]] >= *std::max_element(x.begin(), x.end()) - 1e-4);
        }
      }
    }
}

double largest_norm(const float* q, std::int64_t rows, std::int64_t d) {
  double largest = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    double squares = 0;
    for (std::int64_t c = 0; c < d; ++c) squares += static_cast<double>(q[i * d + c]) * q[i * d + c];
    largest = std::max(largest, std::sqrt(squares));
  }
  return largest;
}

// ε_P of the header: e^{2σ} − 1 with σ = u·s·max‖q_i‖.
double score_shift(const float* q, std::int64_t n, std::int64_t d) {
  return std::expm1(2 * kU * largest_norm(q, n, d) / std::sqrt(static_cast<double>(d)));
}

// Checks the bf16 forward against the float64 reference; returns the largest error over the fp32
// bound (> 1: the bf16 rounding shows).
double check_forward(const Problem& p, const std::vector<std::string>& params, std::int64_t n_buckets,
                     std::int64_t rounds, const std::string& label) {
  const auto in = bf16_inputs(p, static_cast<std::uint64_t>(p.seq_len * 3 + rounds));
  const Run run = run_bf16(p, in.bf16, params);
  check_buckets(run, in.widened.q, p, n_buckets, rounds);
  const Tensor out = to_f32(run.out);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double over_fp32 = 0;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      const float *q = in.widened.q.head(b, h), *v = in.widened.v.head(b, h);
      const auto k64 = normalised(q, n, d);
      const std::vector<float> k(k64.begin(), k64.end());
      const auto seen = union_mask(*run.model, p, rounds, b, h);
      const auto want = reference_attention(q, k.data(), v, n, n, d, scale, [&](std::int64_t i, std::int64_t j) {
        return seen[static_cast<std::size_t>(i * n + j)] != 0;
      });
      const double fp32_bound = 2 * attention_tolerance(q, k.data(), v, n, n, d, scale);
      const double bound = (score_shift(q, n, d) + kU + kU * (1 + kU)) * max_abs_of(v, n * d) + fp32_bound;
      std::int64_t failures = 0;
      for (std::int64_t e = 0; e < n * d; ++e) {
        const double error = std::fabs(out.head(b, h)[e] - want[static_cast<std::size_t>(e)]);
        over_fp32 = std::max(over_fp32, error / fp32_bound);
        if (!(error <= bound) && failures++ < 3)
          FAIL_CHECK(label << " b=" << b << " h=" << h << " token " << e / d << " feature " << e % d << ": got "
                           << out.head(b, h)[e] << ", want " << want[static_cast<std::size_t>(e)] << " (bound " << bound
                           << ")");
      }
      CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of the bf16 bound");
    }
  return over_fp32;
}

std::string label_of(const Problem& p, const std::vector<std::string>& params, const std::string& path) {
  std::string label = "reformer bf16 [" + path + "] N=" + std::to_string(p.seq_len) +
                      " D=" + std::to_string(p.head_dim) + (p.causal ? " causal" : "");
  for (const auto& param : params) label += " " + param;
  return label;
}

}  // namespace

TEST_SUITE("reformer_bf16") {
  TEST_CASE("reformer in bf16 equals the float64 reference within the bf16 bound, on every kernel path") {
    for_each_bf16_path([](const std::string& path) {
      for (bool causal : {false, true}) {
        double over_fp32 = 0;
        for (std::int64_t n : {1, 7, 8, 9, 16, 17, 24, 25, 100}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const std::vector<std::string> params{"chunk_len=8", "n_buckets=4"};
          over_fp32 = std::max(over_fp32, check_forward(p, params, 4, 1, label_of(p, params, path)));
        }
        for (std::int64_t n : {63, 64, 65, 129}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal};
          check_forward(p, {}, 10, 1, label_of(p, {}, path));
        }
        // Not fp32 in disguise: the bf16 rounding of k̂, P and O shows past the fp32 bound.
        CHECK_MESSAGE(over_fp32 > 1, path << (causal ? " causal" : "") << ": never past the fp32 bound");
      }
    });
  }

  TEST_CASE("multi-round reformer in bf16 equals softmax over the union of its rounds' keys within the bound") {
    for_each_bf16_path([](const std::string& path) {
      for (bool causal : {false, true})
        for (const char* rounds : {"2", "4"}) {
          const Problem p{.batch = 1, .heads = 2, .seq_len = 77, .head_dim = 16, .causal = causal};
          const std::vector<std::string> params{"chunk_len=10", "n_buckets=6", std::string("n_rounds=") + rounds};
          check_forward(p, params, 6, std::stoll(rounds), label_of(p, params, path));
        }
    });
  }

  TEST_CASE("reformer's bf16 gradients equal the float64 reference's within the bf16 bound, at chunk ± 1") {
    for_each_bf16_path([](const std::string& path) {
      for (bool causal : {false, true})
        for (const auto& [n, rounds, chunk] :
             {std::tuple{7, 1, 8}, {8, 1, 8}, {9, 1, 8}, {17, 2, 8}, {40, 4, 8}, {47, 1, 16}, {65, 2, 16}}) {
          // Chunks of 16: a thread's next tile keeps the previous one's key panels.
          const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = causal};
          const std::vector<std::string> params{"chunk_len=" + std::to_string(chunk), "n_buckets=4",
                                                "n_rounds=" + std::to_string(rounds)};
          const std::string label = label_of(p, params, path);
          const auto in = bf16_inputs(p, static_cast<std::uint64_t>(n) + 3);
          Run run = run_bf16(p, in.bf16, params, true);
          Tensor dout32 = Tensor::bhnd(1, 2, n, 16);
          CounterRng(9, "dout").fill_normal(dout32);
          const Tensor dout = to_bf16(dout32), dout_widened = to_f32(dout);
          Tensor dq = Tensor::bhnd(1, 2, n, 16, DType::BF16), dk = Tensor::bhnd(1, 2, n, 16, DType::BF16),
                 dv = Tensor::bhnd(1, 2, n, 16, DType::BF16);
          run.mechanism->backward(in.bf16.q, in.bf16.k, in.bf16.v, run.out, dout, dq, dk, dv);
          const Tensor got_q = to_f32(dq), got_k = to_f32(dk), got_v = to_f32(dv);
          for (float x : got_k.values()) REQUIRE(x == 0.0f);  // k is not read
          const double scale = 0.25;
          for (std::int64_t h = 0; h < 2; ++h) {
            const float *q = in.widened.q.head(0, h), *v = in.widened.v.head(0, h);
            const auto k64 = normalised(q, n, 16);
            const std::vector<float> k(k64.begin(), k64.end());
            const auto seen = union_mask(*run.model, p, rounds, 0, h);
            const auto ref = reference_attention_backward(
                q, k.data(), v, dout_widened.head(0, h), n, n, 16, scale,
                [&](std::int64_t i, std::int64_t j) { return seen[static_cast<std::size_t>(i * n + j)] != 0; });
            // Through k̂ = q/‖q‖: dq += (dk̂ − k̂·(k̂·dk̂))/‖q‖, its terms likewise in absolute values.
            std::vector<double> want_q = ref.dq, terms_q = ref.dq_terms;
            for (std::int64_t i = 0; i < n; ++i) {
              double squares = 0, dot = 0, dot_terms = 0;
              for (std::int64_t c = 0; c < 16; ++c) {
                squares += static_cast<double>(q[i * 16 + c]) * q[i * 16 + c];
                dot += k64[i * 16 + c] * ref.dk[i * 16 + c];
                dot_terms += std::fabs(k64[i * 16 + c]) * ref.dk_terms[i * 16 + c];
              }
              for (std::int64_t c = 0; c < 16; ++c) {
                want_q[i * 16 + c] += (ref.dk[i * 16 + c] - k64[i * 16 + c] * dot) / std::sqrt(squares);
                terms_q[i * 16 + c] +=
                    (ref.dk_terms[i * 16 + c] + std::fabs(k64[i * 16 + c]) * dot_terms) / std::sqrt(squares);
              }
            }
            const double factor =
                3 * score_shift(q, n, 16) + 7 * kU * (1 + kU) + 2 * gradient_error_factor(q, k.data(), n, n, 16, scale);
            const Tensor* got[2] = {&got_q, &got_v};
            const std::vector<double>* want[2] = {&want_q, &ref.dv};
            const std::vector<double>* terms[2] = {&terms_q, &ref.dv_terms};
            for (int g = 0; g < 2; ++g) {
              std::int64_t failures = 0;
              for (std::int64_t e = 0; e < n * 16; ++e) {
                const auto i = static_cast<std::size_t>(e);
                const double error = std::fabs(got[g]->head(0, h)[e] - (*want[g])[i]);
                if (!(error <= factor * (*terms[g])[i] + 1e-30) && failures++ < 3)
                  FAIL_CHECK(label << " d"
                                   << "qv"[g] << " h=" << h << " element " << e << ": got " << got[g]->head(0, h)[e]
                                   << ", want " << (*want[g])[i] << " (bound " << factor * (*terms[g])[i] << ")");
              }
              CHECK_MESSAGE(failures == 0, label << " d"
                                                 << "qv"[g] << ": " << failures << " out of the bound");
            }
          }
        }
    });
  }

  TEST_CASE("reformer's bf16 decode, on its bf16 rings, equals its bf16 causal forward; FLOPs as fp32's steps") {
    // Parameters resolved for the context (the decode contract), the whole forward on the same values.
    constexpr std::int64_t kTokens = 12;
    const ModelInfo& info = *find_model("reformer");
    for (const auto& params : {std::vector<std::string>{"chunk_len=4", "n_buckets=4"},
                               std::vector<std::string>{"chunk_len=5", "n_buckets=6", "n_rounds=2"},
                               std::vector<std::string>{"chunk_len=3", "n_buckets=1"}})
      for (std::int64_t context : {1, 9, 20}) {
        const Problem whole{.batch = 1, .heads = 2, .seq_len = context + kTokens, .head_dim = 16, .causal = true};
        Problem p = on_test_threads(whole);
        p.seq_len = context;
        p.dtype = DType::BF16;
        const ParamValues values = info.impl.resolved(p, values_of(params));
        const auto in = bf16_inputs(whole, static_cast<std::uint64_t>(context) + 1);
        const Tensor forward = to_f32(run_bf16(whole, in.bf16, values).out);

        // The bf16 model on the bf16 inputs; the fp32 one on the same values widened, for the FLOPs.
        Problem p32 = p;
        p32.dtype = DType::F32;
        auto mechanism = info.impl.create(p, values, 42), mechanism32 = info.impl.create(p32, values, 42);
        auto rows = [&](const Tensor& t, std::int64_t first, std::int64_t count) { return rows_of(t, first, count); };
        const Tensor q = rows(in.widened.q, 0, context), k = rows(in.widened.k, 0, context),
                     v = rows(in.widened.v, 0, context);
        const Tensor q16 = to_bf16(q), k16 = to_bf16(k), v16 = to_bf16(v);
        Tensor prefill = Tensor::bhnd(1, 2, context, 16, DType::BF16), prefill32 = Tensor::bhnd(1, 2, context, 16);
        mechanism->prepare(q16, k16, v16);
        mechanism->prepare_decode(kTokens);
        mechanism->forward(q16, k16, v16, prefill);
        mechanism32->prepare(q, k, v);
        mechanism32->prepare_decode(kTokens);
        mechanism32->forward(q, k, v, prefill32);
        const double largest_v = max_abs_of(in.widened.v.data(), in.widened.v.size());
        for (std::int64_t t = 0; t < kTokens; ++t) {
          const std::int64_t token = context + t;
          const Tensor q1 = rows(in.widened.q, token, 1), k1 = rows(in.widened.k, token, 1),
                       v1 = rows(in.widened.v, token, 1);
          Tensor out = Tensor::bhnd(1, 2, 1, 16, DType::BF16), out32 = Tensor::bhnd(1, 2, 1, 16);
          FlopCounter::reset();
          mechanism->decode_step(to_bf16(q1), to_bf16(k1), to_bf16(v1), out);
          const std::int64_t flops = FlopCounter::total();
          FlopCounter::reset();
          mechanism32->decode_step(q1, k1, v1, out32);
          CHECK(flops == FlopCounter::total());
          const Tensor step = to_f32(out);
          for (std::int64_t h = 0; h < 2; ++h)
            for (std::int64_t c = 0; c < 16; ++c) {
              const float want = forward.head(0, h)[token * 16 + c], got = step.head(0, h)[c];
              const double bound = 2 * kU * (largest_v + std::fabs(want)) + 64 * kFloatEps * largest_v;
              CHECK_MESSAGE(std::fabs(got - want) <= bound, params.back() << " context " << context << " token "
                                                                          << token << " head " << h << " feature " << c
                                                                          << ": got " << got << ", want " << want);
            }
        }
        for (const auto& named : mechanism->decode_state()) CHECK(named.tensor->dtype() == DType::BF16);
      }
  }

  TEST_CASE("reformer bf16 rows: FLOPs as fp32's, bf16 bytes, k̂ and the rings' rows half, every estimate exact") {
    for (const auto& params : {std::vector<std::string>{"chunk_len=16", "n_buckets=4"},
                               std::vector<std::string>{"chunk_len=10", "n_buckets=6", "n_rounds=2"}})
      for (bool causal : {false, true})
        for (Pass pass : {Pass::Forward, Pass::Backward, Pass::Train, Pass::Decode}) {
          if (pass == Pass::Decode && !causal) continue;
          for (std::int64_t n : {47, 48, 100}) {
            CAPTURE(params.back());
            // A decode step's FLOPs follow its union of keys, so its buckets: the f32 point hashes the
            // unrounded draws (the decode test compares the steps' FLOPs on the same values).
            const auto [a, b] = check_bf16_rows("reformer", n, causal, pass, params, pass != Pass::Decode);
            if (pass == Pass::Backward || pass == Pass::Train) {
              // k̂ halves; 1/‖q‖, the log-sum-exp and the integer sort do not.
              CHECK(a.saved_bytes - b.saved_bytes == 2 * 2 * n * 32);
            }
            if (pass == Pass::Decode) {
              // The rings' k̂ and v rows halve; their int32 positions and the member counts do not.
              const std::int64_t buckets = params[1] == "n_buckets=4" ? 4 : 6, rounds = params.size() > 2 ? 2 : 1;
              const std::int64_t m = params[0] == "chunk_len=16" ? 16 : 10;
              const std::int64_t slots = 2 * rounds * buckets * 2 * m, value_bytes = 2 * slots * 32 * 4;
              CHECK(a.state_bytes - b.state_bytes == value_bytes / 2);
              CHECK(b.state_bytes == value_bytes / 2 + 4 * (slots + 2 * rounds * buckets));
            }
          }
        }
  }

  TEST_CASE("reformer's bf16 form needs a head size the bf16 kernels tile: others are unsupported rows") {
    check_bf16_head_dim_unsupported("reformer");
  }
}
