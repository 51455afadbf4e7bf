#include "taxonomy/engines/pattern_common.hpp"

#include <cstring>
#include <utility>

#include "lib/core/memory_tracker.hpp"

namespace xfb {

IndexBuffer::IndexBuffer(std::int64_t count) : size_(count) {
  if (size_ > 0) {
    data_ = static_cast<std::int32_t*>(MemoryTracker::instance().allocate(static_cast<std::size_t>(bytes())));
    std::memset(data_, 0, static_cast<std::size_t>(bytes()));
  }
}

IndexBuffer::~IndexBuffer() { release(); }

IndexBuffer::IndexBuffer(IndexBuffer&& other) noexcept
    : size_(std::exchange(other.size_, 0)), data_(std::exchange(other.data_, nullptr)) {}

IndexBuffer& IndexBuffer::operator=(IndexBuffer&& other) noexcept {
  if (this != &other) {
    release();
    size_ = std::exchange(other.size_, 0);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

void IndexBuffer::release() noexcept {
  if (data_ != nullptr) MemoryTracker::instance().release(data_, static_cast<std::size_t>(bytes()));
  data_ = nullptr;
  size_ = 0;
}

}  // namespace xfb
