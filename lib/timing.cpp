#include "lib/timing.hpp"

#include <chrono>
#include <string_view>

#include "lib/dnnl_context.hpp"
#include "lib/stage_clock.hpp"

namespace xfb {

TimingResult time_repeatedly(const TimingSettings& settings, const std::function<void()>& body) {
  for (int i = 0; i < settings.warmup; ++i) body();
  TimingResult result;
  const auto created_before = DnnlContext::instance().primitives_created();
  double total_ns = 0;
  using clock = std::chrono::steady_clock;
  while (static_cast<int>(result.samples_ns.size()) < settings.max_reps &&
         (static_cast<int>(result.samples_ns.size()) < settings.min_reps || total_ns < settings.min_time_s * 1e9)) {
    const auto start = clock::now();
    stage_clock::open();
    body();
    const auto stop = clock::now();
    for (const auto& [stage, ns] : stage_clock::close()) result.stage_samples_ns[stage].push_back(ns);
    const double ns = std::chrono::duration<double, std::nano>(stop - start).count();
    result.samples_ns.push_back(ns);
    total_ns += ns;
  }
  result.primitives_created_while_timed = DnnlContext::instance().primitives_created() - created_before;
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
