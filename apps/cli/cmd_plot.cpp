// `xfbench plot FILE.json --metric time|memory|speedup|state|gflops --out FILE.svg`: a log-log chart.
#include <cstdio>

#include "apps/cli/commands.hpp"
#include "apps/report/plot.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {

void add_plot(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("plot", "draw a report as a log-log SVG chart (one series per model)");
  auto file = std::make_shared<std::string>();
  auto out = std::make_shared<std::string>();
  auto metric = std::make_shared<std::string>("time");
  auto baseline = std::make_shared<std::string>("vanilla");
  command->add_option("file", *file, "report JSON")->required();
  command->add_option("--metric", *metric, "time | memory | speedup | state (decode rows) | gflops")
      ->check(CLI::IsMember({"time", "memory", "speedup", "state", "gflops"}))
      ->capture_default_str();
  command->add_option("--baseline", *baseline, "model the speed-up is relative to")->capture_default_str();
  command->add_option("--out,-o", *out, "SVG file to write (.svg; - for standard output)")->required();
  command->callback([=, &action] {
    const bool baseline_given = command->count("--baseline") > 0;
    action = [=] {
      check_output_path(*out, {*file});
      const bool svg_name = out->size() > 4 && out->compare(out->size() - 4, 4, ".svg") == 0;
      if (*out != "-" && !svg_name)
        throw InputError("--out " + *out +
                         ": plot writes SVG only (no PNG or other format); give the file the .svg extension (or - "
                         "for standard output)");
      PlotOptions options;
      options.metric = *metric == "memory"    ? PlotMetric::Memory
                       : *metric == "speedup" ? PlotMetric::Speedup
                       : *metric == "state"   ? PlotMetric::State
                       : *metric == "gflops"  ? PlotMetric::Gflops
                                              : PlotMetric::Time;
      options.baseline = *baseline;
      const Report report = load_nonempty_report(*file);
      if (baseline_given || options.metric == PlotMetric::Speedup)
        require_model(report, *baseline, *file, "--baseline");
      write_output(*out, render_plot(report, options), {*file});
      return kExitOk;
    };
  });
}

}  // namespace xfb::cli
