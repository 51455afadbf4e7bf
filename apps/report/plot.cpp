#include "apps/report/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "apps/report/svg.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/stats.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {
namespace {

using svg::escape;
using svg::num;

constexpr double kMinWidth = 980, kPlotLeft = 80, kPlotWidth = 560, kPlotTop = 66, kPlotHeight = 400;
constexpr double kLegendLeft = kPlotLeft + kPlotWidth + 30, kLegendLine = 17;
// Rough advance of one character of the legend's 12 px text and the notes' 11 px text.
constexpr double kLegendChar = 7, kNoteChar = 6.2;
// Characters of one line of the coincidence notes under the chart.
constexpr std::size_t kNoteColumns = 92;
// Values the log axes draw; outside, a point is absent ("out of range"), so the axes span at
// most 60 decades and every coordinate is finite.
constexpr double kMinValue = 1e-30, kMaxValue = 1e30;
// Ticks per axis at most: every tick loop is bounded whatever the data.
constexpr int kMaxTickSteps = 200;

struct Point {
  std::int64_t n;
  bool drawn;  // false: the row exists but has no value (not ok, no baseline)
  double value;
  double low = 0, high = 0;  // the spread over the row's clean samples; 0, 0 when there is none
  std::string why;           // status when not drawn
  bool spread() const { return high > 0; }
};

struct Series {
  std::string model, label, cls;
  int rank = 0;
  std::size_t colour = 0;     // palette index, over the document
  std::vector<Point> points;  // by N
};

struct Panel {
  std::string configuration, title;  // title: the configuration, its pass named even when forward
  std::set<int> threads;
  std::vector<Series> series;
};

// A decode panel's rows time one generated token (plotted in µs) against the context length.
bool decode_panel(const std::string& configuration) { return configuration.find(", decode pass") != std::string::npos; }

std::string metric_title(const PlotOptions& o, bool decode) {
  switch (o.metric) {
    case PlotMetric::Time:
      return decode ? "median time per generated token (µs, log scale)" : "median time per timed call (ms, log scale)";
    case PlotMetric::Memory:
      return "peak tracked memory (MiB, log scale)";
    case PlotMetric::Speedup:
      return "speed-up over " + o.baseline + " (×, log scale; higher is faster)";
    case PlotMetric::State:
      return "decode state kept between steps (MiB, log scale)";
    case PlotMetric::Gflops:
      return "executed GFLOP/s (log scale; higher is faster)";
  }
  return "";
}

std::string chart_title(const PlotOptions& o) {
  switch (o.metric) {
    case PlotMetric::Time:
      return "Median time";
    case PlotMetric::Memory:
      return "Peak tracked memory";
    case PlotMetric::Speedup:
      return "Speed-up over " + o.baseline;
    case PlotMetric::State:
      return "Decode state";
    case PlotMetric::Gflops:
      return "Executed GFLOP/s";
  }
  return "";
}

// configuration_text with the pass said when it is the forward one too.
std::string panel_title(const ResultRow& row) {
  const std::string text = configuration_text(row), scope = scope_name(row.scope);
  if (row.pass != Pass::Forward || text.rfind(scope, 0) != 0) return text;
  return scope + ", forward pass" + text.substr(scope.size());
}

// "CPU: AMD EPYC · threads: 2 · dtype: f32 · commit 1ae2d46fb680": the report's context, the
// panel's thread counts (the context's when no row has one), its dtype (f32 unless the settings or
// context name one) and the commit's first 12 hexadecimal digits with any suffix ("-dirty") kept.
std::string subtitle(const Report& report, const std::set<int>& threads) {
  const auto text_of = [](const nlohmann::json& object, const char* field) {
    const auto found = object.find(field);
    return found != object.end() && found->is_string() ? found->get<std::string>() : std::string();
  };
  std::string cpu = text_of(report.context, "cpu_model"), commit = text_of(report.context, "git_commit");
  std::string dtype = text_of(report.settings, "dtype");
  if (dtype.empty()) dtype = text_of(report.context, "dtype");
  const std::size_t hash = commit.find('-');
  if (std::min(hash, commit.size()) > 12)
    commit = commit.substr(0, 12) + (hash == std::string::npos ? "" : commit.substr(hash));
  std::string thread_list;
  for (int t : threads) thread_list += (thread_list.empty() ? "" : ", ") + std::to_string(t);
  if (thread_list.empty() && report.context.contains("threads") && report.context["threads"].is_number_integer())
    thread_list = std::to_string(report.context["threads"].get<int>());
  return "CPU: " + (cpu.empty() ? "unknown" : cpu) + " · threads: " + (thread_list.empty() ? "unknown" : thread_list) +
         " · dtype: " + (dtype.empty() ? "f32" : dtype) + " · commit " + (commit.empty() ? "unknown" : commit);
}

int model_rank(const std::string& name) {
  const auto& models = model_cards();
  for (std::size_t i = 0; i < models.size(); ++i)
    if (models[i].name == name) return static_cast<int>(models[i].classes.front()) * 1000 + static_cast<int>(i);
  return 1 << 20;
}

std::string first_class(const ResultRow& row) { return row.classes.empty() ? "unknown" : row.classes.front(); }

bool in_range(double v) { return v >= kMinValue && v <= kMaxValue; }

// The point of an ok row: its value for the metric and, for time and GFLOP/s, its spread: the
// values of the 90th and 10th percentile of its clean samples (slow and fast) when it has two or more.
Point ok_point(const ResultRow& row, const PlotOptions& o, const ResultRow* baseline) {
  Point point{row.seq_len, false, 0, 0, 0, ""};
  const bool spread = row.samples_ns.size() >= 2;
  const double fast = spread ? sample_quantile(row.samples_ns, 0.1) : 0,
               slow = spread ? sample_quantile(row.samples_ns, 0.9) : 0;
  switch (o.metric) {
    case PlotMetric::Time: {
      const double scale = row.pass == Pass::Decode ? 1e-3 : 1e-6;
      point.value = row.median_ns * scale;
      if (spread) {
        point.low = fast * scale;
        point.high = slow * scale;
      }
      break;
    }
    case PlotMetric::Gflops:  // a sample's GFLOP/s: the median's scaled by median / sample
      point.value = row.gflops_per_s;
      if (spread) {
        point.low = finite_ratio(row.gflops_per_s * row.median_ns, slow).value_or(0);
        point.high = finite_ratio(row.gflops_per_s * row.median_ns, fast).value_or(0);
      }
      break;
    case PlotMetric::State:
      point.value = static_cast<double>(row.state_bytes) / 1048576.0;
      break;
    case PlotMetric::Memory:
      point.value = static_cast<double>(row.peak_tensor_bytes) / 1048576.0;
      break;
    case PlotMetric::Speedup:
      point.value = baseline ? finite_ratio(baseline->median_ns, row.median_ns).value_or(0) : 0;
      point.why = "no " + o.baseline + " point";
      break;
  }
  point.drawn = in_range(point.value);
  if (!point.drawn && point.value > 0) point.why = "out of range";
  if (!point.drawn && point.why.empty()) point.why = "no value";
  // A band that does not hold the value (an inconsistent row) or leaves the axes is not drawn.
  if (!point.drawn || !in_range(point.low) || !in_range(point.high) || point.low > point.value ||
      point.high < point.value)
    point.low = point.high = 0;
  return point;
}

// ", threads=T" and ", seed=S" for the fields the report's rows vary in (a grid): one panel per
// value, as tables have one table per value.
std::function<std::string(const ResultRow&)> grid_suffix(const Report& report) {
  const RowsVary vary = rows_vary(report);
  return [=](const ResultRow& row) {
    return (vary.threads ? ", threads=" + std::to_string(row.threads) : "") +
           (vary.seed ? ", seed=" + std::to_string(row.seed) : "");
  };
}

std::vector<Panel> collect(const Report& report, const PlotOptions& o) {
  std::map<std::string, std::vector<const ResultRow*>> groups;
  std::vector<std::string> order;
  const auto suffix = grid_suffix(report);
  for (const auto& row : report.results) {
    const std::string configuration = configuration_text(row) + suffix(row);
    if (!groups.count(configuration)) order.push_back(configuration);
    groups[configuration].push_back(&row);
  }
  std::vector<Panel> panels;
  for (const auto& configuration : order) {
    const auto& rows = groups[configuration];
    std::map<std::int64_t, const ResultRow*> baseline;
    std::map<std::string, std::set<std::string>> settings;
    Panel panel{configuration, panel_title(*rows.front()) + suffix(*rows.front()), {}, {}};
    for (const auto* row : rows) {
      settings[row->model].insert(row->params.dump());
      if (row->threads > 0) panel.threads.insert(row->threads);
      if (row->model == o.baseline && row->status == Status::Ok && !baseline.count(row->seq_len))
        baseline[row->seq_len] = row;
    }
    std::map<std::string, Series> by_label;
    for (const auto* row : rows) {
      std::string label = row->model;
      if (settings[row->model].size() > 1) label += " (" + params_text(row->params) + ")";
      Series& series = by_label[label];
      series.model = row->model;
      series.label = label;
      series.cls = first_class(*row);
      series.rank = model_rank(row->model);
      const auto found = baseline.find(row->seq_len);
      series.points.push_back(row->status == Status::Ok
                                  ? ok_point(*row, o, found == baseline.end() ? nullptr : found->second)
                                  : Point{row->seq_len, false, 0, 0, 0, status_name(row->status)});
    }
    for (auto& [label, series] : by_label) {
      std::sort(series.points.begin(), series.points.end(), [](const Point& a, const Point& b) { return a.n < b.n; });
      panel.series.push_back(series);
    }
    std::stable_sort(panel.series.begin(), panel.series.end(),
                     [](const Series& a, const Series& b) { return a.rank < b.rank; });
    panels.push_back(std::move(panel));
  }
  return panels;
}

// Gives every label of the document one palette index, in class-then-registry order.
void assign_colours(std::vector<Panel>& panels) {
  std::set<std::pair<int, std::string>> labels;
  for (const auto& panel : panels)
    for (const auto& s : panel.series) labels.insert({s.rank, s.label});
  std::map<std::string, std::size_t> index;
  for (const auto& [rank, label] : labels) index.emplace(label, index.size());
  for (auto& panel : panels)
    for (auto& s : panel.series) s.colour = index[s.label];
}

// The 1-2-5 value at or below (down = true) or at or above v.
double nice_bound(double v, bool down) {
  const double decade = std::pow(10.0, std::floor(std::log10(v)));
  const double steps[] = {1, 2, 5, 10};
  if (down) {
    for (int i = 3; i >= 0; --i)
      if (steps[i] * decade <= v * (1 + 1e-9)) return steps[i] * decade;
    return decade;
  }
  for (double s : steps)
    if (s * decade >= v * (1 - 1e-9)) return s * decade;
  return 10 * decade;
}

std::string length_label(double n) {
  const auto v = static_cast<long long>(std::llround(n));
  if (v >= 1048576 && v % 1048576 == 0) return std::to_string(v / 1048576) + "M";
  if (v >= 1024 && v % 1024 == 0) return std::to_string(v / 1024) + "K";
  return std::to_string(v);
}

std::string value_label(double v) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", v);
  return text;
}

