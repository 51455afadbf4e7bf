#include "apps/report/lra.hpp"

#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#include "lib/core/errors.hpp"
#include "lib/core/stats.hpp"

namespace xfb {

const std::vector<LraPublished>& lra_table2() {
  // Tay et al., "Long Range Arena: A Benchmark for Efficient Transformers", ICLR 2021,
  // arXiv 2011.04006, Table 2 (copied in ../shared/SURVEY.md). Sparse Transformer and Longformer
  // were not timed there.
  static const std::vector<LraPublished> table = {
      {"vanilla", "Transformer", {8.1, 4.9, 2.3, 1.4}, {0.85, 2.65, 5.51, 9.48}, {}},
      {"local", "Local Attention", {9.2, 8.4, 7.4, 7.4}, {0.42, 0.76, 1.06, 1.37}, {}},
      {"linformer", "Linformer", {9.3, 9.1, 8.5, 7.7}, {0.37, 0.55, 0.99, 0.99}, {}},
      {"reformer", "Reformer", {4.4, 2.2, 1.5, 1.1}, {0.48, 0.99, 1.53, 2.28}, {}},
      {"sinkhorn", "Sinkhorn Trans.", {9.1, 7.9, 6.6, 5.3}, {0.47, 0.83, 1.13, 1.48}, {}},
      // The 3K speed is printed identical to Sinkhorn's and is very likely a typo.
      {"synthesizer", "Synthesizer", {8.7, 5.7, 6.6, 1.9}, {0.65, 1.98, 4.09, 6.99}, {false, false, true, false}},
      {"bigbird", "BigBird", {7.4, 3.9, 2.7, 1.5}, {0.77, 1.49, 2.18, 2.88}, {}},
      {"linear-transformer", "Linear Trans.", {9.1, 9.3, 8.6, 7.8}, {0.37, 0.57, 0.80, 1.03}, {}},
      {"performer", "Performer", {9.5, 9.4, 8.7, 8.0}, {0.37, 0.59, 0.82, 1.06}, {}},
  };
  return table;
}

namespace {

int lra_column(std::int64_t n) {
  for (int k = 1; k <= 4; ++k)
    if (n == 1000 * k || n == 1024 * k) return k - 1;
  return -1;
}

std::string rho_text(const std::vector<double>& ours, const std::vector<double>& theirs) {
  if (ours.size() < 3) return "n/a";
  return format_number("%.2f", spearman_rho(ours, theirs));
}

// Speed-up (vanilla's median over the row's) or memory ratio (the row's peak over vanilla's);
// none when it is not a finite number.
std::optional<double> our_ratio(const ResultRow& row, const ResultRow& vanilla, bool speed) {
  if (speed) return finite_ratio(vanilla.median_ns, row.median_ns);
  return finite_ratio(static_cast<double>(row.peak_tensor_bytes), static_cast<double>(vanilla.peak_tensor_bytes));
}

struct Column {
  std::int64_t n = 0;
  const ResultRow* vanilla = nullptr;
  std::map<std::string, const ResultRow*> rows;  // first row per model
};

// One table (speed-up or memory) for one configuration; rho receives its ρ per sequence length.
std::string render_metric(const std::vector<Column>& columns, bool speed, TableFormat format,
                          std::map<std::int64_t, std::string>& rho_by_length) {
  std::vector<std::vector<std::string>> cells;
  std::vector<std::string> header = {"model"};
  for (const auto& c : columns) {
    const std::string name = std::to_string(c.n);
    header.push_back("N=" + name + " ours");
    header.push_back("N=" + name + " LRA");
  }
  cells.push_back(header);
  std::vector<std::vector<double>> ours(columns.size()), theirs(columns.size());
  for (const auto& published : lra_table2()) {
    std::vector<std::string> line = {std::string(published.model) + " (" + published.lra_name + ")"};
    for (std::size_t i = 0; i < columns.size(); ++i) {
      const int k = lra_column(columns[i].n);
      const double base = speed ? published.steps_per_s[k] / lra_table2().front().steps_per_s[k]
                                : published.memory_gb[k] / lra_table2().front().memory_gb[k];
      const auto found = columns[i].rows.find(published.model);
      const ResultRow* row = found == columns[i].rows.end() ? nullptr : found->second;
      std::string mine = "-";
      if (row && row->status != Status::Ok)
        mine = row->status == Status::Unsupported ? "n/a" : status_name(row->status);
      const auto ratio = row && row->status == Status::Ok ? our_ratio(*row, *columns[i].vanilla, speed) : std::nullopt;
      if (ratio) {
        const double value = *ratio;
        mine = format_number("%.2f×", value);
        if (!(speed && published.doubtful[k])) {
          ours[i].push_back(value);
          theirs[i].push_back(base);
        }
      }
      line.push_back(mine);
      line.push_back(format_number("%.2f×", base) + (speed && published.doubtful[k] ? "†" : ""));
    }
    cells.push_back(line);
  }
  std::vector<std::string> rho = {"Spearman ρ (models)"};
  for (std::size_t i = 0; i < columns.size(); ++i) {
    rho.push_back(rho_text(ours[i], theirs[i]));
    rho.push_back("(n=" + std::to_string(ours[i].size()) + ")");
    rho_by_length[columns[i].n] = rho.end()[-2] + " " + rho.back();
  }
  cells.push_back(rho);
  return render_cells(cells, format, 1);
}

// ρ of one configuration's speed and memory tables per length, kept per pass for the side-by-side.
struct PassRho {
  std::map<std::int64_t, std::string> speed, memory;
};

// The configuration without its pass ("attention, B=1 H=8 D=64").
std::string configuration_without_pass(const ResultRow& row) {
  ResultRow forward = row;
  forward.pass = Pass::Forward;
  return configuration_text(forward);
}

// ρ for every pass of one configuration side by side (LRA timed training steps: its `train` column
// compares like with like).
std::string render_rho_by_pass(const std::map<std::string, PassRho>& passes, TableFormat format) {
  std::set<std::int64_t> lengths;
  for (const auto& [pass, rho] : passes)
    for (const auto& [n, text] : rho.speed) lengths.insert(n);
  std::vector<std::vector<std::string>> cells;
  std::vector<std::string> header = {"N"};
  for (const char* metric : {"speed", "memory"})
    for (const auto& [pass, rho] : passes) header.push_back(std::string("ρ ") + metric + " " + pass);
  cells.push_back(header);
  for (auto n : lengths) {
    std::vector<std::string> line = {std::to_string(n)};
    for (bool speed : {true, false})
      for (const auto& [pass, rho] : passes) {
        const auto& by_length = speed ? rho.speed : rho.memory;
        const auto found = by_length.find(n);
        line.push_back(found == by_length.end() ? "-" : found->second);
      }
    cells.push_back(line);
  }
  return render_cells(cells, format, 1);
}

}  // namespace

std::string render_lra_comparison(const Report& report, TableFormat format) {
  std::map<std::string, std::map<std::int64_t, Column>> groups;
  std::map<std::string, std::pair<std::string, std::string>> base_and_pass;  // configuration → (without pass, pass)
  for (const auto& row : report.results) {
    if (lra_column(row.seq_len) < 0) continue;
    base_and_pass[configuration_text(row)] = {configuration_without_pass(row), pass_name(row.pass)};
    Column& column = groups[configuration_text(row)][row.seq_len];
    column.n = row.seq_len;
    column.rows.emplace(row.model, &row);
    if (row.model == "vanilla" && row.status == Status::Ok && column.vanilla == nullptr) column.vanilla = &row;
  }
  std::ostringstream out;
  const bool md = format == TableFormat::Markdown;
  bool any = false;
  std::map<std::string, std::map<std::string, PassRho>> rho;  // configuration without pass → pass → ρ
  for (const auto& [configuration, by_length] : groups) {
    std::vector<Column> columns;
    for (const auto& [n, column] : by_length)
      if (column.vanilla != nullptr) columns.push_back(column);
    if (columns.empty()) continue;
    any = true;
    const std::string bold = md ? "**" : "";
    out << (out.tellp() > 0 ? "\n" : "") << bold
        << "Speed-up over vanilla (ours: median time; LRA: training steps/s over "
        << "the Transformer's) — " << configuration << bold << "\n"
        << (md ? "\n" : "");
    const auto& [base, pass] = base_and_pass[configuration];
    PassRho& pass_rho = rho[base][pass];
    out << render_metric(columns, true, format, pass_rho.speed);
    out << "\n"
        << bold << "Peak memory relative to vanilla (ours: tracked bytes; LRA: GB per device) — " << configuration
        << bold << "\n"
        << (md ? "\n" : "");
    out << render_metric(columns, false, format, pass_rho.memory);
  }
  for (const auto& [base, passes] : rho) {
    const std::string bold = md ? "**" : "";
    out << "\n"
        << bold << "Spearman ρ against LRA by pass (LRA timed training steps: `train` compares like with like) — "
        << base << bold << "\n"
        << (md ? "\n" : "");
    out << render_rho_by_pass(passes, format);
  }
  if (!any)
    throw InputError(
        "report has no vanilla point at an LRA length (1000·k or 1024·k tokens, k = 1…4); run "
        "`xfbench sweep --preset lra`");
  out << (md ? "\n" : "") << "LRA: Tay et al., Long Range Arena, ICLR 2021 (arXiv 2011.04006), Table 2: byte-level "
      << "text, batch 32, TPU v3; ratios computed from the published steps/s and GB. † as printed, very likely a "
      << "typo (identical to Sinkhorn's cell); excluded from ρ. ρ ranks the models with a value in both columns.\n";
  return out.str();
}

}  // namespace xfb
