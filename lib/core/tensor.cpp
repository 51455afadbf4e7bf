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

std::string dtype_name(DType dtype) { return dtype == DType::BF16 ? "bf16" : "f32"; }

DType parse_dtype(const std::string& name) {
  if (name == "f32") return DType::F32;
  if (name == "bf16") return DType::BF16;
  throw std::invalid_argument("unknown dtype '" + name + "' (f32 or bf16)");
}

Tensor::Tensor(Shape shape, DType dtype) : shape_(std::move(shape)), size_(element_count(shape_)), dtype_(dtype) {
  if (size_ > 0) {
    data_ = MemoryTracker::instance().allocate(static_cast<std::size_t>(bytes()));
    std::memset(data_, 0, static_cast<std::size_t>(bytes()));
  }
}

Tensor::~Tensor() { release(); }

Tensor::Tensor(Tensor&& other) noexcept
    : shape_(std::move(other.shape_)),
      size_(std::exchange(other.size_, 0)),
      dtype_(other.dtype_),
      data_(std::exchange(other.data_, nullptr)) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    release();
    shape_ = std::move(other.shape_);
    size_ = std::exchange(other.size_, 0);
    dtype_ = other.dtype_;
    data_ = std::exchange(other.data_, nullptr);
  }
  return *this;
}

Tensor Tensor::clone() const {
  Tensor copy(shape_, dtype_);
  if (size_ > 0) std::memcpy(copy.data_, data_, static_cast<std::size_t>(bytes()));
  return copy;
}

void Tensor::fill(float value) { std::fill(data(), data() + size_, value); }

void Tensor::wrong_dtype(DType expected) const {
  throw std::logic_error("Tensor " + shape_string(shape_) + " holds " + dtype_name(dtype_) + ", read as " +
                         dtype_name(expected));
}

Tensor to_bf16(const Tensor& fp32) {
  Tensor narrowed(fp32.shape(), DType::BF16);
  narrow(fp32.data(), narrowed.bf16_data(), fp32.size());
  return narrowed;
}

Tensor to_f32(const Tensor& tensor) {
  if (tensor.dtype() == DType::F32) return tensor.clone();
  Tensor widened(tensor.shape());
  widen(tensor.bf16_data(), widened.data(), tensor.size());
  return widened;
}

void Tensor::release() noexcept {
  if (data_ != nullptr) MemoryTracker::instance().release(data_, static_cast<std::size_t>(bytes()));
  data_ = nullptr;
}

}  // namespace xfb
