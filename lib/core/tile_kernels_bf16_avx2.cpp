// lib/core/tile_kernels_bf16_isa.inc for 256-bit vectors, pairs widened (convert-and-FMA; compiled with -mavx2 -mfma).
#include <immintrin.h>  // always-inline intrinsics only

#include "lib/core/tile_kernels_isa.hpp"

namespace xfb::tiles::bf16_avx2 {
#define XFB_VECTOR_FLOATS 8
#define XFB_BLOCK_ROWS 6
#define XFB_BF16_DOT 0
#include "lib/core/tile_kernels_bf16_isa.inc"
}  // namespace xfb::tiles::bf16_avx2
