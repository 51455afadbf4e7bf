#include "apps/report/crossover.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>

namespace xfb {

std::string crossover_kind_name(CrossoverKind kind) {
  switch (kind) {
    case CrossoverKind::None:
      return "none";
    case CrossoverKind::Interpolated:
      return "interpolated";
    case CrossoverKind::Below:
      return "below";
    case CrossoverKind::AfterGap:
      return "after_gap";
    case CrossoverKind::Never:
      return "never";
  }
  return "?";
}

namespace {

bool compared(const CrossoverPoint& p) { return p.model && p.reference; }
bool faster(const CrossoverPoint& p) { return compared(p) && *p.model < *p.reference; }

// Where log(model/reference), linear in log N between the two lengths, is zero: `low` has a
// ratio ≥ 1, `high` one < 1.
std::int64_t interpolate(const CrossoverPoint& low, const CrossoverPoint& high) {
  const double at_low = std::log(*low.model / *low.reference);
  const double at_high = std::log(*high.model / *high.reference);
  const double log_low = std::log(static_cast<double>(low.n));
  const double log_high = std::log(static_cast<double>(high.n));
  const double log_n = log_low + (log_high - log_low) * at_low / (at_low - at_high);
  return std::clamp<std::int64_t>(std::llround(std::exp(log_n)), low.n, high.n);
}

}  // namespace

Crossover find_crossover(const std::vector<CrossoverPoint>& points) {
  Crossover result;
  auto top = std::find_if(points.rbegin(), points.rend(), compared);
  if (top == points.rend()) return result;
  result.compared_to = top->n;
  result.partial = top != points.rbegin();
  result.contended = top->contended;
  if (!faster(*top)) {
    result.kind = CrossoverKind::Never;
    return result;
  }
  auto first = top;  // the smallest length of the chain of faster lengths
  while (std::next(first) != points.rend() && faster(*std::next(first))) {
    ++first;
    result.contended = result.contended || first->contended;
  }
  result.n = first->n;
  const auto below = std::next(first);
  if (below == points.rend()) {
    result.kind = CrossoverKind::Below;
  } else if (!compared(*below)) {
    result.kind = CrossoverKind::AfterGap;
    result.low = below->n;
    result.high = first->n;
  } else {
    result.kind = CrossoverKind::Interpolated;
    result.low = below->n;
    result.high = first->n;
    result.n = interpolate(*below, *first);
    result.contended = result.contended || below->contended;
  }
  return result;
}

namespace {

Crossover crossover_by(const RowsByLength& model, const RowsByLength& reference,
                       const std::function<double(const ResultRow&)>& figure, bool timed) {
  std::map<std::int64_t, CrossoverPoint> by_length;
  for (const auto* side : {&model, &reference})
    for (const auto& [n, row] : *side) by_length[n].n = n;
  auto value = [&](const RowsByLength& rows, std::int64_t n) -> std::optional<double> {
    const auto found = rows.find(n);
    if (found == rows.end() || found->second->status != Status::Ok) return std::nullopt;
    const double v = figure(*found->second);
    return std::isfinite(v) && v > 0 ? std::optional<double>(v) : std::nullopt;
  };
  std::vector<CrossoverPoint> points;
  for (auto& [n, point] : by_length) {
    point.model = value(model, n);
    point.reference = value(reference, n);
    if (point.model && point.reference)
      point.contended = timed && (model.at(n)->contended || reference.at(n)->contended);
    else
      point.model = point.reference = std::nullopt;
    points.push_back(point);
  }
  return find_crossover(points);
}

}  // namespace

Crossover time_crossover(const RowsByLength& model, const RowsByLength& reference) {
  return crossover_by(
      model, reference, [](const ResultRow& r) { return r.median_ns; }, true);
}

Crossover memory_crossover(const RowsByLength& model, const RowsByLength& reference) {
  return crossover_by(
      model, reference, [](const ResultRow& r) { return static_cast<double>(r.peak_tensor_bytes); }, false);
}

std::optional<Crossovers> crossovers(const RowsByLength& model, const RowsByLength& reference) {
  if (reference.empty() || model == reference) return std::nullopt;
  return Crossovers{time_crossover(model, reference), memory_crossover(model, reference)};
}

std::string crossover_text(const Crossover& c) {
  std::string text;
  switch (c.kind) {
    case CrossoverKind::None:
      return "-";
    case CrossoverKind::Interpolated:
      text = std::to_string(c.n);
      break;
    case CrossoverKind::Below:
      text = "≤ " + std::to_string(c.n);
      break;
    case CrossoverKind::AfterGap:
      text = "≤ " + std::to_string(c.n) + " (" + std::to_string(c.low) + " not compared)";
      break;
    case CrossoverKind::Never:
      text = "never";
      break;
  }
  return text + (c.partial ? " (to " + std::to_string(c.compared_to) + ")" : "") + (c.contended ? "!" : "");
}

nlohmann::json crossover_json(const Crossover& c) {
  auto length = [](std::int64_t n) { return n > 0 ? nlohmann::json(n) : nlohmann::json(nullptr); };
  const bool bracketed = c.kind == CrossoverKind::Interpolated || c.kind == CrossoverKind::AfterGap;
  return {{"kind", crossover_kind_name(c.kind)},
          {"seq_len", length(c.n)},
          {"between", bracketed ? nlohmann::json::array({c.low, c.high}) : nlohmann::json(nullptr)},
          {"compared_to", length(c.compared_to)},
          {"partial", c.partial},
          {"contended", c.contended}};
}

std::vector<std::size_t> pareto_front(const std::vector<std::pair<double, double>>& points) {
  std::vector<std::size_t> order(points.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return points[a] < points[b]; });
  // By time, then memory: a point is dominated by a faster one at most as large, or by an
  // equally fast, smaller one (the first of its time).
  std::vector<bool> on_front(points.size(), false);
  double smallest_faster = std::numeric_limits<double>::infinity();  // least memory of strictly faster points
  for (std::size_t i = 0; i < order.size();) {
    std::size_t end = i;
    while (end < order.size() && points[order[end]].first == points[order[i]].first) ++end;
    const double least = points[order[i]].second;
    for (std::size_t j = i; j < end && points[order[j]].second == least; ++j)
      on_front[order[j]] = least < smallest_faster;
    smallest_faster = std::min(smallest_faster, least);
    i = end;
  }
  std::vector<std::size_t> front;
  for (std::size_t i = 0; i < points.size(); ++i)
    if (on_front[i]) front.push_back(i);
  return front;
}

