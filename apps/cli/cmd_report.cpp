// `xfbench report A.json [B.json …] --out report.html`: one self-contained HTML page of the reports.
#include <cstdio>

#include "apps/bench/system_info.hpp"
#include "apps/cli/commands.hpp"
#include "apps/report/html_report.hpp"
#include "apps/report/table.hpp"
#include "apps/report/tidy_csv.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {
bool ends_with(const std::string& text, const std::string& end) {
  return text.size() > end.size() && text.compare(text.size() - end.size(), end.size(), end) == 0;
}

// The tidy CSV (apps/report/tidy_csv.hpp) of every row of every report, with a first column
// `report` naming the file the row comes from.
std::string tidy_csv_of(const std::vector<NamedReport>& reports) {
  Report all;
  std::vector<std::string> sources;
  for (const auto& [name, report] : reports)
    for (const auto& row : report.results) {
      all.results.push_back(row);
      sources.push_back(name);
    }
  auto cells = tidy_cells(all);
  cells.front().insert(cells.front().begin(), "report");
  for (std::size_t i = 1; i < cells.size(); ++i) cells[i].insert(cells[i].begin(), sources[i - 1]);
  return render_cells(cells, TableFormat::Csv);
}
}  // namespace

void add_report(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand(
      "report", "one self-contained HTML page of reports: context, tables with spread, plots, warnings");
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>();
  auto baseline = std::make_shared<std::string>("vanilla");
  auto csv = std::make_shared<std::string>();
  command->add_option("reports", *inputs, "reports (JSON) to show, one section each")->required();
  command->add_option("--out,-o", *out, "HTML file to write (.html; - for standard output)")->required();
  command->add_option("--baseline", *baseline, "model the speed-up and memory ratio are relative to")
      ->capture_default_str();
  command->add_option("--csv", *csv,
                      "also write the tidy CSV of every row (table --format csv --tidy, with a report column)");
  command->callback([=, &action] {
    const bool baseline_given = command->count("--baseline") > 0;
    action = [=] {
      check_output_path(*out, *inputs);
      if (!csv->empty()) {
        check_output_path(*csv, *inputs);
        if (*csv == *out) throw InputError("--csv " + *csv + " is also --out");
      }
      if (*out != "-" && !ends_with(*out, ".html") && !ends_with(*out, ".htm"))
        throw InputError("--out " + *out +
                         ": report writes HTML; give the file the .html extension (or - for "
                         "standard output)");
      std::vector<NamedReport> reports;
      for (const auto& path : *inputs) {
        reports.push_back({path, load_nonempty_report(path)});
        if (baseline_given) require_model(reports.back().report, *baseline, path, "--baseline");
      }
      HtmlReportOptions options;
      options.baseline = *baseline;
      options.generator = version_text();
      const std::string page = render_html_report(reports, options);
      if (!csv->empty()) write_output(*csv, tidy_csv_of(reports), *inputs);
      write_output(*out, page, *inputs);
      return kExitOk;
    };
  });
}

}  // namespace xfb::cli
