#include "lib/core/tensor.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "lib/core/memory_tracker.hpp"

namespace xfb {

std::int64_t element_count(const Shape& shape) {
  std::int64_t count = 1;
  for (auto extent : shape) {
    if (extent < 0) throw std::invalid_argument("negative tensor extent in " + shape_string(shape));
    count *= extent;
  }
  return count;
}

std::string shape_string(const Shape& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) text += ",";
    text += std::to_string(shape[i]);
  }
  return text + "]";
}

Tensor::Tensor(Shape shape) : shape_(std::move(shape)), size_(element_count(shape_)) {
  if (size_ > 0) {
    data_ = static_cast<float*>(MemoryTracker::instance().allocate(static_cast<std::size_t>(bytes())));
    std::memset(data_, 0, static_cast<std::size_t>(bytes()));
  }
}

Tensor::~Tensor() { release(); }

Tensor::Tensor(Tensor&& other) noexcept
    : shape_(std::move(other.shape_)),
      size_(std::exchange(other.size_, 0)),
      data_(std::exchange(other.data_, nullptr)) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    release();
    shape_ = std::move(other.shape_);
    size_ = std::exchange(other.size_, 0);
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

Tensor Tensor::clone() const {
  Tensor copy(shape_);
  if (size_ > 0) std::memcpy(copy.data_, data_, static_cast<std::size_t>(bytes()));
  return copy;
}

void Tensor::fill(float value) { std::fill(data_, data_ + size_, value); }

void Tensor::release() noexcept {
  if (data_ != nullptr) MemoryTracker::instance().release(data_, static_cast<std::size_t>(bytes()));
  data_ = nullptr;
}

}  // namespace xfb
