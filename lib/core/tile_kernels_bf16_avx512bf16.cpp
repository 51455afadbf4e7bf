// lib/core/tile_kernels_bf16_isa.inc for 512-bit vectors, one vdpbf16ps per pair product (AVX512_BF16).
#include <immintrin.h>  // always-inline intrinsics only

#include "lib/core/tile_kernels_isa.hpp"

#ifdef XFB_EMULATE_AVX512
#include "lib/core/bf16.hpp"  // AVX2 flags here: no AVX-512 copy of its inline functions
namespace xfb::tiles {
#include "lib/core/avx512_emulation.hpp"
}
#endif

namespace xfb::tiles::bf16_avx512bf16 {
#define XFB_VECTOR_FLOATS 16
#define XFB_BLOCK_ROWS 12
#define XFB_BF16_DOT 1
#include "lib/core/tile_kernels_bf16_isa.inc"
}  // namespace xfb::tiles::bf16_avx512bf16
