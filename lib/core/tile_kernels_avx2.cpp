// lib/core/tile_kernels_isa.inc for 256-bit vectors (compiled with -mavx2 -mfma).
#include <immintrin.h>  // always-inline intrinsics only (vroundps, vminps, vmaxps in exp_lanes)

#include "lib/core/exp_polynomial.hpp"
#include "lib/core/tile_kernels_isa.hpp"

namespace xfb::tiles::avx2 {
#define XFB_VECTOR_FLOATS 8
#define XFB_BLOCK_ROWS 6
#define XFB_SPLAT(x) \
  vec { (x), (x), (x), (x), (x), (x), (x), (x) }
#include "lib/core/tile_kernels_isa.inc"
}  // namespace xfb::tiles::avx2
