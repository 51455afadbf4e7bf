#include "apps/bench/ab.hpp"

#include <cmath>
#include <cstdio>
#include <sstream>

#include <unistd.h>

#include "apps/bench/sweep.hpp"
#include "apps/bench/system_info.hpp"
#include "apps/report/point_fields.hpp"
#include "apps/report/table.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/stats.hpp"

namespace xfb {

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
  if (!side.dtype.empty()) point.problem.dtype = parse_dtype(side.dtype);
  return point;
}

// "99%", "99.9%": a confidence level as a percentage of 3 significant digits.
std::string percent_text(double level) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3g%%", 100 * level);
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
                   " rounds" + (interval ? "" : "; too few for a " + percent_text(1 - s.alpha) + " interval");
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
      throw InputError("--" + std::string(side == &s.a ? "a" : "b") + "-bin " + side->program +
                       " is not an executable");
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
    return nlohmann::json{{"label", side.label},
                          {"program", side.program.empty() ? "self" : side.program},
                          {"model", side.model},
                          {"params", side.params},
                          {"dtype", side.dtype}};
  };
  report.settings = point_settings(s.base);  // every point field, as a sweep records them
  report.settings.update({{"models", s.models},
                          {"seq_lens", s.seq_lens},
                          {"rounds", s.rounds},
                          {"alpha", s.alpha},
                          {"max_slowdown", s.max_slowdown},
                          {"a", side_json(s.a)},
                          {"b", side_json(s.b)},
                          {"params", s.params}});
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
          point.reason =
              std::string(row == &point.a ? "A" : "B") + ": " + status_name(row->status) + ": " + row->reason;
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

}  // namespace xfb
