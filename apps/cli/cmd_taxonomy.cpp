// `xfbench taxonomy`: the survey's Table 1 (md, json) or its class diagram (svg) from the registry.
#include <cstdio>

#include "apps/cli/commands.hpp"
#include "apps/report/report.hpp"
#include "apps/report/taxonomy_view.hpp"

namespace xfb::cli {

void add_taxonomy(CLI::App& app, Action& action) {
  auto* command =
      app.add_subcommand("taxonomy", "the survey's Table 1 (md, json) or class diagram (svg) from the registry");
  auto format = std::make_shared<std::string>("md");
  auto out = std::make_shared<std::string>();
  command->add_option("--format", *format, "md | json | svg")
      ->check(CLI::IsMember({"md", "json", "svg"}))
      ->capture_default_str();
  command->add_option("--out,-o", *out, "write to this file instead of stdout (- is stdout)");
  command->callback([=, &action] {
    action = [=] {
      if (!out->empty()) check_output_path(*out);
      const TaxonomyFormat f = *format == "json"  ? TaxonomyFormat::Json
                               : *format == "svg" ? TaxonomyFormat::Svg
                                                  : TaxonomyFormat::Markdown;
      const std::string text = render_taxonomy(f);
      if (out->empty())
        std::printf("%s", text.c_str());
      else
        write_output(*out, text);
      return 0;
    };
  });
}

}  // namespace xfb::cli
