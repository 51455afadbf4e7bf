#include "apps/report/table.hpp"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>

#include "apps/report/complexity.hpp"
#include "apps/report/crossover.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {
namespace {

// Rows × lengths of one table: a report of distinct models at distinct lengths must not make
// the table grow as the square of its size.
constexpr std::size_t kMaxTableCells = 1'000'000;

std::string metric_title(const TableOptions& o, bool decode) {
  switch (o.metric) {
    case TableMetric::Time:
      return decode ? "median time per generated token (µs; ~ marks CV > 5%, ! a contended point)"
                    : "median time (ms; ~ marks CV > 5%, ! a contended point)";
    case TableMetric::Speedup:
      return "speed-up over " + o.baseline +
             " (×, higher is faster; ~ marks CV > 5%, ! a contended point, in either row)";
    case TableMetric::Memory:
      return "peak tracked memory (MiB)";
    case TableMetric::MemoryRatio:
      return "peak tracked memory relative to " + o.baseline + " (×, lower is smaller)";
    case TableMetric::Gflops:
      return "executed GFLOP/s (~ marks CV > 5%, ! a contended point; in parentheses the share of the measured FMA "
             "peak, for bf16 rows of the bf16 dot-product peak, where the report has it; ≤ where the peak was measured "
             "on a busy machine)";
    case TableMetric::State:
      return "decode state kept between steps (MiB; - for other passes)";
    case TableMetric::Crossover:
      return "crossover length against " + o.baseline +
             ": smallest N from which the model is faster (time) or smaller (memory) at every larger compared N";
    case TableMetric::Front:
      return decode ? "time–memory front (time per generated token in µs, peak tracked MiB)"
                    : "time–memory front (median ms, peak tracked MiB)";
  }
  return "";
}

// The stability marks after a measured figure: ~ a spread over 5% (CV), ! a contended point.
std::string stability_marks(const ResultRow& row) {
  return std::string(row.unstable ? "~" : "") + (row.contended ? "!" : "");
}

std::string status_cell(const ResultRow& row) {
  switch (row.status) {
    case Status::Skipped:
      return "skipped";
    case Status::Unsupported:
      return "n/a";
    case Status::Error:
      return "error";
    case Status::Ok:
      return "";
  }
  return "";
}

std::string cell(const ResultRow& row, const ResultRow* baseline, const TableOptions& o,
                 const nlohmann::json& context) {
  if (row.status != Status::Ok) return status_cell(row);
  switch (o.metric) {
    case TableMetric::Time:
      return time_cell(row);
    case TableMetric::Speedup:
      if (baseline == nullptr || baseline->status != Status::Ok) return "-";
      if (const auto ratio = finite_ratio(baseline->median_ns, row.median_ns))
        return format_number("%.2f×", *ratio) + (row.unstable || baseline->unstable ? "~" : "") +
               (row.contended || baseline->contended ? "!" : "");
      return "-";
    case TableMetric::Memory:
      return memory_cell(row);
    case TableMetric::MemoryRatio:
      if (baseline == nullptr || baseline->status != Status::Ok) return "-";
      if (const auto ratio = finite_ratio(static_cast<double>(row.peak_tensor_bytes),
                                          static_cast<double>(baseline->peak_tensor_bytes)))
        return format_number("%.3f×", *ratio);
      return "-";
    case TableMetric::Gflops: {
      // A bf16 row against the bf16 dot-product peak; without that figure, no share (never the fp32 peak).
      const double peak = dot_peak_for_row(context, row);
      const auto share = finite_ratio(100.0 * row.gflops_per_s, peak);
      const std::string figure = format_number("%.1f", row.gflops_per_s);
      if (row.dtype == DType::BF16 && !(peak > 0)) return figure + stability_marks(row) + " (no bf16 peak)";
      const bool upper_bound = peak_contended_for_row(context, row);  // a peak measured on a busy machine
      return figure + stability_marks(row) +
             (share ? format_number(upper_bound ? " (≤%.0f%%)" : " (%.0f%%)", *share) : "");
    }
    case TableMetric::State:
      return row.pass == Pass::Decode ? format_number("%.3f", static_cast<double>(row.state_bytes) / (1024.0 * 1024.0))
                                      : "-";
    case TableMetric::Crossover:
    case TableMetric::Front:
      break;  // whole-group summaries (apps/report/crossover.hpp), not cells per N
  }
  return "";
}

// Row order: registry order grouped by each model's first class.
int model_rank(const std::string& name) {
  const auto& models = model_cards();
  const ModelCard* model = find_card(name);
  if (model == nullptr) return 1 << 20;
  const int class_rank = static_cast<int>(model->classes.front());
  const auto position = std::find_if(models.begin(), models.end(), [&](const ModelCard& m) { return m.name == name; });
  return class_rank * 1000 + static_cast<int>(position - models.begin());
}

std::string row_label(const ResultRow& row, bool with_params) {
  std::string label = row.model;
  const ModelCard* card = find_card(row.model);
  // An attention model run with a mixture-of-experts FFN: "performer+switch" (a feed-forward card is its FFN).
  if (row.ffn != "dense" && (card == nullptr || card->ffn != row.ffn)) label += "+" + row.ffn;
  if (with_params && !row.params.empty()) label += " (" + params_text(row.params) + ")";
  return label;
}

std::vector<std::string> complexity_cells(const std::vector<const ResultRow*>& rows) {
  const ComplexitySeries series = analyse_series(rows);
  const std::string survey = survey_text(series);
  if (series.lengths.size() < 3 || !series.flops.fit) return {survey, "-", "-"};
  const char* mark = series.verdict == ComplexityVerdict::Match           ? " ✓"
                     : series.verdict == ComplexityVerdict::MatchRevision ? " ✓ (rev.)"
                     : series.verdict == ComplexityVerdict::Mismatch      ? " ✗"
                     : series.verdict == ComplexityVerdict::Ambiguous     ? " ?"
                                                                          : "";
  char exponent[32] = "-";
  if (series.time.exponent) std::snprintf(exponent, sizeof exponent, "N^%.2f", *series.time.exponent);
  return {survey,
          (series.per_token ? per_token_name(series.flops.fit->best) : big_o_name(series.flops.fit->best)) + mark,
          exponent};
}

}  // namespace

