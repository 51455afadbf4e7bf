#pragma once
// Paired statistics for interleaved A/B timing: one log ratio d_i = log(B_i / A_i) per round.
//
// Wilcoxon signed-rank test of "the d_i are symmetric about 0" (zeros dropped, ties given mid-ranks):
//   W+ = Σ rank(|d_i|) over d_i > 0. Exact null distribution of W+ over all 2^n sign patterns
//   (computed on doubled ranks, so mid-ranks stay integers) for n ≤ kExactSignedRankMax, otherwise
//   the normal approximation with tie correction σ² = n(n+1)(2n+1)/24 − Σ(t³ − t)/48 and continuity
//   correction. p = min(1, 2·min(P(W+ ≤ w), P(W+ ≥ w))).
// Hodges–Lehmann estimate: the median of the n(n+1)/2 Walsh averages (d_i + d_j)/2, i ≤ j, and
// its distribution-free confidence interval [W_(k), W_(M+1−k)] over the sorted Walsh averages,
// k the largest count with P(W+ < k) ≤ (1 − confidence)/2 under the tie-free null distribution.
// Reported as ratios exp(·). With too few rounds for the confidence, the interval is (0, ∞).
#include <cstddef>
#include <vector>

namespace xfb {

inline constexpr std::size_t kExactSignedRankMax = 60;

struct PairedResult {
  std::size_t rounds = 0;          // non-zero differences used
  double ratio = 1;                // exp(Hodges–Lehmann estimate of the median log ratio)
  double ci_low = 0, ci_high = 0;  // confidence interval of the ratio (0 and +∞ when undecidable)
  double w_plus = 0;               // signed-rank statistic
  double p_value = 1;              // two-sided
  bool exact = true;
};

PairedResult paired_log_ratio_test(const std::vector<double>& log_ratios, double confidence);

}  // namespace xfb
