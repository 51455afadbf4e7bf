#include "apps/report/ab_report.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

#include "apps/report/table.hpp"
#include "lib/core/stats.hpp"

namespace xfb {

std::string ab_verdict_name(AbVerdict v) {
  switch (v) {
    case AbVerdict::Faster:
      return "faster";
    case AbVerdict::Slower:
      return "slower";
    case AbVerdict::Same:
      return "same";
    case AbVerdict::Noisy:
      return "noisy";
    case AbVerdict::Error:
      return "error";
  }
  return "?";
}

namespace {

std::string point_label(const AbPoint& p) {
  return p.a.model + (p.b.model != p.a.model ? " vs " + p.b.model : "") + " N=" + std::to_string(p.a.seq_len) +
         (p.a.pass != Pass::Forward ? " " + pass_name(p.a.pass) : "");
}

}  // namespace

nlohmann::json ab_to_json(const AbReport& report) {
  nlohmann::json points = nlohmann::json::array();
  for (const auto& p : report.points) {
    nlohmann::json rounds = nlohmann::json::array();
    for (const auto& r : p.rounds)
      rounds.push_back({{"order", r.b_first ? "BA" : "AB"},
                        {"a_median_ns", r.a_ns},
                        {"b_median_ns", r.b_ns},
                        {"a_contended", r.a_contended},
                        {"b_contended", r.b_contended}});
    points.push_back(
        {{"model_a", p.a.model},
         {"model_b", p.b.model},
         {"seq_len", p.a.seq_len},
         {"params_a", p.a.params},
         {"params_b", p.b.params},
         {"reproducer_a", p.a.reproducer},
         {"reproducer_b", p.b.reproducer},
         {"rounds", rounds},
         {"usable_rounds", p.usable_rounds},
         {"ratio", p.stats.ratio},
         {"ci_low", p.stats.ci_low},
         {"ci_high", std::isfinite(p.stats.ci_high) ? nlohmann::json(p.stats.ci_high) : nlohmann::json(nullptr)},
         {"w_plus", p.stats.w_plus},
         {"p_value", p.stats.p_value},
         {"verdict", ab_verdict_name(p.verdict)},
         {"reason", p.reason}});
  }
  return {{"schema_version", 1},         {"tool", "xfbench ab"}, {"context", report.context},
          {"settings", report.settings}, {"points", points},     {"regressions", ab_regressions(report)}};
}

std::size_t ab_regressions(const AbReport& report) {
  std::size_t count = 0;
  for (const auto& p : report.points) count += p.verdict == AbVerdict::Slower || p.verdict == AbVerdict::Error;
  return count;
}

std::vector<DashboardEntry> ab_dashboard_entries(const AbReport& report, AbDashboardOmissions* omitted) {
  AbDashboardOmissions counts;
  std::vector<DashboardEntry> entries;
  for (const auto& p : report.points) {
    std::vector<double> b;
    for (const auto& r : p.rounds)
      if (!r.a_contended && !r.b_contended) b.push_back(r.b_ns);
    if (p.verdict == AbVerdict::Error) {
      ++counts.error;
      continue;
    }
    if (p.verdict == AbVerdict::Noisy || b.empty()) {
      ++counts.noisy;
      continue;
    }
    const SampleStats stats = summarize(b);
    DashboardEntry entry{dashboard_name(p.b), stats.median, stats.mad, stats.min, stats.max, std::nullopt};
    entry.ratio = DashboardEntry::Ratio{p.stats.ratio, p.stats.ci_low, p.stats.ci_high};
    entries.push_back(entry);
  }
  if (omitted) *omitted = counts;
  return entries;
}

std::string ab_omission_note(const AbDashboardOmissions& omitted) {
  return "left out " + std::to_string(omitted.noisy + omitted.error) +
         " A/B point(s): " + std::to_string(omitted.noisy) + " noisy, " + std::to_string(omitted.error) +
         " error; they have no trustworthy time";
}

std::string render_ab(const AbReport& report, AbFormat format_kind) {
  switch (format_kind) {
    case AbFormat::Json:
      return ab_to_json(report).dump(2) + "\n";
    case AbFormat::GithubBenchmark:
      return github_benchmark_json(ab_dashboard_entries(report));
    case AbFormat::Bencher:
      return bencher_bmf_json(ab_dashboard_entries(report));
    case AbFormat::Text:
    case AbFormat::Markdown:
      break;
  }
  const bool md = format_kind == AbFormat::Markdown;
  std::vector<std::vector<std::string>> cells = {
      {"point", "A ms", "B ms", "B/A", "interval", "p", "rounds", "verdict", "note"}};
  std::size_t counts[5] = {};
  for (const auto& p : report.points) {
    ++counts[static_cast<int>(p.verdict)];
    std::vector<double> a, b;
    for (const auto& r : p.rounds) {
      a.push_back(r.a_ns);
      b.push_back(r.b_ns);
    }
    const bool interval = p.stats.ci_low > 0 && std::isfinite(p.stats.ci_high);
    cells.push_back(
        {point_label(p), format_number("%.3f", median_of(a) * 1e-6), format_number("%.3f", median_of(b) * 1e-6),
         p.stats.rounds ? format_number("%.3f×", p.stats.ratio) : "-",
         interval ? format_number("%.3f", p.stats.ci_low) + "–" + format_number("%.3f", p.stats.ci_high) : "-",
         p.stats.rounds ? format_number("%.2g", p.stats.p_value) : "-",
         std::to_string(p.usable_rounds) + "/" + std::to_string(p.rounds.size()), ab_verdict_name(p.verdict),
         p.reason});
  }
  std::ostringstream out;
  const std::size_t regressions = ab_regressions(report);
  if (md) out << "**xfbench ab**: " << (regressions ? "❌ " : "✅ ") << regressions << " regression(s)\n\n";
  out << render_cells(cells, md ? TableFormat::Markdown : TableFormat::Text, 1);
  out << (md ? "\n" : "") << report.points.size() << " point(s): " << counts[0] << " faster, " << counts[1]
      << " slower, " << counts[2] << " same, " << counts[3] << " noisy, " << counts[4] << " error; " << regressions
      << " regression(s)\n";
  return out.str();
}

}  // namespace xfb
