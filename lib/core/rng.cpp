#include "lib/core/rng.hpp"

#include <cmath>
#include <numbers>

namespace xfb {

std::uint64_t mix64(std::uint64_t x) {
  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::uint64_t stream_id(std::string_view name) {
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ULL;
  return h;
}

double CounterRng::uniform(std::uint64_t index) const {
  return (static_cast<double>(bits(index) >> 11) + 0.5) * 0x1.0p-53;
}

double CounterRng::normal(std::uint64_t index) const {
  const std::uint64_t pair = index / 2;
  const double u1 = uniform(2 * pair);
  const double u2 = uniform(2 * pair + 1);
  const double radius = std::sqrt(-2.0 * std::log(u1));
  const double angle = 2.0 * std::numbers::pi * u2;
  return (index % 2 == 0) ? radius * std::cos(angle) : radius * std::sin(angle);
}

namespace {

// t[i] := value(i) for every element, in fp32 or rounded to bf16 (the same fp32 draw either way).
template <class Value>
void fill_each(Tensor& t, const Value& value) {
  const std::int64_t n = t.size();
  if (t.dtype() == DType::BF16) {
    bf16* out = t.bf16_data();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) out[i] = to_bf16(value(i));
    return;
  }
  float* out = t.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) out[i] = value(i);
}

}  // namespace

void CounterRng::fill_normal(Tensor& t, float mean, float stddev) const {
  fill_each(t,
            [&](std::int64_t i) { return static_cast<float>(mean + stddev * normal(static_cast<std::uint64_t>(i))); });
}

void CounterRng::fill_normal_rows(Tensor& t, std::int64_t total_rows, std::int64_t first_row) const {
  const std::int64_t rows = t.dim(2), dim = t.dim(3);
  fill_each(t, [&](std::int64_t i) {
    const std::int64_t head = i / (rows * dim), row = i / dim % rows, col = i % dim;
    const auto index = static_cast<std::uint64_t>((head * total_rows + first_row + row) * dim + col);
    return static_cast<float>(normal(index));
  });
}

void CounterRng::fill_uniform(Tensor& t, float lo, float hi) const {
  float* out = t.data();
  const std::int64_t n = t.size();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i)
    out[i] = static_cast<float>(lo + (hi - lo) * uniform(static_cast<std::uint64_t>(i)));
}

}  // namespace xfb
