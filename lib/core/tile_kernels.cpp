#include "lib/core/tile_kernels.hpp"

#include <cstring>

#include "lib/core/cpu_isa.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels_isa.hpp"

namespace xfb::tiles {

void pack_key_panels(const float* keys, std::int64_t ldk, std::int64_t cols, std::int64_t d, float* packed) {
  if (fits_head_dim(d)) {  // register transposes of whole 16-feature (8 on AVX2) blocks
    if (kernel_isa() == KernelIsa::Avx512)
      avx512::pack_key_panels(keys, ldk, cols, d, packed);
    else
      avx2::pack_key_panels(keys, ldk, cols, d, packed);
    return;
  }
  const std::int64_t panels = panels_for(cols);
  std::memset(packed, 0, static_cast<std::size_t>(panels * d * kPanel) * sizeof(float));
  for (std::int64_t j = 0; j < cols; ++j) {
    float* column = packed + (j / kPanel) * d * kPanel + j % kPanel;
    const float* key = keys + j * ldk;
    for (std::int64_t c = 0; c < d; ++c) column[c * kPanel] = key[c];
  }
}

void scores(const float* q, std::int64_t ldq, std::int64_t rows, const float* packed, std::int64_t panels,
            std::int64_t d, float alpha, float* s, std::int64_t lds) {
  if (kernel_isa() == KernelIsa::Avx512)
    avx512::scores(q, ldq, rows, packed, panels, d, alpha, s, lds);
  else
    avx2::scores(q, ldq, rows, packed, panels, d, alpha, s, lds);
}

void accumulate_pv(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v,
                   std::int64_t ldv, std::int64_t d, float* out, std::int64_t ldo, float alpha) {
  if (kernel_isa() == KernelIsa::Avx512)
    avx512::accumulate_pv(p, ldp, rows, cols, v, ldv, d, out, ldo, alpha);
  else
    avx2::accumulate_pv(p, ldp, rows, cols, v, ldv, d, out, ldo, alpha);
}

void accumulate_transposed(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* x,
                           std::int64_t ldx, std::int64_t d, float alpha, float* out, std::int64_t ldo) {
  if (kernel_isa() == KernelIsa::Avx512)
    avx512::accumulate_transposed(p, ldp, rows, cols, x, ldx, d, alpha, out, ldo);
  else
    avx2::accumulate_transposed(p, ldp, rows, cols, x, ldx, d, alpha, out, ldo);
}

void pv_product(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v,
                std::int64_t ldv, std::int64_t d, float alpha, float* out, std::int64_t ldo) {
  if (!fits_head_dim(d)) {
    ops::gemm(false, false, rows, d, cols, alpha, p, ldp, v, ldv, 1.0f, out, ldo);
    return;
  }
  accumulate_pv(p, ldp, rows, cols, v, ldv, d, out, ldo, alpha);
  FlopCounter::add(matmul_flops(rows, d, cols));
}

void transposed_product(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* x,
                        std::int64_t ldx, std::int64_t d, float alpha, float* out, std::int64_t ldo) {
  if (!fits_head_dim(d)) {
    ops::gemm(true, false, cols, d, rows, alpha, p, ldp, x, ldx, 1.0f, out, ldo);
    return;
  }
  accumulate_transposed(p, ldp, rows, cols, x, ldx, d, alpha, out, ldo);
  FlopCounter::add(matmul_flops(cols, d, rows));
}

void packed_score_product(const float* x, std::int64_t ldx, std::int64_t rows, const float* y, std::int64_t ldy,
                          std::int64_t cols, std::int64_t d, float alpha, float* panels, float* s, std::int64_t lds) {
  pack_key_panels(y, ldy, cols, d, panels);
  scores(x, ldx, rows, panels, panels_for(cols), d, alpha, s, lds);
  FlopCounter::add(matmul_flops(rows, cols, d));
}

float interval_max(const float* x, std::int64_t lo, std::int64_t hi, float start) {
  return kernel_isa() == KernelIsa::Avx512 ? avx512::interval_max(x, lo, hi, start)
                                           : avx2::interval_max(x, lo, hi, start);
}

float exp_interval(float* x, std::int64_t lo, std::int64_t hi, std::int64_t width, float shift) {
  return kernel_isa() == KernelIsa::Avx512 ? avx512::exp_interval(x, lo, hi, width, shift)
                                           : avx2::exp_interval(x, lo, hi, width, shift);
}

void softmax_grad_interval(float* p, float* g, std::int64_t lo, std::int64_t hi, std::int64_t width, float shift,
                           float dot) {
  if (kernel_isa() == KernelIsa::Avx512)
    avx512::softmax_grad_interval(p, g, lo, hi, width, shift, dot);
  else
    avx2::softmax_grad_interval(p, g, lo, hi, width, shift, dot);
}

float row_max(const float* x, std::int64_t n, float start) {
  return kernel_isa() == KernelIsa::Avx512 ? avx512::row_max(x, n, start) : avx2::row_max(x, n, start);
}

float exp_and_sum(float* x, std::int64_t n, float shift) {
  return kernel_isa() == KernelIsa::Avx512 ? avx512::exp_and_sum(x, n, shift) : avx2::exp_and_sum(x, n, shift);
}

std::int64_t positions_at_least(const float* values, std::int64_t n, float threshold, std::int32_t* positions,
                                float* kept) {
  return kernel_isa() == KernelIsa::Avx512 ? avx512::positions_at_least(values, n, threshold, positions, kept)
                                           : avx2::positions_at_least(values, n, threshold, positions, kept);
}

}  // namespace xfb::tiles
