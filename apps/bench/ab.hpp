#pragma once
// Interleaved A/B timing: two configurations, point by point, in alternating order. Round r runs
// A then B when r is even and B then A when it is odd (A B | B A | A B …), each run a child
// process (`xfbench run … --json`) as in a sweep, so drift and neighbours hit both sides alike.
// A side is a binary (another build of xfbench, or this one) plus optionally another model or
// extra parameters. Per round the ratio B/A of the children's medians (clean samples) is kept;
// lib/core/paired.hpp turns the rounds' log ratios into a Hodges–Lehmann ratio, its confidence
// interval (1 − alpha) and a signed-rank p-value. Verdicts per point:
//   slower  the ratio exceeds 1 + max_slowdown and its whole interval lies above 1 + max_slowdown/2
//   faster  the ratio is under 1 / (1 + max_slowdown), the interval under 1 / (1 + max_slowdown/2)
// (the margin keeps thousands of A/A decisions free of verdicts while a change of twice the
// threshold is still found in nearly every run at 10 rounds and a few percent of noise)
//   same    otherwise
//   noisy   rounds where either side's row was `contended` are dropped and run again (at most
//           2·rounds in all); fewer than half of `rounds` clean, or too few for the interval: no
//           verdict
//   error   a child failed (its reason is kept)
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/bench/point.hpp"
#include "apps/report/ab_report.hpp"
#include "lib/core/paired.hpp"

namespace xfb {

struct AbSide {
  std::string label;                // "A" / "B" or what the user named it
  std::string program;              // xfbench binary; empty: this one
  std::string model;                // empty: the point's model
  std::vector<std::string> params;  // `key=value`, added after the common ones
  std::string dtype;                // "f32" / "bf16"; empty: the points' --dtype
};

struct AbSettings {
  std::vector<std::string> models;  // registry names (of this build)
  std::vector<std::int64_t> seq_lens;
  PointConfig base;                            // everything but model, seq_len, params and pass
  std::vector<Pass> passes = {Pass::Forward};  // every point is compared once per pass
  std::vector<std::string> params;             // common `key=value` / `model.key=value`
  AbSide a, b;
  int rounds = 10;
  double alpha = 0.01;
  double max_slowdown = 0.05;
  double timeout_s = 600;
  bool progress = true;
};

// Decides one point from its rounds (pure: tests feed it rounds).
void judge_ab_point(AbPoint& point, const AbSettings& settings);

// Validates (InputError before anything runs), then runs every point's rounds.
AbReport run_ab(const AbSettings& settings, const std::string& command_line);

}  // namespace xfb
