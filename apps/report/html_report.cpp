#include "apps/report/html_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "apps/report/plot.hpp"
#include "apps/report/svg.hpp"
#include "apps/report/table.hpp"
#include "lib/core/errors.hpp"
#include "lib/core/stats.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {
namespace {

using svg::escape;  // &, <, >, " and ': the same references are valid in HTML

// One metric of a configuration: the table `xfbench table --metric …` prints and, where `plot` has
// the metric, its chart beside it.
struct MetricView {
  std::string id;  // data-metric, the words of --metric
  std::string heading;
  std::string what;  // units and marks, one sentence
  TableMetric table;
  std::optional<PlotMetric> plot = std::nullopt;
  bool uses_baseline = false;
  bool decode_only = false;   // shown for decode configurations only
  bool complexity = false;    // with table --complexity's columns (when every model is known)
  bool spread_shown = false;  // the cells say ± CV
};

// Every table the page shows per configuration, in order. This list is the one place to add a
// metric: a new TableMetric (crossover, front) or PlotMetric is one more entry or field here.
std::vector<MetricView> metric_views(const std::string& baseline) {
  return {
      {.id = "time",
       .heading = "Median time",
       .what = "ms per timed call (µs per generated token in decode tables); ± is the coefficient of variation; "
               "~ marks CV > 5%, ! a contended point; hover a cell for p10–p90 and min–max",
       .table = TableMetric::Time,
       .plot = PlotMetric::Time,
       .complexity = true,
       .spread_shown = true},
      {.id = "speedup",
       .heading = "Speed-up over " + baseline,
       .what = baseline + "'s median over the model's (higher is faster; ! a contended point)",
       .table = TableMetric::Speedup,
       .plot = PlotMetric::Speedup,
       .uses_baseline = true},
      {.id = "memory",
       .heading = "Peak tracked memory",
       .what = "MiB live at the peak, inputs and output included",
       .table = TableMetric::Memory,
       .plot = PlotMetric::Memory},
      {.id = "memory-ratio",
       .heading = "Memory relative to " + baseline,
       .what = "the model's peak tracked bytes over " + baseline + "'s (lower is smaller)",
       .table = TableMetric::MemoryRatio,
       .uses_baseline = true},
      {.id = "gflops",
       .heading = "Executed GFLOP/s",
       .what = "GFLOP/s and, in parentheses, the share of the FMA peak the sweep measured",
       .table = TableMetric::Gflops,
       .plot = PlotMetric::Gflops},
      {.id = "crossover",
       .heading = "Crossover with " + baseline,
       .what = "the smallest N from which the model is faster (and smaller) than " + baseline +
               " and stays so, interpolated on the log-log lines between the bracketing lengths",
       .table = TableMetric::Crossover,
       .uses_baseline = true},
      {.id = "front",
       .heading = "Time–memory front",
       .what = "per N, the models no other model beats in both time and memory",
       .table = TableMetric::Front},
      {.id = "state",
       .heading = "Decode state",
       .what = "MiB kept between decode steps",
       .table = TableMetric::State,
       .plot = PlotMetric::State,
       .decode_only = true},
  };
}

// `value` with about four significant digits and no exponent: 0.01234, 12.34, 12345.
std::string significant(double value) {
  const int digits = value > 0 ? static_cast<int>(std::floor(std::log10(value))) : 0;
  char text[64];
  std::snprintf(text, sizeof text, "%.*f", std::clamp(3 - digits, 0, 12), value);
  return text;
}

// The number a cell starts with ("12.3~", "1.25×", "40.1 (12%)"), if it starts with one.
std::optional<double> leading_number(const std::string& text) {
  const std::size_t sign = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  const std::size_t digit = sign + (text.size() > sign && text[sign] == '.' ? 1 : 0);
  if (text.size() <= digit || text[digit] < '0' || text[digit] > '9') return std::nullopt;
  const double value = std::strtod(text.c_str(), nullptr);
  if (!std::isfinite(value)) return std::nullopt;
  return value;
}

// Time figures of a row in its table's unit: µs per generated token for decode rows, else ms.
double time_in_unit(const ResultRow& row, double ns) { return ns * (row.pass == Pass::Decode ? 1e-3 : 1e-6); }
std::string time_unit(const ResultRow& row) { return row.pass == Pass::Decode ? "µs" : "ms"; }

struct Spread {
  double p10 = 0, p90 = 0;
};
Spread spread_of(const ResultRow& row) {
  if (row.samples_ns.empty()) return {row.median_ns, row.median_ns};
  return {sample_quantile(row.samples_ns, 0.1), sample_quantile(row.samples_ns, 0.9)};
}

std::string label_of(const ResultRow& row, bool with_params) {
  return with_params && !row.params.empty() ? row.model + " (" + params_text(row.params) + ")" : row.model;
}

// What a point's cell says on hover: its status and reason, or its time and spread.
std::string point_tooltip(const ResultRow& row) {
  if (row.status != Status::Ok) return status_name(row.status) + (row.reason.empty() ? "" : ": " + row.reason);
  const std::string unit = " " + time_unit(row);
  const Spread spread = spread_of(row);
  std::string text = "median " + significant(time_in_unit(row, row.median_ns)) + unit + "; p10–p90 " +
                     significant(time_in_unit(row, spread.p10)) + "–" + significant(time_in_unit(row, spread.p90)) +
                     unit + "; min–max " + significant(time_in_unit(row, row.min_ns)) + "–" +
                     significant(time_in_unit(row, row.max_ns)) + unit + "; CV " +
                     format_number("%.1f%%", 100 * row.cv) + "; " + std::to_string(row.samples_ns.size()) +
                     (row.samples_ns.size() == 1 ? " sample" : " samples");
  if (row.contended_samples > 0) text += " (" + std::to_string(row.contended_samples) + " contended left out)";
  if (row.contended) text += "; " + contended_warning(row);
  return text;
}

// ---- tables -------------------------------------------------------------------------------------

struct Cell {
  std::string text;
  std::optional<double> value;  // the sort key of a numeric cell (data-value)
  std::string tooltip;
  std::string spread;  // shown after the text, smaller
};
using Row = std::vector<Cell>;

Cell text_cell(const std::string& text) { return {text, std::nullopt, "", ""}; }
Cell number_cell(const std::string& text, double value) { return {text, value, "", ""}; }

// A column sorts numerically when more of its cells are numbers than words other than the table's
// status marks; the rest of its cells then count as missing.
bool numeric_column(const std::vector<Row>& rows, std::size_t column) {
  static const std::set<std::string> marks = {"", "-", "skipped", "n/a", "error"};
  std::size_t numbers = 0, words = 0;
  for (const auto& row : rows) {
    if (column >= row.size()) continue;
    if (row[column].value)
      ++numbers;
    else if (!marks.count(row[column].text))
      ++words;
  }
  return numbers > words;
}

std::string cell_html(const char* tag, const Cell& cell, bool numeric) {
  std::string html = std::string("<") + tag;
  if (numeric) html += " class=\"xr-num\"";
  if (cell.value && numeric) html += " data-value=\"" + format_number("%.9g", *cell.value) + "\"";
  if (!cell.tooltip.empty()) html += " title=\"" + escape(cell.tooltip) + "\"";
  html += ">" + escape(cell.text);
  if (!cell.spread.empty()) html += " <span class=\"xr-spread\">" + escape(cell.spread) + "</span>";
  return html + "</" + tag + ">";
}

// A sortable <table>: `header` names the columns, every row has at most as many cells.
std::string table_html(const std::string& css_class, const std::vector<std::string>& header,
                       const std::vector<Row>& rows) {
  std::vector<bool> numeric(header.size());
  for (std::size_t i = 0; i < header.size(); ++i) numeric[i] = numeric_column(rows, i);
  std::ostringstream out;
  out << "<table class=\"" << css_class << "\" data-sortable=\"true\">\n<thead><tr>";
  for (std::size_t i = 0; i < header.size(); ++i)
    out << "<th scope=\"col\" data-numeric=\"" << (numeric[i] ? "true" : "false") << "\""
        << (numeric[i] ? " class=\"xr-num\"" : "") << ">" << escape(header[i]) << "</th>";
  out << "</tr></thead>\n<tbody>\n";
  for (const auto& row : rows) {
    out << "<tr>";
    for (std::size_t i = 0; i < row.size() && i < header.size(); ++i) out << cell_html("td", row[i], numeric[i]);
    out << "</tr>\n";
  }
  out << "</tbody>\n</table>\n";
  return out.str();
}

// The rows of render_cells' CSV (fields quoted where they hold a comma or a quote, "" for a quote).
std::vector<std::vector<std::string>> parse_csv(const std::string& csv) {
  std::vector<std::vector<std::string>> lines;
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (std::size_t i = 0; i < csv.size(); ++i) {
    const char c = csv[i];
    if (quoted) {
      if (c != '"')
        fields.back() += c;
      else if (i + 1 < csv.size() && csv[i + 1] == '"')
        fields.back() += csv[++i];
      else
        quoted = false;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c == '\n') {
      lines.push_back(std::move(fields));
      fields.assign(1, "");
    } else {
      fields.back() += c;
    }
  }
  if (fields.size() > 1 || !fields.front().empty()) lines.push_back(std::move(fields));
  return lines;
}

// The rows of one configuration by their table label and N (the label names parameters when a model
// has several settings, as `table` does).
using PointGrid = std::map<std::string, std::map<std::int64_t, const ResultRow*>>;
PointGrid point_grid(const Report& configuration) {
  std::map<std::string, std::set<std::string>> settings;
  for (const auto& row : configuration.results) settings[row.model].insert(row.params.dump());
  PointGrid grid;
  for (const auto& row : configuration.results)
    grid[label_of(row, settings[row.model].size() > 1)].emplace(row.seq_len, &row);
  return grid;
}

// The columns of a table's CSV that repeat the configuration the section's heading names.
bool configuration_column(const std::vector<std::vector<std::string>>& lines, std::size_t column) {
  static const std::set<std::string> names = {"scope", "pass",     "causal", "dtype",        "batch",
                                              "heads", "head_dim", "d_ff",   "decode_tokens"};
  if (!names.count(lines.front()[column])) return false;
  for (std::size_t r = 1; r < lines.size(); ++r)
    if (column >= lines[r].size() || lines[r][column] != lines[1][column]) return false;
  return true;
}

// The table `xfbench table --format csv` prints for one configuration, as a sortable table whose
// point cells carry the point's spread.
std::string metric_table_html(const Report& configuration, const MetricView& view, const TableOptions& options) {
  const auto lines = parse_csv(render_table(configuration, options));
  if (lines.size() < 2) return "<p class=\"xr-empty\">(no rows)</p>\n";
  const PointGrid grid = point_grid(configuration);
  std::vector<std::size_t> kept;
  for (std::size_t i = 0; i < lines.front().size(); ++i)
    if (!configuration_column(lines, i)) kept.push_back(i);
  const auto model_column =
      static_cast<std::size_t>(std::find(lines.front().begin(), lines.front().end(), "model") - lines.front().begin());
  std::vector<std::string> header;
  for (auto i : kept) header.push_back(lines.front()[i]);
  std::vector<Row> rows;
  for (std::size_t r = 1; r < lines.size(); ++r) {
    const auto& line = lines[r];
    const std::string label = model_column < line.size() ? line[model_column] : "";
    const auto points = grid.find(label);
    Row row;
    for (auto i : kept) {
      Cell cell = text_cell(i < line.size() ? line[i] : "");
      cell.value = leading_number(cell.text);
      const std::string& name = lines.front()[i];
      if (points != grid.end() && name.rfind("N=", 0) == 0) {
        const auto point = points->second.find(std::atoll(name.c_str() + 2));
        if (point != points->second.end()) {
          const ResultRow& p = *point->second;
          cell.tooltip = point_tooltip(p);
          if (view.table == TableMetric::Time && p.status == Status::Ok) cell.value = time_in_unit(p, p.median_ns);
          if (view.spread_shown && p.status == Status::Ok && p.samples_ns.size() > 1)
            cell.spread = "±" + format_number("%.1f%%", 100 * p.cv);
        }
      }
      row.push_back(std::move(cell));
    }
    rows.push_back(std::move(row));
  }
  return table_html("xr-table", header, rows);
}

// ---- sections -----------------------------------------------------------------------------------

// The plot's SVG, for inline use: without the XML declaration and the namespace attribute (HTML
// gives <svg> its namespace), so the page names no URL. "" when the metric has nothing to draw.
std::string inline_plot(const Report& configuration, PlotMetric metric, const std::string& baseline) {
  PlotOptions options;
  options.metric = metric;
  options.baseline = baseline;
  std::string svg;
  try {
    svg = render_plot(configuration, options);
  } catch (const InputError&) {
    return "";
  }
  svg.erase(0, svg.find("<svg"));
  const std::string ns = " xmlns=\"http://www.w3.org/2000/svg\"";
  if (const auto at = svg.find(ns); at != std::string::npos) svg.erase(at, ns.size());
  return "<figure class=\"xr-plot\">\n" + svg + "</figure>\n";
}

bool has_model(const Report& report, const std::string& model) {
  return std::any_of(report.results.begin(), report.results.end(),
                     [&](const ResultRow& row) { return row.model == model; });
}

bool every_model_known(const Report& report) {
  return std::all_of(report.results.begin(), report.results.end(),
                     [](const ResultRow& row) { return find_card(row.model) != nullptr; });
}

std::string metric_html(const Report& configuration, const MetricView& view, const HtmlReportOptions& options) {
  std::ostringstream out;
  out << "<div class=\"xr-metric\" data-metric=\"" << escape(view.id) << "\">\n<h4>" << escape(view.heading)
      << "</h4>\n<p class=\"xr-what\">" << escape(view.what) << "</p>\n";
  if (view.uses_baseline && !has_model(configuration, options.baseline)) {
    out << "<p class=\"xr-empty\">No " << escape(options.baseline)
        << " rows in this configuration (xfbench report --baseline names another model).</p>\n</div>\n";
    return out.str();
  }
  TableOptions table;
  table.metric = view.table;
  table.format = TableFormat::Csv;
  table.baseline = options.baseline;
  table.complexity = view.complexity && every_model_known(configuration);
  out << metric_table_html(configuration, view, table);
  if (view.plot) out << inline_plot(configuration, *view.plot, options.baseline);
  out << "</div>\n";
  return out.str();
}

// The report split by configuration_text, in first-seen order.
std::vector<std::pair<std::string, Report>> configurations(const Report& report) {
  std::vector<std::pair<std::string, Report>> parts;
  std::map<std::string, std::size_t> index;
  for (const auto& row : report.results) {
    const std::string name = configuration_text(row);
    if (!index.count(name)) {
      index[name] = parts.size();
      parts.push_back({name, Report{report.context, report.settings, {}}});
    }
    parts[index[name]].second.results.push_back(row);
  }
  return parts;
}

std::string context_value(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_array() && std::all_of(value.begin(), value.end(), [](const auto& v) { return v.is_string(); })) {
    std::string text;
    for (const auto& item : value) text += (text.empty() ? "" : " ") + item.get<std::string>();
    return text;
  }
  return value.dump();
}

