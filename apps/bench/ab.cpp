#include "apps/bench/ab.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

#include <unistd.h>

#include "apps/bench/sweep.hpp"
#include "apps/bench/system_info.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/stats.hpp"
#include "apps/report/point_fields.hpp"
#include "apps/report/table.hpp"

namespace xfb {

std::string ab_verdict_name(AbVerdict v) {
  switch (v) {
    case AbVerdict::Faster: return "faster";
    case AbVerdict::Slower: return "slower";
    case AbVerdict::Same: return "same";
    case AbVerdict::Noisy: return "noisy";
    case AbVerdict::Error: return "error";
  }
  return "?";
}

namespace {

// A side of a round counts with at least min_reps clean repetitions. A report row is also flagged
// when its descheduled repetitions outnumber the clean ones (the clean minority is a lucky
// selection); a round need not be: A and B alternate under the same load, so that selection
// touches both sides alike and cancels in their ratio.
bool too_few_clean(const ResultRow& row, int min_reps) {
  const bool none_clean = row.contended_samples_ns.empty() && row.contended_samples > 0;
  return none_clean || static_cast<int>(row.samples_ns.size()) < min_reps;
}

PointConfig side_point(const AbSettings& s, const AbSide& side, const std::string& model, std::int64_t n, Pass pass) {
  PointConfig point = s.base;
  point.pass = pass;
  point.model = side.model.empty() ? model : side.model;
  point.problem.seq_len = n;
  point.params = params_for_model(point.model, s.params);
  point.params.insert(point.params.end(), side.params.begin(), side.params.end());
  return point;
}

std::string point_label(const AbPoint& p) {
  return p.a.model + (p.b.model != p.a.model ? " vs " + p.b.model : "") + " N=" + std::to_string(p.a.seq_len) +
         (p.a.pass != Pass::Forward ? " " + pass_name(p.a.pass) : "");
}

std::string format(const char* pattern, double value) {
  char text[64];
  std::snprintf(text, sizeof text, pattern, value);
  return text;
}

}  // namespace

void judge_ab_point(AbPoint& point, const AbSettings& s) {
  std::vector<double> log_ratios;
  for (const auto& round : point.rounds)
    if (!round.a_contended && !round.b_contended && round.a_ns > 0 && round.b_ns > 0)
      log_ratios.push_back(std::log(round.b_ns / round.a_ns));
  point.usable_rounds = log_ratios.size();
  point.stats = paired_log_ratio_test(log_ratios, 1 - s.alpha);
  if (point.verdict == AbVerdict::Error) return;
  const bool interval = point.stats.ci_low > 0 && std::isfinite(point.stats.ci_high);
  if (2 * point.usable_rounds < static_cast<std::size_t>(s.rounds) || !interval) {
    point.verdict = AbVerdict::Noisy;
    point.reason = std::to_string(point.usable_rounds) + " clean of " + std::to_string(point.rounds.size()) +
                   " rounds" +
                   (interval ? "" : "; too few for a " + format("%.3g", 100 * (1 - s.alpha)) + "% interval");
    return;
  }
  const double limit = 1 + s.max_slowdown, margin = 1 + s.max_slowdown / 2;
  if (point.stats.ci_low > margin && point.stats.ratio > limit)
    point.verdict = AbVerdict::Slower;
  else if (point.stats.ci_high < 1 / margin && point.stats.ratio < 1 / limit)
    point.verdict = AbVerdict::Faster;
  else
    point.verdict = AbVerdict::Same;
}

AbReport run_ab(const AbSettings& s, const std::string& command_line) {
  if (s.rounds < 2 || s.rounds > static_cast<int>(kExactSignedRankMax))
    throw InputError("--rounds must be between 2 and " + std::to_string(kExactSignedRankMax));
  if (!(s.alpha > 0 && s.alpha < 1)) throw InputError("--alpha must be between 0 and 1");
  if (s.timeout_s <= 0) throw InputError("--timeout must be positive");
  for (const auto* side : {&s.a, &s.b})
    if (!side->program.empty() && access(side->program.c_str(), X_OK) != 0)
      throw InputError("--" + std::string(side == &s.a ? "a" : "b") + "-bin " + side->program + " is not an executable");
  std::vector<std::pair<Point, Point>> pairs;
  for (const auto& model : s.models)
    for (Pass pass : s.passes)
      for (auto n : s.seq_lens)
        pairs.emplace_back(resolve_point(side_point(s, s.a, model, n, pass)),
                           resolve_point(side_point(s, s.b, model, n, pass)));
  if (pairs.empty()) throw InputError("no points to compare");

  AbReport report;
  const int threads = s.base.problem.threads;
  report.context = capture_context(threads);
  report.context["command_line"] = command_line;
  report.context["seed"] = s.base.seed;
  auto side_json = [](const AbSide& side) {
    return nlohmann::json{{"label", side.label}, {"program", side.program.empty() ? "self" : side.program},
                          {"model", side.model}, {"params", side.params}};
  };
  report.settings = point_settings(s.base);  // every point field, as a sweep records them
  report.settings.update({{"models", s.models},   {"seq_lens", s.seq_lens},         {"rounds", s.rounds},
                          {"alpha", s.alpha},     {"max_slowdown", s.max_slowdown}, {"a", side_json(s.a)},
                          {"b", side_json(s.b)},  {"params", s.params}});
  report.settings["pass"] = pass_list_name(s.passes);
  std::size_t index = 0;
  for (const auto& [a_point, b_point] : pairs) {
    ++index;
    const ResultRow a_row = describe_point(a_point), b_row = describe_point(b_point);
    if (s.progress)
      std::fprintf(stderr, "[%zu/%zu] %s N=%lld: %d rounds\n", index, pairs.size(), a_point.config.model.c_str(),
                   static_cast<long long>(a_point.config.problem.seq_len), s.rounds);
    AbPoint point;
    // A round in which either row is contended is run again (the order keeps alternating), until
    // `rounds` rounds are clean or 2·rounds have been run.
    std::size_t clean_rounds = 0;
    for (int r = 0; r < 2 * s.rounds && clean_rounds < static_cast<std::size_t>(s.rounds); ++r) {
      AbRound round;
      round.b_first = r % 2 == 1;
      const auto run_side = [&](bool b) {
        return b ? run_point_in_child(b_point, b_row, s.timeout_s, s.b.program)
                 : run_point_in_child(a_point, a_row, s.timeout_s, s.a.program);
      };
      ResultRow first = run_side(round.b_first);
      ResultRow second = run_side(!round.b_first);
      point.a = round.b_first ? second : first;
      point.b = round.b_first ? first : second;
      for (const auto* row : {&point.a, &point.b})
        if (row->status != Status::Ok && point.verdict != AbVerdict::Error) {
          point.verdict = AbVerdict::Error;
          point.reason = std::string(row == &point.a ? "A" : "B") + ": " + status_name(row->status) + ": " + row->reason;
        }
      round.a_ns = point.a.median_ns;
      round.b_ns = point.b.median_ns;
      round.a_contended = too_few_clean(point.a, s.base.timing.min_reps);
      round.b_contended = too_few_clean(point.b, s.base.timing.min_reps);
      clean_rounds += !round.a_contended && !round.b_contended;
      point.rounds.push_back(round);
      if (point.verdict == AbVerdict::Error) break;
    }
    judge_ab_point(point, s);
    report.points.push_back(std::move(point));
  }
  return report;
}

nlohmann::json ab_to_json(const AbReport& report) {
  nlohmann::json points = nlohmann::json::array();
  for (const auto& p : report.points) {
    nlohmann::json rounds = nlohmann::json::array();
    for (const auto& r : p.rounds)
      rounds.push_back({{"order", r.b_first ? "BA" : "AB"}, {"a_median_ns", r.a_ns}, {"b_median_ns", r.b_ns},
                        {"a_contended", r.a_contended}, {"b_contended", r.b_contended}});
    points.push_back({{"model_a", p.a.model},
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
  return {{"schema_version", 1}, {"tool", "xfbench ab"}, {"context", report.context}, {"settings", report.settings},
          {"points", points}, {"regressions", ab_regressions(report)}};
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
  return "left out " + std::to_string(omitted.noisy + omitted.error) + " A/B point(s): " +
         std::to_string(omitted.noisy) + " noisy, " + std::to_string(omitted.error) +
         " error; they have no trustworthy time";
}

std::string render_ab(const AbReport& report, AbFormat format_kind) {
  switch (format_kind) {
    case AbFormat::Json: return ab_to_json(report).dump(2) + "\n";
    case AbFormat::GithubBenchmark: return github_benchmark_json(ab_dashboard_entries(report));
    case AbFormat::Bencher: return bencher_bmf_json(ab_dashboard_entries(report));
    case AbFormat::Text:
    case AbFormat::Markdown: break;
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
    cells.push_back({point_label(p), format("%.3f", median_of(a) * 1e-6), format("%.3f", median_of(b) * 1e-6),
                     p.stats.rounds ? format("%.3f×", p.stats.ratio) : "-",
                     interval ? format("%.3f", p.stats.ci_low) + "–" + format("%.3f", p.stats.ci_high) : "-",
                     p.stats.rounds ? format("%.2g", p.stats.p_value) : "-",
                     std::to_string(p.usable_rounds) + "/" + std::to_string(p.rounds.size()),
                     ab_verdict_name(p.verdict), p.reason});
  }
  std::ostringstream out;
  const std::size_t regressions = ab_regressions(report);
  if (md) out << "**xfbench ab**: " << (regressions ? "❌ " : "✅ ") << regressions << " regression(s)\n\n";
  out << render_cells(cells, md ? TableFormat::Markdown : TableFormat::Text, 1);
  out << (md ? "\n" : "") << report.points.size() << " point(s): " << counts[0] << " faster, " << counts[1]
      << " slower, " << counts[2] << " same, " << counts[3] << " noisy, " << counts[4] << " error; "
      << regressions << " regression(s)\n";
  return out.str();
}

}  // namespace xfb