std::string render_cells(const std::vector<std::vector<std::string>>& cells, TableFormat format,
                         std::size_t left_columns) {
  std::ostringstream out;
  if (cells.empty()) return "";
  if (format == TableFormat::Csv) {
    for (const auto& line : cells) {
      for (std::size_t i = 0; i < line.size(); ++i) {
        std::string value = line[i];
        if (value.find_first_of(",\"\r\n") != std::string::npos) {
          std::string quoted = "\"";
          for (char c : value) quoted += c == '"' ? std::string("\"\"") : std::string(1, c);
          value = quoted + "\"";
        }
        out << (i ? "," : "") << value;
      }
      out << "\n";
    }
    return out.str();
  }
  std::vector<std::size_t> widths(cells.front().size(), 0);
  auto display_width = [](const std::string& s) {
    std::size_t w = 0;
    for (unsigned char c : s) w += (c & 0xC0) != 0x80;
    return w;
  };
  for (const auto& line : cells)
    for (std::size_t i = 0; i < line.size(); ++i) widths[i] = std::max(widths[i], display_width(line[i]));
  for (std::size_t r = 0; r < cells.size(); ++r) {
    const auto& line = cells[r];
    for (std::size_t i = 0; i < line.size(); ++i) {
      const std::string pad(widths[i] - display_width(line[i]), ' ');
      const bool left = i < left_columns;
      if (format == TableFormat::Markdown) out << "| ";
      out << (left ? line[i] + pad : pad + line[i]) << (format == TableFormat::Markdown ? " " : "  ");
    }
    out << (format == TableFormat::Markdown ? "|" : "") << "\n";
    if (r == 0) {
      for (std::size_t i = 0; i < line.size(); ++i) {
        if (format == TableFormat::Markdown)
          out << "|" << (i < left_columns ? ":" : "-") << std::string(widths[i], '-') << (i < left_columns ? "-" : ":");
        else
          out << std::string(widths[i], '-') << "  ";
      }
      out << (format == TableFormat::Markdown ? "|" : "") << "\n";
    }
  }
  return out.str();
}

std::string first_class(const std::string& model) {
  const ModelCard* info = find_card(model);
  return info ? class_name(info->classes.front()) : "unknown";
}

std::string time_cell(const ResultRow& row) {
  if (row.status != Status::Ok) return "";
  return (row.pass == Pass::Decode ? format_number("%.1f", row.median_ns * 1e-3)
                                   : format_number("%.3f", row.median_ns * 1e-6)) +
         stability_marks(row);
}

std::string memory_cell(const ResultRow& row) {
  if (row.status != Status::Ok) return "";
  return format_number("%.1f", static_cast<double>(row.peak_tensor_bytes) / (1024.0 * 1024.0));
}

std::vector<TableGroup> table_groups(const Report& report, const std::string& baseline) {
  const RowsVary vary = rows_vary(report);
  std::map<TableKey, std::vector<const ResultRow*>> by_key;
  for (const auto& row : report.results)
    by_key[{scope_name(row.scope), pass_name(row.pass), row.causal, row.batch, row.heads, row.head_dim, row.d_ff,
            row.decode_tokens, dtype_name(row.dtype), vary.threads ? std::optional<int>(row.threads) : std::nullopt,
            vary.seed ? std::optional<std::uint64_t>(row.seed) : std::nullopt}]
        .push_back(&row);
  std::vector<TableGroup> groups;
  for (const auto& [key, rows] : by_key) {
    TableGroup& group = groups.emplace_back();
    group.key = key;
    std::map<std::string, std::set<std::string>> variants;
    for (const auto* row : rows) {
      group.lengths.insert(row->seq_len);
      variants[row->model].insert(row->params.dump());
    }
    for (const auto* row : rows) {
      const std::string label = row_label(*row, variants[row->model].size() > 1);
      if (!group.grid.count(label)) group.labels.push_back(label);
      group.grid[label][row->seq_len] = row;
      group.label_model[label] = row->model;
      if (row->model == baseline) group.baseline.emplace(row->seq_len, row);
    }
    std::stable_sort(group.labels.begin(), group.labels.end(), [&](const std::string& a, const std::string& b) {
      return model_rank(group.label_model[a]) < model_rank(group.label_model[b]);
    });
    if (group.labels.size() * group.lengths.size() > kMaxTableCells)
      throw InputError("a table of this report would have " + std::to_string(group.labels.size()) + " rows × " +
                       std::to_string(group.lengths.size()) + " sequence lengths, more than " +
                       std::to_string(kMaxTableCells) + " cells");
  }
  return groups;
}

