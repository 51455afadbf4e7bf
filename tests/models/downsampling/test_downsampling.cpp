// The downsampling models (output M < N rows): Funnel's pooled-query attention and TokenLearner
// followed by attention over its tokens, against naive double-precision references; their
// gradients against central differences; their FLOP counts and how FLOPs and memory scale.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/counter_point.hpp"
#include "tests/support/gradient_check.hpp"
#include "tests/support/reference.hpp"
#include "tests/support/tokenlearner_reference.hpp"

using namespace xfb;
using namespace xfb::test;

namespace {

using Matrix = std::vector<double>;  // row-major

// A registered downsampling model run on the test threads, with its [B, H, M, D] output and, when
// a dO is given, its backward; the executed FLOPs of each pass.
struct DownsamplingRun {
  std::unique_ptr<Mechanism> mechanism;
  std::int64_t rows = 0;  // M
  Tensor out, dq, dk, dv;
  std::int64_t forward_flops = 0, backward_flops = 0;
  std::int64_t expected_forward_flops = 0, expected_backward_flops = 0;
};

DownsamplingRun run_model(const std::string& model, const Problem& p, const AttentionInputs& in,
                          const std::vector<std::string>& params, const Tensor* dout = nullptr) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  const Problem run_on = on_test_threads(p);
  const ParamValues values = resolve_params(model, info->impl.params, params);
  if (info->impl.validate) info->impl.validate(run_on, values);
  DownsamplingRun run;
  run.rows = output_rows_of(info->impl, run_on, values);
  REQUIRE(run.rows >= 1);
  REQUIRE(run.rows <= p.seq_len);
  run.mechanism = info->impl.create(run_on, values, 42);
  run.mechanism->prepare(in.q, in.k, in.v);
  if (dout != nullptr) run.mechanism->prepare_backward();
  run.out = Tensor::bhnd(p.batch, p.heads, run.rows, p.head_dim);
  run.out.fill(std::nanf(""));  // every element must be written
  FlopCounter::reset();
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  run.forward_flops = FlopCounter::total();
  run.expected_forward_flops = info->impl.flops(run_on, values);
  if (dout == nullptr) return run;
  for (Tensor* t : {&run.dq, &run.dk, &run.dv}) {
    *t = Tensor::bhnd(p.batch, p.heads, p.seq_len, p.head_dim);
    t->fill(std::nanf(""));
  }
  FlopCounter::reset();
  run.mechanism->backward(in.q, in.k, in.v, run.out, *dout, run.dq, run.dk, run.dv);
  run.backward_flops = FlopCounter::total();
  run.expected_backward_flops = info->impl.backward_flops(run_on, values);
  return run;
}

Tensor random_rows(const Problem& p, std::int64_t rows, std::uint64_t seed, const char* name) {
  Tensor t = Tensor::bhnd(p.batch, p.heads, rows, p.head_dim);
  CounterRng(seed, name).fill_normal(t);
  return t;
}