struct Axes {
  double x_lo, x_hi, y_lo, y_hi;  // data bounds (powers of two on x, 1-2-5 values on y)
  double top;                     // panel's plot top in the document
  double x(double n) const { return kPlotLeft + kPlotWidth * std::log2(n / x_lo) / std::log2(x_hi / x_lo); }
  double y(double v) const { return top + kPlotHeight * (1 - std::log10(v / y_lo) / std::log10(y_hi / y_lo)); }
};

Axes axes_for(const Panel& panel, double top) {
  double n_lo = INFINITY, n_hi = 0, v_lo = INFINITY, v_hi = 0;
  for (const auto& s : panel.series)
    for (const auto& p : s.points) {
      n_lo = std::min(n_lo, static_cast<double>(p.n));
      n_hi = std::max(n_hi, static_cast<double>(p.n));
      if (p.drawn) {
        v_lo = std::min(v_lo, p.spread() ? p.low : p.value);
        v_hi = std::max(v_hi, p.spread() ? p.high : p.value);
      }
    }
  Axes a{};
  a.x_lo = std::pow(2.0, std::floor(std::log2(n_lo)));
  a.x_hi = std::pow(2.0, std::ceil(std::log2(n_hi)));
  if (a.x_hi <= a.x_lo) a.x_hi = 2 * a.x_lo;
  a.y_lo = nice_bound(v_lo, true);
  a.y_hi = nice_bound(v_hi, false);
  if (a.y_hi <= a.y_lo) a.y_hi = nice_bound(a.y_lo * 1.5, false);
  a.top = top;
  return a;
}

