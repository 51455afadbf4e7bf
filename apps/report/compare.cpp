#include "apps/report/compare.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "apps/report/json_fields.hpp"
#include "apps/report/table.hpp"
#include "lib/core/decimal.hpp"
#include "lib/core/errors.hpp"

namespace xfb {

void parse_metrics(const std::string& text, CompareOptions& options) {
  options.gate_time = options.gate_memory = options.gate_flops = false;
  std::stringstream in(text);
  std::string metric;
  bool any = false;
  while (std::getline(in, metric, ',')) {
    if (metric == "time")
      options.gate_time = true;
    else if (metric == "memory")
      options.gate_memory = true;
    else if (metric == "flops")
      options.gate_flops = true;
    else
      throw InputError("--metrics: unknown metric '" + metric + "' (time, memory, flops)");
    any = true;
  }
  if (!any) throw InputError("--metrics is empty (time, memory, flops)");
}

double parse_fraction(const std::string& text, const std::string& option) {
  const bool percent = !text.empty() && text.back() == '%';
  const std::string number = percent ? text.substr(0, text.size() - 1) : text;
  const auto parsed = parse_decimal(number);
  if (!parsed) throw InputError(option + ": '" + text + "' is not a decimal number or percentage (e.g. 5% or 0.05)");
  const double value = *parsed;
  if (value < 0) throw InputError(option + ": " + text + " must not be negative");
  // A bare 5 could mean 5% or 500%: only a percentage or a fraction up to 1 is unambiguous.
  if (!percent && value > 1)
    throw InputError(option + ": '" + text + "' is ambiguous; write " + text +
                     "% for a percentage or a fraction such as " +
                     "0.05 (at most 1; above 100% write a percentage, e.g. 150%)");
  return percent ? value / 100 : value;
}

std::string verdict_name(Verdict v) {
  switch (v) {
    case Verdict::Faster:
      return "faster";
    case Verdict::Slower:
      return "slower";
    case Verdict::Same:
      return "same";
    case Verdict::Noisy:
      return "noisy";
    case Verdict::New:
      return "new";
    case Verdict::Missing:
      return "missing";
    case Verdict::Error:
      return "error";
  }
  return "?";
}

std::vector<std::string> context_differences(const nlohmann::json& a, const nlohmann::json& b,
                                             const std::vector<std::string>& fields) {
  std::vector<std::string> differences;
  auto text = [](const nlohmann::json& context, const std::string& field) {
    if (!context.contains(field)) return std::string("missing");
    const auto& value = context[field];
    if (!value.is_string()) return describe_json(value);  // one line: dump() escapes newlines
    const std::string literal = quoted(value.get<std::string>());
    return "'" + literal.substr(1, literal.size() - 2) + "'";
  };
  for (const auto& field : fields) {
    const bool in_a = a.contains(field), in_b = b.contains(field);
    if (in_a != in_b || (in_a && a[field] != b[field]))
      differences.push_back(field + " (" + text(a, field) + " vs " + text(b, field) + ")");
  }
  return differences;
}

std::vector<std::string> required_context_fields(const CompareOptions& options) {
  std::vector<std::string> fields;
  auto add = [&](const std::vector<std::string>& more) {
    for (const auto& field : more)
      if (std::find(fields.begin(), fields.end(), field) == fields.end()) fields.push_back(field);
  };
  if (options.gate_time) add(kTimeContextFields);
  if (options.gate_memory) add(kMemoryContextFields);
  return fields;
}

namespace {

double growth(std::int64_t delta, std::int64_t base) {
  if (base > 0) return static_cast<double>(delta) / static_cast<double>(base);
  return delta > 0 ? INFINITY : 0.0;
}

void judge(PointComparison& point, const CompareOptions& o, bool scratchpad_compared) {
  const bool base_ok = point.base && point.base->status == Status::Ok;
  const bool now_ok = point.now && point.now->status == Status::Ok;
  if (point.now && point.now->status == Status::Error) {
    point.verdict = Verdict::Error;
    point.error_regression = base_ok;
    return;
  }
  if (!point.now) {
    point.verdict = Verdict::Missing;
    point.missing_regression = o.fail_on_missing && base_ok;
    return;
  }
  if (!base_ok) {
    point.verdict = now_ok ? Verdict::New : Verdict::Same;
    return;
  }
  if (!now_ok) {
    point.verdict = Verdict::Missing;
    point.missing_regression = o.fail_on_missing;
    return;
  }
  const ResultRow &base = *point.base, &now = *point.now;
  point.time_ratio = finite_ratio(now.median_ns, base.median_ns).value_or(0);
  point.test = mann_whitney_u(now.samples_ns, base.samples_ns);
  const bool significant = point.test.p_value < o.alpha;
  point.verdict = base.contended || now.contended                   ? Verdict::Noisy
                  : !significant || now.median_ns == base.median_ns ? Verdict::Same
                  : now.median_ns > base.median_ns                  ? Verdict::Slower
                                                                    : Verdict::Faster;
  point.memory_delta = now.peak_tensor_bytes - base.peak_tensor_bytes;
  point.owned_known = base.peak_owned_bytes >= 0 && now.peak_owned_bytes >= 0;
  if (point.owned_known) point.owned_delta = now.peak_owned_bytes - base.peak_owned_bytes;
  point.flops_delta = now.flops - base.flops;
  // Multiplied, not divided: a ratio too large for a double still counts as slower.
  point.time_regression =
      o.gate_time && point.verdict == Verdict::Slower && now.median_ns > base.median_ns * (1 + o.max_slowdown);
  // Reports without owned bytes (older schema) fall back to the total, as before.
  const bool owned_grew = point.owned_known && growth(point.owned_delta, base.peak_owned_bytes) > o.max_memory_growth;
  const bool total_grew = (scratchpad_compared || !point.owned_known) &&
                          growth(point.memory_delta, base.peak_tensor_bytes) > o.max_memory_growth;
  point.memory_regression = o.gate_memory && (owned_grew || total_grew);
  point.flops_regression = o.gate_flops && point.flops_delta != 0;
}

}  // namespace

Comparison compare_reports(const Report& base, const Report& now, const CompareOptions& options) {
  auto joined = [](const std::vector<std::string>& items) {
    std::string list;
    for (const auto& item : items) list += (list.empty() ? "" : ", ") + item;
    return list;
  };
  const auto differences = context_differences(base.context, now.context, required_context_fields(options));
  if (!differences.empty() && !options.allow_different_context)
    throw InputError("reports were measured in different contexts: " + joined(differences) +
                     "; pass --allow-different-context to compare them anyway");
  Comparison result;
  const auto scratchpad_differences = context_differences(base.context, now.context, kScratchpadContextFields);
  result.scratchpad_compared = scratchpad_differences.empty();
  if (!result.scratchpad_compared)
    result.notes.push_back("oneDNN scratchpad not compared (" + joined(scratchpad_differences) +
                           "): memory is gated on peak_owned_bytes, the project's own tensors");
  if (!options.gate_time) {
    const auto time_differences = context_differences(base.context, now.context, kTimeContextFields);
    if (!time_differences.empty())
      result.notes.push_back("times are not gated and come from different contexts (" + joined(time_differences) + ")");
  }
  std::map<std::string, std::size_t> index;
  for (const auto& row : base.results) {
    if (index.count(row.key())) throw InputError("BASE report holds the point " + row.key() + " twice");
    index[row.key()] = result.points.size();
    PointComparison point;
    point.key = row.key();
    point.base = row;
    result.points.push_back(std::move(point));
  }
  std::set<std::string> seen;
  for (const auto& row : now.results) {
    if (!seen.insert(row.key()).second) throw InputError("NEW report holds the point " + row.key() + " twice");
    auto found = index.find(row.key());
    if (found != index.end()) {
      result.points[found->second].now = row;
    } else {
      PointComparison point;
      point.key = row.key();
      point.now = row;
      result.points.push_back(std::move(point));
    }
  }
  std::vector<double> time_ratios, memory_ratios;
  for (auto& point : result.points) {
    judge(point, options, result.scratchpad_compared);
    if (point.base && point.now && point.base->status == Status::Ok && point.now->status == Status::Ok) {
      ++result.both_ok;
      if (point.time_ratio > 0) time_ratios.push_back(point.time_ratio);
      if (point.now->peak_tensor_bytes > 0)
        if (const auto ratio = finite_ratio(static_cast<double>(point.now->peak_tensor_bytes),
                                            static_cast<double>(point.base->peak_tensor_bytes)))
          memory_ratios.push_back(*ratio);
      if (point.flops_delta != 0) ++result.flops_changes;
    }
    result.time_regressions += point.time_regression;
    result.memory_regressions += point.memory_regression;
    result.flops_regressions += point.flops_regression;
    result.error_regressions += point.error_regression;
    result.missing_regressions += point.missing_regression;
    result.regressions += point.regression();
  }
  result.compared_nothing = result.both_ok == 0;
  if (!time_ratios.empty()) result.time_geomean = geometric_mean(time_ratios);
  if (!memory_ratios.empty()) result.memory_geomean = geometric_mean(memory_ratios);
  return result;
}

namespace {

std::string signed_count(std::int64_t delta, double base, const char* unit) {
  if (delta == 0) return "0";
  const double magnitude = std::fabs(static_cast<double>(delta));
  std::string amount;
  if (std::string(unit) == "B")
    amount = magnitude < 1024      ? format_number("%.0f B", magnitude)
             : magnitude < 1048576 ? format_number("%.1f KiB", magnitude / 1024)
                                   : format_number("%.1f MiB", magnitude / 1048576);
  else
    amount = magnitude < 1e6 ? format_number("%.0f FLOP", magnitude) : format_number("%.3g MFLOP", magnitude / 1e6);
  return (delta > 0 ? "+" : "−") + amount +
         (base > 0 ? format_number(" (%+.2f%%)", 100.0 * static_cast<double>(delta) / base) : "");
}

// Δ of peak_tensor_bytes where the scratchpad is comparable, else Δ of the owned bytes, marked.
std::string memory_cell(const PointComparison& p, bool scratchpad_compared) {
  if (scratchpad_compared || !p.owned_known)
    return signed_count(p.memory_delta, static_cast<double>(p.base->peak_tensor_bytes), "B");
  return signed_count(p.owned_delta, static_cast<double>(p.base->peak_owned_bytes), "B") + " owned";
}

std::string median_cell(const std::optional<ResultRow>& row) {
  if (!row) return "-";
  if (row->status != Status::Ok) return status_name(row->status);
  return format_number("%.3f", row->median_ns * 1e-6);
}

std::string regression_cell(const PointComparison& p) {
  std::string text;
  auto add = [&](bool flag, const char* what) {
    if (!flag) return;
    if (!text.empty()) text += ',';
    text += what;
  };
  add(p.time_regression, "time");
  add(p.memory_regression, "memory");
  add(p.flops_regression, "flops");
  add(p.error_regression, "error");
  add(p.missing_regression, "missing");
  return text.empty() ? "" : "REGRESSION: " + text;
}

// Labels carry the configuration only when the reports mix configurations, and the parameters
// only when a model appears with several settings.
std::vector<std::string> point_labels(const Comparison& c) {
  std::set<std::string> configurations;
  std::map<std::string, std::set<std::string>> settings;
  for (const auto& p : c.points) {
    configurations.insert(configuration_text(p.row()));
    settings[p.row().model].insert(p.row().params.dump());
  }
  std::vector<std::string> labels;
  for (const auto& p : c.points) {
    const ResultRow& row = p.row();
    std::string label = row.model;
    if (settings[row.model].size() > 1) label += " (" + params_text(row.params) + ")";
    label += " N=" + std::to_string(row.seq_len);
    if (configurations.size() > 1) label += " [" + configuration_text(row) + "]";
    labels.push_back(label);
  }
  return labels;
}

nlohmann::json point_json(const PointComparison& p) {
  const ResultRow& row = p.row();
  nlohmann::json regressions = nlohmann::json::array();
  if (p.time_regression) regressions.push_back("time");
  if (p.memory_regression) regressions.push_back("memory");
  if (p.flops_regression) regressions.push_back("flops");
  if (p.error_regression) regressions.push_back("error");
  if (p.missing_regression) regressions.push_back("missing");
  nlohmann::json j = {{"model", row.model},
                      {"scope", scope_name(row.scope)},
                      {"pass", pass_name(row.pass)},
                      {"causal", row.causal},
                      {"dtype", dtype_name(row.dtype)},
                      {"batch", row.batch},
                      {"heads", row.heads},
                      {"seq_len", row.seq_len},
                      {"head_dim", row.head_dim},
                      {"d_ff", row.d_ff},
                      {"params", row.params},
                      {"verdict", verdict_name(p.verdict)},
                      {"regressions", regressions},
                      {"base_status", p.base ? nlohmann::json(status_name(p.base->status)) : nlohmann::json(nullptr)},
                      {"new_status", p.now ? nlohmann::json(status_name(p.now->status)) : nlohmann::json(nullptr)}};
  if (p.base && p.now && p.base->status == Status::Ok && p.now->status == Status::Ok) {
    j["base_median_ns"] = p.base->median_ns;
    j["new_median_ns"] = p.now->median_ns;
    j["time_ratio"] = p.time_ratio;
    j["u_statistic"] = p.test.u_a;
    j["p_value"] = p.test.p_value;
    j["test"] = p.test.exact ? "exact" : "normal";
    j["base_peak_tensor_bytes"] = p.base->peak_tensor_bytes;
    j["new_peak_tensor_bytes"] = p.now->peak_tensor_bytes;
    j["memory_delta_bytes"] = p.memory_delta;
    if (p.owned_known) {
      j["base_peak_owned_bytes"] = p.base->peak_owned_bytes;
      j["new_peak_owned_bytes"] = p.now->peak_owned_bytes;
      j["owned_delta_bytes"] = p.owned_delta;
    }
    j["base_contended"] = p.base->contended;
    j["new_contended"] = p.now->contended;
    j["base_flops"] = p.base->flops;
    j["new_flops"] = p.now->flops;
    j["flops_delta"] = p.flops_delta;
  }
  if (p.now && !p.now->reason.empty()) j["new_reason"] = p.now->reason;
  return j;
}

}  // namespace

std::string comparison_summary(const Comparison& c) {
  std::ostringstream out;
  if (c.both_ok > 0 && c.time_geomean > 0)
    out << "geometric mean over " << c.both_ok << " point(s) measured in both: time "
        << format_number("%.3f×", c.time_geomean) << " (new/base, "
        << format_number("%+.1f%%", 100 * (c.time_geomean - 1)) << "), peak memory "
        << format_number("%.3f×", c.memory_geomean) << "; ";
  else
    out << "no point was measured (ok) in both reports: nothing compared; ";
  out << c.regressions << " regression(s)";
  if (c.regressions > 0)
    out << " (time " << c.time_regressions << ", memory " << c.memory_regressions << ", flops " << c.flops_regressions
        << ", ok→error " << c.error_regressions << ", missing " << c.missing_regressions << ")";
  if (c.flops_changes > 0) out << "; executed FLOPs changed at " << c.flops_changes << " point(s)";
  return out.str();
}

std::string render_comparison(const Comparison& c, const CompareOptions& o, CompareFormat format_kind) {
  if (format_kind == CompareFormat::Json) {
    std::map<std::string, std::size_t> verdicts;
    nlohmann::json points = nlohmann::json::array();
    for (const auto& p : c.points) {
      ++verdicts[verdict_name(p.verdict)];
      points.push_back(point_json(p));
    }
    std::vector<std::string> gates;
    if (o.gate_time) gates.push_back("time");
    if (o.gate_memory) gates.push_back("memory");
    if (o.gate_flops) gates.push_back("flops");
    nlohmann::json summary = {{"points", c.points.size()},
                              {"measured_in_both", c.both_ok},
                              {"time_geomean", c.time_geomean},
                              {"memory_geomean", c.memory_geomean},
                              {"regressions", c.regressions},
                              {"time_regressions", c.time_regressions},
                              {"memory_regressions", c.memory_regressions},
                              {"flops_regressions", c.flops_regressions},
                              {"error_regressions", c.error_regressions},
                              {"missing_regressions", c.missing_regressions},
                              {"flops_changes", c.flops_changes},
                              {"compared_nothing", c.compared_nothing},
                              {"verdicts", verdicts},
                              {"scratchpad_compared", c.scratchpad_compared},
                              {"notes", c.notes},
                              {"text", comparison_summary(c)}};
    nlohmann::json options = {{"alpha", o.alpha},
                              {"max_slowdown", o.max_slowdown},
                              {"max_memory_growth", o.max_memory_growth},
                              {"metrics", gates},
                              {"allow_different_context", o.allow_different_context}};
    return nlohmann::json{{"summary", summary}, {"options", options}, {"points", points}}.dump(2) + "\n";
  }
  const bool md = format_kind == CompareFormat::Markdown;
  std::vector<std::vector<std::string>> cells = {
      {"point", "base ms", "new ms", "new/base", "p", "verdict", "Δ peak memory", "Δ flops", "gate"}};
  const auto labels = point_labels(c);
  for (std::size_t i = 0; i < c.points.size(); ++i) {
    const auto& p = c.points[i];
    const bool measured = p.base && p.now && p.base->status == Status::Ok && p.now->status == Status::Ok;
    cells.push_back({labels[i], median_cell(p.base), median_cell(p.now),
                     p.time_ratio > 0 ? format_number("%.3f×", p.time_ratio) : "-",
                     measured ? format_number("%.2g", p.test.p_value) : "-", verdict_name(p.verdict),
                     measured ? memory_cell(p, c.scratchpad_compared) : "-",
                     measured ? signed_count(p.flops_delta, static_cast<double>(p.base->flops), "FLOP") : "-",
                     regression_cell(p)});
  }
  std::ostringstream out;
  if (md)
    out << "**xfbench compare**: " << (c.regressions || c.compared_nothing ? "❌ " : "✅ ") << c.regressions
        << " regression(s)" << (c.compared_nothing ? ", nothing compared" : "") << "\n\n";
  out << render_cells(cells, md ? TableFormat::Markdown : TableFormat::Text, 1);
  out << (md ? "\n" : "") << comparison_summary(c) << "\n";
  for (const auto& note : c.notes) out << (md ? "\n" : "") << "note: " << note << "\n";
  return out.str();
}

}  // namespace xfb