namespace {

std::string heading(const TableKey& key) {
  return "scope " + key.scope + (key.pass != "forward" ? ", " + key.pass + " pass" : "") +
         (key.causal ? ", causal" : "") + ", B=" + std::to_string(key.batch) + " H=" + std::to_string(key.heads) +
         " D=" + std::to_string(key.head_dim) +
         (key.pass == "decode" ? ", T=" + std::to_string(key.decode_tokens) : "") +
         (key.d_ff ? ", d_ff=" + std::to_string(key.d_ff) : "") + (key.dtype != "f32" ? ", " + key.dtype : "") +
         (key.threads ? ", threads=" + std::to_string(*key.threads) : "") +
         (key.seed ? ", seed=" + std::to_string(*key.seed) : "");
}

// Models × lengths of one metric, with the complexity columns when asked for.
std::vector<std::vector<std::string>> metric_cells(const TableGroup& group, const TableOptions& options,
                                                   const nlohmann::json& context) {
  std::vector<std::string> header = {"class", "model"};
  for (auto n : group.lengths) header.push_back("N=" + std::to_string(n));
  if (options.complexity) header.insert(header.end(), {"survey", "flops fit", "time"});
  std::vector<std::vector<std::string>> cells = {header};
  for (const auto& label : group.labels) {
    const auto& by_length = group.grid.at(label);
    std::vector<std::string> line = {first_class(group.label_model.at(label)), label};
    for (auto n : group.lengths) {
      auto found = by_length.find(n);
      auto reference = group.baseline.find(n);
      line.push_back(found == by_length.end()
                         ? ""
                         : cell(*found->second, reference == group.baseline.end() ? nullptr : reference->second,
                                options, context));
    }
    if (options.complexity) {
      std::vector<const ResultRow*> series;
      for (const auto& [n, row] : by_length) series.push_back(row);
      const auto extra = complexity_cells(series);
      line.insert(line.end(), extra.begin(), extra.end());
    }
    cells.push_back(line);
  }
  return cells;
}

}  // namespace

std::string render_table(const Report& report, const TableOptions& options) {
  const bool csv = options.format == TableFormat::Csv;
  std::ostringstream out;
  bool first_group = true;
  // CSV: one header for every group, so a dtype column when any row is not f32.
  const bool dtype_column = std::any_of(report.results.begin(), report.results.end(),
                                        [](const ResultRow& r) { return r.dtype != DType::F32; });
  for (const TableGroup& group : table_groups(report, options.baseline)) {
    const TableKey& key = group.key;
    if (!csv)
      out << (first_group ? "" : "\n") << (options.format == TableFormat::Markdown ? "**" : "")
          << metric_title(options, key.pass == "decode") << " — " << heading(key)
          << (options.format == TableFormat::Markdown ? "**\n\n" : "\n");
    auto cells = options.metric == TableMetric::Crossover ? crossover_cells(group, options.format)
                 : options.metric == TableMetric::Front   ? front_cells(group, options.format)
                                                          : metric_cells(group, options, report.context);
    if (csv) {
      std::vector<std::string> columns = {"scope", "pass", "causal", "batch", "heads", "head_dim"};
      std::vector<std::string> values = {key.scope,
                                         key.pass,
                                         key.causal ? "true" : "false",
                                         std::to_string(key.batch),
                                         std::to_string(key.heads),
                                         std::to_string(key.head_dim)};
      if (dtype_column) {
        columns.push_back("dtype");
        values.push_back(key.dtype);
      }
      if (key.threads) {
        columns.push_back("threads");
        values.push_back(std::to_string(*key.threads));
      }
      if (key.seed) {
        columns.push_back("seed");
        values.push_back(std::to_string(*key.seed));
      }
      cells.front().insert(cells.front().begin(), columns.begin(), columns.end());
      for (std::size_t r = 1; r < cells.size(); ++r) cells[r].insert(cells[r].begin(), values.begin(), values.end());
      if (!first_group) cells.erase(cells.begin());
    }
    out << render_cells(cells, options.format, options.metric == TableMetric::Front ? 3 : 2);
    first_group = false;
  }
  if (first_group) out << "(no results)\n";
  const std::string note = options.metric == TableMetric::Crossover ? crossover_note()
                           : options.metric == TableMetric::Front   ? front_note()
                                                                    : "";
  if (!first_group && !csv && !note.empty()) out << "\n" << note << "\n";
  return out.str();
}

}  // namespace xfb