// The context as label–value rows: the fields a reader looks for first, then any other field.
std::string context_html(const nlohmann::json& context) {
  static const std::vector<std::pair<std::string, std::string>> known = {
      {"cpu_model", "CPU"},
      {"logical_cores", "logical cores"},
      {"threads", "threads"},
      {"isa_flags", "ISA flags"},
      {"kernel_isa", "kernel ISA"},
      {"onednn_isa", "oneDNN ISA"},
      {"onednn_version", "oneDNN"},
      {"onednn_commit", "oneDNN commit"},
      {"compiler", "compiler"},
      {"cxx_flags", "compiler flags"},
      {"build_type", "build type"},
      {"xfbench_version", "xfbench"},
      {"git_commit", "commit"},
      {"seed", "seed"},
      {"date", "date"},
      {"host", "host"},
      {"command_line", "command line"},
      {"fma_peak_gflops", "FMA peak (GFLOP/s)"},
      {"triad_bandwidth_gbs", "triad bandwidth (GB/s)"},
      {"machine_contended", "peaks measured while the machine was busy"},
  };
  std::ostringstream out;
  out << "<table class=\"xr-context\">\n<tbody>\n";
  auto line = [&](const std::string& label, const nlohmann::json& value) {
    out << "<tr><th scope=\"row\">" << escape(label) << "</th><td>" << escape(context_value(value)) << "</td></tr>\n";
  };
  std::set<std::string> shown;
  for (const auto& [field, label] : known)
    if (context.contains(field)) {
      line(label, context[field]);
      shown.insert(field);
    }
  for (const auto& [field, value] : context.items())
    if (!shown.count(field)) line(field, value);
  out << "</tbody>\n</table>\n";
  return out.str();
}

