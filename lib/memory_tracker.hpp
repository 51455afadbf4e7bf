#pragma once
// Process-wide accounting of the bytes the project allocates for tensors and oneDNN scratchpads.
// Every tracked allocation is 64-byte aligned. `peak_bytes` is the high-water mark of
// `current_bytes` since the last `reset_peak`.
#include <cstddef>
#include <cstdint>

namespace xfb {

class MemoryTracker {
 public:
  static MemoryTracker& instance();

  void* allocate(std::size_t bytes);  // throws std::bad_alloc
  void release(void* ptr, std::size_t bytes) noexcept;

  std::int64_t current_bytes() const noexcept;
  std::int64_t peak_bytes() const noexcept;
  void reset_peak() noexcept;  // peak := current

 private:
  MemoryTracker() = default;
};

inline constexpr std::size_t kTensorAlignment = 64;

}  // namespace xfb
