#include "lib/core/memory_tracker.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace xfb {
namespace {
struct Level {
  std::atomic<std::int64_t> current{0};
  std::atomic<std::int64_t> peak{0};

  void add(std::int64_t bytes) noexcept {
    const std::int64_t now = current.fetch_add(bytes) + bytes;
    std::int64_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
  void reset_peak() noexcept { peak.store(current.load()); }
};
Level g_all;    // both pools
Level g_owned;  // MemoryPool::Owned only
}  // namespace

MemoryTracker& MemoryTracker::instance() {
  static MemoryTracker tracker;
  return tracker;
}

void* MemoryTracker::allocate(std::size_t bytes, MemoryPool pool) {
  const std::size_t rounded = (bytes + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  void* ptr = std::aligned_alloc(kTensorAlignment, rounded == 0 ? kTensorAlignment : rounded);
  if (ptr == nullptr) throw std::bad_alloc();
  g_all.add(static_cast<std::int64_t>(bytes));
  if (pool == MemoryPool::Owned) g_owned.add(static_cast<std::int64_t>(bytes));
  return ptr;
}

void MemoryTracker::release(void* ptr, std::size_t bytes, MemoryPool pool) noexcept {
  if (ptr == nullptr) return;
  std::free(ptr);
  g_all.current.fetch_sub(static_cast<std::int64_t>(bytes));
  if (pool == MemoryPool::Owned) g_owned.current.fetch_sub(static_cast<std::int64_t>(bytes));
}

std::int64_t MemoryTracker::current_bytes() const noexcept { return g_all.current.load(); }
std::int64_t MemoryTracker::peak_bytes() const noexcept { return g_all.peak.load(); }
std::int64_t MemoryTracker::owned_current_bytes() const noexcept { return g_owned.current.load(); }
std::int64_t MemoryTracker::owned_peak_bytes() const noexcept { return g_owned.peak.load(); }
void MemoryTracker::reset_peak() noexcept {
  g_all.reset_peak();
  g_owned.reset_peak();
}

}  // namespace xfb