// Every row a reader should not take at face value, with the reason.
std::vector<Row> warning_rows(const Report& report) {
  std::vector<Row> rows;
  auto add = [&](const ResultRow& r, const std::string& kind, const std::string& reason) {
    Cell model = text_cell(r.model);
    model.tooltip = params_text(r.params);
    rows.push_back({text_cell(kind), model, text_cell(configuration_text(r)),
                    number_cell(std::to_string(r.seq_len), static_cast<double>(r.seq_len)), text_cell(reason)});
  };
  for (const auto& r : report.results) {
    if (r.status != Status::Ok) {
      add(r, status_name(r.status), r.reason);
      continue;
    }
    if (r.contended) add(r, "contended", contended_warning(r));
    if (r.unstable) {
      const Spread spread = spread_of(r);
      add(r, "unstable",
          "CV " + format_number("%.1f%%", 100 * r.cv) + " > 5% (p10–p90 " + significant(time_in_unit(r, spread.p10)) +
              "–" + significant(time_in_unit(r, spread.p90)) + " " + time_unit(r) + ")");
    }
    for (const auto& warning : r.warnings)
      if (warning.rfind("contended:", 0) != 0) add(r, "warning", warning);
  }
  return rows;
}

// Longer lists of warnings start collapsed, so that the tables stay near the top of the page.
constexpr std::size_t kOpenWarnings = 10;

