// `xfbench complexity FILE.json`: empirical complexity per model against the survey's.
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
  command->add_option("--format", *format, "text | md | json")->check(CLI::IsMember({"text", "md", "json"}));
  command->callback([=, &action] {
    action = [=] {
      std::vector<std::string> skipped;
      const Report report = load_nonempty_report(*file);
      require_known_models(report, *file);
      const auto series = analyse_complexity(report, &skipped);
      const ComplexityFormat f = *format == "md"     ? ComplexityFormat::Markdown
                                 : *format == "json" ? ComplexityFormat::Json
                                                     : ComplexityFormat::Text;
      std::printf("%s", render_complexity(series, skipped, f).c_str());
      return 0;
    };
  });
}

}  // namespace xfb::cli
