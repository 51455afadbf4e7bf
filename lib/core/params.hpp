#pragma once
// Typed mechanism parameters: a spec (name, type, default, range or choices, unit) per parameter,
// and the values of one run, parsed from `key=value` strings and validated against the specs.
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "lib/core/errors.hpp"

namespace xfb {

enum class ParamType { Int, Float, Bool, Choice };

struct ParamSpec {
  std::string name;
  ParamType type = ParamType::Int;
  std::string default_value;  // as it would be written on the command line
  double min = 0;             // Int/Float: inclusive range
  double max = 0;
  std::vector<std::string> choices;  // Choice: allowed values
  std::string help;                  // meaning and unit
};

using ParamValue = std::variant<std::int64_t, double, bool, std::string>;

class ParamValues {
 public:
  std::int64_t get_int(const std::string& name) const;
  double get_float(const std::string& name) const;
  bool get_bool(const std::string& name) const;
  const std::string& get_choice(const std::string& name) const;

  void set(const std::string& name, ParamValue value) { values_[name] = std::move(value); }
  const std::map<std::string, ParamValue>& all() const { return values_; }

  // Canonical `key=value` strings, sorted by key.
  std::vector<std::string> to_strings() const;
  nlohmann::json to_json() const;

 private:
  std::map<std::string, ParamValue> values_;
};

// Thrown for any invalid parameter; the message is one line.
struct ParamError : InputError {
  using InputError::InputError;
};

// Defaults for every spec, overridden by `key=value` assignments; validates names, types, ranges.
ParamValues resolve_params(const std::string& model, const std::vector<ParamSpec>& specs,
                           const std::vector<std::string>& assignments);
std::string param_value_string(const ParamValue& value);
std::string param_type_name(ParamType type);

}  // namespace xfb