void draw_axes(std::ostringstream& out, const Axes& a, const PlotOptions& o, bool decode) {
  const double bottom = a.top + kPlotHeight, right = kPlotLeft + kPlotWidth;
  out << "<g class=\"grid\" stroke=\"#e3e3e3\" stroke-width=\"1\">\n";
  std::vector<double> x_ticks;
  double n = a.x_lo;
  for (int i = 0; i < kMaxTickSteps && n <= a.x_hi * (1 + 1e-9); ++i, n *= 2) x_ticks.push_back(n);
  const std::size_t x_step = x_ticks.size() > 10 ? 2 : 1;
  std::vector<double> y_ticks;
  // Decades only above three decades, 1-2-5 down to one, finer below.
  const double decades = std::log10(a.y_hi / a.y_lo);
  const std::vector<double> steps = decades > 3.01   ? std::vector<double>{1}
                                    : decades > 1.01 ? std::vector<double>{1, 2, 5}
                                                     : std::vector<double>{1, 1.5, 2, 3, 5, 7};
  double decade = std::pow(10.0, std::floor(std::log10(a.y_lo)));
  for (int i = 0; i < kMaxTickSteps && decade <= a.y_hi; ++i, decade *= 10)
    for (double step : steps) {
      const double v = step * decade;
      if (v >= a.y_lo * (1 - 1e-9) && v <= a.y_hi * (1 + 1e-9)) y_ticks.push_back(v);
    }
  for (std::size_t i = 0; i < x_ticks.size(); i += x_step)
    out << "<line x1=\"" << num(a.x(x_ticks[i])) << "\" y1=\"" << num(a.top) << "\" x2=\"" << num(a.x(x_ticks[i]))
        << "\" y2=\"" << num(bottom) << "\"/>\n";
  for (double v : y_ticks)
    out << "<line x1=\"" << num(kPlotLeft) << "\" y1=\"" << num(a.y(v)) << "\" x2=\"" << num(right) << "\" y2=\""
        << num(a.y(v)) << "\"/>\n";
  out << "</g>\n<rect x=\"" << num(kPlotLeft) << "\" y=\"" << num(a.top) << "\" width=\"" << num(kPlotWidth)
      << "\" height=\"" << num(kPlotHeight) << "\" fill=\"none\" stroke=\"#555\"/>\n";
  out << "<g class=\"axis\" data-axis=\"x\">\n";
  for (std::size_t i = 0; i < x_ticks.size(); i += x_step)
    out << "<text class=\"tick\" data-value=\"" << value_label(x_ticks[i]) << "\" x=\"" << num(a.x(x_ticks[i]))
        << "\" y=\"" << num(bottom + 18) << "\" text-anchor=\"middle\">" << length_label(x_ticks[i]) << "</text>\n";
  out << "</g>\n<g class=\"axis\" data-axis=\"y\">\n";
  for (double v : y_ticks)
    out << "<text class=\"tick\" data-value=\"" << value_label(v) << "\" x=\"" << num(kPlotLeft - 8) << "\" y=\""
        << num(a.y(v) + 4) << "\" text-anchor=\"end\">" << value_label(v) << "</text>\n";
  out << "</g>\n";
  out << "<text class=\"axis-title\" x=\"" << num(kPlotLeft + kPlotWidth / 2) << "\" y=\"" << num(bottom + 42)
      << "\" text-anchor=\"middle\">" << (decode ? "context length N" : "sequence length N")
      << " (tokens, log scale)</text>\n";
  out << "<text class=\"axis-title\" transform=\"translate(" << num(kPlotLeft - 58) << ","
      << num(a.top + kPlotHeight / 2) << ") rotate(-90)\" text-anchor=\"middle\">" << escape(metric_title(o, decode))
      << "</text>\n";
}

