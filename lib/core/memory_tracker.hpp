#pragma once
// Process-wide accounting of the bytes the project allocates for tensors and oneDNN scratchpads.
// Every tracked allocation is 64-byte aligned and belongs to one pool:
//   Owned    the project's own tensors and buffers: their sizes follow from the problem, the
//            parameters and the thread count alone, so they are identical on every machine;
//   Library  oneDNN's scratchpad: its size depends on the ISA and version oneDNN dispatches.
// `peak_bytes` is the high-water mark of `current_bytes` (both pools) since the last `reset_peak`;
// `owned_peak_bytes` the high-water mark of the owned pool alone over the same span.
#include <cstddef>
#include <cstdint>

namespace xfb {

enum class MemoryPool { Owned, Library };

class MemoryTracker {
 public:
  static MemoryTracker& instance();

  void* allocate(std::size_t bytes, MemoryPool pool = MemoryPool::Owned);  // throws std::bad_alloc
  void release(void* ptr, std::size_t bytes, MemoryPool pool = MemoryPool::Owned) noexcept;

  std::int64_t current_bytes() const noexcept;
  std::int64_t peak_bytes() const noexcept;
  std::int64_t owned_current_bytes() const noexcept;
  std::int64_t owned_peak_bytes() const noexcept;
  void reset_peak() noexcept;  // both peaks := their current values

 private:
  MemoryTracker() = default;
};

inline constexpr std::size_t kTensorAlignment = 64;

}  // namespace xfb