std::string warnings_html(const Report& report) {
  const auto rows = warning_rows(report);
  std::map<std::string, int> counts;
  for (const auto& row : rows) ++counts[row.front().text];
  std::ostringstream out;
  out << "<h3>Warnings</h3>\n";
  if (rows.empty()) return out.str() + "<p class=\"xr-ok\">None: every point ran, none contended or unstable.</p>\n";
  out << "<details class=\"xr-details\"" << (rows.size() <= kOpenWarnings ? " open=\"open\"" : "")
      << "><summary class=\"xr-warn\">";
  for (auto it = counts.begin(); it != counts.end(); ++it)
    out << (it == counts.begin() ? "" : ", ") << it->second << " " << escape(it->first);
  out << "</summary>\n"
      << table_html("xr-warnings", {"kind", "model", "configuration", "N", "reason"}, rows) << "</details>\n";
  return out.str();
}

// One row per point, the spread as columns (times in ms).
std::string points_html(const Report& report) {
  std::vector<Row> rows;
  for (const auto& r : report.results) {
    Row row = {text_cell(configuration_text(r)),
               text_cell(r.classes.empty() ? "" : r.classes.front()),
               text_cell(r.model),
               text_cell(params_text(r.params)),
               number_cell(std::to_string(r.seq_len), static_cast<double>(r.seq_len)),
               text_cell(status_name(r.status))};
    if (r.status == Status::Ok) {
      const Spread spread = spread_of(r);
      for (double ns : {r.median_ns, spread.p10, spread.p90, r.min_ns, r.max_ns})
        row.push_back(number_cell(significant(ns * 1e-6), ns * 1e-6));
      row.push_back(number_cell(format_number("%.1f", 100 * r.cv), 100 * r.cv));
      row.push_back(number_cell(std::to_string(r.samples_ns.size()), static_cast<double>(r.samples_ns.size())));
      row.push_back(number_cell(std::to_string(r.contended_samples), static_cast<double>(r.contended_samples)));
      row.push_back(number_cell(format_number("%.1f", r.gflops_per_s), r.gflops_per_s));
      const double mib = static_cast<double>(r.peak_tensor_bytes) / 1048576.0;
      row.push_back(number_cell(format_number("%.2f", mib), mib));
    } else {
      row.resize(row.size() + 10, text_cell(""));
    }
    row.push_back(text_cell(r.reason));
    rows.push_back(std::move(row));
  }
  return "<details class=\"xr-details\"><summary>Every point (" + std::to_string(rows.size()) +
         "), with its spread</summary>\n" +
         table_html(
             "xr-points",
             {"configuration", "class", "model", "parameters", "N", "status", "median (ms)", "p10 (ms)", "p90 (ms)",
              "min (ms)", "max (ms)", "CV %", "samples", "contended", "GFLOP/s", "peak MiB", "reason"},
             rows) +
         "</details>\n";
}

