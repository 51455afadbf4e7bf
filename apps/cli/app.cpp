// The command-line application: global flags and every subcommand (apps/cli/cmd_<name>.cpp).
#include "apps/bench/system_info.hpp"
#include "apps/cli/commands.hpp"

namespace xfb::cli {
namespace {
std::string g_command_line;
}

void set_command_line(int argc, const char* const* argv) {
  g_command_line.clear();
  for (int i = 0; i < argc; ++i) g_command_line += (i ? " " : "") + std::string(argv[i]);
}
const std::string& command_line() { return g_command_line; }

void build_app(CLI::App& app, Action& action) {
  app.require_subcommand(1);
  app.set_version_flag("--version", version_text());
  add_list(app, action);
  add_env(app, action);
  add_run(app, action);
  add_sweep(app, action);
  add_table(app, action);
  add_compare(app, action);
  add_ab(app, action);
  add_merge(app, action);
  add_plot(app, action);
  add_report(app, action);
  add_complexity(app, action);
  add_taxonomy(app, action);
}

}  // namespace xfb::cli
