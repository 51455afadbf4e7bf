#pragma once
// Typed, range-checked reads of one JSON object's fields, for the report reader. Every failure
// is an InputError "<where>.<field>: must be <rule>, got <value>" (values quoted and shortened),
// so a malformed input is named to the field and never reaches a library's own error text.
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace xfb {

class FieldReader {
 public:
  // Throws InputError unless `object` is a JSON object; `where` prefixes every message.
  FieldReader(const nlohmann::json& object, std::string where);

  // A field given without a fallback is required; with one, the fallback stands in when absent.
  bool has(const char* name) const;
  std::string text(const char* name, std::optional<std::string> fallback = {}) const;
  // A non-empty string of at most 256 bytes without control characters (names, labels).
  std::string name(const char* name) const;
  std::string choice(const char* name, std::initializer_list<const char*> allowed,
                     std::optional<std::string> fallback = {}) const;
  bool flag(const char* name, std::optional<bool> fallback = {}) const;
  std::int64_t integer(const char* name, std::int64_t lo, std::int64_t hi,
                       std::optional<std::int64_t> fallback = {}) const;
  std::uint64_t unsigned_integer(const char* name, std::optional<std::uint64_t> fallback = {}) const;
  // A finite number in [lo, hi].
  double number(const char* name, double lo, double hi, std::optional<double> fallback = {}) const;
  // Arrays and objects; `optional` ones read as empty when absent.
  std::vector<double> numbers(const char* name, double lo, double hi, bool optional = false) const;
  std::vector<std::string> texts(const char* name, bool optional = false) const;
  std::map<std::string, double> number_map(const char* name, double lo, double hi, bool optional = false) const;
  // An object whose values are strings, finite numbers or booleans (a row's params).
  nlohmann::json scalar_object(const char* name) const;
  // An object of any content, or an empty one when absent and optional.
  nlohmann::json object(const char* name, bool optional = false) const;

  // "<where>.<name>"
  std::string path(const std::string& name) const;
  [[noreturn]] void fail(const std::string& name, const std::string& rule, const nlohmann::json* got) const;

 private:
  const nlohmann::json* find(const char* name, bool required) const;
  const nlohmann::json& object_;
  std::string where_;
};

// How a value appears in a message: a quoted, shortened string, a number, null, "an object"…
std::string describe_json(const nlohmann::json& value);

// Parses JSON text, refusing nesting deeper than `max_depth` and a key given twice in one object
// (which JSON leaves undefined); throws InputError "<where>: …" naming the byte offset of a syntax error.
nlohmann::json parse_json_text(const std::string& text, const std::string& where, int max_depth = 16);

}  // namespace xfb
