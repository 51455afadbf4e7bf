#include "lib/core/stats.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace xfb {

double median_of(std::vector<double> values) {
  if (values.empty()) throw std::invalid_argument("median of no values");
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

double sample_quantile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const double position = std::clamp(p, 0.0, 1.0) * static_cast<double>(samples.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(position));
  const std::size_t above = std::min(below + 1, samples.size() - 1);
  return samples[below] + (position - static_cast<double>(below)) * (samples[above] - samples[below]);
}

SampleStats summarize(const std::vector<double>& samples) {
  SampleStats s;
  if (samples.empty()) return s;
  s.median = median_of(samples);
  s.min = *std::min_element(samples.begin(), samples.end());
  s.max = *std::max_element(samples.begin(), samples.end());
  std::vector<double> deviations;
  deviations.reserve(samples.size());
  for (double x : samples) deviations.push_back(std::fabs(x - s.median));
  s.mad = median_of(deviations);
  double sum = 0;
  for (double x : samples) sum += x;
  s.mean = sum / static_cast<double>(samples.size());
  if (samples.size() > 1) {
    double squares = 0;
    for (double x : samples) squares += (x - s.mean) * (x - s.mean);
    s.stddev = std::sqrt(squares / static_cast<double>(samples.size() - 1));
  }
  s.cv = s.mean > 0 ? s.stddev / s.mean : 0.0;
  return s;
}

std::vector<double> average_ranks(const std::vector<double>& values) {
  std::vector<std::size_t> order(values.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t i, std::size_t j) { return values[i] < values[j]; });
  std::vector<double> ranks(values.size());
  for (std::size_t start = 0; start < order.size();) {
    std::size_t end = start + 1;
    while (end < order.size() && values[order[end]] == values[order[start]]) ++end;
    const double rank = 0.5 * static_cast<double>(start + 1 + end);  // mean of ranks start+1 … end
    for (std::size_t i = start; i < end; ++i) ranks[order[i]] = rank;
    start = end;
  }
  return ranks;
}

namespace {

// Two-sided exact p-value of the rank sum of `m` items drawn from `doubled_ranks` (2·rank, so
// tie-averaged ranks stay integers), observed doubled sum `observed`.
double exact_rank_sum_p(const std::vector<long>& doubled_ranks, std::size_t m, long observed) {
  const long total = std::accumulate(doubled_ranks.begin(), doubled_ranks.end(), 0L);
  const auto width = static_cast<std::size_t>(total + 1);
  // ways[k][s]: subsets of size k with doubled rank sum s (counts < 2^53 for n ≤ 50: exact).
  std::vector<std::vector<double>> ways(m + 1, std::vector<double>(width, 0.0));
  ways[0][0] = 1;
  std::size_t seen = 0;
  for (long rank : doubled_ranks) {
    ++seen;
    const auto r = static_cast<std::size_t>(rank);
    for (std::size_t k = std::min(seen, m); k >= 1; --k)
      for (std::size_t s = width - 1; s >= r; --s) ways[k][s] += ways[k - 1][s - r];
  }
  double all = 0, below = 0, above = 0;
  for (std::size_t s = 0; s < width; ++s) {
    all += ways[m][s];
    if (static_cast<long>(s) <= observed) below += ways[m][s];
    if (static_cast<long>(s) >= observed) above += ways[m][s];
  }
  return std::min(1.0, 2.0 * std::min(below, above) / all);
}

double tie_term(std::vector<double> pooled) {
  std::sort(pooled.begin(), pooled.end());
  double sum = 0;
  for (std::size_t start = 0; start < pooled.size();) {
    std::size_t end = start + 1;
    while (end < pooled.size() && pooled[end] == pooled[start]) ++end;
    const auto t = static_cast<double>(end - start);
    sum += t * t * t - t;
    start = end;
  }
  return sum;
}

}  // namespace

UTestResult mann_whitney_u(const std::vector<double>& a, const std::vector<double>& b, UTestMethod method) {
  UTestResult result;
  if (a.empty() || b.empty()) return result;
  const auto na = static_cast<double>(a.size()), nb = static_cast<double>(b.size());
  std::vector<double> pooled = a;
  pooled.insert(pooled.end(), b.begin(), b.end());
  const auto ranks = average_ranks(pooled);
  const double rank_sum_a = std::accumulate(ranks.begin(), ranks.begin() + static_cast<long>(a.size()), 0.0);
  result.u_a = rank_sum_a - na * (na + 1) / 2;
  result.u_b = na * nb - result.u_a;
  const bool exact =
      method == UTestMethod::Exact || (method == UTestMethod::Auto && pooled.size() <= kExactUTestMaxTotal);
  if (exact) {
    std::vector<long> doubled;
    doubled.reserve(ranks.size());
    for (double r : ranks) doubled.push_back(std::lround(2 * r));
    result.exact = true;
    result.p_value = exact_rank_sum_p(doubled, a.size(), std::lround(2 * rank_sum_a));
    return result;
  }
  const double n = na + nb;
  const double variance = na * nb / 12.0 * ((n + 1) - tie_term(pooled) / (n * (n - 1)));
  const double difference = result.u_a - na * nb / 2;
  if (variance <= 0) return result;  // every value equal: no evidence either way
  const double correction = difference > 0 ? 0.5 : difference < 0 ? -0.5 : 0.0;
  result.z = (difference - correction) / std::sqrt(variance);
  result.p_value = std::min(1.0, std::erfc(std::fabs(result.z) / std::sqrt(2.0)));
  return result;
}

double spearman_rho(const std::vector<double>& x, const std::vector<double>& y) {
  if (x.size() != y.size() || x.size() < 2)
    throw std::invalid_argument("spearman_rho needs two equal-length series of at least two values");
  const auto rx = average_ranks(x), ry = average_ranks(y);
  const double mean = 0.5 * static_cast<double>(x.size() + 1);
  double sxy = 0, sxx = 0, syy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxy += (rx[i] - mean) * (ry[i] - mean);
    sxx += (rx[i] - mean) * (rx[i] - mean);
    syy += (ry[i] - mean) * (ry[i] - mean);
  }
  return sxx > 0 && syy > 0 ? sxy / std::sqrt(sxx * syy) : 0.0;
}

double geometric_mean(const std::vector<double>& values) {
  if (values.empty()) throw std::invalid_argument("geometric mean of no values");
  double sum = 0;
  for (double v : values) {
    if (!(v > 0)) throw std::invalid_argument("geometric mean of a non-positive value");
    sum += std::log(v);
  }
  return std::exp(sum / static_cast<double>(values.size()));
}

}  // namespace xfb
