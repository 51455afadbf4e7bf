#pragma once
// Empirical complexity of a model from a sweep: the log-log exponent of a metric against the
// sequence length N, and the best of O(N), O(N log N), O(N√N), O(N²) fitted by least squares
// through the origin, y ≈ c·g(N), ranked by the normalised RMS of the residuals
// (√(Σ(y − c·g)²/n) / mean(y)), as google/benchmark does. The survey's complexity string is
// mapped to the class it predicts (expected_complexity) and compared with the FLOP-count fit.
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "apps/report/crossover.hpp"
#include "apps/report/report.hpp"

namespace xfb {

enum class BigO { N, NLogN, NSqrtN, NSquared };
inline constexpr std::array<BigO, 4> kBigOCandidates = {BigO::N, BigO::NLogN, BigO::NSqrtN, BigO::NSquared};
std::string big_o_name(BigO c);  // "N", "N log N", "N√N", "N²"
// Decode series fit the per-token cost times N (cost of N tokens at that rate) against the same
// classes, so each names one power of N lower: "1", "log N", "√N", "N".
std::string per_token_name(BigO c);
double big_o_value(BigO c, double n);

struct BigOFit {
  BigO best = BigO::N;
  double coefficient = 0;        // c of y ≈ c·g(N) for the best class
  std::array<double, 4> nrms{};  // normalised RMS of every candidate, kBigOCandidates order
  double best_nrms() const { return nrms[static_cast<std::size_t>(best)]; }
};

// Needs at least two points with n > 0; throws std::invalid_argument otherwise.
BigOFit fit_big_o(const std::vector<double>& n, const std::vector<double>& y);
// Least-squares slope of log y against log n; needs positive values and two distinct n.
double loglog_exponent(const std::vector<double>& n, const std::vector<double>& y);

// What the survey's printed complexity predicts for growth in N with hyperparameters fixed.
struct ExpectedComplexity {
  bool known = false;  // false: the string is not in the mapping
  BigO cls = BigO::N;
  bool ambiguous = false;  // the string does not pin the growth in N down (see note)
  std::string note;
};
ExpectedComplexity expected_complexity(const std::string& printed);
// The same for a per-token decoding cost (ModelCard::decode_cost), as the class of N tokens' cost.
ExpectedComplexity expected_decode_complexity(const std::string& printed);

// One fitted metric: available when every value is positive.
struct MetricFit {
  std::optional<double> exponent;
  std::optional<BigOFit> fit;
};

// MatchRevision: the fit is the class of the revision's figure (ModelCard::revised_complexity), not v1's.
enum class ComplexityVerdict { Match, MatchRevision, Mismatch, Ambiguous, Unmapped };
std::string verdict_name(ComplexityVerdict v);

// One model (one parameter setting, one configuration) with at least three ok sequence lengths.
struct ComplexitySeries {
  std::string model, label;   // label adds the parameters when a model has several settings
  std::string configuration;  // "attention, B=1 H=8 D=64"
  std::string survey;         // the registry's complexity string (decode: its per-token decode cost)
  bool per_token = false;     // a decode series: time and FLOPs per generated token, the state as
                              // workspace; fits and expected class of N × them (see per_token_name),
                              // exponents of the per-token values themselves
  ExpectedComplexity expected;
  std::string survey_revision;  // the revision's figure where it differs from v1's (not for decode)
  ExpectedComplexity expected_revision;
  std::vector<std::int64_t> lengths;
  MetricFit time, flops, workspace;
  ComplexityVerdict verdict = ComplexityVerdict::Unmapped;  // from the FLOP-count fit
  // Against analyse_complexity's baseline in the same configuration (apps/report/crossover.hpp);
  // unset for the baseline itself and where it has no row.
  std::optional<Crossovers> crossover;
  std::string baseline;
};

// The survey column: v1's figure, and the revision's after it where it differs ("O(N log N); rev. O(N√N)").
std::string survey_text(const ComplexitySeries& s);
// Series for every (configuration, model, params) with ≥ 3 ok lengths, each with its crossover
// against `baseline`; `skipped` receives one line per series that had fewer.
std::vector<ComplexitySeries> analyse_complexity(const Report& report, std::vector<std::string>* skipped = nullptr,
                                                 const std::string& baseline = "vanilla");
// Fits one set of rows of the same model and configuration (used by `table --complexity`).
ComplexitySeries analyse_series(const std::vector<const ResultRow*>& rows);

enum class ComplexityFormat { Text, Markdown, Json };
std::string render_complexity(const std::vector<ComplexitySeries>& series, const std::vector<std::string>& skipped,
                              ComplexityFormat format);

}  // namespace xfb
