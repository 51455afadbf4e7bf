#include "lib/core/params.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

#include "lib/core/decimal.hpp"

namespace xfb {
namespace {

const ParamValue& lookup(const std::map<std::string, ParamValue>& values, const std::string& name) {
  auto found = values.find(name);
  if (found == values.end()) throw ParamError("parameter '" + name + "' has no value");
  return found->second;
}

std::string range_text(const ParamSpec& spec) {
  std::ostringstream out;
  if (spec.type == ParamType::Choice) {
    for (std::size_t i = 0; i < spec.choices.size(); ++i) out << (i ? "|" : "") << spec.choices[i];
  } else if (spec.type == ParamType::Bool) {
    out << "true|false";
  } else {
    out << "[" << spec.min << ", " << spec.max << "]";
  }
  return out.str();
}

ParamValue parse_value(const std::string& model, const ParamSpec& spec, const std::string& text) {
  const std::string where = "parameter '" + spec.name + "' of " + model;
  switch (spec.type) {
    case ParamType::Int: {
      std::int64_t value = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (ec != std::errc() || end != text.data() + text.size())
        throw ParamError(where + " must be an integer, got '" + text + "'");
      if (static_cast<double>(value) < spec.min || static_cast<double>(value) > spec.max)
        throw ParamError(where + " must be in " + range_text(spec) + ", got " + text);
      return value;
    }
    case ParamType::Float: {
      const auto value = parse_decimal(text);
      if (!value) throw ParamError(where + " must be a decimal number, got '" + text + "'");
      if (*value < spec.min || *value > spec.max)
        throw ParamError(where + " must be in " + range_text(spec) + ", got " + text);
      return *value;
    }
    case ParamType::Bool:
      if (text == "true" || text == "1") return true;
      if (text == "false" || text == "0") return false;
      throw ParamError(where + " must be true or false, got '" + text + "'");
    case ParamType::Choice:
      for (const auto& choice : spec.choices)
        if (choice == text) return text;
      throw ParamError(where + " must be one of " + range_text(spec) + ", got '" + text + "'");
  }
  throw ParamError(where + ": unknown type");
}

}  // namespace

std::int64_t ParamValues::get_int(const std::string& name) const {
  return std::get<std::int64_t>(lookup(values_, name));
}
double ParamValues::get_float(const std::string& name) const { return std::get<double>(lookup(values_, name)); }
bool ParamValues::get_bool(const std::string& name) const { return std::get<bool>(lookup(values_, name)); }
const std::string& ParamValues::get_choice(const std::string& name) const {
  return std::get<std::string>(lookup(values_, name));
}

std::string param_value_string(const ParamValue& value) {
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else if constexpr (std::is_same_v<T, bool>) {
          return v ? "true" : "false";
        } else if constexpr (std::is_same_v<T, double>) {
          std::ostringstream out;
          out.precision(17);
          out << v;
          return out.str();
        } else {
          return std::to_string(v);
        }
      },
      value);
}

std::string param_type_name(ParamType type) {
  switch (type) {
    case ParamType::Int:
      return "int";
    case ParamType::Float:
      return "float";
    case ParamType::Bool:
      return "bool";
    case ParamType::Choice:
      return "choice";
  }
  return "?";
}

std::vector<std::string> ParamValues::to_strings() const {
  std::vector<std::string> out;
  for (const auto& [name, value] : values_) out.push_back(name + "=" + param_value_string(value));
  return out;
}

nlohmann::json ParamValues::to_json() const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& [name, value] : values_) std::visit([&](const auto& v) { out[name] = v; }, value);
  return out;
}

ParamValues resolve_params(const std::string& model, const std::vector<ParamSpec>& specs,
                           const std::vector<std::string>& assignments) {
  ParamValues values;
  for (const auto& spec : specs) values.set(spec.name, parse_value(model, spec, spec.default_value));
  std::vector<std::string> assigned;
  for (const auto& assignment : assignments) {
    const auto eq = assignment.find('=');
    if (eq == std::string::npos || eq == 0) throw ParamError("--param expects key=value, got '" + assignment + "'");
    const std::string key = assignment.substr(0, eq);
    const ParamSpec* spec = nullptr;
    for (const auto& candidate : specs)
      if (candidate.name == key) spec = &candidate;
    if (spec == nullptr) {
      std::string known;
      for (const auto& candidate : specs) known += (known.empty() ? "" : ", ") + candidate.name;
      throw ParamError("unknown parameter '" + key + "' for " + model +
                       (known.empty() ? " (it takes none)" : " (known: " + known + ")"));
    }
    if (std::find(assigned.begin(), assigned.end(), key) != assigned.end())
      throw ParamError("parameter '" + key + "' of " + model + " is given more than once");
    assigned.push_back(key);
    values.set(key, parse_value(model, *spec, assignment.substr(eq + 1)));
  }
  return values;
}

}  // namespace xfb
