// `xfbench complexity FILE.json`: empirical complexity per model against the survey's; the JSON
// adds each model's crossover length against `--baseline`.
#include <cstdio>

#include "apps/cli/commands.hpp"
#include "apps/report/complexity.hpp"

namespace xfb::cli {

void add_complexity(CLI::App& app, Action& action) {
  auto* command =
      app.add_subcommand("complexity", "fit how time, FLOPs and workspace grow with N; compare with the survey");
  auto file = std::make_shared<std::string>();
  auto format = std::make_shared<std::string>("text");
  command->add_option("file", *file, "report JSON")->required();
  auto baseline = std::make_shared<std::string>("vanilla");
  command->add_option("--format", *format, "text | md | json")
      ->check(CLI::IsMember({"text", "md", "json"}))
      ->capture_default_str();
  command->add_option("--baseline", *baseline, "model the JSON's crossover lengths are relative to")
      ->capture_default_str();
  command->callback([=, &action] {
    const bool baseline_given = command->count("--baseline") > 0;
    action = [=] {
      std::vector<std::string> skipped;
      const Report report = load_nonempty_report(*file);
      require_known_models(report, *file);
      if (baseline_given) require_model(report, *baseline, *file, "--baseline");
      const auto series = analyse_complexity(report, &skipped, *baseline);
      const ComplexityFormat f = *format == "md"     ? ComplexityFormat::Markdown
                                 : *format == "json" ? ComplexityFormat::Json
                                                     : ComplexityFormat::Text;
      std::printf("%s", render_complexity(series, skipped, f).c_str());
      return 0;
    };
  });
}

}  // namespace xfb::cli
