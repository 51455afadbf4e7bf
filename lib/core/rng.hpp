#pragma once
// Counter-based random numbers: value i of stream s under seed k is a pure function of (k, s, i),
// so fills are bit-identical whatever the thread count or the order of evaluation.
#include <cstdint>
#include <string_view>

#include "lib/core/tensor.hpp"

namespace xfb {

std::uint64_t mix64(std::uint64_t x);
// A stream id derived from a name, e.g. stream_id("vanilla/q").
std::uint64_t stream_id(std::string_view name);

class CounterRng {
 public:
  CounterRng(std::uint64_t seed, std::uint64_t stream) : key_(mix64(seed ^ mix64(stream + 0x9e3779b97f4a7c15ULL))) {}
  CounterRng(std::uint64_t seed, std::string_view stream) : CounterRng(seed, stream_id(stream)) {}

  std::uint64_t bits(std::uint64_t index) const { return mix64(key_ + mix64(index)); }
  // Uniform in (0, 1): never exactly 0 or 1.
  double uniform(std::uint64_t index) const;
  // Standard normal by Box–Muller on the uniforms 2i and 2i+1.
  double normal(std::uint64_t index) const;
  // The normal draw of entry (h, a, b) of a tensor drawn by its coordinates (each below 2²⁴)
  // rather than by its offset: a parameter with a position axis then has the same values for every
  // sequence length, those of N tokens a prefix of those of N + T.
  double normal_at(std::int64_t h, std::int64_t a, std::int64_t b) const {
    constexpr std::uint64_t kShift = 24;
    return normal((((static_cast<std::uint64_t>(h) << kShift) + static_cast<std::uint64_t>(a)) << kShift) +
                  static_cast<std::uint64_t>(b));
  }

  // fill_normal and fill_normal_rows fill fp32 or bf16 tensors: a bf16 one holds the fp32 draws
  // rounded to nearest even, so both types of a tensor see the same numbers.
  void fill_normal(Tensor& t, float mean = 0.0f, float stddev = 1.0f) const;
  // t: [B, H, R, D], rows first_row … first_row + R − 1 of the [B, H, total_rows, D] tensor that
  // fill_normal would fill (so a sequence's tokens can be drawn in pieces, bit-identically).
  void fill_normal_rows(Tensor& t, std::int64_t total_rows, std::int64_t first_row) const;
  void fill_uniform(Tensor& t, float lo, float hi) const;

 private:
  std::uint64_t key_;
};

}  // namespace xfb
