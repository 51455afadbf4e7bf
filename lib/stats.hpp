#pragma once
// Summary statistics of timing samples.
#include <cstdint>
#include <vector>

namespace xfb {

struct SampleStats {
  double median = 0, min = 0, max = 0;
  double mad = 0;  // median absolute deviation from the median (unscaled)
  double mean = 0, stddev = 0;  // stddev with Bessel's correction (0 for one sample)
  double cv = 0;                // stddev / mean
};

double median_of(std::vector<double> values);
SampleStats summarize(const std::vector<double>& samples);

inline constexpr double kUnstableCv = 0.05;  // coefficient of variation that flags a point

}  // namespace xfb
