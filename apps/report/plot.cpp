#include "apps/report/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "apps/report/svg.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {
namespace {

using svg::escape;
using svg::num;

constexpr double kWidth = 980, kPlotLeft = 80, kPlotWidth = 560, kPlotTop = 50, kPlotHeight = 400;
constexpr double kLegendLeft = kPlotLeft + kPlotWidth + 30, kLegendLine = 17;
// Values the log axes draw; outside, a point is absent ("out of range"), so the axes span at
// most 60 decades and every coordinate is finite.
constexpr double kMinValue = 1e-30, kMaxValue = 1e30;
// Ticks per axis at most: every tick loop is bounded whatever the data.
constexpr int kMaxTickSteps = 200;

struct Point {
  std::int64_t n;
  bool drawn;  // false: the row exists but has no value (not ok, no baseline)
  double value;
  std::string why;  // status when not drawn
};

struct Series {
  std::string model, label, cls;
  int rank = 0;
  std::vector<Point> points;  // by N
};

struct Panel {
  std::string configuration;
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
  }
  return "";
}

int model_rank(const std::string& name) {
  const auto& models = model_cards();
  for (std::size_t i = 0; i < models.size(); ++i)
    if (models[i].name == name) return static_cast<int>(models[i].classes.front()) * 1000 + static_cast<int>(i);
  return 1 << 20;
}

std::string first_class(const ResultRow& row) { return row.classes.empty() ? "unknown" : row.classes.front(); }