// Element by element within `tolerance`; fails with the first few elements.
void check_rows(const float* got, const Matrix& want, double tolerance, const std::string& label) {
  std::int64_t failures = 0;
  for (std::size_t e = 0; e < want.size(); ++e) {
    const double error = std::fabs(got[e] - want[e]);
    if (!(error <= tolerance) && failures++ < 3)
      FAIL_CHECK(label << ": element " << e << ": got " << got[e] << ", want " << want[e] << " (tolerance " << tolerance
                       << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
}

// The gradients of q, k, v (and each parameter with a gradient) against central differences of
// the reference ⟨dO, reference⟩, dO [B, H, M, D].
void check_run_gradients(const std::string& label, const Problem& p, const AttentionInputs& in, const Tensor& dout,
                         const DownsamplingRun& run, const ModelReference& reference, bool every_element) {
  NamedValues inputs = named_inputs(in);
  std::map<std::string, const Tensor*> grads{{"q", &run.dq}, {"k", &run.dk}, {"v", &run.dv}};
  for (const auto& parameter : run.mechanism->parameters())
    for (const auto& gradient : run.mechanism->parameter_gradients())
      if (gradient.name == "d" + parameter.name) {
        inputs[parameter.name] = widened(parameter.tensor->data(), parameter.tensor->size());
        grads[parameter.name] = gradient.tensor;
      }
  const double size_factor = std::log2(static_cast<double>(std::max<std::int64_t>(p.seq_len, 2))) + p.head_dim;
  check_against_differences(label, inputs, grads, dout, reference, size_factor, every_element);
}

// ---- funnel ----

struct FunnelOptions {
  bool separate_cls = false, truncate_seq = false;
};

// The pooled queries of one head ([n, d] rows), from the official code's definition: with
// separate_cls the sequence is [x0, x0, x1, …] (with truncate_seq without its last token); then
// windows of 2 averaged, a last window of one row taken as it is.
Matrix funnel_pooled(const double* q, std::int64_t n, std::int64_t d, FunnelOptions o) {
  std::vector<const double*> sequence;
  if (o.separate_cls) sequence.push_back(q);
  const std::int64_t kept = o.separate_cls && o.truncate_seq ? n - 1 : n;
  for (std::int64_t j = 0; j < kept; ++j) sequence.push_back(q + j * d);
  const std::size_t m = (sequence.size() + 1) / 2;
  Matrix pooled(m * d);
  for (std::size_t i = 0; i < m; ++i)
    for (std::int64_t c = 0; c < d; ++c) {
      const bool pair = 2 * i + 1 < sequence.size();
      pooled[i * d + c] = pair ? (sequence[2 * i][c] + sequence[2 * i + 1][c]) / 2 : sequence[2 * i][c];
    }
  return pooled;
}

// Every head's output [B, H, M, D], flattened.
Matrix funnel_reference(const NamedValues& x, const Problem& p, FunnelOptions o) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  Matrix out;
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    const Matrix pooled = funnel_pooled(x.at("q").data() + bh * n * d, n, d, o);
    const std::int64_t m = static_cast<std::int64_t>(pooled.size()) / d;
    const Matrix head = reference_attention(pooled.data(), x.at("k").data() + bh * n * d, x.at("v").data() + bh * n * d,
                                            m, n, d, 1 / std::sqrt(double(d)), full_mask);
    out.insert(out.end(), head.begin(), head.end());
  }
  return out;
}

std::vector<std::string> funnel_params(FunnelOptions o, std::vector<std::string> more = {}) {
  if (o.separate_cls) more.push_back("separate_cls=true");
  if (o.truncate_seq) more.push_back("truncate_seq=true");
  return more;
}

std::string funnel_label(const Problem& p, const std::vector<std::string>& params) {
  std::string label = "funnel N=" + std::to_string(p.seq_len) + " D=" + std::to_string(p.head_dim);
  for (const auto& param : params) label += " " + param;
  return label;
}

void check_funnel(const Problem& p, FunnelOptions o, std::vector<std::string> extra = {}) {
  const auto params = funnel_params(o, std::move(extra));
  const std::string label = funnel_label(p, params);
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len + 5));
  const DownsamplingRun run = run_model("funnel", p, in, params);
  const NamedValues x = named_inputs(in);
  const Matrix want = funnel_reference(x, p, o);
  const std::int64_t n = p.seq_len, d = p.head_dim, m = run.rows;
  REQUIRE(static_cast<std::int64_t>(want.size()) == p.batch * p.heads * m * d);
  for (std::int64_t bh = 0; bh < p.batch * p.heads; ++bh) {
    // fp32 error of attention over N keys with the pooled queries (as rounded in fp32: the pooling's
    // own error is one rounding of q, inside the score terms' allowance).
    const Matrix pooled = funnel_pooled(x.at("q").data() + bh * n * d, n, d, o);
    const std::vector<float> pooled32(pooled.begin(), pooled.end());
    const double tolerance = attention_tolerance(pooled32.data(), in.k.data() + bh * n * d, in.v.data() + bh * n * d, m,
                                                 n, d, 1 / std::sqrt(double(d)));
    check_rows(run.out.data() + bh * m * d, Matrix(want.begin() + bh * m * d, want.begin() + (bh + 1) * m * d),
               tolerance, label + " head " + std::to_string(bh));
  }
  CHECK_MESSAGE(run.forward_flops == run.expected_forward_flops, label);
}

// ---- tokenlearner ----

