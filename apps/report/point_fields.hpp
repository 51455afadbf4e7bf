#pragma once
// The benchmark point's field table: every field of a PointConfig (lib/core/point_config.hpp) once,
// with its type, range, default (the PointConfig's own), help and where it appears. From this
// table alone come
//   - the command-line options of every command that takes a point (`run`, `sweep`, `ab`; apps/)
//     and their validation: integers exact and in range (no wrap-around), reals finite and in
//     range, choices by name, each option at most once unless it is a list;
//   - the relations between fields and the size limits (check_point_config);
//   - the child protocol: the point as JSON (point_to_json / point_from_json, validated alike);
//   - the reproducer's `xfbench run …` words (point_arguments);
//   - the report settings of a point (point_settings);
//   - a row's identity fields (set_row_identity) and its key (point_key).
// Limits (docs/cli.md#limits): every size field has its own range below; besides, one [B, H, N+T, D]
// tensor holds at most 2^36 elements, B·H·(N+T)²·D ≤ 2^56 (so every FLOP and workspace formula fits
// in 64 bits), a layer's B·N·(H·D)·d_ff ≤ 2^56, and a point keeps at most 2^27 timed samples.
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/report/report.hpp"
#include "lib/core/point_config.hpp"

namespace xfb {

enum class FieldType {
  Integer,   // int64 in [min, max]
  Length,    // a token count in [min, max]: an Integer that also takes 1K, 16K, 1M (lib/core/token_count.hpp)
  Unsigned,  // uint64, the whole range (the seed)
  Real,      // finite double in [real_min, real_max]
  Flag,      // true when given
  Choice,    // one of `choices`; `pass` also takes a comma list in sweep and ab
  Text,      // a non-empty string
  TextList,  // repeatable string (`--param key=value`)
};

// Which commands take the field: every point command, or `run` alone (sweep and ab take grids
// instead: --models, --seq-lens).
enum class FieldUse { Point, RunOnly };

struct PointField {
  std::string key;    // JSON, settings and row name: "head_dim"
  std::string flags;  // CLI11 names: "--head-dim,-d"
  FieldType type = FieldType::Integer;
  std::int64_t min = 0, max = 0;      // Integer
  double real_min = 0, real_max = 0;  // Real
  std::vector<std::string> choices;   // Choice
  std::string help;                   // meaning and unit
  FieldUse use = FieldUse::Point;
  bool in_settings = true;                                // recorded in a report's settings
  bool in_key = true;                                     // part of the row key (rows are matched across reports by it)
  std::function<nlohmann::json(const PointConfig&)> get;  // the value as given
  std::function<void(PointConfig&, const nlohmann::json&)> set;       // a value that passed check_field_value
  std::function<nlohmann::json(const PointConfig&)> recorded;         // as settings and rows record it
  std::function<std::vector<std::string>(const PointConfig&)> words;  // reproducer words; none: omitted
  std::function<void(ResultRow&, const nlohmann::json&)> to_row;      // the recorded value into a row
  std::function<nlohmann::json(const ResultRow&)> from_row;           // and back (the key)

  std::string long_flag() const;  // "--head-dim"
};

const std::vector<PointField>& point_fields();
const PointField& point_field(const std::string& key);  // std::logic_error for an unknown key

// A command-line word for the field as a JSON value of its type; InputError naming the flag.
nlohmann::json parse_field_text(const PointField& field, const std::string& text);
// Type and range of a JSON value for the field; InputError naming `where` (a flag or a JSON key).
void check_field_value(const PointField& field, const nlohmann::json& value, const std::string& where);

// The words given per field key, as the command line gave them (a list field may repeat).
using FieldTexts = std::map<std::string, std::vector<std::string>>;
// `defaults` with every given field applied (each validated); `pass` must be a single pass here.
PointConfig apply_field_texts(PointConfig defaults, const FieldTexts& texts);

// The product of non-negative factors, or -1 when it overflows int64.
std::int64_t checked_product(std::initializer_list<std::int64_t> factors);

// Relations between fields and the size limits above; InputError naming the options.
void check_point_config(const PointConfig& config);

// The child protocol: every field as given, by key. point_from_json validates types, ranges and
// relations as the command line does, and refuses unknown keys.
nlohmann::json point_to_json(const PointConfig& config);
PointConfig point_from_json(const nlohmann::json& json);

// The `run …` words that reproduce the point (no program name).
std::vector<std::string> point_arguments(const PointConfig& config);
// The settings a point contributes to a report: every in_settings field as recorded.
nlohmann::json point_settings(const PointConfig& config);
// The row's identity fields (model, scope, pass, shape, d_ff, decode_tokens, dtype, threads, seed).
void set_row_identity(ResultRow& row, const PointConfig& config);
// The key rows are matched by across reports: the in_key fields and the resolved params.
std::string point_key(const ResultRow& row);

}  // namespace xfb
