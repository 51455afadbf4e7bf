#include "apps/report/json_fields.hpp"

#include <cmath>
#include <limits>
#include <string>
#include <unordered_set>
#include <vector>

#include "apps/report/files.hpp"
#include "lib/core/errors.hpp"

namespace xfb {
namespace {

constexpr std::size_t kMaxNameBytes = 256;

bool has_control_character(const std::string& text) {
  for (unsigned char c : text)
    if (c < 0x20 || c == 0x7F) return true;
  return false;
}

std::string bound_rule(const char* kind, double lo, double hi, double value) {
  const bool too_big = value > hi;
  char text[96];
  std::snprintf(text, sizeof text, too_big ? "%s <= %.17g" : "%s >= %.17g", kind, too_big ? hi : lo);
  return text;
}

}  // namespace

std::string describe_json(const nlohmann::json& value) {
  if (value.is_string()) return quoted(value.get<std::string>());
  if (value.is_object()) return "an object";
  if (value.is_array()) return "an array";
  std::string text = value.dump();  // a number, true, false or null: ASCII
  if (text.size() > 40) text = text.substr(0, 40) + "…";
  return text;
}

FieldReader::FieldReader(const nlohmann::json& object, std::string where) : object_(object), where_(std::move(where)) {
  if (!object_.is_object())
    throw InputError((where_.empty() ? "the top level" : where_) + ": must be an object, got " +
                     describe_json(object_));
}

std::string FieldReader::path(const std::string& name) const { return where_.empty() ? name : where_ + "." + name; }

void FieldReader::fail(const std::string& name, const std::string& rule, const nlohmann::json* got) const {
  throw InputError(path(name) + ": " +
                   (got ? "must be " + rule + ", got " + describe_json(*got) : "missing (" + rule + ")"));
}

bool FieldReader::has(const char* name) const { return object_.contains(name); }

const nlohmann::json* FieldReader::find(const char* name, bool required) const {
  const auto found = object_.find(name);
  if (found != object_.end()) return &*found;
  if (required) throw InputError(path(name) + ": missing");
  return nullptr;
}

std::string FieldReader::text(const char* name, std::optional<std::string> fallback) const {
  const auto* value = find(name, !fallback);
  if (!value) return *fallback;
  if (!value->is_string()) fail(name, "a string", value);
  return value->get<std::string>();
}

std::string FieldReader::name(const char* name) const {
  const auto* value = find(name, true);
  const char* rule = "a non-empty string of at most 256 bytes without control characters";
  if (!value->is_string()) fail(name, rule, value);
  const auto& text = value->get_ref<const std::string&>();
  if (text.empty() || text.size() > kMaxNameBytes || has_control_character(text)) fail(name, rule, value);
  return text;
}

std::string FieldReader::choice(const char* name, std::initializer_list<const char*> allowed,
                                std::optional<std::string> fallback) const {
  std::string rule = "one of";
  for (const char* option : allowed) rule += std::string(rule.size() > 6 ? ", " : " ") + option;
  const auto* value = find(name, !fallback);
  if (!value) return *fallback;
  if (value->is_string())
    for (const char* option : allowed)
      if (value->get_ref<const std::string&>() == option) return option;
  fail(name, rule, value);
}

bool FieldReader::flag(const char* name, std::optional<bool> fallback) const {
  const auto* value = find(name, !fallback);
  if (!value) return *fallback;
  if (!value->is_boolean()) fail(name, "true or false", value);
  return value->get<bool>();
}

std::int64_t FieldReader::integer(const char* name, std::int64_t lo, std::int64_t hi,
                                  std::optional<std::int64_t> fallback) const {
  const auto* value = find(name, !fallback);
  if (!value) return *fallback;
  const bool fits =
      value->is_number_integer() &&
      (!value->is_number_unsigned() ||
       value->get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
  if (!fits) fail(name, "an integer >= " + std::to_string(lo), value);
  const auto v = value->get<std::int64_t>();
  if (v < lo) fail(name, "an integer >= " + std::to_string(lo), value);
  if (v > hi) fail(name, "an integer <= " + std::to_string(hi), value);
  return v;
}

std::uint64_t FieldReader::unsigned_integer(const char* name, std::optional<std::uint64_t> fallback) const {
  const auto* value = find(name, !fallback);
  if (!value) return *fallback;
  if (!value->is_number_unsigned()) fail(name, "an integer >= 0", value);
  return value->get<std::uint64_t>();
}

double FieldReader::number(const char* name, double lo, double hi, std::optional<double> fallback) const {
  const auto* value = find(name, !fallback);
  if (!value) return *fallback;
  if (!value->is_number() || !std::isfinite(value->get<double>()))
    fail(name, bound_rule("a finite number", lo, hi, lo), value);
  const double v = value->get<double>();
  if (v < lo || v > hi) fail(name, bound_rule("a number", lo, hi, v), value);
  return v;
}

std::vector<double> FieldReader::numbers(const char* name, double lo, double hi, bool optional) const {
  const auto* value = find(name, !optional);
  std::vector<double> out;
  if (!value) return out;
  if (!value->is_array()) fail(name, "an array of numbers", value);
  out.reserve(value->size());
  for (std::size_t i = 0; i < value->size(); ++i) {
    const auto& item = (*value)[i];
    const std::string where = std::string(name) + "[" + std::to_string(i) + "]";
    if (!item.is_number() || !std::isfinite(item.get<double>()))
      fail(where, bound_rule("a finite number", lo, hi, lo), &item);
    const double v = item.get<double>();
    if (v < lo || v > hi) fail(where, bound_rule("a number", lo, hi, v), &item);
    out.push_back(v);
  }
  return out;
}

std::vector<std::string> FieldReader::texts(const char* name, bool optional) const {
  const auto* value = find(name, !optional);
  std::vector<std::string> out;
  if (!value) return out;
  if (!value->is_array()) fail(name, "an array of strings", value);
  for (std::size_t i = 0; i < value->size(); ++i) {
    const auto& item = (*value)[i];
    if (!item.is_string()) fail(std::string(name) + "[" + std::to_string(i) + "]", "a string", &item);
    out.push_back(item.get<std::string>());
  }
  return out;
}

std::map<std::string, double> FieldReader::number_map(const char* name, double lo, double hi, bool optional) const {
  const auto* value = find(name, !optional);
  std::map<std::string, double> out;
  if (!value) return out;
  const FieldReader entries(*value, path(name));
  for (const auto& [key, item] : value->items()) out[key] = entries.number(key.c_str(), lo, hi);
  return out;
}

nlohmann::json FieldReader::scalar_object(const char* name) const {
  const auto* value = find(name, true);
  const FieldReader entries(*value, path(name));
  for (const auto& [key, item] : value->items()) {
    if (key.empty() || key.size() > kMaxNameBytes || has_control_character(key))
      fail(name, "an object whose keys are names without control characters", value);
    const bool scalar =
        item.is_string() || item.is_boolean() || (item.is_number() && std::isfinite(item.get<double>()));
    if (!scalar) entries.fail(key, "a string, a finite number or a boolean", &item);
    if (item.is_string() && has_control_character(item.get_ref<const std::string&>()))
      entries.fail(key, "a string without control characters", &item);
  }
  return *value;
}

nlohmann::json FieldReader::object(const char* name, bool optional) const {
  const auto* value = find(name, !optional);
  if (!value) return nlohmann::json::object();
  if (!value->is_object()) fail(name, "an object", value);
  return *value;
}

nlohmann::json parse_json_text(const std::string& text, const std::string& where, int max_depth) {
  using Event = nlohmann::json::parse_event_t;
  // The keys of each open object: nlohmann keeps the last of two equal keys without a word.
  std::vector<std::unordered_set<std::string>> open_objects;
  const auto check_structure = [&](int depth, Event event, nlohmann::json& parsed) {
    if ((event == Event::object_start || event == Event::array_start) && depth >= max_depth)
      throw InputError(where + ": nesting deeper than " + std::to_string(max_depth) + " levels");
    if (event == Event::object_start) open_objects.emplace_back();
    if (event == Event::object_end) open_objects.pop_back();
    if (event == Event::key && !open_objects.back().insert(parsed.get<std::string>()).second)
      throw InputError(where + ": the key " + describe_json(parsed) + " appears twice in one object");
    return true;
  };
  try {
    return nlohmann::json::parse(text, check_structure);
  } catch (const nlohmann::json::parse_error& e) {
    throw InputError(where + ": not valid JSON (syntax error at byte " + std::to_string(e.byte) + ")");
  } catch (const nlohmann::json::out_of_range&) {
    throw InputError(where + ": not valid JSON (a number too large for a double)");
  } catch (const nlohmann::json::exception&) {
    throw InputError(where + ": not valid JSON");
  }
}

}  // namespace xfb
