#pragma once
// The tidy export of a report (`table --format csv --tidy`): one CSV row per result row, in
// report order, one column per variable, units in the column names, so that Python's csv
// module or pandas reads it without reshaping. Columns:
//   - model, class (the first of the row's classes), classes (all, joined by '+');
//   - every identity field of a row from the point's field table (apps/report/point_fields.hpp),
//     in its order: seq_len, batch, heads, head_dim, scope, pass, decode_tokens, causal, d_ff,
//     ffn, experts, capacity_factor, group_size, threads, seed;
//   - params (the resolved parameters, "key=value,…") and a param_<key> column for every key
//     whose value differs between two rows of one model (a parameter grid);
//   - status, reason, then the measurement (empty for a row that is not ok): samples, median_ns,
//     p10_ns, p90_ns, min_ns, max_ns (of the clean samples; decode rows per generated token),
//     cv, unstable, contended, contended_samples, prefill_ns, peak_tensor_bytes, peak_owned_bytes,
//     workspace_bytes, saved_bytes, state_bytes, flops, gflops_per_s, tokens_per_s.
// Numbers as the report's JSON writes them, booleans true/false, RFC 4180 quoting.
#include <string>
#include <vector>

#include "apps/report/report.hpp"

namespace xfb {

// Header first, then one line per row of the report.
std::vector<std::vector<std::string>> tidy_cells(const Report& report);
std::string tidy_csv(const Report& report);

}  // namespace xfb
