#pragma once
// bfloat16: the upper 16 bits of an IEEE fp32 value (1 sign, 8 exponent, 7 mantissa bits; unit
// roundoff u = 2⁻⁸). A distinct type, so a bf16 buffer never passes for raw integers or floats.
// Widening to fp32 is exact; narrowing rounds to nearest, ties to even (NaN stays a quiet NaN),
// as oneDNN's conversions do, so the project's rounding and oneDNN's agree bit for bit.
#include <bit>
#include <cstdint>

namespace xfb {

enum class bf16 : std::uint16_t {};

inline float to_float(bf16 x) { return std::bit_cast<float>(static_cast<std::uint32_t>(x) << 16); }

inline bf16 to_bf16(float x) {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const std::uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<bf16>(nan ? (bits >> 16) | 0x40u : rounded);
}

// A value of either element type as fp32 (bf16 widened exactly), for code written once over both.
inline float as_float(float x) { return x; }
inline float as_float(bf16 x) { return to_float(x); }

// x rounded to the nearest bf16 value, as fp32.
inline float round_to_bf16(float x) { return to_float(to_bf16(x)); }

// narrow: dst[i] = to_bf16(src[i]); widen: dst[i] = to_float(src[i]); for i < n.
inline void narrow(const float* src, bf16* dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}
inline void widen(const bf16* src, float* dst, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

}  // namespace xfb