void check_tokenlearner(const Problem& p, TokenLearnerShape t) {
  const std::string label = "tokenlearner N=" + std::to_string(p.seq_len) + " S=" + std::to_string(t.tokens) +
                            " F=" + std::to_string(t.bottleneck);
  const auto in = random_inputs(p, static_cast<std::uint64_t>(p.seq_len + 11));
  const DownsamplingRun run = run_model("tokenlearner", p, in, tokenlearner_params(t));
  CHECK(run.rows == std::min(t.tokens, p.seq_len));
  const NamedValues x = with_parameters(in, *run.mechanism);
  const std::int64_t d = p.head_dim, m = run.rows;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h) {
      TokenErrorScale scale;
      const Matrix want = tokenlearner_head(x, p, t, b, h, scale);
      // fp32 error: a logit is a blocked sum of d then f products of a normalised row (rounding
      // growing with log2 of each length, amplified by the row's 1/σ; the erf polynomial's 1.3·eps
      // per GELU is within it), relative to its terms; a weight's relative error is at most twice
      // a logit's plus the softmax's log2 N; a token is a convex sum of the inputs, so its error is
      // relative to the largest |token|; the attention over the S tokens adds its score terms and
      // log2 S.
      const double logit_error =
          (std::log2(static_cast<double>(d)) + std::log2(static_cast<double>(t.bottleneck)) + 2) * scale.logit_terms *
          std::max(1.0, scale.inverse_std);
      const double tolerance = 8 * kFloatEps *
                               (2 * logit_error + std::log2(static_cast<double>(p.seq_len)) + scale.score_terms +
                                std::log2(static_cast<double>(m)) + 1) *
                               std::max(1.0, scale.largest_token);
      const std::int64_t at = (b * p.heads + h) * m * d;
      check_rows(run.out.data() + at, want, tolerance, label + " b=" + std::to_string(b) + " h=" + std::to_string(h));
    }
  CHECK_MESSAGE(run.forward_flops == run.expected_forward_flops, label);
}

ResultRow counter_row(const std::string& model, std::int64_t n, std::vector<std::string> params = {}) {
  const ResultRow row = run_point(
      counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = false}, std::move(params)));
  REQUIRE(row.status == Status::Ok);
  return row;
}

}  // namespace

