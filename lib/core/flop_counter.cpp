#include "lib/core/flop_counter.hpp"

#include <atomic>

namespace xfb {
namespace {
std::atomic<std::int64_t> g_flops{0};
}
void FlopCounter::add(std::int64_t flops) noexcept { g_flops.fetch_add(flops, std::memory_order_relaxed); }
std::int64_t FlopCounter::total() noexcept { return g_flops.load(); }
void FlopCounter::reset() noexcept { g_flops.store(0); }
}  // namespace xfb
