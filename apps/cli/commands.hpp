#pragma once
// Each subcommand lives in its own apps/cli/cmd_<name>.cpp and registers itself on the CLI11 app
// from main(); `action` is set to the chosen subcommand's body, run after parsing.
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "apps/bench/point.hpp"
#include "apps/bench/sweep.hpp"
#include "apps/report/point_fields.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {

using Action = std::function<int()>;

// A check for string options whose empty value would read as "not given" (`--dump ""`): refused.
inline const CLI::Validator kNonEmpty{
    [](std::string& value) { return value.empty() ? std::string("must not be empty") : std::string(); }, "",
    "NONEMPTY"};

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

// The selection options of sweep and ab (apps/bench/selection.hpp).
struct SelectionOptions {
  std::string models, exclude, seq_lens;
};
// Registers --models, --exclude and --seq-lens on `command` (--models required when it has no default).
void add_selection_options(CLI::App& command, SelectionOptions& selection);

// Sweep: the points the options give — every combination of the fields given as comma lists
// (`--threads 1,2 --heads 4,8`), the first field of the table varying slowest — each validated;
// `gridded` receives the keys of the fields given as lists. A list for a field outside a point's
// identity (timing, `--causal`) is an InputError. `passes` as for point_of.
std::vector<PointConfig> point_grid_of(const PointOptions& options, std::vector<Pass>& passes,
                                       std::vector<std::string>& gridded);

// Fills the point grid shared by sweep-like settings (models, seq_lens, passes, the grid of base
// points without parameters, parameters) from the parsed options. Settings without a `grid`
// (ab) take one value per field.
template <class GridSettings>
void fill_point_grid(const PointOptions& options, const SelectionOptions& selection, GridSettings& settings) {
  std::vector<std::string> gridded;
  std::vector<PointConfig> grid = point_grid_of(options, settings.passes, gridded);
  settings.models = parse_model_selection(selection.models, selection.exclude);
  settings.seq_lens = parse_seq_lens(selection.seq_lens);
  settings.params = grid.front().params;
  for (auto& point : grid) point.params.clear();
  settings.base = grid.front();
  if constexpr (requires { settings.grid; }) {
    settings.grid = std::move(grid);
    settings.gridded = std::move(gridded);
  } else if (!gridded.empty()) {
    throw InputError(point_field(gridded.front()).long_flag() +
                     " is given a list: this command runs one value per field (sweep takes grids)");
  }
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
