#pragma once
// Dense tensor, row-major (C order), 64-byte aligned, allocated through the MemoryTracker.
// Attention tensors use the shape [B, H, N, D]: batch, heads, tokens, features per head.
// Elements are fp32 (the default everywhere) or bf16 (lib/core/bf16.hpp; --dtype bf16, issue 31):
// bytes() is in the element's real size, so tracked memory is. The typed accessors check the
// element type: data()/values()/head() are the fp32 view, bf16_data()/bf16_head() the bf16 one;
// using the other throws std::logic_error (operator[] is the unchecked fp32 view, for loops).
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include "lib/core/bf16.hpp"

namespace xfb {

// The element type of a tensor and of a point's q, k, v, output and decode state.
enum class DType { F32, BF16 };
std::string dtype_name(DType dtype);         // "f32", "bf16"
DType parse_dtype(const std::string& name);  // std::invalid_argument on an unknown name
inline std::int64_t element_bytes(DType dtype) { return dtype == DType::BF16 ? 2 : 4; }

using Shape = std::vector<std::int64_t>;

std::int64_t element_count(const Shape& shape);
std::string shape_string(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(Shape shape, DType dtype = DType::F32);  // zero-filled
  static Tensor bhnd(std::int64_t batch, std::int64_t heads, std::int64_t tokens, std::int64_t dim,
                     DType dtype = DType::F32) {
    return Tensor(Shape{batch, heads, tokens, dim}, dtype);
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
  DType dtype() const { return dtype_; }
  std::int64_t bytes() const { return size_ * element_bytes(dtype_); }
  bool empty() const { return size_ == 0; }

  float* data() { return static_cast<float*>(checked(DType::F32)); }
  const float* data() const { return static_cast<const float*>(checked(DType::F32)); }
  std::span<float> values() { return {data(), static_cast<std::size_t>(size_)}; }
  std::span<const float> values() const { return {data(), static_cast<std::size_t>(size_)}; }
  float& operator[](std::int64_t i) { return static_cast<float*>(data_)[i]; }
  float operator[](std::int64_t i) const { return static_cast<const float*>(data_)[i]; }
  bf16* bf16_data() { return static_cast<bf16*>(checked(DType::BF16)); }
  const bf16* bf16_data() const { return static_cast<const bf16*>(checked(DType::BF16)); }
  // The storage whatever the element type (copies, dumps): bytes() bytes.
  void* raw_data() { return data_; }
  const void* raw_data() const { return data_; }

  // Pointer to the [N, D] matrix of head h in batch b of a rank-4 tensor.
  float* head(std::int64_t b, std::int64_t h) { return data() + head_offset(b, h); }
  const float* head(std::int64_t b, std::int64_t h) const { return data() + head_offset(b, h); }
  bf16* bf16_head(std::int64_t b, std::int64_t h) { return bf16_data() + head_offset(b, h); }
  const bf16* bf16_head(std::int64_t b, std::int64_t h) const { return bf16_data() + head_offset(b, h); }

  void fill(float value);  // fp32 tensors

 private:
  void release() noexcept;
  void* checked(DType expected) const {
    if (expected != dtype_) [[unlikely]]
      wrong_dtype(expected);
    return data_;
  }
  [[noreturn]] void wrong_dtype(DType expected) const;
  std::int64_t head_offset(std::int64_t b, std::int64_t h) const { return (b * shape_[1] + h) * shape_[2] * shape_[3]; }
  Shape shape_;
  std::int64_t size_ = 0;
  DType dtype_ = DType::F32;
  void* data_ = nullptr;
};

// A bf16 copy of an fp32 tensor, every element rounded to nearest even (lib/core/bf16.hpp).
Tensor to_bf16(const Tensor& fp32);
// The fp32 values of a tensor of either type (bf16 widened exactly): a new fp32 tensor.
Tensor to_f32(const Tensor& tensor);

}  // namespace xfb
