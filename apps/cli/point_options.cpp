// The point options of run, sweep, ab and env, registered from the point field table.
#include <algorithm>
#include <cstdlib>

#include "apps/cli/commands.hpp"
#include "lib/core/errors.hpp"

namespace xfb::cli {
namespace {

std::string default_text(const PointField& field, const PointConfig& defaults) {
  if (field.type == FieldType::Flag || field.type == FieldType::TextList || field.use == FieldUse::RunOnly) return "";
  const nlohmann::json value = field.get(defaults);
  return " (default: " + (value.is_string() ? value.get<std::string>() : value.dump()) + ")";
}

// The option's value as --help shows it.
std::string type_name(FieldType type) {
  switch (type) {
    case FieldType::Integer:
    case FieldType::Unsigned:
      return "INT";
    case FieldType::Length:
      return "TOKENS";
    case FieldType::Real:
      return "REAL";
    case FieldType::Choice:
      return "CHOICE";
    case FieldType::Flag:
      return "";
    case FieldType::Text:
      return "TEXT";
    case FieldType::TextList:
      return "KEY=VALUE";
  }
  return "TEXT";
}

}  // namespace

void add_point_options(CLI::App& command, const std::shared_ptr<PointOptions>& options, FieldUse use,
                       const std::vector<std::string>& only) {
  for (const auto& field : point_fields()) {
    if (use == FieldUse::Point && field.use == FieldUse::RunOnly) continue;
    if (!only.empty() && std::find(only.begin(), only.end(), field.key) == only.end()) continue;
    const std::string key = field.key, help = field.help + default_text(field, options->defaults);
    if (field.type == FieldType::Flag) {
      command.add_flag_callback(
          field.flags, [options, key] { options->texts[key].push_back("true"); }, help);
    } else {
      // Every occurrence is kept (one word each): a list field takes them all, another refuses a repeat.
      command
          .add_option_function<std::vector<std::string>>(
              field.flags, [options, key](const std::vector<std::string>& words) { options->texts[key] = words; }, help)
          ->allow_extra_args(false)
          ->type_name(type_name(field.type));
    }
  }
}

namespace {

// OMP_NUM_THREADS's first item (libgomp also takes a list, one count per nesting level), spaces
// around it allowed: whether it is a decimal count OpenMP would use, rather than ignore (0, -1, abc).
bool omp_threads_readable(const std::string& text) {
  const std::string first = text.substr(0, text.find(','));
  const auto begin = first.find_first_not_of(" \t"), end = first.find_last_not_of(" \t");
  if (begin == std::string::npos) return false;
  const std::string digits = first.substr(begin, end - begin + 1);
  return digits.find_first_not_of("0123456789") == std::string::npos &&
         digits.find_first_not_of('0') != std::string::npos;
}

// The default --threads is OpenMP's (OMP_NUM_THREADS, else the cores): a variable OpenMP ignores
// or a count out of range is refused, and the message names where it came from, not an option the
// user never gave.
void check_default_threads(const PointConfig& defaults) {
  const PointField& field = point_field("threads");
  const int threads = defaults.problem.threads;
  const char* variable = std::getenv("OMP_NUM_THREADS");
  if (variable != nullptr && !omp_threads_readable(variable))
    throw InputError("OMP_NUM_THREADS=" + std::string(variable).substr(0, 40) +
                     " is not a thread count (OpenMP ignores it and would use " + std::to_string(threads) + "); give " +
                     field.long_flag() + " or set OMP_NUM_THREADS to a count from " + std::to_string(field.min) +
                     " to " + std::to_string(field.max));
  if (threads >= field.min && threads <= field.max) return;
  const std::string source =
      variable != nullptr ? "OMP_NUM_THREADS=" + std::string(variable).substr(0, 40) + " gives" : "OpenMP's default is";
  throw InputError(source + " " + std::to_string(threads) + " threads, outside " + field.long_flag() + "'s [" +
                   std::to_string(field.min) + ", " + std::to_string(field.max) + "]; give " + field.long_flag() +
                   " or set OMP_NUM_THREADS in that range");
}

}  // namespace

PointConfig point_of(const PointOptions& options, std::vector<Pass>* passes) {
  FieldTexts texts = options.texts;
  PointConfig defaults = options.defaults;
  if (texts.count("threads") == 0 || texts.at("threads").empty()) check_default_threads(defaults);
  if (passes != nullptr) {
    // Sweep and ab: the lengths come from --seq-lens and each point is checked at its own
    // (plan_points, run_ab); the size limits here must not judge the default --seq-len.
    defaults.problem.seq_len = 1;
    // Sweep and ab: --pass may list passes; the point carries the first, the grid all of them.
    const auto pass = texts.find("pass");
    *passes = pass == texts.end() ? std::vector<Pass>{options.defaults.pass} : std::vector<Pass>{};
    if (pass != texts.end()) {
      if (pass->second.size() > 1)
        throw InputError("--pass is given " + std::to_string(pass->second.size()) + " times");
      *passes = parse_passes(pass->second.front());
      pass->second = {pass_name(passes->front())};
    }
  }
  return apply_field_texts(defaults, texts);
}

namespace {

constexpr std::size_t kMaxGridPoints = 100'000;  // combinations of the gridded fields

// The values of a gridded option; InputError for an empty or repeated one.
std::vector<std::string> grid_values(const PointField& field, const std::string& text) {
  std::vector<std::string> values;
  for (auto& value : comma_items(text)) {
    if (value.empty()) throw InputError(field.long_flag() + " '" + text + "' has an empty entry");
    if (std::find(values.begin(), values.end(), value) != values.end())
      throw InputError(field.long_flag() + " '" + text + "' lists " + value + " twice");
    values.push_back(std::move(value));
  }
  return values;
}

}  // namespace

std::vector<PointConfig> point_grid_of(const PointOptions& options, std::vector<Pass>& passes,
                                       std::vector<std::string>& gridded) {
  std::vector<FieldTexts> combinations = {options.texts};
  for (const auto& field : point_fields()) {
    const auto given = options.texts.find(field.key);
    if (field.key == "pass" || field.type == FieldType::TextList || field.use == FieldUse::RunOnly ||
        given == options.texts.end() || given->second.size() != 1 ||
        given->second.front().find(',') == std::string::npos)
      continue;
    if (!field.in_key || field.type == FieldType::Flag)
      throw InputError(field.long_flag() + " takes one value: a grid varies only the fields that identify a point");
    gridded.push_back(field.key);
    const auto values = grid_values(field, given->second.front());
    if (combinations.size() * values.size() > kMaxGridPoints)
      throw InputError("the grid of " + field.long_flag() + " and the lists before it has more than " +
                       std::to_string(kMaxGridPoints) + " combinations");
    std::vector<FieldTexts> expanded;
    for (const auto& combination : combinations)
      for (const auto& value : values) {
        expanded.push_back(combination);
        expanded.back()[field.key] = {value};
      }
    combinations = std::move(expanded);
  }
  std::vector<PointConfig> grid;
  for (const auto& texts : combinations) grid.push_back(point_of({texts, options.defaults}, &passes));
  return grid;
}

void add_selection_options(CLI::App& command, SelectionOptions& selection) {
  auto* models = command.add_option("--models", selection.models,
                                    "comma list of names, globs (*former), class:<class>, all; spaces trimmed");
  if (selection.models.empty())
    models->required();
  else
    models->capture_default_str();
  command.add_option("--exclude", selection.exclude, "models to leave out, in the --models syntax");
  command.add_option("--seq-lens", selection.seq_lens, "a,b,c | lo:hi:xK | lo:hi:+K; lengths may be written 1K, 16K")
      ->capture_default_str();
}

namespace {
PointField number_field(const std::string& flags, FieldType type, double min, double max) {
  PointField field;
  field.key = flags;
  field.flags = flags;
  field.type = type;
  field.min = static_cast<std::int64_t>(min);
  field.max = static_cast<std::int64_t>(max);
  field.real_min = min;
  field.real_max = max;
  return field;
}

std::string number_text(double value) {
  const nlohmann::json json = value;
  return json.dump();
}
}  // namespace

CLI::Option* add_real_option(CLI::App& command, const std::string& flags, double& target, double min, double max,
                             const std::string& help) {
  const PointField field = number_field(flags, FieldType::Real, min, max);
  return command.add_option_function<std::string>(
      flags, [field, &target](const std::string& word) { target = parse_field_text(field, word).get<double>(); },
      target >= min && target <= max ? help + " (default: " + number_text(target) + ")" : help);
}

CLI::Option* add_integer_option(CLI::App& command, const std::string& flags, int& target, std::int64_t min,
                                std::int64_t max, const std::string& help) {
  const PointField field = number_field(flags, FieldType::Integer, static_cast<double>(min), static_cast<double>(max));
  return command.add_option_function<std::string>(
      flags,
      [field, &target](const std::string& word) {
        target = static_cast<int>(parse_field_text(field, word).get<std::int64_t>());
      },
      help + " (default: " + std::to_string(target) + ")");
}

}  // namespace xfb::cli
