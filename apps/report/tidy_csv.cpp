#include "apps/report/tidy_csv.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "apps/report/point_fields.hpp"
#include "apps/report/table.hpp"
#include "lib/core/stats.hpp"

namespace xfb {

namespace {

using nlohmann::json;

struct Column {
  std::string name;
  std::function<json(const ResultRow&)> value;
};

// What an ok row measured, in column order.
const std::vector<Column>& measurement_columns() {
  static const std::vector<Column> columns = {
      {"samples", [](const ResultRow& r) { return json(r.samples_ns.size()); }},
      {"median_ns", [](const ResultRow& r) { return json(r.median_ns); }},
      {"p10_ns", [](const ResultRow& r) { return json(sample_quantile(r.samples_ns, 0.1)); }},
      {"p90_ns", [](const ResultRow& r) { return json(sample_quantile(r.samples_ns, 0.9)); }},
      {"min_ns", [](const ResultRow& r) { return json(r.min_ns); }},
      {"max_ns", [](const ResultRow& r) { return json(r.max_ns); }},
      {"cv", [](const ResultRow& r) { return json(r.cv); }},
      {"unstable", [](const ResultRow& r) { return json(r.unstable); }},
      {"contended", [](const ResultRow& r) { return json(r.contended); }},
      {"contended_samples", [](const ResultRow& r) { return json(r.contended_samples); }},
      {"prefill_ns", [](const ResultRow& r) { return json(r.prefill_ns); }},
      {"peak_tensor_bytes", [](const ResultRow& r) { return json(r.peak_tensor_bytes); }},
      {"peak_owned_bytes", [](const ResultRow& r) { return json(r.peak_owned_bytes); }},
      {"workspace_bytes", [](const ResultRow& r) { return json(r.workspace_bytes); }},
      {"saved_bytes", [](const ResultRow& r) { return json(r.saved_bytes); }},
      {"state_bytes", [](const ResultRow& r) { return json(r.state_bytes); }},
      {"flops", [](const ResultRow& r) { return json(r.flops); }},
      {"gflops_per_s", [](const ResultRow& r) { return json(r.gflops_per_s); }},
      {"tokens_per_s", [](const ResultRow& r) { return json(r.tokens_per_s); }},
  };
  return columns;
}

std::string text_of(const json& value) { return value.is_string() ? value.get<std::string>() : value.dump(); }

// The parameter keys whose value differs between two rows of one model (or that some of its
// rows lack), sorted.
std::vector<std::string> gridded_params(const Report& report) {
  struct Seen {
    std::set<std::string> values;
    std::size_t rows = 0;
  };
  std::map<std::string, std::map<std::string, Seen>> seen;  // model → key → its values
  std::map<std::string, std::size_t> rows_of_model;
  for (const auto& row : report.results) {
    ++rows_of_model[row.model];
    for (const auto& [key, value] : row.params.items()) {
      Seen& s = seen[row.model][key];
      s.values.insert(value.dump());
      ++s.rows;
    }
  }
  std::set<std::string> keys;
  for (const auto& [model, by_key] : seen)
    for (const auto& [key, s] : by_key)
      if (s.values.size() > 1 || s.rows < rows_of_model[model]) keys.insert(key);
  return {keys.begin(), keys.end()};
}

std::string joined(const std::vector<std::string>& items, const std::string& separator) {
  std::string text;
  for (const auto& item : items) text += (text.empty() ? "" : separator) + item;
  return text;
}

}  // namespace

std::vector<std::vector<std::string>> tidy_cells(const Report& report) {
  std::vector<const PointField*> identity;
  for (const auto& field : point_fields())
    if (field.from_row && field.key != "model") identity.push_back(&field);
  const std::vector<std::string> params = gridded_params(report);

  std::vector<std::string> header = {"model", "class", "classes"};
  for (const auto* field : identity) header.push_back(field->key);
  header.push_back("params");
  for (const auto& key : params) header.push_back("param_" + key);
  header.insert(header.end(), {"status", "reason"});
  for (const auto& column : measurement_columns()) header.push_back(column.name);

  std::vector<std::vector<std::string>> cells = {header};
  for (const auto& row : report.results) {
    std::vector<std::string> line = {row.model, row.classes.empty() ? first_class(row.model) : row.classes.front(),
                                     joined(row.classes, "+")};
    for (const auto* field : identity) line.push_back(text_of(field->from_row(row)));
    line.push_back(params_text(row.params));
    for (const auto& key : params) line.push_back(row.params.contains(key) ? text_of(row.params[key]) : "");
    line.insert(line.end(), {status_name(row.status), row.reason});
    for (const auto& column : measurement_columns())
      line.push_back(row.status == Status::Ok ? text_of(column.value(row)) : "");
    cells.push_back(std::move(line));
  }
  return cells;
}

std::string tidy_csv(const Report& report) { return render_cells(tidy_cells(report), TableFormat::Csv); }

}  // namespace xfb
