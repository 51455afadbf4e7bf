// `xfbench env`: the context a report records; `--measure` adds FMA peak and memory bandwidth.
#include <cstdio>

#include "apps/bench/system_info.hpp"
#include "apps/cli/commands.hpp"
#include "lib/core/dnnl_context.hpp"

namespace xfb::cli {

void add_env(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("env", "print this machine's context (CPU, ISA, oneDNN, compiler, build)");
  auto measure = std::make_shared<bool>(false);
  auto point = std::make_shared<PointOptions>();
  point->defaults.problem.threads = DnnlContext::default_threads();
  auto json = std::make_shared<bool>(false);
  command->add_flag("--measure", *measure, "also measure fp32 FMA peak and memory bandwidth (a few seconds)");
  add_point_options(*command, point, FieldUse::Point, {"threads"});
  command->add_flag("--json", *json, "print JSON");
  command->callback([=, &action] {
    const int threads = point_of(*point).problem.threads;  // validated when parsed
    action = [=] {
      auto& context = DnnlContext::instance();
      context.set_threads(threads);
      auto info = capture_context(context.threads());
      if (*measure) info.update(machine_figures(measure_machine(context.threads())));
      if (*json) {
        std::printf("%s\n", info.dump(2).c_str());
      } else {
        for (const auto& [key, value] : info.items())
          std::printf("%-20s %s\n", key.c_str(),
                      value.is_string() ? value.get<std::string>().c_str() : value.dump().c_str());
      }
      return 0;
    };
  });
}

}  // namespace xfb::cli
