#pragma once
// Dense fp32 tensor, row-major (C order), 64-byte aligned, allocated through the MemoryTracker.
// Attention tensors use the shape [B, H, N, D]: batch, heads, tokens, features per head.
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

namespace xfb {

using Shape = std::vector<std::int64_t>;

std::int64_t element_count(const Shape& shape);
std::string shape_string(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape);  // zero-filled
  static Tensor bhnd(std::int64_t batch, std::int64_t heads, std::int64_t tokens, std::int64_t dim) {
    return Tensor(Shape{batch, heads, tokens, dim});
  }
  ~Tensor();
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  Tensor clone() const;

  const Shape& shape() const { return shape_; }
  std::int64_t dim(std::size_t axis) const { return shape_.at(axis); }
  std::int64_t rank() const { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t size() const { return size_; }
  std::int64_t bytes() const { return size_ * static_cast<std::int64_t>(sizeof(float)); }
  bool empty() const { return size_ == 0; }

  float* data() { return data_; }
  const float* data() const { return data_; }
  std::span<float> values() { return {data_, static_cast<std::size_t>(size_)}; }
  std::span<const float> values() const { return {data_, static_cast<std::size_t>(size_)}; }
  float& operator[](std::int64_t i) { return data_[i]; }
  float operator[](std::int64_t i) const { return data_[i]; }

  // Pointer to the [N, D] matrix of head h in batch b of a rank-4 tensor.
  float* head(std::int64_t b, std::int64_t h) { return data_ + (b * shape_[1] + h) * shape_[2] * shape_[3]; }
  const float* head(std::int64_t b, std::int64_t h) const {
    return data_ + (b * shape_[1] + h) * shape_[2] * shape_[3];
  }

  void fill(float value);

 private:
  void release() noexcept;
  Shape shape_;
  std::int64_t size_ = 0;
  float* data_ = nullptr;
};

}  // namespace xfb
