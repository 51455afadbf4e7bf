#pragma once
// Per-ISA entry points of the tile kernels (contracts in lib/core/tile_kernels.hpp), each compiled in
// its own file with its ISA's flags; lib/core/tile_kernels.cpp picks one by kernel_isa(). Plain types
// only: this header is included under AVX-512 flags.
namespace xfb::tiles {
#define XFB_TILE_KERNELS(ns)                                                                                        \
  namespace ns {                                                                                                    \
  void scores(const float* q, long ldq, long rows, const float* packed, long panels, long d, float alpha, float* s, \
              long lds);                                                                                            \
  void accumulate_pv(const float* p, long ldp, long rows, long cols, const float* v, long ldv, long d, float* out,  \
                     long ldo, float alpha);                                                                        \
  void accumulate_transposed(const float* p, long ldp, long rows, long cols, const float* x, long ldx, long d,      \
                             float alpha, float* out, long ldo);                                                    \
  float interval_max(const float* x, long lo, long hi, float start);                                                \
  float exp_interval(float* x, long lo, long hi, long width, float shift);                                          \
  void softmax_grad_interval(float* p, float* g, long lo, long hi, long width, float shift, float dot);             \
  float row_max(const float* x, long n, float start);                                                               \
  float exp_and_sum(float* x, long n, float shift);                                                                 \
  void pack_key_panels(const float* keys, long ldk, long cols, long d, float* packed);                              \
  long positions_at_least(const float* values, long n, float threshold, int* positions, float* kept);               \
  }
XFB_TILE_KERNELS(avx2)
XFB_TILE_KERNELS(avx512)
#undef XFB_TILE_KERNELS

// The bf16 products (lib/core/tile_kernels_bf16.hpp; bf16 elements as unsigned short), one namespace
// per path: bf16_avx2 and bf16_avx512 widen pairs (convert-and-FMA), bf16_avx512bf16 runs vdpbf16ps.
#define XFB_BF16_TILE_KERNELS(ns)                                                                                   \
  namespace ns {                                                                                                    \
  void scores_bf16(const unsigned short* q, long ldq, long rows, const unsigned short* packed, long panels, long d, \
                   float alpha, float* s, long lds);                                                                \
  void accumulate_pv_bf16(const unsigned short* p, long ldp, long rows, long cols, const unsigned short* v_pairs,   \
                          long d, float* out, long ldo, float alpha);                                               \
  void accumulate_transposed_bf16(const unsigned short* p_pairs, long ldp, long rows, long cols,                    \
                                  const unsigned short* x_pairs, long d, float alpha, float* out, long ldo);        \
  }
XFB_BF16_TILE_KERNELS(bf16_avx2)
XFB_BF16_TILE_KERNELS(bf16_avx512)
XFB_BF16_TILE_KERNELS(bf16_avx512bf16)
#undef XFB_BF16_TILE_KERNELS
namespace bf16_avx512bf16 {
void round_row_bf16(const float* src, long n, unsigned short* dst);  // vcvtneps2bf16
}
}  // namespace xfb::tiles
