#pragma once
// Comparison tables from a report: models as rows (grouped by class), sequence lengths as
// columns, one table per configuration (scope, causal, batch, heads, head_dim). Formats: an
// aligned terminal table, Markdown, CSV.
#include <string>

#include "lib/report.hpp"

namespace xfb {

enum class TableMetric { Time, Speedup, Memory, Gflops };
enum class TableFormat { Text, Markdown, Csv };

struct TableOptions {
  TableMetric metric = TableMetric::Time;
  TableFormat format = TableFormat::Text;
  std::string baseline = "vanilla";  // for speedup: baseline median / model median
};

std::string render_table(const Report& report, const TableOptions& options);

}  // namespace xfb
