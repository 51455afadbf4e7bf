#include "apps/report/merge.hpp"

#include <algorithm>
#include <map>

#include "apps/report/compare.hpp"
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

void check_compatible(const NamedReport& first, const NamedReport& other) {
  const auto context = context_differences(first.report.context, other.report.context, kMergeContextFields);
  if (!context.empty())
    throw InputError("cannot merge " + other.name + " into " + first.name + ": contexts differ in " + joined(context));
  const auto a = settings_without_shard(first.report.settings), b = settings_without_shard(other.report.settings);
  if (a == b) return;
  std::vector<std::string> keys;
  for (const auto& [key, value] : a.items())
    if (!b.contains(key) || b[key] != value) keys.push_back(key);
  for (const auto& [key, value] : b.items())
    if (!a.contains(key)) keys.push_back(key);
  throw InputError("cannot merge " + other.name + " into " + first.name + ": settings differ in " + joined(keys));
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