// Solid lines for the first cycle through the palette, then dash patterns.
const char* dash(std::size_t colour) {
  static const char* patterns[] = {"none", "7 4", "2 3", "9 3 2 3", "4 2"};
  return patterns[colour / svg::kPaletteSize % 5];
}

// Consecutive drawn points: the line's runs (an absent point breaks it).
std::vector<std::vector<const Point*>> runs_of(const Series& s) {
  std::vector<std::vector<const Point*>> runs(1);
  for (const auto& p : s.points) {
    if (p.drawn)
      runs.back().push_back(&p);
    else if (!runs.back().empty())
      runs.emplace_back();
  }
  if (runs.back().empty()) runs.pop_back();
  return runs;
}

// The band of a run with a spread: the high edge left to right, the low edge back; around a lone
// point, a bar as wide as a marker. Points of the run without a spread pinch it to the line.
std::string band_path(const std::vector<const Point*>& run, const Axes& a) {
  const auto low = [](const Point* p) { return p->spread() ? p->low : p->value; };
  const auto high = [](const Point* p) { return p->spread() ? p->high : p->value; };
  std::string d;
  const auto add = [&](double x, double y) { d += (d.empty() ? "M" : "L") + num(x) + "," + num(y); };
  const double half = run.size() == 1 ? 4 : 0;
  for (const Point* p : run) add(a.x(static_cast<double>(p->n)) - half, a.y(high(p)));
  if (half > 0) add(a.x(static_cast<double>(run.front()->n)) + half, a.y(high(run.front())));
  for (auto p = run.rbegin(); p != run.rend(); ++p) add(a.x(static_cast<double>((*p)->n)) + half, a.y(low(*p)));
  if (half > 0) add(a.x(static_cast<double>(run.front()->n)) - half, a.y(low(run.front())));
  return d + "Z";
}

