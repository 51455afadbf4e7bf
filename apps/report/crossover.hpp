#pragma once
// Where each model starts to pay off, and which models are worth running at a given N.
//
// Crossover: against a reference model (the table's baseline), per model and configuration, the
// smallest N from which the model is faster (median time) — or smaller (peak tracked bytes) — at
// every larger compared length. A length is compared when both the model and the reference have
// an ok row there with a positive figure. The chain runs down from the largest compared length;
// a length with rows that is not compared (skipped, error, unsupported or absent on either side)
// ends it, so no claim spans a length that was not measured. Lengths above the largest compared
// one bound the claim ("to N"). Between the length that ends the chain by being slower (or
// equal) and the next larger one, the crossing is interpolated on the two log-log lines: log of
// the ratio model/reference is linear in log N there, and its zero is the crossover. Nothing is
// extrapolated beyond the measured lengths: a model faster at every compared length gets "≤ the
// smallest", since below it overheads rather than the asymptotic slopes decide.
//
// Front: per N, the models whose ok row no other ok row beats in both time and memory (another
// row dominates it when it is at most as slow and as large, and strictly better in one); rows
// equal in both are both on the front.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apps/report/report.hpp"
#include "apps/report/table.hpp"

namespace xfb {

enum class CrossoverKind {
  None,          // no compared length (the reference has no row there, or no length is ok on both sides)
  Interpolated,  // slower or equal at `low`, faster at `high` and above: `n` lies between them
  Below,         // faster at every compared length from the smallest length of either on: `n` is it, an upper bound
  AfterGap,      // faster from `high` = `n` on; `low`, the next smaller length, is not compared: `n` is an upper bound
  Never,         // not faster at the largest compared length
};
std::string crossover_kind_name(CrossoverKind kind);  // "none", "interpolated", "below", "after_gap", "never"

struct Crossover {
  CrossoverKind kind = CrossoverKind::None;
  std::int64_t n = 0;              // the crossover length (rounded), or its upper bound; 0 for None and Never
  std::int64_t low = 0, high = 0;  // Interpolated: the bracketing lengths; AfterGap: the gap and n
  std::int64_t compared_to = 0;    // the largest compared length (0: none)
  bool partial = false;            // a larger length has rows but is not compared: the claim stops at compared_to
  bool contended = false;          // a time figure the result rests on comes from a contended row
};

// One length of a model and its reference: the two figures when the length is compared.
struct CrossoverPoint {
  std::int64_t n = 0;
  std::optional<double> model, reference;  // both set, and positive, when compared
  bool contended = false;
};

// The crossover of points in increasing n (see the file comment).
Crossover find_crossover(const std::vector<CrossoverPoint>& points);

using RowsByLength = std::map<std::int64_t, const ResultRow*>;
// The crossover of one model's rows against the reference's, by median time or peak tracked bytes.
Crossover time_crossover(const RowsByLength& model, const RowsByLength& reference);
Crossover memory_crossover(const RowsByLength& model, const RowsByLength& reference);

// Both of a model's crossovers; nullopt when the reference has no row or the rows are its own.
struct Crossovers {
  Crossover time, memory;
};
std::optional<Crossovers> crossovers(const RowsByLength& model, const RowsByLength& reference);

// "2048", "≤ 1024", "≤ 4096 (2048 not compared)", "never", "-"; " (to 8192)" when partial, "!"
// when contended.
std::string crossover_text(const Crossover& c);
// {"kind", "seq_len" (null for none and never), "between" ([low, high] or null), "compared_to"
// (null when nothing was compared), "partial", "contended"}.
nlohmann::json crossover_json(const Crossover& c);

// Indices of the points (time, memory) that no other point dominates, in input order.
std::vector<std::size_t> pareto_front(const std::vector<std::pair<double, double>>& points);

// The rows of `table --metric crossover` and `--metric front` for one configuration (header
// first; CSV gets machine-readable columns), and the legend printed once under the tables.
std::vector<std::vector<std::string>> crossover_cells(const TableGroup& group, TableFormat format);
std::vector<std::vector<std::string>> front_cells(const TableGroup& group, TableFormat format);
std::string crossover_note();
std::string front_note();

}  // namespace xfb
