#pragma once
// The result of `xfbench ab` (apps/bench/ab.hpp runs it) and its renderings: per point the rounds
// of both sides, the paired statistics and the verdict; as text, Markdown, JSON ({schema_version,
// tool: "xfbench ab", context, settings, points, regressions}) and the dashboard exports.
#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/report/dashboard.hpp"
#include "apps/report/report.hpp"
#include "lib/core/paired.hpp"

namespace xfb {

enum class AbVerdict { Faster, Slower, Same, Noisy, Error };
std::string ab_verdict_name(AbVerdict v);

struct AbRound {
  bool b_first = false;
  double a_ns = 0, b_ns = 0;  // the children's medians
  bool a_contended = false, b_contended = false;
};

struct AbPoint {
  ResultRow a, b;  // the last round's rows (identity, parameters, reproducers)
  std::vector<AbRound> rounds;
  std::size_t usable_rounds = 0;  // neither side contended
  PairedResult stats;
  AbVerdict verdict = AbVerdict::Same;
  std::string reason;  // for noisy and error
};

struct AbReport {
  nlohmann::json context = nlohmann::json::object();
  nlohmann::json settings = nlohmann::json::object();
  std::vector<AbPoint> points;
};

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
