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
#include "lib/core/paired.hpp"
#include "apps/report/dashboard.hpp"
#include "apps/report/report.hpp"

namespace xfb {

struct AbSide {
  std::string label;                 // "A" / "B" or what the user named it
  std::string program;               // xfbench binary; empty: this one
  std::string model;                 // empty: the point's model
  std::vector<std::string> params;   // `key=value`, added after the common ones
};

struct AbSettings {
  std::vector<std::string> models;    // registry names (of this build)
  std::vector<std::int64_t> seq_lens;
  PointConfig base;                   // everything but model, seq_len, params and pass
  std::vector<Pass> passes = {Pass::Forward};  // every point is compared once per pass
  std::vector<std::string> params;    // common `key=value` / `model.key=value`
  AbSide a, b;
  int rounds = 10;
  double alpha = 0.01;
  double max_slowdown = 0.05;
  double timeout_s = 600;
  bool progress = true;
};

enum class AbVerdict { Faster, Slower, Same, Noisy, Error };
std::string ab_verdict_name(AbVerdict v);

struct AbRound {
  bool b_first = false;
  double a_ns = 0, b_ns = 0;         // the children's medians
  bool a_contended = false, b_contended = false;
};

struct AbPoint {
  ResultRow a, b;                    // the last round's rows (identity, parameters, reproducers)
  std::vector<AbRound> rounds;
  std::size_t usable_rounds = 0;     // neither side contended
  PairedResult stats;
  AbVerdict verdict = AbVerdict::Same;
  std::string reason;                // for noisy and error
};

struct AbReport {
  nlohmann::json context = nlohmann::json::object();
  nlohmann::json settings = nlohmann::json::object();
  std::vector<AbPoint> points;
};

// Decides one point from its rounds (pure: tests feed it rounds).
void judge_ab_point(AbPoint& point, const AbSettings& settings);

// Validates (InputError before anything runs), then runs every point's rounds.
AbReport run_ab(const AbSettings& settings, const std::string& command_line);

nlohmann::json ab_to_json(const AbReport& report);
enum class AbFormat { Text, Markdown, Json, GithubBenchmark, Bencher };
std::string render_ab(const AbReport& report, AbFormat format);
// The dashboard exports' points left out: verdict noisy (or no clean round) and error.
struct AbDashboardOmissions {
  std::size_t noisy = 0, error = 0;
};
// One entry per point with a verdict of faster, slower or same: side B's median over the clean
// rounds (neither side contended) and the ratio with its interval; `omitted` counts the others.
std::vector<DashboardEntry> ab_dashboard_entries(const AbReport& report, AbDashboardOmissions* omitted = nullptr);
// "left out 2 A/B point(s): 1 noisy, 1 error; they have no trustworthy time"
std::string ab_omission_note(const AbDashboardOmissions& omitted);
// Number of points whose verdict is slower or error (the exit status of `xfbench ab`).
std::size_t ab_regressions(const AbReport& report);

}  // namespace xfb
