#pragma once
// Exports for CI dashboards, one entry per benchmark point:
//   github-action-benchmark, tool `customSmallerIsBetter`: a JSON array of
//     {"name": …, "unit": "ms", "value": median, "range": "± MAD"}            (milliseconds)
//   Bencher Metric Format (BMF): a JSON object keyed by benchmark name,
//     {name: {"latency": {"value": median, "lower_value": min, "upper_value": max}}}  (nanoseconds)
//     plus, for A/B entries, {"ratio": {"value": B/A, "lower_value": CI low, "upper_value": CI high}}.
// Only trustworthy measurements are exported: ok rows that are neither contended (their threads
// waited for a CPU) nor unstable (CV > 5%). A dashboard charts every value it gets and has no field
// for "do not trust this one", so such rows are left out and counted instead.
#include <optional>
#include <string>
#include <vector>

#include "apps/report/report.hpp"

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
struct DashboardOmissions {
  std::size_t contended = 0, unstable = 0;  // ok rows left out; a contended row counts as contended only
};
// Every ok row of the report that is neither contended nor unstable; `omitted` counts the others.
std::vector<DashboardEntry> dashboard_entries(const Report& report, DashboardOmissions* omitted = nullptr);
// "left out 2 ok row(s) of FILE: 1 contended, 1 unstable (CV > 5%): their times are not trustworthy"
std::string omission_note(const DashboardOmissions& omitted, const std::string& file);

std::string github_benchmark_json(const std::vector<DashboardEntry>& entries);
std::string bencher_bmf_json(const std::vector<DashboardEntry>& entries);

}  // namespace xfb