std::string status_summary(const Report& report) {
  std::map<std::string, int> counts;
  for (const auto& row : report.results) ++counts[status_name(row.status)];
  std::string text = std::to_string(report.results.size()) + " points:";
  for (const auto& [status, count] : counts) text += " " + std::to_string(count) + " " + status + ",";
  text.pop_back();
  return text;
}

std::string report_html(const NamedReport& input, std::size_t index, const HtmlReportOptions& options) {
  const std::string id = "r" + std::to_string(index + 1);
  std::ostringstream out;
  out << "<section class=\"xr-report\" id=\"" << id << "\" data-file=\"" << escape(input.name) << "\">\n<h2>"
      << escape(input.name) << "</h2>\n<p class=\"xr-summary\">" << escape(status_summary(input.report))
      << "</p>\n<h3>Context</h3>\n"
      << context_html(input.report.context) << "<details class=\"xr-details\"><summary>Settings</summary>\n<pre>"
      << escape(input.report.settings.dump(2)) << "</pre>\n</details>\n"
      << warnings_html(input.report);
  const auto views = metric_views(options.baseline);
  std::size_t number = 0;
  for (const auto& [name, configuration] : configurations(input.report)) {
    const bool decode = configuration.results.front().pass == Pass::Decode;
    out << "<section class=\"xr-configuration\" id=\"" << id << "-c" << ++number << "\" data-configuration=\""
        << escape(name) << "\">\n<h3>" << escape(name) << "</h3>\n";
    for (const auto& view : views)
      if (!view.decode_only || decode) out << metric_html(configuration, view, options);
    out << "</section>\n";
  }
  out << points_html(input.report) << "</section>\n";
  return out.str();
}

