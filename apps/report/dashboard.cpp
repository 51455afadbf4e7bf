#include "apps/report/dashboard.hpp"

#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

namespace xfb {

std::string dashboard_name(const ResultRow& row) {
  std::string name = row.model + " N=" + std::to_string(row.seq_len) + " [" + configuration_text(row) + "]";
  if (!row.params.empty()) name += " (" + params_text(row.params) + ")";
  return name;
}

std::vector<DashboardEntry> dashboard_entries(const Report& report, DashboardOmissions* omitted) {
  std::vector<DashboardEntry> entries;
  DashboardOmissions counts;
  for (const auto& row : report.results) {
    if (row.status != Status::Ok) continue;
    if (row.contended || row.unstable) {
      ++(row.contended ? counts.contended : counts.unstable);
      continue;
    }
    entries.push_back({dashboard_name(row), row.median_ns, row.mad_ns, row.min_ns, row.max_ns, std::nullopt});
  }
  if (omitted) *omitted = counts;
  return entries;
}

std::string omission_note(const DashboardOmissions& omitted, const std::string& file) {
  return "left out " + std::to_string(omitted.contended + omitted.unstable) + " ok row(s) of " + file + ": " +
         std::to_string(omitted.contended) + " contended, " + std::to_string(omitted.unstable) +
         " unstable (CV > 5%); their times are not trustworthy";
}

std::string github_benchmark_json(const std::vector<DashboardEntry>& entries) {
  nlohmann::json list = nlohmann::json::array();
  for (const auto& e : entries) {
    char range[48];
    std::snprintf(range, sizeof range, "± %.6g", e.spread_ns * 1e-6);
    list.push_back({{"name", e.name}, {"unit", "ms"}, {"value", e.median_ns * 1e-6}, {"range", range}});
  }
  return list.dump(2) + "\n";
}

std::string bencher_bmf_json(const std::vector<DashboardEntry>& entries) {
  nlohmann::json benches = nlohmann::json::object();
  for (const auto& e : entries) {
    nlohmann::json measures = {
        {"latency", {{"value", e.median_ns}, {"lower_value", e.min_ns}, {"upper_value", e.max_ns}}}};
    if (e.ratio) {
      nlohmann::json ratio = {{"value", e.ratio->value}, {"lower_value", e.ratio->low}};
      if (std::isfinite(e.ratio->high)) ratio["upper_value"] = e.ratio->high;
      measures["ratio"] = ratio;
    }
    benches[e.name] = measures;
  }
  return benches.dump(2) + "\n";
}

}  // namespace xfb
