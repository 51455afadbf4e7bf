// xfbench: benchmarks the efficient-attention models of "Efficient Transformers: A Survey".
// Exit codes: 0 success · 1 a check or regression failed · 2 usage or input error · 3 runtime error.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <iostream>

#include "apps/commands.hpp"
#include "lib/bench/point.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {
std::string g_command_line;
}
const std::string& command_line() { return g_command_line; }

void add_problem_options(CLI::App& command, ProblemOptions& o) {
  auto& p = o.point;
  command.add_option("--batch,-b", p.problem.batch, "sequences per call")->capture_default_str();
  command.add_option("--heads", p.problem.heads, "attention heads")->capture_default_str();
  command.add_option("--head-dim,-d", p.problem.head_dim, "features per head")->capture_default_str();
  command.add_flag("--causal", o.causal, "causal (decoder) attention: token i sees j <= i");
  command.add_option("--scope", o.scope, "attention (the mechanism alone) or layer (pre-LN encoder layer)")
      ->check(CLI::IsMember({"attention", "layer"}))
      ->capture_default_str();
  command.add_option("--pass", o.pass,
                     "forward, backward (after an untimed forward), train (forward + backward as one step) or decode "
                     "(prefill the N-token context, then time --decode-tokens steps of one token; causal); "
                     "sweep: also a list, e.g. forward,train")
      ->capture_default_str();
  command.add_option("--decode-tokens", p.decode_tokens, "decode pass: tokens generated one at a time after the context")
      ->capture_default_str();
  command.add_option("--d-ff", p.d_ff, "layer scope FFN width (default 4·heads·head-dim)");
  p.problem.threads = DnnlContext::default_threads();
  command.add_option("--threads,-t", p.problem.threads, "threads for oneDNN and OpenMP loops (default: all cores)")
      ->capture_default_str();
  command.add_option("--seed", p.seed, "seed of inputs and parameters")->capture_default_str();
  command.add_option("--param,-p", o.params, "mechanism parameter key=value (repeatable)");
  command.add_option("--warmup", p.timing.warmup, "untimed runs before timing (>= 1)")->capture_default_str();
  command.add_option("--min-reps", p.timing.min_reps, "timed repetitions, at least")->capture_default_str();
  command.add_option("--min-time", p.timing.min_time_s, "seconds of timed repetitions, at least")->capture_default_str();
  command.add_option("--max-reps", p.timing.max_reps, "timed repetitions, at most")->capture_default_str();
}

void finish_problem_options(ProblemOptions& o) {
  o.point.problem.causal = o.causal;
  o.point.scope = o.scope == "layer" ? Scope::Layer : Scope::Attention;
  o.point.pass = parse_pass(o.pass);
  o.point.params = o.params;
}

}  // namespace xfb::cli

int main(int argc, char** argv) {
  using namespace xfb;
  for (int i = 0; i < argc; ++i) cli::g_command_line += (i ? " " : "") + std::string(argv[i]);
  CLI::App app{"xfbench — benchmarks of the efficient-attention models of 'Efficient Transformers: A Survey'"};
  app.require_subcommand(1);
  bool verbose = false, quiet = false;
  app.add_flag("-v,--verbose", verbose, "debug logging");
  app.add_flag("-q,--quiet", quiet, "warnings and errors only");
  cli::Action action;
  cli::add_list(app, action);
  cli::add_env(app, action);
  cli::add_run(app, action);
  cli::add_sweep(app, action);
  cli::add_table(app, action);
  cli::add_compare(app, action);
  cli::add_ab(app, action);
  cli::add_merge(app, action);
  cli::add_plot(app, action);
  cli::add_complexity(app, action);
  cli::add_taxonomy(app, action);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "xfbench: error: %s\n", e.what());
    return kExitUsage;
  }
  auto logger = spdlog::stderr_color_st("xfbench");
  logger->set_pattern("xfbench: %l: %v");
  logger->set_level(verbose ? spdlog::level::debug : quiet ? spdlog::level::warn : spdlog::level::info);
  spdlog::set_default_logger(logger);
  try {
    return action();
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