void draw_series(std::ostringstream& out, const Series& s, const Axes& a) {
  out << "<g class=\"series\" data-model=\"" << escape(s.model) << "\" data-label=\"" << escape(s.label)
      << "\" data-class=\"" << escape(s.cls) << "\" stroke=\"" << svg::series_colour(s.colour) << "\" fill=\""
      << svg::series_colour(s.colour) << "\">\n";
  const auto runs = runs_of(s);
  for (const auto& run : runs)
    if (std::any_of(run.begin(), run.end(), [](const Point* p) { return p->spread(); }))
      out << "<path class=\"band\" stroke=\"none\" fill-opacity=\"0.18\" d=\"" << band_path(run, a) << "\"/>\n";
  for (const auto& run : runs) {
    if (run.size() < 2) continue;
    out << "<polyline class=\"line\" fill=\"none\" stroke-width=\"2\" stroke-dasharray=\"" << dash(s.colour)
        << "\" points=\"";
    for (std::size_t i = 0; i < run.size(); ++i)
      out << (i ? " " : "") << num(a.x(static_cast<double>(run[i]->n))) << "," << num(a.y(run[i]->value));
    out << "\"/>\n";
  }
  const std::string marker = svg::class_marker(s.cls);
  for (const auto& run : runs)
    for (const Point* p : run) {
      out << "<path class=\"point\" data-n=\"" << p->n << "\" data-value=\"" << value_label(p->value);
      if (p->spread()) out << "\" data-low=\"" << value_label(p->low) << "\" data-high=\"" << value_label(p->high);
      out << "\" transform=\"translate(" << num(a.x(static_cast<double>(p->n))) << "," << num(a.y(p->value))
          << ")\" stroke=\"white\" stroke-width=\"0.8\" d=\"" << marker << "\"/>\n";
    }
  out << "</g>\n";
}

