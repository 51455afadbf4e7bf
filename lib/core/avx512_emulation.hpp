#pragma once
// Lane-by-lane stand-ins for the AVX-512 intrinsics the 512-bit tile kernels call, for a build with
// XFBENCH_EMULATE_AVX512 (docs/contributing.md#testing-the-avx-512-paths-on-an-avx2-host): the
// 512-bit kernels (tile_kernels_avx512.cpp, tile_kernels_bf16_avx512{,bf16}.cpp) are then compiled
// with AVX2 flags, their vector-extension code runs as pairs of 256-bit halves, and these functions
// replace the instructions. They keep each instruction's documented result, lane for lane, so that
// the whole suite runs the 512-bit kernels' own blocking, lane counts and pair layouts on a host
// without AVX-512 — correctness only; speed means nothing in such a build.
//
// Included inside namespace xfb::tiles before the kernels' namespaces open, so an unqualified call
// in a kernel finds these before the global intrinsics (which need AVX-512 at their call site).
// The vector types (__m512, __mmask16, __m512bh, …) are the compiler's own: immintrin.h declares
// them whatever the target flags. The including file includes lib/core/bf16.hpp first, at file
// scope: in this build it compiles with AVX2 flags, so tile_kernels_isa.inc's rule against headers
// (no AVX-512 copy of an inline function) holds.

// Lanes as plain arrays (GCC 12 at -O1 with sanitizers misreports subscripted vectors as
// uninitialised).
constexpr int kEmulatedLanes = 16;
struct FloatLanes {
  float at[kEmulatedLanes];
};
struct WordLanes {
  unsigned at[kEmulatedLanes];
};
struct HalfwordLanes {
  unsigned short at[kEmulatedLanes];
};

inline FloatLanes emulated_lanes(__m512 v) { return __builtin_bit_cast(FloatLanes, v); }
inline __m512 as_m512(FloatLanes v) { return __builtin_bit_cast(__m512, v); }
inline bool lane_kept(__mmask16 k, int lane) { return ((k >> lane) & 1) != 0; }

// Denormals in and out of vdpbf16ps and vcvtneps2bf16 are zero (sign kept).
inline float flush_denormal(float x) {
  const unsigned bits = __builtin_bit_cast(unsigned, x);
  return (bits & 0x7f800000u) == 0 ? __builtin_bit_cast(float, bits & 0x80000000u) : x;
}

inline __m512 _mm512_set1_ps(float x) { return x - __m512{}; }
inline __m512 _mm512_mul_ps(__m512 a, __m512 b) { return a * b; }
inline __m512 _mm512_loadu_ps(const void* p) {
  FloatLanes v;
  __builtin_memcpy(&v, p, sizeof v);
  return as_m512(v);
}

// Only _CMP_GE_OQ is called: a ≥ b, false when either is NaN.
inline __mmask16 _mm512_cmp_ps_mask(__m512 a, __m512 b, int predicate) {
  if (predicate != _CMP_GE_OQ) __builtin_trap();
  const FloatLanes x = emulated_lanes(a), y = emulated_lanes(b);
  unsigned mask = 0;
  for (int i = 0; i < kEmulatedLanes; ++i)
    if (x.at[i] >= y.at[i]) mask |= 1u << i;
  return static_cast<__mmask16>(mask);
}

// Only a scale of 2⁰ with round-to-nearest-even is called (vrndscaleps imm 0x08).
inline __m512 _mm512_maskz_roundscale_ps(__mmask16 k, __m512 a, int imm) {
  if (imm != (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)) __builtin_trap();
  FloatLanes x = emulated_lanes(a);
  for (int i = 0; i < kEmulatedLanes; ++i) x.at[i] = lane_kept(k, i) ? __builtin_roundevenf(x.at[i]) : 0.0f;
  return as_m512(x);
}

// a·2^floor(b) rounded once (vscalefps; b is finite or NaN here). Beyond ±400 the result is the
// same as at ±400: overflow to ±inf, or underflow to ±0.
inline __m512 _mm512_maskz_scalef_ps(__mmask16 k, __m512 a, __m512 b) {
  FloatLanes x = emulated_lanes(a);
  const FloatLanes e = emulated_lanes(b);
  for (int i = 0; i < kEmulatedLanes; ++i) {
    const float power = e.at[i];
    if (!lane_kept(k, i)) {
      x.at[i] = 0.0f;
    } else if (power != power) {
      x.at[i] = power;
    } else {
      const float clamped = power > 400.0f ? 400.0f : (power < -400.0f ? -400.0f : power);
      x.at[i] = __builtin_ldexpf(x.at[i], static_cast<int>(__builtin_floorf(clamped)));
    }
  }
  return as_m512(x);
}

