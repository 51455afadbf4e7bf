#include "lib/core/stage_clock.hpp"

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace xfb::stage_clock {
namespace {
using Clock = std::chrono::steady_clock;

// Stage names are string literals; laps inside the timed call only touch this fixed array (no
// allocation), and close() builds the map after the call's stop time was taken.
constexpr std::size_t kMaxStages = 8;

struct Window {
  bool open = false;
  bool muted = false;
  Clock::time_point last;
  std::array<const char*, kMaxStages> names{};
  std::array<double, kMaxStages> ns{};
  std::size_t count = 0;
};

Window& window() {
  static Window instance;
  return instance;
}

std::size_t slot_of(Window& w, const char* stage) {
  for (std::size_t i = 0; i < w.count; ++i)
    if (std::strcmp(w.names[i], stage) == 0) return i;
  if (w.count == kMaxStages) {
    std::fprintf(stderr, "stage_clock: more than %zu stages in one call\n", kMaxStages);
    std::abort();  // a programming error in a mechanism, never user input
  }
  w.names[w.count] = stage;
  w.ns[w.count] = 0.0;
  return w.count++;
}
}  // namespace

void open() {
  Window& w = window();
  w.count = 0;
  w.open = true;
  w.last = Clock::now();
}

void lap(const char* stage) {
  Window& w = window();
  if (!w.open || w.muted) return;
  const auto now = Clock::now();
  w.ns[slot_of(w, stage)] += std::chrono::duration<double, std::nano>(now - w.last).count();
  w.last = now;
}

std::size_t stages() {
  const Window& w = window();
  return w.open ? w.count : 0;
}

void restart() {
  if (!window().muted) window().last = Clock::now();
}

void mute(bool muted) { window().muted = muted; }

std::map<std::string, double> close() {
  Window& w = window();
  w.open = false;
  std::map<std::string, double> stages;
  for (std::size_t i = 0; i < w.count; ++i) stages[w.names[i]] = w.ns[i];
  return stages;
}

}  // namespace xfb::stage_clock
