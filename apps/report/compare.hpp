#pragma once
// Comparison of two reports (BASE → NEW) point by point, for reviews and CI gates.
//
// Points are matched by ResultRow::key(). For points ok in both: the ratio of medians
// (new / base), a two-sided Mann–Whitney U test on the raw samples, the change of
// peak_tensor_bytes and of the executed FLOP count. Verdicts:
//   faster / slower  the U test is significant at `alpha` and the median went down / up
//   noisy            either row is `contended` (its threads waited for a CPU): no time verdict
//   same             otherwise; also when neither report measured the point
//   new              not measured in BASE (absent, or not ok there), ok in NEW
//   missing          measured in BASE, absent from NEW or skipped/unsupported there
//   error            the point is an error in NEW
// Regressions (any one makes `compare` exit 1), each gated by `metrics`:
//   time    slower AND new/base − 1 > max_slowdown
//   memory  (new − base) / base > max_memory_growth, for peak_owned_bytes (the project's own
//           tensors: identical on every machine) and, only where both reports ran the same oneDNN
//           version and ISA, for peak_tensor_bytes (which includes oneDNN's scratchpad)
//   flops   any change of the executed FLOP count (deterministic: a change means different work)
//   error   ok in BASE, error in NEW (always gated)
//   nothing no point is ok in both reports (`compared_nothing`): the comparison checked nothing,
//           which `compare` treats as a failure (exit 1) rather than a pass
//   missing a `missing` point, only when fail_on_missing (CI gates against a stored baseline: a
//           model whose resolved parameters changed, or that no longer runs, must not drop out of
//           the comparison silently)
#include <optional>
#include <string>
#include <vector>

#include "apps/report/report.hpp"
#include "lib/core/stats.hpp"

namespace xfb {

struct CompareOptions {
  double alpha = 0.01;             // significance level of the U test
  double max_slowdown = 0.05;      // fraction: 0.05 lets a point be up to 5% slower
  double max_memory_growth = 0.0;  // fraction of BASE's peak_tensor_bytes
  bool gate_time = true, gate_memory = true, gate_flops = true;
  bool allow_different_context = false;
  bool fail_on_missing = false;  // a point measured in BASE and not in NEW is a regression
};

// Parses "time,memory,flops" (any non-empty subset) into the gate flags; throws InputError.
void parse_metrics(const std::string& text, CompareOptions& options);
// Parses "5%" or "0.05" into 0.05; throws InputError naming `option` on anything else, on a
// negative or non-finite value, and on a bare number above 1 ("5": 5% or 500%? write "5%").
double parse_fraction(const std::string& text, const std::string& option);

enum class Verdict { Faster, Slower, Same, Noisy, New, Missing, Error };
std::string verdict_name(Verdict v);

struct PointComparison {
  std::string key;
  std::optional<ResultRow> base, now;  // absent when the report lacks the point
  const ResultRow& row() const { return now ? *now : *base; }
  Verdict verdict = Verdict::Same;
  double time_ratio = 0;          // new median / base median; 0 unless both ok
  UTestResult test;               // both ok only
  std::int64_t memory_delta = 0;  // new − base peak_tensor_bytes, both ok only
  std::int64_t owned_delta = 0;   // new − base peak_owned_bytes, both ok and both known
  bool owned_known = false;       // both rows carry peak_owned_bytes
  std::int64_t flops_delta = 0;   // new − base flops, both ok only
  bool time_regression = false, memory_regression = false, flops_regression = false, error_regression = false,
       missing_regression = false;
  bool regression() const {
    return time_regression || memory_regression || flops_regression || error_regression || missing_regression;
  }
};

struct Comparison {
  std::vector<PointComparison> points;  // BASE order, then points only in NEW
  std::size_t both_ok = 0;              // points measured in both
  double time_geomean = 0;              // geometric mean of new/base medians (0: no such point)
  double memory_geomean = 0;            // same for peak_tensor_bytes
  std::size_t regressions = 0, time_regressions = 0, memory_regressions = 0, flops_regressions = 0,
              error_regressions = 0, missing_regressions = 0;
  std::size_t flops_changes = 0;    // reported whether or not gated
  bool scratchpad_compared = true;  // same oneDNN version and ISA: peak_tensor_bytes gated too
  bool compared_nothing = false;    // no point ok in both reports: the gate checked nothing (exit 1)
  std::vector<std::string> notes;   // what was not compared and why
};

// Context fields that must agree for `compare` (unless allowed), by gated metric: times need the
// same machine, build and oneDNN path; the project's own tracked bytes depend on the thread count
// alone; FLOP counts on nothing of the context.
inline const std::vector<std::string> kTimeContextFields = {"cpu_model",  "threads",    "onednn_version",
                                                            "onednn_isa", "kernel_isa", "build_type"};
inline const std::vector<std::string> kMemoryContextFields = {"threads"};
// Where these agree, oneDNN's scratchpad (inside peak_tensor_bytes) is comparable.
inline const std::vector<std::string> kScratchpadContextFields = {"onednn_version", "onednn_isa"};
std::vector<std::string> required_context_fields(const CompareOptions& options);
// "threads (2 vs 4)" for every field in `fields` that differs (missing counts as a value).
std::vector<std::string> context_differences(const nlohmann::json& a, const nlohmann::json& b,
                                             const std::vector<std::string>& fields);

// Throws InputError naming the differing required context fields unless
// options.allow_different_context.
Comparison compare_reports(const Report& base, const Report& now, const CompareOptions& options);

enum class CompareFormat { Text, Markdown, Json };
std::string render_comparison(const Comparison& comparison, const CompareOptions& options, CompareFormat format);
// "geometric mean over 12 points measured in both: time 0.98× …; 1 regression (…)"
std::string comparison_summary(const Comparison& comparison);

}  // namespace xfb
