#include "taxonomy/engines/top_positions.hpp"

#include <algorithm>
#include <bit>
#include <limits>

#include "lib/core/tile_kernels.hpp"

namespace xfb {
namespace {

// Order-preserving map of floats (no NaN) to int32 keys, its own inverse on the bits; −0 maps as
// +0 (x + 0 is +0 for both), so equal values have equal keys.
inline std::int32_t order_key(float x) {
  const auto bits = std::bit_cast<std::int32_t>(x + 0.0f);
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

// The float of a key (a key past +inf's gives a NaN, which no compare passes).
inline float key_value(std::int32_t key) { return std::bit_cast<float>(key ^ ((key >> 31) & 0x7FFFFFFF)); }

std::int64_t count_at_least(const std::int32_t* keys, std::int64_t count, std::int32_t key) {
  std::int64_t at_least = 0;
#pragma omp simd reduction(+ : at_least)
  for (std::int64_t i = 0; i < count; ++i) at_least += keys[i] >= key ? 1 : 0;
  return at_least;
}

}  // namespace

void TopPositions::reset(std::int64_t w, std::int32_t* positions, float* values, std::int32_t* scratch_indices,
                         float* scratch_values) {
  w_ = w;
  positions_ = positions;
  values_ = values;
  scratch_indices_ = scratch_indices;
  scratch_values_ = scratch_values;
  count_ = 0;
  least_ = std::numeric_limits<std::int32_t>::min();
  bar_ = -std::numeric_limits<float>::infinity();
}

void TopPositions::add(const float* values, std::int64_t count, std::int64_t first) {
  const std::int64_t added = tiles::positions_at_least(values, count, bar_, positions_ + count_, values_ + count_);
#pragma omp simd
  for (std::int64_t j = count_; j < count_ + added; ++j) positions_[j] += static_cast<std::int32_t>(first);
  count_ += added;
  if (count_ > w_ + kSlack) cut(w_ + kSlack / 2);
}

// Keeps between w and `keep` (≥ w) of the best of the list, in order, exactly w when keep = w:
// bisection over the order keys for a key K with w ≤ #{keys ≥ K} ≤ keep (each step a branch-free
// count), then every value at or above K by the vector filter; or, when more than `keep` values
// equal the w-th largest K, those above it and the lowest positions equal to it. The bar rises past
// K: a later value equal to K loses to the at least w kept at or above it.
void TopPositions::cut(std::int64_t keep) {
  std::int32_t* keys = scratch_indices_;
  std::int64_t low = least_, high = least_, at_least = count_;  // count_ keys are ≥ least_
#pragma omp simd reduction(max : high)
  for (std::int64_t i = 0; i < count_; ++i) {
    keys[i] = order_key(values_[i]);
    high = std::max<std::int64_t>(high, keys[i]);
  }
  while (low < high && at_least > keep) {
    const std::int64_t middle = low + (high - low) / 2 + 1;
    const std::int64_t above = count_at_least(keys, count_, static_cast<std::int32_t>(middle));
    if (above >= w_) {
      low = middle;
      at_least = above;
    } else {
      high = middle - 1;
    }
  }
  const auto cut = static_cast<std::int32_t>(low);
  std::int64_t taken = 0;
  if (at_least <= keep) {
    taken = tiles::positions_at_least(values_, count_, key_value(cut), scratch_indices_, scratch_values_);
    for (std::int64_t t = 0; t < taken; ++t) {
      positions_[t] = positions_[scratch_indices_[t]];
      values_[t] = scratch_values_[t];
    }
  } else {
    for (std::int64_t ties = w_ - count_at_least(keys, count_, cut + 1), j = 0; j < count_; ++j) {
      const bool take = keys[j] > cut || (keys[j] == cut && ties > 0);
      positions_[taken] = positions_[j];
      values_[taken] = values_[j];
      taken += take ? 1 : 0;
      ties -= take && keys[j] == cut ? 1 : 0;
    }
  }
  count_ = taken;
  least_ = cut;
  bar_ = key_value(cut + 1);
}

void TopPositions::finish(std::int32_t* members) {
  if (count_ > w_) cut(w_);
  std::copy(positions_, positions_ + count_, members);
}

}  // namespace xfb
