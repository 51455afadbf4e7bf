#pragma once
// Each subcommand lives in its own apps/cmd_<name>.cpp and registers itself on the CLI11 app
// from main(); `action` is set to the chosen subcommand's body, run after parsing.
#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "lib/bench/point.hpp"
#include "lib/bench/sweep.hpp"

namespace xfb::cli {

using Action = std::function<int()>;

void add_list(CLI::App& app, Action& action);
void add_env(CLI::App& app, Action& action);
void add_run(CLI::App& app, Action& action);
void add_sweep(CLI::App& app, Action& action);
void add_table(CLI::App& app, Action& action);
void add_compare(CLI::App& app, Action& action);
void add_ab(CLI::App& app, Action& action);
void add_merge(CLI::App& app, Action& action);
void add_plot(CLI::App& app, Action& action);
void add_complexity(CLI::App& app, Action& action);
void add_taxonomy(CLI::App& app, Action& action);

// Options shared by `run`, `sweep` and `ab`: problem shape, scope, pass, threads, seed, timing.
struct ProblemOptions {
  PointConfig point;
  bool causal = false;
  std::string scope = "attention";
  std::string pass = "forward";
  std::vector<std::string> params;
};
void add_problem_options(CLI::App& command, ProblemOptions& options);
// Applies scope/pass/causal/params to options.point (throws InputError on a bad scope).
void finish_problem_options(ProblemOptions& options);

// Fills the point grid shared by sweep-like settings (models, seq_lens, base point without
// parameters, parameters) from the parsed options; finishes the problem options first.
template <class GridSettings>
void fill_point_grid(ProblemOptions& problem, const std::string& models, const std::string& seq_lens,
                     GridSettings& settings) {
  settings.passes = parse_passes(problem.pass);  // a sweep runs every point once per listed pass
  problem.pass = pass_name(settings.passes.front());
  finish_problem_options(problem);
  settings.models = parse_model_selection(models);
  settings.seq_lens = parse_seq_lens(seq_lens);
  settings.base = problem.point;
  settings.base.params.clear();
  settings.params = problem.params;
}

// The command line as typed, for report provenance.
const std::string& command_line();

}  // namespace xfb::cli
