#pragma once
// Comparison tables from a report: models as rows (grouped by class), sequence lengths as
// columns, one table per configuration (scope, pass, causal, batch, heads, head_dim, decode
// tokens). Decode tables give time per generated token in µs; `state` shows their state_bytes.
// `crossover` and `front` (apps/report/crossover.hpp) summarise each configuration instead: where
// each model starts to beat the baseline, and which models are on the time–memory front per N.
// Formats: an aligned terminal table, Markdown, CSV.
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "apps/report/report.hpp"

namespace xfb {

enum class TableMetric { Time, Speedup, Memory, MemoryRatio, Gflops, State, Crossover, Front };
enum class TableFormat { Text, Markdown, Csv };

struct TableOptions {
  TableMetric metric = TableMetric::Time;
  TableFormat format = TableFormat::Text;
  // speedup: baseline median / model median; memory-ratio: model peak / baseline peak;
  // crossover: the model both are compared with
  std::string baseline = "vanilla";
  // Adds the survey's complexity, the FLOP-count fit (✓ matches it, ✗ does not, ? ambiguous
  // survey string) and the time exponent (apps/report/complexity.hpp); models with < 3 ok lengths get "-".
  bool complexity = false;
};

std::string render_table(const Report& report, const TableOptions& options);

// One table's configuration: every field of a row's identity but model, N and params.
struct TableKey {
  std::string scope, pass;
  bool causal = false;
  std::int64_t batch = 0, heads = 0, head_dim = 0, d_ff = 0, decode_tokens = 0;
  std::string dtype = "f32";  // a bf16 and an f32 row of one point are in different tables
  // Set only when the report's rows vary in them (a grid): one table per thread count or seed.
  std::optional<int> threads;
  std::optional<std::uint64_t> seed;
  auto operator<=>(const TableKey&) const = default;
};

// The rows of one configuration, as a table lays them out.
struct TableGroup {
  TableKey key;
  std::set<std::int64_t> lengths;  // every N a row of the group has
  // Row labels: the model, with its parameters when the group holds several settings of it;
  // ordered by the model's first class, then registry order.
  std::vector<std::string> labels;
  std::map<std::string, std::string> label_model;
  std::map<std::string, std::map<std::int64_t, const ResultRow*>> grid;  // label → N → row
  std::map<std::int64_t, const ResultRow*> baseline;                     // the baseline model's first row at each N
};

// The report's rows by configuration, in TableKey order; `baseline` names the model of
// TableGroup::baseline.
std::vector<TableGroup> table_groups(const Report& report, const std::string& baseline);

// The first class of a registered model ("unknown" otherwise), as tables group rows.
std::string first_class(const std::string& model);

// A time cell as `--metric time` prints it (ms, µs per token for decode; ~ unstable, ! contended)
// and a memory cell (peak tracked MiB); empty for a row that is not ok.
std::string time_cell(const ResultRow& row);
std::string memory_cell(const ResultRow& row);

// Lays out rows of cells (the first is the header): aligned text, Markdown or CSV (RFC 4180
// quoting: a field holding a comma, quote or line break is quoted, quotes doubled). The first
// `left_columns` columns are left-aligned, the rest right-aligned.
std::string render_cells(const std::vector<std::vector<std::string>>& cells, TableFormat format,
                         std::size_t left_columns = 2);

}  // namespace xfb
