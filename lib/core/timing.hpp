#pragma once
// Timing harness: untimed warm-up, then timed repetitions until the clean samples meet both
// min_reps and min_time (capped by max_reps). Every repetition's wall time is kept; repetitions
// during which the point's threads waited for a CPU (lib/core/contention.hpp) are kept apart and
// re-measured, within a retry budget: the loop gives up once the descheduled samples add up to
// more than 2·min_time + 0.25 s (or max_reps samples were taken in all). A result with fewer clean
// samples than min_reps, or with more descheduled samples than clean ones, is `contended`.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "lib/core/contention.hpp"

namespace xfb {

struct TimingSettings {
  int warmup = 1;           // untimed runs before timing
  int min_reps = 5;         // clean timed runs, at least
  double min_time_s = 0.5;  // seconds of clean timed runs, at least
  int max_reps = 1000;      // timed runs, clean or not, at most
};

struct TimingResult {
  std::vector<double> samples_ns;            // clean repetitions, wall clock
  std::vector<double> contended_samples_ns;  // descheduled repetitions, left out of statistics
  // Per stage_clock stage, one per clean run (per run of any kind when no run was clean).
  std::map<std::string, std::vector<double>> stage_samples_ns;
  ContentionSummary contention;
  bool contended = false;  // clean samples < min_reps, or < descheduled ones
  std::int64_t primitives_created_while_timed = 0;
};

// The stopping and sorting rule of the loop, apart from any clock (tests feed it samples).
class SampleCollector {
 public:
  explicit SampleCollector(const TimingSettings& settings) : settings_(settings) {}
  void add(double wall_ns, const SampleContention& contention, const std::map<std::string, double>& stages = {});
  bool done() const;
  TimingResult finish(int threads) const;

 private:
  TimingSettings settings_;
  TimingResult result_;
  std::vector<double> all_wall_ns_;
  std::vector<SampleContention> all_contention_;
  std::map<std::string, std::vector<double>> contended_stage_samples_ns_;
  double clean_ns_ = 0, contended_ns_ = 0;
};

TimingResult time_repeatedly(const TimingSettings& settings, const std::function<void()>& body);

// Decoding (`--pass decode`): one run is a prefill (a forward over the context, building the state)
// followed by `tokens` steps, each timed on its own with its contention probe. `settings.warmup`
// whole runs are untimed; then runs repeat until at least min_reps of them have run, their clean
// steps number min_reps·tokens and the runs took min_time in all — or max_reps runs, or the retry
// budget of descheduled steps (as above) is spent. `steps` sorts the step samples as
// time_repeatedly does (`contended`: fewer clean steps than one run's, or more descheduled than
// clean ones). `ready(t)` runs untimed right before step t (the harness brings the token's inputs
// into cache there, as the projection that produces them in a real decoder would leave them).
struct DecodeTimingResult {
  TimingResult steps;              // per-token wall times of every timed run's steps
  std::vector<double> prefill_ns;  // one per timed run
  std::int64_t runs = 0;
};
DecodeTimingResult time_decoding(const TimingSettings& settings, std::int64_t tokens,
                                 const std::function<void()>& prefill,
                                 const std::function<void(std::int64_t step)>& step,
                                 const std::function<void(std::int64_t step)>& ready);

// True when this binary was built with optimisation (NDEBUG and not a Debug build).
bool optimised_build();

}  // namespace xfb