// "absent: 1K error; 2K, 4K skipped" or "absent: unsupported (every N)", at most ~50 characters.
std::string absent_text(const Series& s) {
  std::vector<std::string> reasons;            // first-seen order
  std::map<std::string, std::string> lengths;  // reason → "1K, 2K"
  std::size_t missing = 0;
  for (const auto& p : s.points) {
    if (p.drawn) continue;
    ++missing;
    if (!lengths.count(p.why)) reasons.push_back(p.why);
    std::string& list = lengths[p.why];
    list += (list.empty() ? "" : ", ") + length_label(static_cast<double>(p.n));
  }
  if (missing == 0) return "";
  if (missing == s.points.size() && reasons.size() == 1) return "absent: " + reasons.front() + " (every N)";
  std::string text = "absent:";
  for (const auto& reason : reasons) text += (text.size() > 7 ? "; " : " ") + lengths[reason] + " " + reason;
  if (text.size() > 52) text = text.substr(0, 50) + "…";
  return text;
}

// Series (indices into the panel) drawn on top of each other: groups of two or more in which every
// pair is within kCoincidePx at every N both draw (one at least). Each series, in panel order, joins
// the first group it fits, so no group chains lines that are apart. Panels of more than
// kMaxCoincideSeries series are not searched (the pairs grow as the square).
constexpr std::size_t kMaxCoincideSeries = 256;
std::vector<std::vector<std::size_t>> coinciding(const Panel& panel, const Axes& a) {
  const std::size_t count = panel.series.size();
  if (count > kMaxCoincideSeries) return {};
  std::vector<std::map<std::int64_t, double>> ys(count);  // drawn N → y
  for (std::size_t i = 0; i < count; ++i)
    for (const auto& p : panel.series[i].points)
      if (p.drawn) ys[i].emplace(p.n, a.y(p.value));
  const auto close = [&](std::size_t i, std::size_t j) {
    std::size_t shared = 0;
    for (const auto& [n, y] : ys[i]) {
      const auto other = ys[j].find(n);
      if (other == ys[j].end()) continue;
      if (std::fabs(other->second - y) > kCoincidePx) return false;
      ++shared;
    }
    return shared > 0;
  };
  std::vector<std::vector<std::size_t>> groups;
  for (std::size_t i = 0; i < count; ++i) {
    const auto fits = [&](const std::vector<std::size_t>& g) {
      return std::all_of(g.begin(), g.end(), [&](std::size_t j) { return close(i, j); });
    };
    const auto group = std::find_if(groups.begin(), groups.end(), fits);
    if (group == groups.end())
      groups.push_back({i});
    else
      group->push_back(i);
  }
  std::erase_if(groups, [](const std::vector<std::size_t>& g) { return g.size() < 2; });
  return groups;
}

// "A", "B", …, "Z", "AA", …
std::string group_tag(std::size_t k) { return (k >= 26 ? group_tag(k / 26 - 1) : "") + char('A' + k % 26); }

