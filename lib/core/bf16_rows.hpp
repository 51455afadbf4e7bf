#pragma once
// Element-type glue for code written once over T = float or T = bf16 (issue 31): the computation
// stays fp32 and reads or writes T tensors through these. For T = float every function is the
// identity or a plain copy, so the fp32 form is unchanged; for T = bf16 a read widens (exact) and a
// write rounds to nearest even, once.
#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

#include "lib/core/bf16.hpp"
#include "lib/core/tensor.hpp"

namespace xfb {

template <class T>
inline T stored(float x) {
  if constexpr (std::is_same_v<T, bf16>)
    return to_bf16(x);
  else
    return x;
}

// A tensor's elements as T (T must be its element type).
template <class T>
T* elements(Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>)
    return t.bf16_data();
  else
    return t.data();
}
template <class T>
const T* elements(const Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>)
    return t.bf16_data();
  else
    return t.data();
}

// dst[i] = src[i] for i < n: a copy, a widening (bf16 → fp32) or a rounding (fp32 → bf16).
inline void convert(const float* src, float* dst, std::int64_t n) { std::copy_n(src, n, dst); }
inline void convert(const bf16* src, float* dst, std::int64_t n) { widen(src, dst, n); }
inline void convert(const float* src, bf16* dst, std::int64_t n) { narrow(src, dst, n); }
inline void convert(const bf16* src, bf16* dst, std::int64_t n) { std::copy_n(src, n, dst); }

// n elements as fp32: x itself (fp32), or widened into scratch [n] (bf16).
inline const float* fp32_elements(const float* x, std::int64_t, float*) { return x; }
inline const float* fp32_elements(const bf16* x, std::int64_t n, float* scratch) {
  widen(x, scratch, n);
  return scratch;
}

// Rows [c0, c0 + rows) of a [N, D] matrix as fp32: the rows themselves, or widened into scratch
// ([rows, D]).
template <class T>
const float* fp32_rows(const T* x, std::int64_t c0, std::int64_t rows, std::int64_t d, float* scratch) {
  return fp32_elements(x + c0 * d, rows * d, scratch);
}
// The rows an earlier fp32_rows(x, c0, …, scratch) returned, without widening them again.
inline const float* widened_rows(const float* x, std::int64_t c0, std::int64_t d, const float*) { return x + c0 * d; }
inline const float* widened_rows(const bf16*, std::int64_t, std::int64_t, const float* scratch) { return scratch; }

// Elements [at, at + count) of each bf16 tensor widened into rows + t·stride (t: its place in the
// list); and back: rows + t·stride [count] rounded into elements [at, at + count) of the t-th tensor.
// The storage-only bf16 forms' per-head fp32 rows.
inline void widen_spans(std::span<const Tensor* const> tensors, std::int64_t at, std::int64_t count, float* rows,
                        std::int64_t stride) {
  for (std::size_t t = 0; t < tensors.size(); ++t)
    widen(tensors[t]->bf16_data() + at, rows + static_cast<std::int64_t>(t) * stride, count);
}
inline void narrow_spans(const float* rows, std::int64_t stride, std::span<Tensor* const> tensors, std::int64_t at,
                         std::int64_t count) {
  for (std::size_t t = 0; t < tensors.size(); ++t)
    narrow(rows + static_cast<std::int64_t>(t) * stride, tensors[t]->bf16_data() + at, count);
}

// Where rows [c0, …) of an fp32 result go: the result itself (fp32), or scratch, rounded into the
// bf16 result by store_rows afterwards.
inline float* fp32_target(float* x, std::int64_t c0, std::int64_t d, float*) { return x + c0 * d; }
inline float* fp32_target(bf16*, std::int64_t, std::int64_t, float* scratch) { return scratch; }
inline void store_rows(const float*, float*, std::int64_t, std::int64_t, std::int64_t) {}
inline void store_rows(const float* scratch, bf16* x, std::int64_t c0, std::int64_t rows, std::int64_t d) {
  narrow(scratch, x + c0 * d, rows * d);
}

}  // namespace xfb
