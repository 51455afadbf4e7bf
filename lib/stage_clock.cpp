#include "lib/stage_clock.hpp"

#include <chrono>

namespace xfb::stage_clock {
namespace {
using Clock = std::chrono::steady_clock;

struct Window {
  bool open = false;
  Clock::time_point last;
  std::map<std::string, double> stages_ns;
};

Window& window() {
  static Window instance;
  return instance;
}
}  // namespace

void open() {
  Window& w = window();
  w.stages_ns.clear();
  w.open = true;
  w.last = Clock::now();
}

void lap(const char* stage) {
  Window& w = window();
  if (!w.open) return;
  const auto now = Clock::now();
  w.stages_ns[stage] += std::chrono::duration<double, std::nano>(now - w.last).count();
  w.last = now;
}

void restart() { window().last = Clock::now(); }

std::map<std::string, double> close() {
  Window& w = window();
  w.open = false;
  return std::move(w.stages_ns);
}

}  // namespace xfb::stage_clock
