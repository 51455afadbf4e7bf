#include "lib/core/timing.hpp"

#include <algorithm>
#include <chrono>
#include <limits>
#include <string_view>

#include "lib/core/dnnl_context.hpp"
#include "lib/core/stage_clock.hpp"

namespace xfb {

void SampleCollector::add(double wall_ns, const SampleContention& contention,
                          const std::map<std::string, double>& stages) {
  all_wall_ns_.push_back(wall_ns);
  all_contention_.push_back(contention);
  if (contention.descheduled) {
    result_.contended_samples_ns.push_back(wall_ns);
    contended_ns_ += wall_ns;
    for (const auto& [stage, ns] : stages) contended_stage_samples_ns_[stage].push_back(ns);
    return;
  }
  result_.samples_ns.push_back(wall_ns);
  clean_ns_ += wall_ns;
  for (const auto& [stage, ns] : stages) result_.stage_samples_ns[stage].push_back(ns);
}

bool SampleCollector::done() const {
  const auto clean = static_cast<int>(result_.samples_ns.size());
  const auto contended = static_cast<int>(result_.contended_samples_ns.size());
  if (clean + contended >= settings_.max_reps) return true;
  if (clean >= settings_.min_reps && clean_ns_ >= settings_.min_time_s * 1e9) return true;
  return contended_ns_ > (2 * settings_.min_time_s + 0.25) * 1e9;  // the retry budget is spent
}

TimingResult SampleCollector::finish(int threads) const {
  TimingResult result = result_;
  const auto clean = result.samples_ns.size(), descheduled = result.contended_samples_ns.size();
  // Too few clean samples: below min_reps, or outnumbered by descheduled ones — the machine was busy
  // throughout, and the clean minority is a selection of lucky repetitions, not the point's time.
  result.contended = static_cast<int>(clean) < settings_.min_reps || descheduled > clean;
  if (result.samples_ns.empty()) result.stage_samples_ns = contended_stage_samples_ns_;
  result.contention = summarize_contention(all_wall_ns_, all_contention_, threads);
  return result;
}

TimingResult time_repeatedly(const TimingSettings& settings, const std::function<void()>& body) {
  for (int i = 0; i < settings.warmup; ++i) body();
  const auto created_before = DnnlContext::instance().primitives_created();
  ContentionProbe probe;  // after warm-up: the OpenMP threads exist
  SampleCollector collector(settings);
  using clock = std::chrono::steady_clock;
  while (!collector.done()) {
    probe.start();
    const auto start = clock::now();
    stage_clock::open();
    body();
    const auto stop = clock::now();
    const double ns = std::chrono::duration<double, std::nano>(stop - start).count();
    const auto stages = stage_clock::close();
    collector.add(ns, probe.stop(ns), stages);
  }
  TimingResult result = collector.finish(DnnlContext::instance().threads());
  result.primitives_created_while_timed = DnnlContext::instance().primitives_created() - created_before;
  return result;
}

DecodeTimingResult time_decoding(const TimingSettings& settings, std::int64_t tokens,
                                 const std::function<void()>& prefill,
                                 const std::function<void(std::int64_t step)>& step,
                                 const std::function<void(std::int64_t step)>& ready) {
  using clock = std::chrono::steady_clock;
  auto whole_run = [&] {
    prefill();
    for (std::int64_t t = 0; t < tokens; ++t) step(t);
  };
  for (int i = 0; i < settings.warmup; ++i) whole_run();
  const auto created_before = DnnlContext::instance().primitives_created();
  ContentionProbe probe;
  // Sorting only: the stopping rule is per run, below.
  SampleCollector collector({.warmup = 0,
                             .min_reps = static_cast<int>(tokens),
                             .min_time_s = 0,
                             .max_reps = std::numeric_limits<int>::max()});
  DecodeTimingResult result;
  double total_ns = 0, clean_steps = 0, contended_ns = 0;
  const double budget_ns = (2 * settings.min_time_s + 0.25) * 1e9;
  auto done = [&] {
    if (result.runs >= settings.max_reps) return true;
    if (result.runs >= settings.min_reps &&
        clean_steps >= static_cast<double>(settings.min_reps) * static_cast<double>(tokens) &&
        total_ns >= settings.min_time_s * 1e9)
      return true;
    return result.runs > 0 && contended_ns > budget_ns;
  };
  while (!done()) {
    const auto run_start = clock::now();
    prefill();
    const auto prefilled = clock::now();
    result.prefill_ns.push_back(std::chrono::duration<double, std::nano>(prefilled - run_start).count());
    for (std::int64_t t = 0; t < tokens; ++t) {
      ready(t);
      probe.start();
      const auto start = clock::now();
      stage_clock::open();
      step(t);
      const auto stop = clock::now();
      const double ns = std::chrono::duration<double, std::nano>(stop - start).count();
      const auto stages = stage_clock::close();
      const SampleContention contention = probe.stop(ns);
      collector.add(ns, contention, stages);
      if (contention.descheduled)
        contended_ns += ns;
      else
        clean_steps += 1;
    }
    total_ns += std::chrono::duration<double, std::nano>(clock::now() - run_start).count();
    ++result.runs;
  }
  result.steps = collector.finish(DnnlContext::instance().threads());
  result.steps.primitives_created_while_timed = DnnlContext::instance().primitives_created() - created_before;
  return result;
}

bool optimised_build() {
#if defined(NDEBUG)
  return std::string_view(XFBENCH_BUILD_TYPE) != "Debug";
#else
  return false;
#endif
}

}  // namespace xfb