TEST_SUITE("downsampling") {
  TEST_CASE("funnel: pooled queries over every key equal the double reference, odd and even N, around the blocks") {
    // Defaults: block_q 64 pooled rows (N = 127 … 130), forward strips of 32 rows on the tile
    // kernels (N = 63 … 65), block_k 1024 keys (N = 1023 … 1025).
    for (std::int64_t d : {16, 12})  // tile kernels, sgemm
      for (std::int64_t n : {1, 2, 3, 4, 5, 63, 64, 65, 127, 128, 129, 130}) {
        const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = false};
        check_funnel(p, {});
      }
    for (std::int64_t n : {1023, 1024, 1025}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_funnel(p, {});
    }
  }

  TEST_CASE("funnel: separate_cls and truncate_seq pool as the official code, small uneven blocks") {
    for (const FunnelOptions o : {FunnelOptions{true, false}, FunnelOptions{true, true}, FunnelOptions{false, false}})
      for (std::int64_t d : {16, 8})
        for (std::int64_t n : {1, 2, 3, 6, 7, 39, 40, 41}) {
          const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = false};
          check_funnel(p, o, {"block_q=5", "block_k=20", "backward_block_k=24"});
        }
  }

  TEST_CASE("funnel: M = ceil(N/2) rows (floor(N/2) + 1 with separate_cls alone); truncate_seq needs separate_cls") {
    const ModelInfo* info = find_model("funnel");
    REQUIRE(info != nullptr);
    REQUIRE(info->impl.downsamples());
    for (std::int64_t n : {1, 2, 3, 8, 9}) {
      const Problem p{.batch = 1, .heads = 1, .seq_len = n, .head_dim = 8};
      CHECK(output_rows_of(info->impl, p, resolve_params("funnel", info->impl.params, {})) == (n + 1) / 2);
      CHECK(output_rows_of(info->impl, p, resolve_params("funnel", info->impl.params, {"separate_cls=true"})) ==
            n / 2 + 1);
      CHECK(output_rows_of(info->impl, p,
                           resolve_params("funnel", info->impl.params, {"separate_cls=true", "truncate_seq=true"})) ==
            (n + 1) / 2);
    }
    const Problem p{.batch = 1, .heads = 1, .seq_len = 8, .head_dim = 8};
    CHECK_THROWS_AS(info->impl.validate(p, resolve_params("funnel", info->impl.params, {"truncate_seq=true"})),
                    ParamError);
  }

  TEST_CASE("funnel gradients of q, k, v against central differences of the reference") {
    struct Case {
      std::int64_t n, d;
      FunnelOptions o;
      std::vector<std::string> extra;
    };
    for (const Case& c : {Case{1, 4, {}, {}}, Case{2, 4, {}, {}}, Case{5, 4, {}, {}}, Case{8, 4, {true, false}, {}},
                          Case{9, 4, {true, true}, {}}, Case{8, 16, {true, true}, {}},
                          Case{33, 16, {}, {"block_q=3", "backward_block_k=16"}},
                          Case{35, 8, {true, false}, {"block_q=4", "block_k=7", "backward_block_k=10"}}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = c.n, .head_dim = c.d, .causal = false};
      const auto params = funnel_params(c.o, c.extra);
      const auto in = random_inputs(p, 7);
      const std::int64_t m = (c.o.separate_cls && !c.o.truncate_seq) ? c.n / 2 + 1 : (c.n + 1) / 2;
      const Tensor dout = random_rows(p, m, 7, "dout");
      const DownsamplingRun run = run_model("funnel", p, in, params, &dout);
      REQUIRE(run.rows == m);
      const std::string label = funnel_label(p, params);
      CHECK_MESSAGE(run.backward_flops == run.expected_backward_flops, label);
      check_run_gradients(
          label, p, in, dout, run, [&](const NamedValues& x) { return funnel_reference(x, p, c.o); }, c.n <= 9);
    }
  }

  TEST_CASE("funnel: not causal; every pooled row depends on the last key") {
    const ModelInfo* info = find_model("funnel");
    const Problem causal{.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 32, .causal = true};
    const std::string reason = info->impl.unsupported(causal, resolve_params("funnel", info->impl.params, {}));
    CHECK(reason.find("no causal form") != std::string::npos);
    CHECK(describe_point(quick_point("funnel", 64, true)).status == Status::Unsupported);
    const Problem p{.batch = 1, .heads = 1, .seq_len = 40, .head_dim = 16, .causal = false};
    auto in = random_inputs(p, 3);
    const DownsamplingRun before = run_model("funnel", p, in, {});
    for (std::int64_t c = 0; c < 16; ++c) in.k.data()[39 * 16 + c] += 0.5f;
    const DownsamplingRun after = run_model("funnel", p, in, {});
    for (std::int64_t i = 0; i < before.rows; ++i)
      CHECK_MESSAGE(std::memcmp(before.out.data() + i * 16, after.out.data() + i * 16, 16 * sizeof(float)) != 0,
                    "row " << i);
  }

  TEST_CASE("funnel: quadratic, with half of vanilla's score and value work; memory linear in N") {
    const ModelInfo* vanilla = find_model("vanilla");
    const ResultRow small = counter_row("funnel", 2048), large = counter_row("funnel", 4096);
    const double ratio = static_cast<double>(large.flops) / static_cast<double>(small.flops);
    CHECK(ratio > 3.98);
    CHECK(ratio < 4.01);
    for (const ResultRow* row : {&small, &large}) {
      const Problem p{.batch = 1, .heads = 2, .seq_len = row->seq_len, .head_dim = 32};
      const double half = static_cast<double>(row->flops) / static_cast<double>(vanilla->impl.flops(p, {}));
      CAPTURE(row->seq_len);
      CHECK(half > 0.49);
      CHECK(half < 0.51);
    }
    const double memory = static_cast<double>(large.workspace_bytes) / static_cast<double>(small.workspace_bytes);
    CHECK(memory < 2.05);
    // Far below the M×N scores a materialised form holds: B·H·(N/2)·N floats.
    CHECK(large.workspace_bytes < 2 * 2048 * 4096 * 4 / 16);
  }

  TEST_CASE("tokenlearner: learned tokens and attention over them equal the double reference, N around S and chunks") {
    // Defaults S = 8 (N = 7 clamps S to 7), the MLP's 256-row chunks (N = 255 … 257).
    for (std::int64_t n : {1, 2, 7, 8, 9, 17, 255, 256, 257, 300}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = 16, .causal = false};
      check_tokenlearner(p, {});
    }
    for (const TokenLearnerShape t : {TokenLearnerShape{1, 64}, TokenLearnerShape{16, 5}, TokenLearnerShape{3, 7}})
      for (std::int64_t n : {15, 16, 17}) {
        const Problem p{.batch = 2, .heads = 3, .seq_len = n, .head_dim = 12, .causal = false};
        check_tokenlearner(p, t);
      }
  }

  TEST_CASE("tokenlearner gradients of q, k, v, the LN and both MLP layers against central differences") {
    for (const auto& [n, d, t] : {std::tuple<std::int64_t, std::int64_t, TokenLearnerShape>{1, 4, {3, 5}},
                                  {3, 4, {3, 5}},
                                  {8, 4, {8, 3}},
                                  {9, 4, {8, 3}},
                                  {257, 8, {4, 6}}}) {
      const Problem p{.batch = 2, .heads = 2, .seq_len = n, .head_dim = d, .causal = false};
      const auto in = random_inputs(p, 5);
      const Tensor dout = random_rows(p, std::min(t.tokens, n), 5, "dout");
      const DownsamplingRun run = run_model("tokenlearner", p, in, tokenlearner_params(t), &dout);
      const std::string label = "tokenlearner N=" + std::to_string(n) + " S=" + std::to_string(t.tokens);
      CHECK_MESSAGE(run.backward_flops == run.expected_backward_flops, label);
      CHECK(run.mechanism->parameter_gradients().size() == 6);
      check_run_gradients(
          label, p, in, dout, run, [&](const NamedValues& x) { return tokenlearner_reference(x, p, t); }, n <= 9);
    }
  }

  TEST_CASE("tokenlearner: not causal; every token depends on the last position") {
    const ModelInfo* info = find_model("tokenlearner");
    const Problem causal{.batch = 1, .heads = 2, .seq_len = 64, .head_dim = 32, .causal = true};
    CHECK_FALSE(info->impl.unsupported(causal, resolve_params("tokenlearner", info->impl.params, {})).empty());
    CHECK(describe_point(quick_point("tokenlearner", 64, true)).status == Status::Unsupported);
    const Problem p{.batch = 1, .heads = 1, .seq_len = 50, .head_dim = 8, .causal = false};
    auto in = random_inputs(p, 2);
    const DownsamplingRun before = run_model("tokenlearner", p, in, {});
    // Not a constant shift of the row: the layer norm removes those.
    for (std::int64_t c = 0; c < 8; ++c) in.v.data()[49 * 8 + c] += static_cast<float>(c) - 3.5f;
    const DownsamplingRun after = run_model("tokenlearner", p, in, {});
    for (std::int64_t i = 0; i < before.rows; ++i)
      CHECK_MESSAGE(std::memcmp(before.out.data() + i * 8, after.out.data() + i * 8, 8 * sizeof(float)) != 0,
                    "token " << i);
  }

  TEST_CASE("tokenlearner: FLOPs and workspace grow linearly in N (O(N·S·D + N·D·F)), never N×N") {
    const ResultRow small = counter_row("tokenlearner", 2048), large = counter_row("tokenlearner", 8192);
    const double flop_ratio = static_cast<double>(large.flops) / static_cast<double>(small.flops);
    CHECK(flop_ratio > 3.95);
    CHECK(flop_ratio <= 4.0);
    const double memory_ratio = static_cast<double>(large.workspace_bytes) / static_cast<double>(small.workspace_bytes);
    CHECK(memory_ratio < 4.05);
    CHECK(large.workspace_bytes < 2 * 8192 * 8192 * 4 / 64);
    // FLOPs at other shapes equal the counter (forward and backward).
    const Problem p{.batch = 2, .heads = 3, .seq_len = 600, .head_dim = 24, .causal = false};
    const auto in = random_inputs(p, 9);
    const Tensor dout = random_rows(p, 5, 9, "dout");
    const DownsamplingRun run = run_model("tokenlearner", p, in, {"tokens=5", "bottleneck=33"}, &dout);
    CHECK(run.forward_flops == run.expected_forward_flops);
    CHECK(run.backward_flops == run.expected_backward_flops);
  }
}