// Tags each group inside the chart, left of its first series' rightmost point (tags pushed apart
// downwards where they would overlap), and lists its members under the chart; returns the height
// the list takes.
double draw_coinciding(std::ostringstream& out, const Panel& panel, const std::vector<std::vector<std::size_t>>& groups,
                       const Axes& a) {
  struct Tag {
    double x, y;
    std::size_t group;
  };
  std::vector<Tag> tags;
  for (std::size_t k = 0; k < groups.size(); ++k) {
    const Point* last = runs_of(panel.series[groups[k].front()]).back().back();
    tags.push_back({a.x(static_cast<double>(last->n)) - 8, a.y(last->value) - 6, k});
  }
  std::sort(tags.begin(), tags.end(), [](const Tag& l, const Tag& r) { return l.y < r.y; });
  for (std::size_t i = 1; i < tags.size(); ++i) tags[i].y = std::max(tags[i].y, tags[i - 1].y + 13);
  const auto tag_text = [&](std::size_t k) { return group_tag(k) + " ×" + std::to_string(groups[k].size()); };
  for (const Tag& tag : tags) {
    std::string models;
    for (std::size_t i : groups[tag.group]) models += (models.empty() ? "" : ";") + panel.series[i].label;
    out << "<text class=\"coincide-tag\" data-models=\"" << escape(models) << "\" x=\"" << num(tag.x) << "\" y=\""
        << num(tag.y) << "\" text-anchor=\"end\">" << escape(tag_text(tag.group)) << "</text>\n";
  }
  double y = a.top + kPlotHeight + 62;
  const auto note = [&](const std::string& text) {
    out << "<text class=\"coincide\" x=\"" << num(kPlotLeft) << "\" y=\"" << num(y) << "\">" << escape(text)
        << "</text>\n";
    y += 14;
  };
  for (std::size_t k = 0; k < groups.size(); ++k) {
    std::string line = tag_text(k) + " coincide (within " + num(kCoincidePx) + " px at every N they share): ";
    for (std::size_t i : groups[k]) {
      const std::string& label = panel.series[i].label;
      if (line.size() + label.size() > kNoteColumns && line.size() > 10) {
        note(line);
        line = "  ";
      }
      line += label + (i == groups[k].back() ? "" : ", ");
    }
    note(line);
  }
  return y - (a.top + kPlotHeight + 62);
}

// One legend line: a class header (series = the class's first series) or a series' entry (with its
// absent note on a second line).
struct LegendItem {
  bool header;
  std::size_t series;
  std::string note;
  double height() const { return kLegendLine + (note.empty() ? 0 : kLegendLine - 2); }
};

struct LegendLayout {
  std::vector<LegendItem> items;
  std::vector<std::size_t> column;  // per item
  std::vector<double> y;            // per item, from the legend's top
  double column_width = 0, height = 0;
  std::size_t columns = 1;
};

// The panel's legend grouped by class, in as many columns (three at most) as keep it about as tall
// as the chart; a class header is not left alone at a column's foot.
LegendLayout legend_layout(const Panel& panel) {
  LegendLayout layout;
  double total = 0, widest = 0;
  for (std::size_t i = 0; i < panel.series.size(); ++i) {
    const Series& s = panel.series[i];
    if (i == 0 || s.cls != panel.series[i - 1].cls) layout.items.push_back({true, i, ""});
    layout.items.push_back({false, i, absent_text(s)});
    widest = std::max({widest, kLegendChar * static_cast<double>(svg::class_title(s.cls).size()),
                       40 + kLegendChar * static_cast<double>(s.label.size()),
                       40 + kNoteChar * static_cast<double>(layout.items.back().note.size())});
  }
  for (const auto& item : layout.items) total += item.height();
  layout.columns = std::min<std::size_t>(3, static_cast<std::size_t>(std::ceil(total / (kPlotHeight + 30))));
  layout.columns = std::max<std::size_t>(layout.columns, 1);
  const double limit = std::max(kPlotHeight + 30, total / static_cast<double>(layout.columns) + kLegendLine);
  layout.column_width = std::max(150.0, widest + 16);
  std::size_t column = 0;
  double y = 0;
  for (std::size_t k = 0; k < layout.items.size(); ++k) {
    const auto& item = layout.items[k];
    const double needed = item.height() + (item.header ? layout.items[k + 1].height() : 0);
    if (y > 0 && y + needed > limit && column + 1 < layout.columns) {
      ++column;
      y = 0;
    }
    layout.column.push_back(column);
    layout.y.push_back(y);
    y += item.height();
    layout.height = std::max(layout.height, y);
  }
  return layout;
}

