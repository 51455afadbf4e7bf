#pragma once
// Comparison tables from a report: models as rows (grouped by class), sequence lengths as
// columns, one table per configuration (scope, pass, causal, batch, heads, head_dim, decode
// tokens). Decode tables give time per generated token in µs; `state` shows their state_bytes. Formats: an
// aligned terminal table, Markdown, CSV.
#include <string>
#include <vector>

#include "apps/report/report.hpp"

namespace xfb {

enum class TableMetric { Time, Speedup, Memory, MemoryRatio, Gflops, State };
enum class TableFormat { Text, Markdown, Csv };

struct TableOptions {
  TableMetric metric = TableMetric::Time;
  TableFormat format = TableFormat::Text;
  std::string baseline =
      "vanilla";  // speedup: baseline median / model median; memory-ratio: model peak / baseline peak
  // Adds the survey's complexity, the FLOP-count fit (✓ matches it, ✗ does not, ? ambiguous
  // survey string) and the time exponent (apps/report/complexity.hpp); models with < 3 ok lengths get "-".
  bool complexity = false;
};

std::string render_table(const Report& report, const TableOptions& options);

// Lays out rows of cells (the first is the header): aligned text, Markdown or CSV. The first
// `left_columns` columns are left-aligned, the rest right-aligned.
std::string render_cells(const std::vector<std::vector<std::string>>& cells, TableFormat format,
                         std::size_t left_columns = 2);

}  // namespace xfb
