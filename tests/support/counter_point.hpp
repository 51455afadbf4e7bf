#pragma once
// A sweep point that runs its mechanism once untimed and once timed: for tests that read the
// counters of a run (executed FLOPs, tracked bytes, stages), not its times.
#include <string>
#include <utility>
#include <vector>

#include "apps/bench/point.hpp"
#include "tests/support/reference.hpp"

namespace xfb::test {

inline PointConfig counter_point(const std::string& model, const Problem& problem, std::vector<std::string> params = {},
                                 Scope scope = Scope::Attention) {
  PointConfig c;
  c.model = model;
  c.problem = on_test_threads(problem);
  c.scope = scope;
  c.params = std::move(params);
  c.timing = {.warmup = 1, .min_reps = 1, .min_time_s = 0, .max_reps = 1};
  return c;
}

// A small counter point: B=1 H=2 D=32, N tokens.
inline PointConfig quick_point(const std::string& model, std::int64_t n, bool causal, Scope scope = Scope::Attention,
                               std::vector<std::string> params = {}) {
  return counter_point(model, {.batch = 1, .heads = 2, .seq_len = n, .head_dim = 32, .causal = causal},
                       std::move(params), scope);
}

// The registered models whose attention the contract tests (tests/contract/) check: every one but the
// feed-forward cards (`switch`, `gshard`: ModelCard::ffn), whose attention is vanilla's, checked under its
// own name, and whose FFN's FLOPs depend on the routing; tests/models/sparse_models/test_moe.cpp checks
// their layer (FLOPs, bytes, gradients) and their attention-scope rows.
inline const std::vector<ModelInfo>& attention_models() {
  static const std::vector<ModelInfo> models = [] {
    std::vector<ModelInfo> all;
    for (const auto& model : registry())
      if (model.ffn.empty()) all.push_back(model);
    return all;
  }();
  return models;
}

}  // namespace xfb::test
