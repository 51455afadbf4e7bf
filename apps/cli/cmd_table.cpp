// `xfbench table`: a report as a comparison table (terminal text, Markdown or CSV); `--paper lra`
// sets our ratios next to LRA's published ones; `--complexity` adds the fitted complexity;
// `--format csv --tidy` prints one row per point (apps/report/tidy_csv.hpp).
#include <cstdio>

#include "apps/cli/commands.hpp"
#include "apps/report/dashboard.hpp"
#include "apps/report/lra.hpp"
#include "apps/report/table.hpp"
#include "apps/report/tidy_csv.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {

void add_table(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("table", "print a report as a table: models × sequence lengths");
  auto file = std::make_shared<std::string>();
  auto metric = std::make_shared<std::string>("time");
  auto format = std::make_shared<std::string>("text");
  auto baseline = std::make_shared<std::string>("vanilla");
  auto paper = std::make_shared<std::string>();
  auto complexity = std::make_shared<bool>(false);
  command->add_option("file", *file, "report JSON")->required();
  auto tidy = std::make_shared<bool>(false);
  command
      ->add_option("--metric", *metric,
                   "time | speedup | memory | memory-ratio | gflops | state (decode rows) | crossover | front")
      ->check(CLI::IsMember({"time", "speedup", "memory", "memory-ratio", "gflops", "state", "crossover", "front"}))
      ->capture_default_str();
  command->add_option("--format", *format, "text | md | csv | github-benchmark | bmf")
      ->check(CLI::IsMember({"text", "md", "csv", "github-benchmark", "bmf"}))
      ->capture_default_str();
  command->add_option("--baseline", *baseline, "model the speed-up, memory ratio and crossover are relative to")
      ->capture_default_str();
  command->add_flag("--tidy", *tidy, "with --format csv: one row per point, every field and figure a column");
  command->add_option("--paper", *paper, "lra: our speed-ups and memory ratios next to LRA Table 2's")
      ->check(CLI::IsMember({"lra"}));
  command->add_flag("--complexity", *complexity,
                    "add the survey's complexity, the FLOP-count fit and the time exponent");
  command->callback([=, &action] {
    const bool baseline_given = command->count("--baseline") > 0;
    action = [=] {
      TableOptions options;
      options.metric = *metric == "speedup"        ? TableMetric::Speedup
                       : *metric == "memory"       ? TableMetric::Memory
                       : *metric == "memory-ratio" ? TableMetric::MemoryRatio
                       : *metric == "gflops"       ? TableMetric::Gflops
                       : *metric == "state"        ? TableMetric::State
                       : *metric == "crossover"    ? TableMetric::Crossover
                       : *metric == "front"        ? TableMetric::Front
                                                   : TableMetric::Time;
      if (*tidy) {  // every metric is a column: --metric and --baseline do not apply
        if (*format != "csv") throw InputError("--tidy needs --format csv");
        if (!paper->empty() || *complexity)
          throw InputError("--tidy prints every point's fields; drop --paper and --complexity");
        std::printf("%s", tidy_csv(load_report(*file)).c_str());
        return 0;
      }
      const bool summary = options.metric == TableMetric::Crossover || options.metric == TableMetric::Front;
      if (summary && *complexity)
        throw InputError("--complexity adds columns to the per-N tables, not to --metric " + *metric);
      if (*format == "github-benchmark" || *format == "bmf") {
        if (!paper->empty()) throw InputError("--paper lra prints text or md");
        DashboardOmissions omitted;
        const auto entries = dashboard_entries(load_report(*file), &omitted);
        std::printf("%s", (*format == "bmf" ? bencher_bmf_json(entries) : github_benchmark_json(entries)).c_str());
        if (omitted.contended + omitted.unstable > 0)
          std::fprintf(stderr, "xfbench: note: %s\n", omission_note(omitted, *file).c_str());
        return 0;
      }
      options.format = *format == "md"    ? TableFormat::Markdown
                       : *format == "csv" ? TableFormat::Csv
                                          : TableFormat::Text;
      options.baseline = *baseline;
      options.complexity = *complexity;
      if (!paper->empty()) {
        if (options.format == TableFormat::Csv) throw InputError("--paper lra prints text or md, not csv");
        const Report report = load_nonempty_report(*file);
        require_known_models(report, *file);
        std::printf("%s", render_lra_comparison(report, options.format).c_str());
        return 0;
      }
      const Report report = load_report(*file);
      const bool uses_baseline = options.metric == TableMetric::Speedup || options.metric == TableMetric::MemoryRatio ||
                                 options.metric == TableMetric::Crossover;
      if (baseline_given || uses_baseline) require_model(report, options.baseline, *file, "--baseline");
      if (options.complexity) require_known_models(report, *file);
      std::printf("%s", render_table(report, options).c_str());
      return 0;
    };
  });
}

}  // namespace xfb::cli