std::vector<Panel> collect(const Report& report, const PlotOptions& o) {
  std::map<std::string, std::vector<const ResultRow*>> groups;
  std::vector<std::string> order;
  for (const auto& row : report.results) {
    const std::string configuration = configuration_text(row);
    if (!groups.count(configuration)) order.push_back(configuration);
    groups[configuration].push_back(&row);
  }
  std::vector<Panel> panels;
  for (const auto& configuration : order) {
    const auto& rows = groups[configuration];
    std::map<std::int64_t, const ResultRow*> baseline;
    std::map<std::string, std::set<std::string>> settings;
    for (const auto* row : rows) {
      settings[row->model].insert(row->params.dump());
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
      Point point{row->seq_len, false, 0, status_name(row->status)};
      if (row->status == Status::Ok) {
        if (o.metric == PlotMetric::Time) point.value = row->median_ns * (row->pass == Pass::Decode ? 1e-3 : 1e-6);
        if (o.metric == PlotMetric::State) point.value = static_cast<double>(row->state_bytes) / 1048576.0;
        if (o.metric == PlotMetric::Memory) point.value = static_cast<double>(row->peak_tensor_bytes) / 1048576.0;
        if (o.metric == PlotMetric::Speedup) {
          const auto found = baseline.find(row->seq_len);
          point.value =
              found == baseline.end() ? 0 : finite_ratio(found->second->median_ns, row->median_ns).value_or(0);
          point.why = "no " + o.baseline + " point";
        }
        point.drawn = point.value >= kMinValue && point.value <= kMaxValue;
        if (!point.drawn && point.value > 0) point.why = "out of range";
      }
      series.points.push_back(point);
    }
    Panel panel{configuration, {}};
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
        v_lo = std::min(v_lo, p.value);
        v_hi = std::max(v_hi, p.value);
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

// Marker shapes around the origin, cycled within a class; dash patterns likewise.
const char* marker(int k) {
  static const char* shapes[] = {"M-4,0a4,4 0 1,0 8,0a4,4 0 1,0 -8,0Z", "M-3.5,-3.5h7v7h-7Z", "M0,-4.5L4.5,3.5H-4.5Z",
                                 "M0,-5L5,0L0,5L-5,0Z", "M-4,-4L4,4M-4,4L4,-4"};
  return shapes[k % 5];
}
const char* dash(int k) {
  static const char* patterns[] = {"none", "7 4", "2 3", "9 3 2 3", "4 2"};
  return patterns[(k / 5 + k) % 5];
}

void draw_series(std::ostringstream& out, const Series& s, int index_in_class, const Axes& a) {
  const std::string colour = svg::class_colour(s.cls);
  const bool hollow = index_in_class % 10 >= 5;
  out << "<g class=\"series\" data-model=\"" << escape(s.model) << "\" data-label=\"" << escape(s.label)
      << "\" data-class=\"" << escape(s.cls) << "\" stroke=\"" << colour << "\" fill=\"" << (hollow ? "white" : colour)
      << "\">\n";
  std::vector<std::string> runs(1);
  for (const auto& p : s.points) {
    if (!p.drawn) {
      if (!runs.back().empty()) runs.emplace_back();
      continue;
    }
    std::string& run = runs.back();
    if (!run.empty()) run += ' ';
    run += num(a.x(static_cast<double>(p.n))) + "," + num(a.y(p.value));
  }
  for (const auto& run : runs)
    if (run.find(' ') != std::string::npos)
      out << "<polyline class=\"line\" fill=\"none\" stroke-width=\"2\" stroke-dasharray=\"" << dash(index_in_class)
          << "\" points=\"" << run << "\"/>\n";
  for (const auto& p : s.points)
    if (p.drawn)
      out << "<path class=\"point\" data-n=\"" << p.n << "\" data-value=\"" << value_label(p.value)
          << "\" transform=\"translate(" << num(a.x(static_cast<double>(p.n))) << "," << num(a.y(p.value))
          << ")\" stroke-width=\"1.5\" d=\"" << marker(index_in_class) << "\"/>\n";
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

// Legend entries grouped by class; returns the height used.
double draw_legend(std::ostringstream& out, const Panel& panel, const std::vector<int>& index_in_class, double top) {
  double y = top;
  std::string current;
  out << "<g class=\"legend\">\n";
  for (std::size_t i = 0; i < panel.series.size(); ++i) {
    const Series& s = panel.series[i];
    const std::string colour = svg::class_colour(s.cls);
    if (s.cls != current) {
      current = s.cls;
      out << "<text class=\"legend\" x=\"" << num(kLegendLeft) << "\" y=\"" << num(y + 12)
          << "\" font-weight=\"bold\" style=\"fill:" << colour << "\">" << escape(svg::class_title(s.cls))
          << "</text>\n";
      y += kLegendLine;
    }
    const bool hollow = index_in_class[i] % 10 >= 5;
    out << "<g stroke=\"" << colour << "\" fill=\"" << (hollow ? "white" : colour) << "\"><line x1=\""
        << num(kLegendLeft + 4) << "\" y1=\"" << num(y + 8) << "\" x2=\"" << num(kLegendLeft + 32) << "\" y2=\""
        << num(y + 8) << "\" stroke-width=\"2\" stroke-dasharray=\"" << dash(index_in_class[i])
        << "\"/><path transform=\"translate(" << num(kLegendLeft + 18) << "," << num(y + 8) << ")\" d=\""
        << marker(index_in_class[i]) << "\"/></g>\n";
    const std::string absent = absent_text(s);
    out << "<text class=\"legend\" x=\"" << num(kLegendLeft + 40) << "\" y=\"" << num(y + 12) << "\">"
        << escape(s.label) << "</text>\n";
    y += kLegendLine;
    if (!absent.empty()) {
      out << "<text class=\"note\" x=\"" << num(kLegendLeft + 40) << "\" y=\"" << num(y + 10) << "\">" << escape(absent)
          << "</text>\n";
      y += kLegendLine - 2;
    }
  }
  out << "</g>\n";
  return y - top;
}

}  // namespace

std::string render_plot(const Report& report, const PlotOptions& options) {
  const auto panels = collect(report, options);
  std::ostringstream body;
  double top = 0;
  bool any = false;
  for (const auto& panel : panels) {
    bool drawable = false;
    for (const auto& s : panel.series)
      for (const auto& p : s.points) drawable = drawable || p.drawn;
    if (!drawable) continue;
    any = true;
    const Axes axes = axes_for(panel, top + kPlotTop);
    std::vector<int> index_in_class;
    std::map<std::string, int> per_class;
    for (const auto& s : panel.series) index_in_class.push_back(per_class[s.cls]++);
    body << "<g class=\"panel\" data-configuration=\"" << escape(panel.configuration) << "\" data-metric=\""
         << escape(metric_title(options, decode_panel(panel.configuration))) << "\">\n";
    body << "<text class=\"title\" x=\"" << num(kPlotLeft) << "\" y=\"" << num(top + 30) << "\">"
         << escape(chart_title(options) + " — " + panel.configuration) << "</text>\n";
    draw_axes(body, axes, options, decode_panel(panel.configuration));
    for (std::size_t i = 0; i < panel.series.size(); ++i) draw_series(body, panel.series[i], index_in_class[i], axes);
    const double legend_height = draw_legend(body, panel, index_in_class, top + kPlotTop);
    body << "</g>\n";
    top += std::max(kPlotTop + kPlotHeight + 70, kPlotTop + legend_height + 20);
  }
  if (!any) throw InputError("nothing to plot: the report has no ok point with a value for this metric");
  return svg::open_document(kWidth, top, chart_title(options) + " (xfbench)") + body.str() + "</svg>\n";
}

}  // namespace xfb
