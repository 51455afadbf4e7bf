#include "lib/stats.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace xfb {

double median_of(std::vector<double> values) {
  if (values.empty()) throw std::invalid_argument("median of no values");
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
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

}  // namespace xfb
