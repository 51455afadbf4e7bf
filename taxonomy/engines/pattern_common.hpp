#pragma once
// Pieces shared by the learnable-pattern mechanisms (reformer, routing, sinkhorn).
//
// IndexBuffer: a tracked int32 array (bucket ids, sort orders, cluster memberships), so the
// integer side of a routing decision shows up in tracked memory like the float buffers.
//
// exp_rows_masked: the softmax core of every score tile these models compute. For each of `rows`
// rows of a [rows, cols] tile (row stride ld) it keeps the entries allowed(r, c) says are visible,
// replaces the row by p = exp(s − max) (0 where not allowed), and writes
//   lse[r] = max + log Σ p   and   inverse[r] = 1 / Σ p
// (−inf and 0 for a row with nothing visible, whose p row is all zero). The caller multiplies P by
// V and scales row r by inverse[r]. ld is a multiple of 16 (ops::padded_ld): the row's max and
// exponentials run on whole vectors (tiles::interval_max, exp_interval). Every entry is processed
// whatever the mask, so the work is data-independent: kOnlineSoftmaxFlopsPerElement · rows · cols
// FLOPs (max, subtract+exp, sum), which the function returns.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels.hpp"

namespace xfb {

// Requests the cache lines of one row of d floats (16 floats a line), without waiting for them.
template <class T>
inline void request_row(const T* row, std::int64_t d) {
  for (std::int64_t c = 0; c < d; c += 64 / static_cast<std::int64_t>(sizeof(T))) __builtin_prefetch(row + c);
}

// dst row r = rows[ids[r]] for r < count: rows of d elements, contiguous in both (bf16 rows into
// fp32 ones are widened, bf16_rows.hpp's convert). The token rows of a learned pattern lie
// scattered over the head, so each copy would wait for its row's cache misses; the row
// kGatherAhead places ahead is requested first, keeping several rows' misses in flight.
inline constexpr std::int64_t kGatherAhead = 8;
template <class S, class T>
inline void gather_token_rows(const S* rows, const std::int32_t* ids, std::int64_t count, std::int64_t d, T* dst) {
  for (std::int64_t r = 0; r < count; ++r) {
    if (r + kGatherAhead < count) request_row(rows + ids[r + kGatherAhead] * d, d);
    convert(rows + ids[r] * d, dst + r * d, d);
  }
}

class IndexBuffer {
 public:
  IndexBuffer() = default;
  explicit IndexBuffer(std::int64_t count);  // zero-filled
  ~IndexBuffer();
  IndexBuffer(IndexBuffer&& other) noexcept;
  IndexBuffer& operator=(IndexBuffer&& other) noexcept;
  IndexBuffer(const IndexBuffer&) = delete;
  IndexBuffer& operator=(const IndexBuffer&) = delete;

  std::int32_t* data() { return data_; }
  const std::int32_t* data() const { return data_; }
  std::int64_t size() const { return size_; }
  std::int64_t bytes() const { return size_ * static_cast<std::int64_t>(sizeof(std::int32_t)); }

 private:
  void release() noexcept;
  std::int64_t size_ = 0;
  std::int32_t* data_ = nullptr;
};

// The two products of a gathered tile, whose query, key and value rows were copied contiguous
// ([count, D], row stride D):
//   tile_scores: S = alpha·Q·Kᵀ, [rows, cols] with row stride lds ≥ ⌈cols/16⌉·16;
//   tile_values: O = P·V, [rows, D] overwritten (P [rows, cols] with row stride ldp).
// On the 512-bit tile kernels when D is a multiple of 16 (K packed into `panels`, which holds
// tile_panel_floats(cols, D) floats; the scores of the last panel's padding columns are computed
// too), else on sgemm: measured at N = 8192 (AVX-512 class), routing's cluster attention 4–5%
// faster on the kernels; on the 256-bit kernels 13% slower than sgemm. Both count 2·rows·cols·D.
// The panel buffer is sized whatever the kernel ISA, which can change after it exists.
bool tile_products_on_kernels(std::int64_t d);
std::int64_t tile_panel_floats(std::int64_t cols, std::int64_t d);
void tile_scores(const float* q, std::int64_t rows, const float* k, std::int64_t cols, std::int64_t d, float alpha,
                 float* panels, float* s, std::int64_t lds);
void tile_values(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v, std::int64_t d,
                 float* out);

template <class Allowed>
std::int64_t exp_rows_masked(float* scores, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                             const Allowed& allowed, float* lse, float* inverse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * ld;
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) row[c] = allowed(r, c) ? row[c] : kNegInf;
    const float peak = tiles::interval_max(row, 0, cols, kNegInf);
    const float shift = peak == kNegInf ? 0.0f : peak;
    const float sum = tiles::exp_interval(row, 0, cols, cols, shift);
    lse[r] = sum > 0.0f ? shift + std::log(sum) : kNegInf;
    inverse[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  return kOnlineSoftmaxFlopsPerElement * rows * cols;
}

// dst[i] = src[i] · factor over n values.
inline void scale_row(float* dst, const float* src, float factor, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i] * factor;
}

// The softmax's backward over `rows` rows of [rows, cols] (row stride ld): grads holds dP on entry
// and dS = P ⊙ (dP − Σ P·dP) on return, p the probabilities. Returns its FLOPs
// (kSoftmaxBackwardFlopsPerElement per entry).
inline std::int64_t softmax_backward_rows(const float* p, float* grads, std::int64_t rows, std::int64_t cols,
                                          std::int64_t ld) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* prob = p + r * ld;
    float* g = grads + r * ld;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t c = 0; c < cols; ++c) dot += prob[c] * g[c];
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) g[c] = prob[c] * (g[c] - dot);
  }
  return kSoftmaxBackwardFlopsPerElement * rows * cols;
}

// dst[i] += src[i] over n values.
inline void add_row(float* dst, const float* src, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

// log(exp(a) + exp(b)), exact for −inf operands.
inline float log_add_exp(float a, float b) {
  const float hi = a > b ? a : b;
  if (hi == -std::numeric_limits<float>::infinity()) return hi;
  return hi + std::log(std::exp(a - hi) + std::exp(b - hi));
}

// The backward of one gathered softmax tile (FlashAttention-2 recomputation), shared by the models
// that gather a tile's rows by a learned pattern. On entry `scores` [rows, cols] (row stride ld)
// holds the tile's recomputed scores, −inf where the query does not see the key; lse[r] is row r's
// final log-sum-exp (over everything the query sees, in this tile and any other) and delta[r] =
// dO_r·O_r. q, dout: [rows, D]; k, v: [cols, D] (row stride D). Turns scores into
// P = exp(S − L) (0 where −inf), writes dS into grads ([rows, ld]) and overwrites
//   dv = Pᵀ·dO [cols, D],  dq = dS·K·scale [rows, D],  dk = dSᵀ·Q·scale [cols, D],
// with dS = P ⊙ (dO·Vᵀ − δ). ops::gemm counts the four products (8·rows·cols·D); returns the
// elementwise kRecomputedSoftmaxBackwardFlopsPerElement·rows·cols (every entry, whatever the mask).
struct GatheredTile {
  std::int64_t rows = 0, cols = 0, d = 0, ld = 0;
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* dout = nullptr;
  const float* lse = nullptr;
  const float* delta = nullptr;
};
std::int64_t gathered_tile_backward(const GatheredTile& tile, float scale, float* scores, float* grads, float* dq,
                                    float* dk, float* dv);

}  // namespace xfb
