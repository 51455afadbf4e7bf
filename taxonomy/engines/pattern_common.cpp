#include "taxonomy/engines/pattern_common.hpp"

#include <algorithm>
#include <cstring>
#include <utility>

#include "lib/core/cpu_isa.hpp"
#include "lib/core/memory_tracker.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels.hpp"

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

std::int64_t gathered_tile_backward(const GatheredTile& t, float scale, float* scores, float* grads, float* dq,
                                    float* dk, float* dv) {
  for (std::int64_t r = 0; r < t.rows; ++r) {
    float* p = scores + r * t.ld;
    const float shift = t.lse[r];
    if (shift == -std::numeric_limits<float>::infinity()) {
      std::fill(p, p + t.cols, 0.0f);
      continue;
    }
#pragma omp simd
    for (std::int64_t c = 0; c < t.cols; ++c)
      p[c] = p[c] == -std::numeric_limits<float>::infinity() ? 0.0f : ops::fast_exp(p[c] - shift);
  }
  ops::gemm(true, false, t.cols, t.d, t.rows, 1.0f, scores, t.ld, t.dout, t.d, 0.0f, dv, t.d);
  ops::gemm(false, true, t.rows, t.cols, t.d, 1.0f, t.dout, t.d, t.v, t.d, 0.0f, grads, t.ld);
  for (std::int64_t r = 0; r < t.rows; ++r) {
    const float* p = scores + r * t.ld;
    float* ds = grads + r * t.ld;
    const float delta = t.delta[r];
#pragma omp simd
    for (std::int64_t c = 0; c < t.cols; ++c) ds[c] = p[c] * (ds[c] - delta);
  }
  ops::gemm(false, false, t.rows, t.d, t.cols, scale, grads, t.ld, t.k, t.d, 0.0f, dq, t.d);
  ops::gemm(true, false, t.cols, t.d, t.rows, scale, grads, t.ld, t.q, t.d, 0.0f, dk, t.d);
  return kRecomputedSoftmaxBackwardFlopsPerElement * t.rows * t.cols;
}

bool tile_products_on_kernels(std::int64_t d) { return tiles::fits_head_dim(d) && kernel_isa() == KernelIsa::Avx512; }

std::int64_t tile_panel_floats(std::int64_t cols, std::int64_t d) {
  return tiles::fits_head_dim(d) ? tiles::panels_for(cols) * tiles::kPanel * d : 0;
}

void tile_scores(const float* q, std::int64_t rows, const float* k, std::int64_t cols, std::int64_t d, float alpha,
                 float* panels, float* s, std::int64_t lds) {
  if (!tile_products_on_kernels(d)) {
    ops::gemm(false, true, rows, cols, d, alpha, q, d, k, d, 0.0f, s, lds);
    return;
  }
  tiles::packed_score_product(q, d, rows, k, d, cols, d, alpha, panels, s, lds);
}

void tile_values(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v, std::int64_t d,
                 float* out) {
  if (!tile_products_on_kernels(d)) {
    ops::gemm(false, false, rows, d, cols, 1.0f, p, ldp, v, d, 0.0f, out, d);
    return;
  }
  std::fill(out, out + rows * d, 0.0f);
  tiles::pv_product(p, ldp, rows, cols, v, d, d, 1.0f, out, d);
}

}  // namespace xfb
