// `xfbench compare BASE.json NEW.json`: point-by-point comparison with verdicts and regression
// gates; exit 1 when at least one regression exists (apps/report/compare.hpp has the rules).
#include <cstdio>

#include "apps/cli/commands.hpp"
#include "apps/report/compare.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {

struct CompareCommand {
  std::string base, now;
  std::string metrics = "time,memory,flops";
  std::string max_slowdown = "5%";
  std::string max_memory_growth = "0";
  std::string format = "text";
  CompareOptions options;
};

int run(CompareCommand& c) {
  parse_metrics(c.metrics, c.options);
  c.options.max_slowdown = parse_fraction(c.max_slowdown, "--max-slowdown");
  c.options.max_memory_growth = parse_fraction(c.max_memory_growth, "--max-memory-growth");
  const Report base = load_nonempty_report(c.base);
  const Report now = load_nonempty_report(c.now);
  const Comparison comparison = compare_reports(base, now, c.options);
  const CompareFormat format = c.format == "md"     ? CompareFormat::Markdown
                               : c.format == "json" ? CompareFormat::Json
                                                    : CompareFormat::Text;
  std::printf("%s", render_comparison(comparison, c.options, format).c_str());
  if (comparison.compared_nothing) {
    std::fprintf(stderr, "xfbench: compare: nothing compared: no point is ok in both %s and %s\n", c.base.c_str(),
                 c.now.c_str());
    return kExitCheckFailed;
  }
  return comparison.regressions > 0 ? kExitCheckFailed : kExitOk;
}

}  // namespace

void add_compare(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("compare", "compare two reports point by point; exit 1 on a regression");
  auto c = std::make_shared<CompareCommand>();
  command->add_option("base", c->base, "baseline report (JSON)")->required();
  command->add_option("new", c->now, "new report (JSON)")->required();
  command->add_option("--metrics", c->metrics, "gates that apply: any of time,memory,flops")->capture_default_str();
  add_real_option(*command, "--alpha", c->options.alpha, 1e-9, 0.999,
                  "significance level of the Mann–Whitney U test");  // as ab's --alpha
  command
      ->add_option("--max-slowdown", c->max_slowdown,
                   "slow-down a significant point may have (5% or 0.05; a bare number above 1 is refused)")
      ->capture_default_str();
  command->add_option("--max-memory-growth", c->max_memory_growth, "peak tracked memory growth allowed (0, 1%, 0.01)")
      ->capture_default_str();
  command->add_flag("--allow-different-context", c->options.allow_different_context,
                    "compare even if CPU model, threads, oneDNN version or ISA, kernel ISA or build type differ");
  command->add_flag("--fail-on-missing", c->options.fail_on_missing,
                    "a point measured in base and absent (or not ok) in new is a regression (CI baselines)");
  command->add_option("--format", c->format, "text | md | json")
      ->check(CLI::IsMember({"text", "md", "json"}))
      ->capture_default_str();
  command->callback([c, &action] { action = [c] { return run(*c); }; });
}

}  // namespace xfb::cli
