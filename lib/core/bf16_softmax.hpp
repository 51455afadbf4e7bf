#pragma once
// A softmax row of fp32 scores to bf16 probabilities in place (issue 31: vanilla's and linformer's
// dense score buffers): the statistics fp32, the probabilities rounded to bf16 over the row's own
// first bytes, so a [rows, ld] fp32 buffer holds bf16 P with row stride 2·ld and needs no second one.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "lib/core/bf16.hpp"
#include "lib/core/ops.hpp"

namespace xfb {

inline constexpr std::int64_t kRoundBlock = 32;  // values per block of the in-place rounding

// Rounds value(j, row[j]) to bf16 for the row's `cols` entries, written over its own first 2·cols
// bytes: block b's kRoundBlock bf16 values land on fp32 values [kRoundBlock·b/2, kRoundBlock·b/2 +
// kRoundBlock/2), which block b itself has already read, so each block is read whole before its
// bf16 half is written, which never reaches past that block.
template <class Value>
inline void round_row_in_place(float* row, std::int64_t cols, Value&& value) {
  auto* bytes = reinterpret_cast<unsigned char*>(row);
  for (std::int64_t j0 = 0; j0 < cols; j0 += kRoundBlock) {
    const std::int64_t count = std::min(kRoundBlock, cols - j0);
    float block[kRoundBlock];
    bf16 rounded[kRoundBlock];
    std::memcpy(block, bytes + 4 * j0, static_cast<std::size_t>(count) * 4);
    for (std::int64_t j = 0; j < count; ++j) rounded[j] = to_bf16(value(j0 + j, block[j]));
    std::memcpy(bytes + 2 * j0, rounded, static_cast<std::size_t>(count) * 2);
  }
}

// Softmax over the first `valid` of `cols` scores of a row (fp32 statistics), the probabilities
// rounded to bf16 over the row's own first 2·cols bytes (the bf16 row has stride 2·ld in the score
// buffer), zeros beyond `valid`.
inline void softmax_row_to_bf16(float* row, std::int64_t cols, std::int64_t valid) {
  const float inverse = 1.0f / ops::exp_and_sum(row, valid, ops::row_max(row, valid, row[0]));
  std::fill(row + valid, row + cols, 0.0f);
  round_row_in_place(row, cols, [inverse](std::int64_t, float x) { return x * inverse; });
}

// The softmax backward of one row in bf16: p the row's bf16 probabilities, grad its fp32 dP on
// entry; dS = P·(dP − Σ_valid P·dP) in fp32 for the first `valid` of `cols` entries (0 beyond),
// rounded to bf16 over the row's own first 2·cols bytes (softmax_row_to_bf16's in-place blocks).
inline void softmax_backward_row_to_bf16(const bf16* p, float* grad, std::int64_t cols, std::int64_t valid) {
  float delta = 0.0f;
  for (std::int64_t j = 0; j < valid; ++j) delta += to_float(p[j]) * grad[j];
  round_row_in_place(grad, cols,
                     [&](std::int64_t j, float x) { return j < valid ? to_float(p[j]) * (x - delta) : 0.0f; });
}

}  // namespace xfb