std::string contents_html(const std::vector<NamedReport>& reports) {
  std::ostringstream out;
  out << "<nav class=\"xr-contents\"><ul>\n";
  for (std::size_t i = 0; i < reports.size(); ++i) {
    const std::string id = "r" + std::to_string(i + 1);
    out << "<li><a href=\"#" << id << "\">" << escape(reports[i].name) << "</a><ul>";
    std::size_t number = 0;
    for (const auto& part : configurations(reports[i].report))
      out << "<li><a href=\"#" << id << "-c" << ++number << "\">" << escape(part.first) << "</a></li>";
    out << "</ul></li>\n";
  }
  out << "</ul></nav>\n";
  return out.str();
}

// Plain CSS; class names carry the xr- prefix because the plots' own style sheets (.title, .tick, …)
// apply to the whole page once inline.
const char* const kStyle = R"(
body{font-family:system-ui,'DejaVu Sans',Helvetica,Arial,sans-serif;color:#1d232a;margin:0;background:#fff}
header,main{max-width:1200px;margin:0 auto;padding:0 16px}
h1{font-size:24px;margin:16px 0 4px}
h2{font-size:20px;border-bottom:2px solid #2b5d8a;padding-bottom:4px;margin-top:28px}
h3{font-size:17px;margin:20px 0 8px}
h4{font-size:15px;margin:16px 0 4px}
.xr-what,.xr-summary,.xr-generator{color:#555;font-size:13px;margin:2px 0 8px}
.xr-empty{color:#777;font-style:italic}
.xr-ok{color:#2d6a2d}
.xr-warn{color:#8a3b00;font-weight:bold}
table{border-collapse:collapse;font-size:13px;margin:4px 0 12px}
th,td{border:1px solid #c9d3dd;padding:3px 8px;text-align:left;vertical-align:top}
td.xr-num,th.xr-num{text-align:right;font-variant-numeric:tabular-nums}
table[data-sortable] thead th{background:#d6e4f0;cursor:pointer;white-space:nowrap;user-select:none}
table[data-sortable] thead th:hover{background:#c2d6e8}
th[aria-sort=ascending]::after{content:' \25B2'}
th[aria-sort=descending]::after{content:' \25BC'}
table[data-sortable] tbody tr:nth-child(even){background:#f6f8fa}
.xr-context th{background:#eef1f4;font-weight:normal;color:#444;white-space:nowrap}
.xr-context td{font-family:ui-monospace,'DejaVu Sans Mono',monospace;word-break:break-all}
.xr-spread{color:#6a7580;font-size:11px}
.xr-plot{margin:4px 0 16px}
.xr-plot svg{max-width:100%;height:auto;border:1px solid #e1e6eb}
.xr-contents{font-size:13px}
pre{background:#f6f8fa;padding:8px;font-size:12px;overflow:auto;max-height:320px}
)";

// Sorting: a click (or Enter) on a header sorts the body rows by that column, ascending then
// descending; numeric columns (th data-numeric) compare data-value, others the text; cells without
// a key stay last in both directions. Array.prototype.sort is stable, so ties keep their order.
const char* const kScript = R"(
(function () {
  'use strict';
  function key(cell, numeric) {
    if (!cell) return null;
    if (numeric) {
      var value = cell.getAttribute('data-value');
      return value === null ? null : parseFloat(value);
    }
    var text = cell.textContent.trim();
    return text === '' ? null : text;
  }
  function sortBy(table, header, column) {
    var numeric = header.getAttribute('data-numeric') === 'true';
    var ascending = header.getAttribute('aria-sort') !== 'ascending';
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = key(a.cells[column], numeric), y = key(b.cells[column], numeric);
      if (x === null || y === null) return (x === null) - (y === null);
      var order = numeric ? x - y : x.localeCompare(y);
      return ascending ? order : -order;
    });
    Array.prototype.forEach.call(header.parentNode.cells, function (th) { th.removeAttribute('aria-sort'); });
    header.setAttribute('aria-sort', ascending ? 'ascending' : 'descending');
    rows.forEach(function (row) { body.appendChild(row); });
  }
  Array.prototype.forEach.call(document.querySelectorAll('table[data-sortable="true"]'), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (header, column) {
      header.tabIndex = 0;
      header.addEventListener('click', function () { sortBy(table, header, column); });
      header.addEventListener('keydown', function (event) {
        if (event.key === 'Enter' || event.key === ' ') {
          event.preventDefault();
          sortBy(table, header, column);
        }
      });
    });
    table.setAttribute('data-sort-ready', 'true');
  });
})();
)";

}  // namespace

std::string render_html_report(const std::vector<NamedReport>& reports, const HtmlReportOptions& options) {
  std::string files;
  for (const auto& input : reports) files += (files.empty() ? "" : ", ") + input.name;
  std::ostringstream out;
  out << "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
      << "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n"
      << "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
         "script-src 'unsafe-inline'\"/>\n"
      << "<title>xfbench report: " << escape(files) << "</title>\n<style>" << kStyle << "</style>\n</head>\n<body>\n"
      << "<header>\n<h1>xfbench report</h1>\n<p class=\"xr-generator\">" << escape(files)
      << (options.generator.empty() ? "" : " · written by " + escape(options.generator)) << "</p>\n"
      << contents_html(reports) << "</header>\n<main>\n";
  for (std::size_t i = 0; i < reports.size(); ++i) out << report_html(reports[i], i, options);
  out << "</main>\n<script>/*<![CDATA[*/" << kScript << "/*]]>*/</script>\n</body>\n</html>\n";
  return out.str();
}

}  // namespace xfb
