#pragma once
// Timing harness: untimed warm-up, then timed repetitions until both min_reps and min_time are met
// (capped by max_reps). Every repetition's wall time is kept.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace xfb {

struct TimingSettings {
  int warmup = 1;          // untimed runs before timing
  int min_reps = 5;        // timed runs, at least
  double min_time_s = 0.5; // seconds of timed runs, at least
  int max_reps = 1000;     // timed runs, at most
};

struct TimingResult {
  std::vector<double> samples_ns;
  std::map<std::string, std::vector<double>> stage_samples_ns;  // per stage_clock stage, one per run
  std::int64_t primitives_created_while_timed = 0;
};

TimingResult time_repeatedly(const TimingSettings& settings, const std::function<void()>& body);

// True when this binary was built with optimisation (NDEBUG and not a Debug build).
bool optimised_build();

}  // namespace xfb
