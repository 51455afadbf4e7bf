#include "apps/report/merge.hpp"

#include <algorithm>
#include <map>

#include "apps/report/compare.hpp"
#include "apps/report/point_fields.hpp"
#include "lib/core/errors.hpp"

namespace xfb {
namespace {

nlohmann::json settings_without_shard(const nlohmann::json& settings) {
  nlohmann::json copy = settings;
  if (copy.is_object()) copy.erase("shard");
  return copy;
}

std::string joined(const std::vector<std::string>& parts) {
  std::string text;
  for (const auto& part : parts) text += (text.empty() ? "" : ", ") + part;
  return text;
}

// Settings a grid varies, which merged reports may differ in.
bool is_grid_setting(const std::string& key) {
  if (key == "models" || key == "seq_lens" || key == "pass" || key == "params") return true;
  for (const auto& field : point_fields())
    if (field.key == key) return field.in_key && field.in_settings;
  return false;
}

// The values a setting lists: an array's entries, a comma list's items (`pass`), or the one value.
std::vector<nlohmann::json> setting_values(const std::string& key, const nlohmann::json& value) {
  if (value.is_array()) return {value.begin(), value.end()};
  if (key != "pass" || !value.is_string()) return {value};
  std::vector<nlohmann::json> items;
  std::string text = value.get<std::string>();
  for (std::size_t start = 0, comma = 0; comma != std::string::npos; start = comma + 1) {
    comma = text.find(',', start);
    items.emplace_back(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
  }
  return items;
}

// `merged` with the values of `other` it lacks appended, in the form settings record it.
nlohmann::json merged_setting(const std::string& key, const nlohmann::json& merged, const nlohmann::json& other) {
  auto values = setting_values(key, merged);
  for (const auto& value : setting_values(key, other))
    if (std::find(values.begin(), values.end(), value) == values.end()) values.push_back(value);
  const bool listed = merged.is_array() || other.is_array() || key == "pass";
  if (key == "pass") {
    std::string text;
    for (const auto& value : values) text += (text.empty() ? "" : ",") + value.get<std::string>();
    return text;
  }
  if (values.size() == 1 && !listed) return values.front();
  return nlohmann::json(values);
}

bool threads_differ(const NamedReport& first, const NamedReport& other) {
  return first.report.settings.value("threads", nlohmann::json()) !=
         other.report.settings.value("threads", nlohmann::json());
}

void check_compatible(const NamedReport& first, const NamedReport& other) {
  std::vector<std::string> fields = kMergeContextFields;
  if (threads_differ(first, other)) std::erase(fields, std::string("threads"));
  const auto context = context_differences(first.report.context, other.report.context, fields);
  if (!context.empty())
    throw InputError("cannot merge " + other.name + " into " + first.name + ": contexts differ in " + joined(context));
  const auto a = settings_without_shard(first.report.settings), b = settings_without_shard(other.report.settings);
  std::vector<std::string> keys;
  for (const auto& [key, value] : a.items())
    if ((!b.contains(key) || b[key] != value) && !is_grid_setting(key)) keys.push_back(key);
  for (const auto& [key, value] : b.items())
    if (!a.contains(key) && !is_grid_setting(key)) keys.push_back(key);
  if (!keys.empty())
    throw InputError("cannot merge " + other.name + " into " + first.name + ": settings differ in " + joined(keys) +
                     " (reports may differ only in what a grid varies: models, lengths, passes, parameters and "
                     "the point's identity fields)");
}

// The fields of one machine measurement: its figures and its contended flag.
std::vector<std::string> measurement_fields() {
  std::vector<std::string> fields(std::begin(kMachineFigureFields), std::end(kMachineFigureFields));
  fields.emplace_back(kMachineContendedField);
  return fields;
}

// The peaks and bandwidth of a report per thread count: its machine_by_threads, or its own figures.
nlohmann::json machine_by_threads(const nlohmann::json& context) {
  if (context.contains("machine_by_threads")) return context["machine_by_threads"];
  nlohmann::json figures = nlohmann::json::object();
  for (const auto& field : measurement_fields())
    if (context.contains(field)) figures[field] = context[field];
  nlohmann::json by_threads = nlohmann::json::object();
  if (context.contains("threads") && !figures.empty()) by_threads[context["threads"].dump()] = figures;
  return by_threads;
}

bool measured_contended(const nlohmann::json& figures) {
  return figures.is_object() && figures.value(kMachineContendedField, false);
}

// Per thread count, the first input's figures, or a later input's when only the later one was
// measured undisturbed: merge keeps one measurement per count, the best evidence of the peak, with
// its own flag (docs/cli.md#merge).
void keep_best_figures(const nlohmann::json& entries, nlohmann::json& by_threads) {
  for (const auto& [count, figures] : entries.items())
    if (!by_threads.contains(count) || (measured_contended(by_threads[count]) && !measured_contended(figures)))
      by_threads[count] = figures;
}

// The merged context's machine figures, per thread count as above. With several thread counts the
// context's `threads` is the largest and `machine_by_threads` holds every count measured. The
// top-level figures are those of the context's count, all from one measurement (none when that
// count was not measured).
void merge_thread_contexts(const std::vector<NamedReport>& inputs, nlohmann::json& context) {
  nlohmann::json by_threads = nlohmann::json::object();
  const int first_threads = inputs.front().report.context.value("threads", 0);
  int most_threads = 0;
  bool several_counts = false;
  for (const auto& input : inputs) {
    keep_best_figures(machine_by_threads(input.report.context), by_threads);
    const int threads = input.report.context.value("threads", 0);
    most_threads = std::max(most_threads, threads);
    several_counts = several_counts || threads != first_threads;
  }
  if (several_counts) context["threads"] = most_threads;
  if (by_threads.empty()) return;
  const auto top = by_threads.find(std::to_string(most_threads));
  for (const auto& field : measurement_fields()) {
    context.erase(field);
    if (top != by_threads.end() && top->contains(field)) context[field] = (*top)[field];
  }
  if (several_counts || by_threads.size() > 1) context["machine_by_threads"] = by_threads;
}

template <typename T>
std::size_t position_in(const nlohmann::json& list, const T& value) {
  if (!list.is_array()) return SIZE_MAX;
  for (std::size_t i = 0; i < list.size(); ++i)
    if (list[i] == value) return i;
  return SIZE_MAX;
}

}  // namespace

Report merge_reports(const std::vector<NamedReport>& inputs) {
  if (inputs.empty()) throw InputError("merge needs at least one report");
  Report merged;
  merged.context = inputs.front().report.context;
  merged.settings = settings_without_shard(inputs.front().report.settings);
  merged.context["merged_from"] = nlohmann::json::array();
  std::map<std::string, std::string> owner;
  for (const auto& input : inputs) {
    check_compatible(inputs.front(), input);
    const nlohmann::json settings = settings_without_shard(input.report.settings);
    for (const auto& [key, value] : settings.items())
      merged.settings[key] = merged.settings.contains(key) ? merged_setting(key, merged.settings[key], value) : value;
    const auto& c = input.report.context;
    merged.context["merged_from"].push_back({{"file", input.name},
                                             {"host", c.value("host", "")},
                                             {"date", c.value("date", "")},
                                             {"command_line", c.value("command_line", "")},
                                             {"shard", input.report.settings.value("shard", "")}});
    for (const auto& row : input.report.results) {
      const auto [found, inserted] = owner.emplace(row.key(), input.name);
      if (!inserted)
        throw InputError("duplicate point " + row.model + " N=" + std::to_string(row.seq_len) + " [" +
                         configuration_text(row) + "] in " + found->second + " and " + input.name);
      merged.results.push_back(row);
    }
  }
  merge_thread_contexts(inputs, merged.context);
  const auto& models = merged.settings.contains("models") ? merged.settings["models"] : nlohmann::json();
  const auto& lengths = merged.settings.contains("seq_lens") ? merged.settings["seq_lens"] : nlohmann::json();
  std::stable_sort(merged.results.begin(), merged.results.end(), [&](const ResultRow& a, const ResultRow& b) {
    const auto ma = position_in(models, a.model), mb = position_in(models, b.model);
    if (ma != mb) return ma < mb;
    return position_in(lengths, a.seq_len) < position_in(lengths, b.seq_len);
  });
  return merged;
}

}  // namespace xfb
