// `xfbench merge A.json B.json … -o ALL.json`: joins the shards of a sweep into one report.
#include <string>

#include <spdlog/spdlog.h>

#include "apps/cli/commands.hpp"
#include "apps/report/files.hpp"
#include "apps/report/merge.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {

void add_merge(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("merge", "join reports of one sweep (e.g. its --shard parts) into one report");
  auto inputs = std::make_shared<std::vector<std::string>>();
  auto out = std::make_shared<std::string>();
  command->add_option("reports", *inputs, "reports (JSON) to join")->required();
  command->add_option("--out,-o", *out, "merged report (JSON; - for standard output)")->required();
  command->callback([=, &action] {
    action = [=] {
      check_output_path(*out, *inputs);
      std::vector<NamedReport> reports;
      for (const auto& path : *inputs) reports.push_back({path, load_report(path)});
      const Report merged = merge_reports(reports);
      const std::string text = report_to_json(merged).dump(2) + "\n";
      if (text.size() > kMaxInputBytes)  // a report no command could read back
        throw InputError("the merged report would be " + std::to_string(text.size()) + " bytes, more than the " +
                         std::to_string(kMaxInputBytes >> 20) + " MiB a report may have; merge fewer reports");
      write_output(*out, text, *inputs);
      spdlog::info("merged {} report(s), {} point(s) into {}", reports.size(), merged.results.size(),
                   *out == "-" ? "standard output" : *out);
      return kExitOk;
    };
  });
}

}  // namespace xfb::cli
