#pragma once
// Exports for CI dashboards, one entry per benchmark point:
//   github-action-benchmark, tool `customSmallerIsBetter`: a JSON array of
//     {"name": …, "unit": "ms", "value": median, "range": "± MAD"}            (milliseconds)
//   Bencher Metric Format (BMF): a JSON object keyed by benchmark name,
//     {name: {"latency": {"value": median, "lower_value": min, "upper_value": max}}}  (nanoseconds)
//     plus, for A/B entries, {"ratio": {"value": B/A, "lower_value": CI low, "upper_value": CI high}}.
// Only measured points are exported (a dashboard must not plot a failed point as a value).
#include <optional>
#include <string>
#include <vector>

#include "lib/report/report.hpp"

namespace xfb {

struct DashboardEntry {
  std::string name;
  double median_ns = 0, spread_ns = 0;  // spread: median absolute deviation
  double min_ns = 0, max_ns = 0;
  struct Ratio {
    double value = 1, low = 0, high = 0;
  };
  std::optional<Ratio> ratio;  // A/B: candidate over base with its confidence interval
};

// "vanilla N=1024 [attention, B=1 H=8 D=64]" (+ " (params)" when the row has parameters).
std::string dashboard_name(const ResultRow& row);
// Every ok row of the report.
std::vector<DashboardEntry> dashboard_entries(const Report& report);

std::string github_benchmark_json(const std::vector<DashboardEntry>& entries);
std::string bencher_bmf_json(const std::vector<DashboardEntry>& entries);

}  // namespace xfb
