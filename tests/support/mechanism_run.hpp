#pragma once
// Test helpers for models checked against their own formula: run a registered mechanism and keep
// it, so the test can read the parameter tensors it used (the same ones --dump writes).
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "lib/core/memory_tracker.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

// The tensor called `name` in a mechanism's list of named tensors (parameters(), saved(),
// parameter_gradients(), decode_state()); fails the test when there is none.
inline const Tensor& tensor_named(const std::vector<NamedTensor>& tensors, const std::string& name) {
  for (const auto& named : tensors)
    if (named.name == name) return *named.tensor;
  FAIL("no tensor named " << name);
  throw std::logic_error("unreachable");
}
// The mechanism's parameter tensor called `name`.
inline const Tensor& parameter(const Mechanism& mechanism, const std::string& name) {
  return tensor_named(mechanism.parameters(), name);
}

struct MechanismRun {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out;

  const Tensor& parameter(const std::string& name) const { return test::parameter(*mechanism, name); }
};

inline MechanismRun run_keeping(const std::string& model, const Problem& p, const AttentionInputs& in,
                                const std::vector<std::string>& params = {}, std::uint64_t seed = 42) {
  const ModelInfo* info = find_model(model);
  REQUIRE(info != nullptr);
  MechanismRun run{info->impl.create(on_test_threads(p), resolve_params(model, info->impl.params, params), seed),
                   Tensor::bhnd(p.batch, p.heads, model_output_rows(model, p, params), p.head_dim)};
  run.mechanism->prepare(in.q, in.k, in.v);
  run.out.fill(std::nanf(""));  // every element must be written
  run.mechanism->forward(in.q, in.k, in.v, run.out);
  return run;
}

// Compares one head's output with a double reference; fails with the element and both values.
inline void check_head(const float* got, const std::vector<double>& want, std::int64_t n, std::int64_t d,
                       double tolerance, const std::string& label) {
  std::int64_t failures = 0;
  for (std::int64_t e = 0; e < n * d; ++e) {
    const double error = std::fabs(got[e] - want[static_cast<std::size_t>(e)]);
    if (!(error <= tolerance) && failures++ < 3)
      FAIL_CHECK(label << ": token " << e / d << " feature " << e % d << ": got " << got[e] << ", want "
                       << want[static_cast<std::size_t>(e)] << " (tolerance " << tolerance << ")");
  }
  CHECK_MESSAGE(failures == 0, label << ": " << failures << " elements out of tolerance");
}

inline double max_abs(const float* x, std::int64_t count) {
  double largest = 0;
  for (std::int64_t i = 0; i < count; ++i) largest = std::max(largest, std::fabs(static_cast<double>(x[i])));
  return largest;
}

// A quick one-repetition benchmark point, B=1 H=2 D=32.
inline ResultRow quick_row(const std::string& model, std::int64_t n, bool causal,
                           std::vector<std::string> params = {}) {
  PointConfig c;
  c.model = model;
  c.problem = {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal, .threads = kTestThreads};
  c.params = std::move(params);
  c.timing = {.warmup = 1, .min_reps = 1, .min_time_s = 0, .max_reps = 1};
  const ResultRow row = run_point(c);
  REQUIRE(row.status == Status::Ok);
  return row;
}

// Prefill of the context (whole's first context.seq_len rows) and one decode step per later row of whole,
// twice (a new forward restarts the state), against want, the causal forward over all of whole
// ([B, H, N + tokens, D]), within tolerance; the decode workspace estimate exact. Returns the mechanism.
inline std::unique_ptr<Mechanism> check_decode_steps(const ModelInfo& info, const Problem& context,
                                                     const ParamValues& values, const AttentionInputs& whole,
                                                     const Tensor& want, std::int64_t tokens, double tolerance) {
  const std::int64_t n = context.seq_len, d = context.head_dim, heads = context.batch * context.heads;
  auto mechanism = info.impl.create(context, values, 42);
  const Tensor q = rows_of(whole.q, 0, n), k = rows_of(whole.k, 0, n), v = rows_of(whole.v, 0, n);
  mechanism->prepare(q, k, v);
  const std::int64_t before = MemoryTracker::instance().current_bytes();
  mechanism->prepare_decode(tokens);
  CHECK(MemoryTracker::instance().current_bytes() - before ==
        info.impl.decode_workspace_bytes(context, values, tokens));
  Tensor context_out = Tensor::bhnd(context.batch, context.heads, n, d);
  for (int run = 0; run < 2; ++run) {  // a new forward restarts the state
    mechanism->forward(q, k, v, context_out);
    for (std::int64_t t = 0; t < tokens; ++t) {
      Tensor out = Tensor::bhnd(context.batch, context.heads, 1, d);
      out.fill(std::nanf(""));
      mechanism->decode_step(rows_of(whole.q, n + t, 1), rows_of(whole.k, n + t, 1), rows_of(whole.v, n + t, 1), out);
      for (std::int64_t bh = 0; bh < heads; ++bh)
        for (std::int64_t f = 0; f < d; ++f) {
          const double error = std::fabs(out.data()[bh * d + f] - want.data()[(bh * (n + tokens) + n + t) * d + f]);
          CHECK_MESSAGE(error <= tolerance, "N=" << n << " step " << t << " bh=" << bh << " f=" << f << ": error "
                                                 << error << " (tolerance " << tolerance << ")");
        }
    }
  }
  for (std::int64_t bh = 0; bh < heads; ++bh)
    for (std::int64_t e = 0; e < n * d; ++e)
      CHECK(std::fabs(context_out.data()[bh * n * d + e] - want.data()[bh * (n + tokens) * d + e]) <= tolerance);
  return mechanism;
}

// A linear-attention model's counters at N = 1K, 2K, 4K: executed FLOPs double with N, the workspace
// does not depend on N (the peak is inputs and output plus a constant), the peak grows under 2×.
inline void check_linear_counters(const std::string& model, bool causal, const std::vector<std::string>& params = {}) {
  const auto small = quick_row(model, 1024, causal, params), mid = quick_row(model, 2048, causal, params),
             large = quick_row(model, 4096, causal, params);
  const double flops_ratio = static_cast<double>(large.flops) / static_cast<double>(mid.flops);
  CHECK(flops_ratio > 1.95);
  CHECK(flops_ratio < 2.05);
  CHECK(static_cast<double>(mid.flops) / static_cast<double>(small.flops) < 2.05);
  CHECK(large.workspace_bytes == mid.workspace_bytes);
  const double peak_ratio = static_cast<double>(large.peak_tensor_bytes) / static_cast<double>(mid.peak_tensor_bytes);
  CHECK(peak_ratio < 2.0);
  CHECK(peak_ratio > 1.5);
}

}  // namespace xfb::test
