#pragma once
// Test helpers for models checked against their own formula: run a registered mechanism and keep
// it, so the test can read the parameter tensors it used (the same ones --dump writes).
#include <doctest/doctest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "apps/bench/point.hpp"
#include "taxonomy/registry.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

struct MechanismRun {
  std::unique_ptr<Mechanism> mechanism;
  Tensor out;

  const Tensor& parameter(const std::string& name) const {
    for (const auto& named : mechanism->parameters())
      if (named.name == name) return *named.tensor;
    FAIL("no parameter tensor named " << name);
    throw std::logic_error("unreachable");
  }
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

}  // namespace xfb::test
