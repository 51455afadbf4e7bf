#include "lib/core/paired.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/stats.hpp"

namespace xfb {
namespace {

// counts[s] = number of sign patterns whose doubled positive rank sum is s.
std::vector<double> signed_rank_counts(const std::vector<long>& doubled_ranks) {
  long total = 0;
  for (long r : doubled_ranks) total += r;
  std::vector<double> counts(static_cast<std::size_t>(total) + 1, 0.0);
  counts[0] = 1;
  long reach = 0;
  for (long r : doubled_ranks) {
    for (long s = reach; s >= 0; --s) counts[static_cast<std::size_t>(s + r)] += counts[static_cast<std::size_t>(s)];
    reach += r;
  }
  return counts;
}

double exact_p_value(const std::vector<long>& doubled_ranks, long doubled_w) {
  const auto counts = signed_rank_counts(doubled_ranks);
  double all = 0, below = 0, above = 0;
  for (std::size_t s = 0; s < counts.size(); ++s) {
    all += counts[s];
    if (static_cast<long>(s) <= doubled_w) below += counts[s];
    if (static_cast<long>(s) >= doubled_w) above += counts[s];
  }
  return std::min(1.0, 2 * std::min(below, above) / all);
}

double normal_p_value(const std::vector<double>& ranks, const std::vector<double>& magnitudes, double w) {
  const double n = static_cast<double>(ranks.size());
  double ties = 0;
  std::vector<double> sorted = magnitudes;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size();) {
    std::size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    const double t = static_cast<double>(j - i);
    ties += t * t * t - t;
    i = j;
  }
  const double variance = n * (n + 1) * (2 * n + 1) / 24 - ties / 48;
  if (variance <= 0) return 1;
  const double mean = n * (n + 1) / 4;
  const double z = (std::fabs(w - mean) - 0.5) / std::sqrt(variance);
  return std::min(1.0, std::erfc(std::max(z, 0.0) / std::sqrt(2.0)));
}

// Largest k with P(W+ < k) ≤ tail under the tie-free null distribution of n ranks; 0 if none.
std::size_t walsh_critical_count(std::size_t n, double tail) {
  std::vector<long> ranks(n);
  for (std::size_t i = 0; i < n; ++i) ranks[i] = static_cast<long>(i + 1);
  const auto counts = signed_rank_counts(ranks);
  const double all = std::ldexp(1.0, static_cast<int>(n));
  double below = 0;  // P(W+ ≤ k − 1)·2^n
  std::size_t k = 0;
  while (k < counts.size() && (below + counts[k]) / all <= tail) {
    below += counts[k];
    ++k;
  }
  return k;  // P(W+ < k) ≤ tail
}

}  // namespace

PairedResult paired_log_ratio_test(const std::vector<double>& log_ratios, double confidence) {
  PairedResult result;
  std::vector<double> d;
  for (double x : log_ratios)
    if (x != 0 && std::isfinite(x)) d.push_back(x);
  result.rounds = d.size();
  result.ci_high = std::numeric_limits<double>::infinity();
  if (d.empty()) return result;

  std::vector<double> magnitudes;
  for (double x : d) magnitudes.push_back(std::fabs(x));
  const auto ranks = average_ranks(magnitudes);
  std::vector<long> doubled;
  long doubled_w = 0;
  for (std::size_t i = 0; i < d.size(); ++i) {
    doubled.push_back(std::lround(2 * ranks[i]));
    if (d[i] > 0) doubled_w += doubled.back();
  }
  result.w_plus = static_cast<double>(doubled_w) / 2;
  result.exact = d.size() <= kExactSignedRankMax;
  result.p_value = result.exact ? exact_p_value(doubled, doubled_w) : normal_p_value(ranks, magnitudes, result.w_plus);

  std::vector<double> walsh;
  for (std::size_t i = 0; i < d.size(); ++i)
    for (std::size_t j = i; j < d.size(); ++j) walsh.push_back((d[i] + d[j]) / 2);
  std::sort(walsh.begin(), walsh.end());
  result.ratio = std::exp(median_of(walsh));
  const std::size_t k = d.size() <= kExactSignedRankMax ? walsh_critical_count(d.size(), (1 - confidence) / 2) : 0;
  if (k >= 1) {
    result.ci_low = std::exp(walsh[k - 1]);
    result.ci_high = std::exp(walsh[walsh.size() - k]);
  }
  return result;
}

}  // namespace xfb
