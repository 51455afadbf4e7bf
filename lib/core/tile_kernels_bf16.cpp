#include "lib/core/tile_kernels_bf16.hpp"

#include "lib/core/cpu_isa.hpp"
#include "lib/core/tile_kernels_isa.hpp"

namespace xfb::tiles {
namespace {

const unsigned short* raw(const bf16* x) { return reinterpret_cast<const unsigned short*>(x); }

std::uint32_t word_of(bf16 lo, bf16 hi) {
  return static_cast<std::uint32_t>(lo) | static_cast<std::uint32_t>(hi) << 16;
}

}  // namespace

void pack_key_pair_panels(const bf16* keys, std::int64_t ldk, std::int64_t cols, std::int64_t d, bf16* packed) {
  const std::int64_t panels = panels_for(cols), pairs = d / 2;
  auto* words = reinterpret_cast<std::uint32_t*>(packed);
  for (std::int64_t p = 0; p < panels; ++p) {
    std::uint32_t* panel = words + p * pairs * kPanel;
    for (std::int64_t t = 0; t < kPanel; ++t) {
      const std::int64_t j = p * kPanel + t;
      if (j >= cols) {
        for (std::int64_t c2 = 0; c2 < pairs; ++c2) panel[c2 * kPanel + t] = 0;
        continue;
      }
      const bf16* key = keys + j * ldk;
      for (std::int64_t c2 = 0; c2 < pairs; ++c2) panel[c2 * kPanel + t] = word_of(key[2 * c2], key[2 * c2 + 1]);
    }
  }
}

void pack_row_pairs(const bf16* x, std::int64_t ldx, std::int64_t rows, std::int64_t d, bf16* pairs) {
  auto* words = reinterpret_cast<std::uint32_t*>(pairs);
  for (std::int64_t r2 = 0; r2 < (rows + 1) / 2; ++r2) {
    const bf16* even = x + 2 * r2 * ldx;
    const bf16* odd = 2 * r2 + 1 < rows ? even + ldx : nullptr;
    std::uint32_t* dst = words + r2 * d;
    if (odd != nullptr) {
#pragma omp simd
      for (std::int64_t f = 0; f < d; ++f) dst[f] = word_of(even[f], odd[f]);
    } else {
#pragma omp simd
      for (std::int64_t f = 0; f < d; ++f) dst[f] = static_cast<std::uint32_t>(even[f]);
    }
  }
}

void scores_bf16(const bf16* q, std::int64_t ldq, std::int64_t rows, const bf16* packed, std::int64_t panels,
                 std::int64_t d, float alpha, float* s, std::int64_t lds) {
  if (bf16_dot_product())
    bf16_avx512bf16::scores_bf16(raw(q), ldq, rows, raw(packed), panels, d, alpha, s, lds);
  else if (kernel_isa() == KernelIsa::Avx512)
    bf16_avx512::scores_bf16(raw(q), ldq, rows, raw(packed), panels, d, alpha, s, lds);
  else
    bf16_avx2::scores_bf16(raw(q), ldq, rows, raw(packed), panels, d, alpha, s, lds);
}

void accumulate_pv_bf16(const bf16* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const bf16* v_pairs,
                        std::int64_t d, float* out, std::int64_t ldo, float alpha) {
  if (bf16_dot_product())
    bf16_avx512bf16::accumulate_pv_bf16(raw(p), ldp, rows, cols, raw(v_pairs), d, out, ldo, alpha);
  else if (kernel_isa() == KernelIsa::Avx512)
    bf16_avx512::accumulate_pv_bf16(raw(p), ldp, rows, cols, raw(v_pairs), d, out, ldo, alpha);
  else
    bf16_avx2::accumulate_pv_bf16(raw(p), ldp, rows, cols, raw(v_pairs), d, out, ldo, alpha);
}

void accumulate_transposed_bf16(const bf16* p_pairs, std::int64_t ldp, std::int64_t rows, std::int64_t cols,
                                const bf16* x_pairs, std::int64_t d, float alpha, float* out, std::int64_t ldo) {
  if (bf16_dot_product())
    bf16_avx512bf16::accumulate_transposed_bf16(raw(p_pairs), ldp, rows, cols, raw(x_pairs), d, alpha, out, ldo);
  else if (kernel_isa() == KernelIsa::Avx512)
    bf16_avx512::accumulate_transposed_bf16(raw(p_pairs), ldp, rows, cols, raw(x_pairs), d, alpha, out, ldo);
  else
    bf16_avx2::accumulate_transposed_bf16(raw(p_pairs), ldp, rows, cols, raw(x_pairs), d, alpha, out, ldo);
}

void round_row(const float* src, std::int64_t n, bf16* dst) {
  if (bf16_dot_product())
    bf16_avx512bf16::round_row_bf16(src, n, reinterpret_cast<unsigned short*>(dst));
  else
    narrow(src, dst, n);
}

void round_row_pair(const float* row0, const float* row1, std::int64_t n, bf16* dst) {
  auto* words = reinterpret_cast<std::uint32_t*>(dst);
  if (row1 != nullptr) {
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) words[j] = word_of(to_bf16(row0[j]), to_bf16(row1[j]));
  } else {
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) words[j] = static_cast<std::uint32_t>(to_bf16(row0[j]));
  }
}

}  // namespace xfb::tiles
