#pragma once
// Summary statistics of timing samples, the two-sided Mann–Whitney U test used by `compare`,
// Spearman's rank correlation and the geometric mean.
#include <cstddef>
#include <cstdint>
#include <vector>

namespace xfb {

struct SampleStats {
  double median = 0, min = 0, max = 0;
  double mad = 0;               // median absolute deviation from the median (unscaled)
  double mean = 0, stddev = 0;  // stddev with Bessel's correction (0 for one sample)
  double cv = 0;                // stddev / mean
};

double median_of(std::vector<double> values);
// The p-quantile (p clamped to [0, 1]) of samples, interpolated linearly between order statistics
// (position p·(n − 1), numpy's default); 0 for no samples.
double sample_quantile(std::vector<double> samples, double p);
SampleStats summarize(const std::vector<double>& samples);

inline constexpr double kUnstableCv = 0.05;  // coefficient of variation that flags a point

// 1-based ranks of `values` in ascending order; tied values share the mean of their ranks.
std::vector<double> average_ranks(const std::vector<double>& values);

// Mann–Whitney U (Wilcoxon rank-sum) test of "a and b come from the same distribution" against
// "one tends to be larger", two-sided.
//   u_a = #{(x, y) : x ∈ a, y ∈ b, x > y} + ½ #{x = y} = R_a − n_a(n_a + 1)/2 (R_a: rank sum of a)
// Exact: the permutation distribution of the rank sum over all C(n_a + n_b, n_a) splits of the
// pooled (tie-averaged) ranks, so ties are handled exactly; p = min(1, 2·min(P(R ≤ r), P(R ≥ r))).
// Normal: z = (u_a − n_a·n_b/2 ∓ ½) / σ with continuity correction and the tie-corrected
// σ² = n_a·n_b/12 · ((n + 1) − Σ(t³ − t)/(n(n − 1))), p = erfc(|z|/√2).
// Auto uses the exact distribution when n_a + n_b ≤ kExactUTestMaxTotal.
enum class UTestMethod { Auto, Exact, Normal };
inline constexpr std::size_t kExactUTestMaxTotal = 50;

struct UTestResult {
  double u_a = 0, u_b = 0;  // u_a + u_b = n_a·n_b
  double p_value = 1;       // two-sided; 1 when either sample is empty
  bool exact = false;       // exact permutation distribution, else normal approximation
  double z = 0;             // normal approximation only
};

UTestResult mann_whitney_u(const std::vector<double>& a, const std::vector<double>& b,
                           UTestMethod method = UTestMethod::Auto);

// Spearman's ρ: Pearson correlation of the tie-averaged ranks. Needs at least two pairs and
// throws std::invalid_argument otherwise; 0 when either side is constant.
double spearman_rho(const std::vector<double>& x, const std::vector<double>& y);

// exp(mean(log v)); every value must be positive (throws std::invalid_argument otherwise).
double geometric_mean(const std::vector<double>& values);

}  // namespace xfb
