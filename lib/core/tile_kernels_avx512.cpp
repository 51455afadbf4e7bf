// lib/core/tile_kernels_isa.inc for 512-bit vectors (compiled with -mavx512f -mavx512vl -mavx512bw
// -mavx512dq -mfma): 32 zmm registers hold 12 rows × 2 vectors of accumulators.
#include <immintrin.h>  // always-inline intrinsics only (vrndscaleps, vscalefps in exp_lanes)

#include "lib/core/exp_polynomial.hpp"
#include "lib/core/tile_kernels_isa.hpp"

#ifdef XFB_EMULATE_AVX512
#include "lib/core/bf16.hpp"  // AVX2 flags here: no AVX-512 copy of its inline functions
namespace xfb::tiles {
#include "lib/core/avx512_emulation.hpp"
}
#endif

namespace xfb::tiles::avx512 {
#define XFB_VECTOR_FLOATS 16
#define XFB_BLOCK_ROWS 12
#define XFB_SPLAT(x) \
  vec { (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x), (x) }
#include "lib/core/tile_kernels_isa.inc"
}  // namespace xfb::tiles::avx512