void draw_legend(std::ostringstream& out, const Panel& panel, const LegendLayout& layout, double top) {
  out << "<g class=\"legend\">\n";
  for (std::size_t k = 0; k < layout.items.size(); ++k) {
    const LegendItem& item = layout.items[k];
    const Series& s = panel.series[item.series];
    const double x = kLegendLeft + static_cast<double>(layout.column[k]) * layout.column_width, y = top + layout.y[k];
    const std::string marker = svg::class_marker(s.cls);
    if (item.header) {
      out << "<path fill=\"#555\" transform=\"translate(" << num(x + 6) << "," << num(y + 8) << ")\" d=\"" << marker
          << "\"/><text class=\"legend\" x=\"" << num(x + 16) << "\" y=\"" << num(y + 12) << "\" font-weight=\"bold\">"
          << escape(svg::class_title(s.cls)) << "</text>\n";
      continue;
    }
    const std::string colour = svg::series_colour(s.colour);
    out << "<g class=\"legend-entry\" data-label=\"" << escape(s.label) << "\" stroke=\"" << colour << "\" fill=\""
        << colour << "\"><line x1=\"" << num(x + 4) << "\" y1=\"" << num(y + 8) << "\" x2=\"" << num(x + 32)
        << "\" y2=\"" << num(y + 8) << "\" stroke-width=\"2\" stroke-dasharray=\"" << dash(s.colour)
        << "\"/><path stroke=\"white\" stroke-width=\"0.8\" transform=\"translate(" << num(x + 18) << "," << num(y + 8)
        << ")\" d=\"" << marker << "\"/></g>\n";
    out << "<text class=\"legend\" x=\"" << num(x + 40) << "\" y=\"" << num(y + 12) << "\">" << escape(s.label)
        << "</text>\n";
    if (!item.note.empty())
      out << "<text class=\"note\" x=\"" << num(x + 40) << "\" y=\"" << num(y + kLegendLine + 10) << "\">"
          << escape(item.note) << "</text>\n";
  }
  out << "</g>\n";
}

bool drawable(const Panel& panel) {
  for (const auto& s : panel.series)
    for (const auto& p : s.points)
      if (p.drawn) return true;
  return false;
}

}  // namespace

std::string render_plot(const Report& report, const PlotOptions& options) {
  auto panels = collect(report, options);
  panels.erase(std::remove_if(panels.begin(), panels.end(), [](const Panel& p) { return !drawable(p); }), panels.end());
  if (panels.empty()) throw InputError("nothing to plot: the report has no ok point with a value for this metric");
  assign_colours(panels);
  std::ostringstream body;
  double top = 0, width = kMinWidth;
  for (const auto& panel : panels) {
    const Axes axes = axes_for(panel, top + kPlotTop);
    const bool decode = decode_panel(panel.configuration);
    body << "<g class=\"panel\" data-configuration=\"" << escape(panel.configuration) << "\" data-metric=\""
         << escape(metric_title(options, decode)) << "\">\n";
    body << "<text class=\"title\" x=\"" << num(kPlotLeft) << "\" y=\"" << num(top + 26) << "\">"
         << escape(chart_title(options) + " — " + panel.title) << "</text>\n";
    body << "<text class=\"subtitle\" x=\"" << num(kPlotLeft) << "\" y=\"" << num(top + 46) << "\">"
         << escape(subtitle(report, panel.threads)) << "</text>\n";
    draw_axes(body, axes, options, decode);
    for (const auto& series : panel.series) draw_series(body, series, axes);
    const double notes = draw_coinciding(body, panel, coinciding(panel, axes), axes);
    const LegendLayout legend = legend_layout(panel);
    draw_legend(body, panel, legend, top + kPlotTop);
    body << "</g>\n";
    width = std::max(width, kLegendLeft + static_cast<double>(legend.columns) * legend.column_width + 10);
    top += std::max(kPlotTop + kPlotHeight + 70 + notes, kPlotTop + legend.height + 20);
  }
  return svg::open_document(width, top, chart_title(options) + " (xfbench)") + body.str() + "</svg>\n";
}

}  // namespace xfb
