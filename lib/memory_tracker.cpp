#include "lib/memory_tracker.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace xfb {
namespace {
std::atomic<std::int64_t> g_current{0};
std::atomic<std::int64_t> g_peak{0};

void raise_peak(std::int64_t value) noexcept {
  std::int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (value > seen && !g_peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}
}  // namespace

MemoryTracker& MemoryTracker::instance() {
  static MemoryTracker tracker;
  return tracker;
}

void* MemoryTracker::allocate(std::size_t bytes) {
  const std::size_t rounded = (bytes + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  void* ptr = std::aligned_alloc(kTensorAlignment, rounded == 0 ? kTensorAlignment : rounded);
  if (ptr == nullptr) throw std::bad_alloc();
  const auto now = g_current.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  raise_peak(now);
  return ptr;
}

void MemoryTracker::release(void* ptr, std::size_t bytes) noexcept {
  if (ptr == nullptr) return;
  std::free(ptr);
  g_current.fetch_sub(static_cast<std::int64_t>(bytes));
}

std::int64_t MemoryTracker::current_bytes() const noexcept { return g_current.load(); }
std::int64_t MemoryTracker::peak_bytes() const noexcept { return g_peak.load(); }
void MemoryTracker::reset_peak() noexcept { g_peak.store(g_current.load()); }

}  // namespace xfb