namespace {

std::string json_cell(const nlohmann::json& value) {
  if (value.is_null()) return "";
  if (value.is_string()) return value.get<std::string>();
  if (value.is_array()) return value.empty() ? "" : value.front().dump() + "-" + value.back().dump();
  return value.dump();
}

}  // namespace

std::vector<std::vector<std::string>> crossover_cells(const TableGroup& group, TableFormat format) {
  const bool csv = format == TableFormat::Csv;
  std::vector<std::string> header = {"class", "model"};
  const std::vector<std::string> fields = {"kind", "seq_len", "between", "compared_to", "partial", "contended"};
  for (const std::string metric : {"time", "memory"}) {
    if (!csv) {
      header.push_back(metric);
      continue;
    }
    for (const auto& field : fields) header.push_back(metric + "_" + field);
  }
  std::vector<std::vector<std::string>> cells = {header};
  for (const auto& label : group.labels) {
    std::vector<std::string> line = {first_class(group.label_model.at(label)), label};
    const auto found = crossovers(group.grid.at(label), group.baseline);
    const bool reference = !found && !group.baseline.empty();  // the baseline's own row
    const Crossovers shown = found.value_or(Crossovers{});
    for (const Crossover& c : {shown.time, shown.memory}) {
      if (!csv) {
        line.push_back(reference ? "baseline" : crossover_text(c));
        continue;
      }
      const nlohmann::json json = crossover_json(c);
      for (const auto& field : fields)
        line.push_back(reference ? (field == "kind" ? "baseline" : "") : json_cell(json[field]));
    }
    cells.push_back(line);
  }
  return cells;
}

std::vector<std::vector<std::string>> front_cells(const TableGroup& group, TableFormat format) {
  const bool csv = format == TableFormat::Csv;
  const bool decode = group.key.pass == "decode";
  std::vector<std::vector<std::string>> cells = {{csv ? "seq_len" : "N", "class", "model",
                                                  csv      ? "median_ns"
                                                  : decode ? "time (µs/token)"
                                                           : "time (ms)",
                                                  csv ? "peak_tensor_bytes" : "memory (MiB)"}};
  for (const std::int64_t n : group.lengths) {
    std::vector<std::pair<const std::string*, const ResultRow*>> candidates;
    std::vector<std::pair<double, double>> points;
    for (const auto& label : group.labels) {
      const auto& rows = group.grid.at(label);
      const auto found = rows.find(n);
      if (found == rows.end() || found->second->status != Status::Ok) continue;
      candidates.emplace_back(&label, found->second);
      points.emplace_back(found->second->median_ns, static_cast<double>(found->second->peak_tensor_bytes));
    }
    std::vector<std::size_t> front = pareto_front(points);
    std::stable_sort(front.begin(), front.end(), [&](std::size_t a, std::size_t b) { return points[a] < points[b]; });
    for (std::size_t k = 0; k < front.size(); ++k) {
      const auto& [label, row] = candidates[front[k]];
      cells.push_back({csv || k == 0 ? std::to_string(n) : "", first_class(group.label_model.at(*label)), *label,
                       csv ? nlohmann::json(row->median_ns).dump() : time_cell(*row),
                       csv ? std::to_string(row->peak_tensor_bytes) : memory_cell(*row)});
    }
  }
  return cells;
}

std::string crossover_note() {
  return "N interpolated on the log-log lines between the bracketing lengths; ≤ N: faster (or smaller) at every "
         "compared length from N on, not extrapolated below; (M not compared): a length where either row is not ok "
         "ends the chain; (to N): larger lengths are not compared; never: slower at the largest compared length; "
         "! a contended point (docs/cli.md#crossover)";
}

std::string front_note() {
  return "per N, the models no other ok row beats in both time and memory (at most as slow and as large, strictly "
         "better in one), fastest first; rows that are not ok are left out; ! a contended point";
}

}  // namespace xfb
