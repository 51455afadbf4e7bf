#pragma once
// Each subcommand lives in its own apps/cli/cmd_<name>.cpp and registers itself on the CLI11 app
// from main(); `action` is set to the chosen subcommand's body, run after parsing.
#include <functional>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "apps/bench/point.hpp"
#include "apps/bench/sweep.hpp"
#include "apps/report/point_fields.hpp"

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
void add_report(CLI::App& app, Action& action);

// The point options of a command, from the point field table (apps/report/point_fields.hpp):
// the words as given per field, and the command's defaults (threads: all cores; ab: --min-time 0.1;
// a sweep preset's shape).
struct PointOptions {
  FieldTexts texts;
  PointConfig defaults;
  bool given(const std::string& key) const { return texts.count(key) > 0; }
};
// Registers every field the command takes: `use` Point for sweep and ab (no --model, --seq-len),
// RunOnly for run (all fields); `only` restricts to those keys (env: threads).
void add_point_options(CLI::App& command, const std::shared_ptr<PointOptions>& options, FieldUse use,
                       const std::vector<std::string>& only = {});
// The point the options give: the defaults with every given field applied, validated (InputError).
// `passes` (sweep, ab) receives the --pass list; without it, --pass must name one pass.
PointConfig point_of(const PointOptions& options, std::vector<Pass>* passes = nullptr);

// Fills the point grid shared by sweep-like settings (models, seq_lens, passes, base point without
// parameters, parameters) from the parsed options.
template <class GridSettings>
void fill_point_grid(const PointOptions& options, const std::string& models, const std::string& seq_lens,
                     GridSettings& settings) {
  const PointConfig point = point_of(options, &settings.passes);
  settings.models = parse_model_selection(models);
  settings.seq_lens = parse_seq_lens(seq_lens);
  settings.base = point;
  settings.base.params.clear();
  settings.params = point.params;
}

// Number options outside the point, validated by the same rules as the point fields: integers exact
// and in [min, max] (no wrap-around), reals finite and in [min, max]; InputError naming the flag.
CLI::Option* add_real_option(CLI::App& command, const std::string& flags, double& target, double min, double max,
                             const std::string& help);
CLI::Option* add_integer_option(CLI::App& command, const std::string& flags, int& target, std::int64_t min,
                                std::int64_t max, const std::string& help);

// Every subcommand and global flag on `app`; `action` is set to the chosen command's body. Parsing
// validates every option (CLI11's ParseError or InputError); the action does the work.
void build_app(CLI::App& app, Action& action);

// The command line as typed, for report provenance.
void set_command_line(int argc, const char* const* argv);
const std::string& command_line();

}  // namespace xfb::cli
