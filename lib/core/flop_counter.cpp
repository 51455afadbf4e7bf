#include "lib/core/flop_counter.hpp"

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace xfb {
namespace {

// One counter per thread, each on its own cache line: tile loops call add() from every OpenMP
// thread for every small gemm, and one shared atomic made the threads trade its cache line (a few
// percent of block-local attention's time). Only the owning thread writes a slot; total() and
// reset() run between parallel regions.
struct alignas(64) Slot {
  std::atomic<std::int64_t> flops{0};
};

std::mutex g_slots_mutex;
std::vector<std::unique_ptr<Slot>>& slots() {
  static std::vector<std::unique_ptr<Slot>> all;  // never shrinks: a finished thread's count stays
  return all;
}

Slot& own_slot() {
  thread_local Slot* slot = [] {
    const std::lock_guard lock(g_slots_mutex);
    slots().push_back(std::make_unique<Slot>());
    return slots().back().get();
  }();
  return *slot;
}

}  // namespace

void FlopCounter::add(std::int64_t flops) noexcept {
  Slot& slot = own_slot();
  slot.flops.store(slot.flops.load(std::memory_order_relaxed) + flops, std::memory_order_relaxed);
}

std::int64_t FlopCounter::total() noexcept {
  const std::lock_guard lock(g_slots_mutex);
  std::int64_t sum = 0;
  for (const auto& slot : slots()) sum += slot->flops.load(std::memory_order_relaxed);
  return sum;
}

void FlopCounter::reset() noexcept {
  const std::lock_guard lock(g_slots_mutex);
  for (auto& slot : slots()) slot->flops.store(0, std::memory_order_relaxed);
}

}  // namespace xfb