// Masked lanes are neither read nor written (the instructions suppress faults there).
inline __m512 _mm512_maskz_loadu_ps(__mmask16 k, const void* p) {
  const auto* src = static_cast<const float*>(p);
  FloatLanes x{};
  for (int i = 0; i < kEmulatedLanes; ++i)
    if (lane_kept(k, i)) x.at[i] = src[i];
  return as_m512(x);
}
inline void _mm512_mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
  auto* dst = static_cast<float*>(p);
  const FloatLanes x = emulated_lanes(a);
  for (int i = 0; i < kEmulatedLanes; ++i)
    if (lane_kept(k, i)) dst[i] = x.at[i];
}
inline void _mm256_mask_storeu_epi16(void* p, __mmask16 k, __m256i a) {
  auto* dst = static_cast<unsigned short*>(p);
  const auto x = __builtin_bit_cast(HalfwordLanes, a);
  for (int i = 0; i < kEmulatedLanes; ++i)
    if (lane_kept(k, i)) dst[i] = x.at[i];
}

inline __mmask16 _mm512_movepi32_mask(__m512i a) {
  const auto x = __builtin_bit_cast(WordLanes, a);
  unsigned mask = 0;
  for (int i = 0; i < kEmulatedLanes; ++i) mask |= (x.at[i] >> 31) << i;
  return static_cast<__mmask16>(mask);
}

// The kept lanes packed to the front in order, zeros after.
inline WordLanes compressed(__mmask16 k, WordLanes x) {
  WordLanes packed{};
  int count = 0;
  for (int i = 0; i < kEmulatedLanes; ++i)
    if (lane_kept(k, i)) packed.at[count++] = x.at[i];
  return packed;
}
inline __m512i _mm512_maskz_compress_epi32(__mmask16 k, __m512i a) {
  return __builtin_bit_cast(__m512i, compressed(k, __builtin_bit_cast(WordLanes, a)));
}
inline __m512 _mm512_maskz_compress_ps(__mmask16 k, __m512 a) {
  return __builtin_bit_cast(__m512, compressed(k, __builtin_bit_cast(WordLanes, a)));
}

// vdpbf16ps, as the SDM gives it: per lane, acc += a.hi·b.hi, then += a.lo·b.lo, each a fused
// multiply-add rounded to nearest even (a product of two bf16 values is exact in fp32), with
// denormal inputs read as zero and denormal results flushed to zero.
inline float bf16_value(unsigned short x) { return flush_denormal(to_float(static_cast<bf16>(x))); }
inline __m512 _mm512_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
  FloatLanes sum = emulated_lanes(acc);
  const auto x = __builtin_bit_cast(WordLanes, a), y = __builtin_bit_cast(WordLanes, b);
  for (int i = 0; i < kEmulatedLanes; ++i) {
    const unsigned xw = x.at[i], yw = y.at[i];
    const float high =
        flush_denormal(__builtin_fmaf(bf16_value(static_cast<unsigned short>(xw >> 16)),
                                      bf16_value(static_cast<unsigned short>(yw >> 16)), flush_denormal(sum.at[i])));
    sum.at[i] = flush_denormal(
        __builtin_fmaf(bf16_value(static_cast<unsigned short>(xw)), bf16_value(static_cast<unsigned short>(yw)), high));
  }
  return as_m512(sum);
}

// vcvtneps2bf16: to_bf16's rounding (nearest even, a NaN kept quiet) of the input, a denormal read as zero.
inline __m256bh _mm512_cvtneps_pbh(__m512 a) {
  const FloatLanes x = emulated_lanes(a);
  HalfwordLanes rounded;
  for (int i = 0; i < kEmulatedLanes; ++i)
    rounded.at[i] = static_cast<unsigned short>(to_bf16(flush_denormal(x.at[i])));
  return __builtin_bit_cast(__m256bh, rounded);
}
