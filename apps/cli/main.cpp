// xfbench: benchmarks the efficient-attention models of "Efficient Transformers: A Survey".
// Exit codes: 0 success · 1 a check or regression failed · 2 usage or input error · 3 runtime error.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "apps/cli/commands.hpp"
#include "apps/report/files.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {
// The name of an unknown subcommand (the first word that is not a flag, when it names no command), or "".
std::string unknown_command(const CLI::App& app, int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;  // the global flags take no values
    for (const auto* command : app.get_subcommands([](const CLI::App*) { return true; }))
      if (command->get_name() == argv[i]) return "";
    return argv[i];
  }
  return "";
}

std::string known_commands(const CLI::App& app) {
  std::string names;
  for (const auto* command : app.get_subcommands([](const CLI::App*) { return true; }))
    names += (names.empty() ? "" : ", ") + command->get_name();
  return names;
}
}  // namespace
}  // namespace xfb::cli

int main(int argc, char** argv) {
  using namespace xfb;
  cli::set_command_line(argc, argv);
  install_interrupt_cleanup();  // an interrupted write leaves no temporary behind
  CLI::App app{"xfbench — benchmarks of the efficient-attention models of 'Efficient Transformers: A Survey'"};
  bool verbose = false, quiet = false;
  app.add_flag("-v,--verbose", verbose, "debug logging");
  app.add_flag("-q,--quiet", quiet, "warnings and errors only");
  app.fallthrough();  // commands made after this pass -v and -q on: `xfbench sweep -q …` as `xfbench -q sweep …`
  cli::Action action;
  cli::build_app(app, action);
  const std::string unknown = cli::unknown_command(app, argc, argv);
  if (!unknown.empty()) {
    std::fprintf(stderr, "xfbench: error: unknown command '%s' (known: %s)\n", unknown.c_str(),
                 cli::known_commands(app).c_str());
    return kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --help-all, --version
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "xfbench: error: %s\n", e.what());
    return kExitUsage;
  } catch (const InputError& e) {
    std::fprintf(stderr, "xfbench: error: %s\n", e.what());
    return kExitUsage;
  }
  auto logger = spdlog::stderr_color_st("xfbench");
  logger->set_pattern("xfbench: %l: %v");
  logger->set_level(verbose ? spdlog::level::debug : quiet ? spdlog::level::warn : spdlog::level::info);
  spdlog::set_default_logger(logger);
  try {
    const int code = action();
    // Output lost to a full disk or a closed stream is a failure, not a success (exit 3).
    if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0) {
      std::fprintf(stderr, "xfbench: runtime error: cannot write to standard output: %s\n",
                   std::strerror(errno != 0 ? errno : EIO));
      return kExitRuntime;
    }
    return code;
  } catch (const InputError& e) {
    std::fprintf(stderr, "xfbench: error: %s\n", e.what());
    return kExitUsage;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "xfbench: runtime error: out of memory\n");
    return kExitRuntime;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "xfbench: runtime error: %s\n", e.what());
    return kExitRuntime;
  }
}
