#include "taxonomy/engines/gathered_attention.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"

namespace xfb::fixed {

void TilePattern::reset(std::int64_t rows) {
  rows_ = rows;
  runs_.clear();
  visible_.clear();
}

std::size_t TilePattern::add_run(KeyRun run) {
  runs_.push_back(run);
  visible_.resize(visible_.size() + static_cast<std::size_t>(rows_), ColumnRange{0, run.count});
  return runs_.size() - 1;
}

ColumnRange TilePattern::computed_columns(std::size_t run) const {
  ColumnRange range{runs_[run].count, 0};
  for (std::int64_t r = 0; r < rows_; ++r) {
    const ColumnRange& seen = visible(r, run);
    if (seen.width() == 0) continue;
    range.lo = std::min(range.lo, seen.lo);
    range.hi = std::max(range.hi, seen.hi);
  }
  return range.width() > 0 ? range : ColumnRange{};
}

std::int64_t TilePattern::computed_width() const {
  std::int64_t width = 0;
  for (std::size_t s = 0; s < runs_.size(); ++s) width += computed_columns(s).width();
  return width;
}

std::int64_t TilePattern::visible_entries() const {
  std::int64_t entries = 0;
  for (const auto& seen : visible_) entries += seen.width();
  return entries;
}

std::int64_t tile_flops(const TilePattern& tile, std::int64_t d) {
  return 2 * matmul_flops(tile.rows(), tile.computed_width(), d) + kSoftmaxFlopsPerElement * tile.visible_entries();
}

TileAttention::TileAttention(std::int64_t score_capacity, std::int64_t gather_capacity, std::int64_t d)
    : d_(d),
      scores_(Shape{std::max<std::int64_t>(score_capacity, 1)}),
      keys_(Shape{std::max<std::int64_t>(gather_capacity * d, 1)}),
      values_(Shape{std::max<std::int64_t>(gather_capacity * d, 1)}) {}

std::int64_t TileAttention::bytes(std::int64_t score_capacity, std::int64_t gather_capacity, std::int64_t d) {
  const auto floats = std::max<std::int64_t>(score_capacity, 1) + 2 * std::max<std::int64_t>(gather_capacity * d, 1);
  return floats * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t TileAttention::score_floats(std::int64_t rows, std::int64_t width) {
  return rows * ops::padded_ld(width);
}

namespace {

// Largest of x[0 … n). Written as a select: GCC 12 leaves `std::max` in an `omp simd` max
// reduction scalar (it honours NaNs and signed zeros) but vectorises this form to vmaxps.
float span_max(const float* x, std::int64_t n) {
  float peak = -INFINITY;
#pragma omp simd reduction(max : peak)
  for (std::int64_t i = 0; i < n; ++i) peak = peak > x[i] ? peak : x[i];
  return peak;
}

void scale_span(float* x, std::int64_t n, float factor) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) x[i] *= factor;
}

void copy_rows(const float* src, std::int64_t step, std::int64_t count, std::int64_t d, float* dst) {
  for (std::int64_t c = 0; c < count; ++c) std::copy_n(src + c * step * d, d, dst + c * d);
}

}  // namespace

std::int64_t TileAttention::run(const TilePattern& tile, const float* q, std::int64_t q_ld, const float* k,
                                const float* v, float* out, std::int64_t out_ld, bool gather) {
  const auto& runs = tile.runs();
  columns_.resize(runs.size());
  offsets_.resize(runs.size());
  std::int64_t width = 0;
  for (std::size_t s = 0; s < runs.size(); ++s) {
    columns_[s] = tile.computed_columns(s);
    offsets_[s] = width;
    width += columns_[s].width();
  }
  if (width == 0) {
    for (std::int64_t r = 0; r < tile.rows(); ++r) std::fill_n(out + r * out_ld, d_, 0.0f);
    return 0;
  }
  const std::int64_t ld = ops::padded_ld(width);
  if (tile.rows() * ld > scores_.size() || (gather && width * d_ > keys_.size()))
    throw std::logic_error("TileAttention: tile larger than the buffers sized in prepare");
  if (gather) {
    for (std::size_t s = 0; s < runs.size(); ++s) {
      copy_rows(first_computed(tile, k, s), runs[s].step, columns_[s].width(), d_, keys_.data() + offsets_[s] * d_);
      copy_rows(first_computed(tile, v, s), runs[s].step, columns_[s].width(), d_, values_.data() + offsets_[s] * d_);
    }
  }
  scores(tile, q, q_ld, k, width, ld, gather);
  const std::int64_t flops = softmax_rows(tile, width, ld);
  weighted_values(tile, v, out, out_ld, width, ld, gather);
  return flops;
}

const float* TileAttention::first_computed(const TilePattern& tile, const float* base, std::size_t run) const {
  const KeyRun& r = tile.runs()[run];
  return base + (r.first + columns_[run].lo * r.step) * d_;
}

// S = Q·Kᵀ/√D over the computed columns, run after run.
void TileAttention::scores(const TilePattern& tile, const float* q, std::int64_t q_ld, const float* k,
                           std::int64_t width, std::int64_t ld, bool gather) {
  const std::int64_t rows = tile.rows(), d = d_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  if (gather) {
    ops::gemm(false, true, rows, width, d, scale, q, q_ld, keys_.data(), d, 0.0f, scores_.data(), ld);
    return;
  }
  for (std::size_t s = 0; s < tile.runs().size(); ++s)
    if (columns_[s].width() > 0)
      ops::gemm(false, true, rows, columns_[s].width(), d, scale, q, q_ld, first_computed(tile, k, s),
                tile.runs()[s].step * d, 0.0f, scores_.data() + offsets_[s], ld);
}

// O = P·V over the computed columns.
void TileAttention::weighted_values(const TilePattern& tile, const float* v, float* out, std::int64_t out_ld,
                                    std::int64_t width, std::int64_t ld, bool gather) {
  const std::int64_t rows = tile.rows(), d = d_;
  if (gather) {
    ops::gemm(false, false, rows, d, width, 1.0f, scores_.data(), ld, values_.data(), d, 0.0f, out, out_ld);
    return;
  }
  float beta = 0.0f;
  for (std::size_t s = 0; s < tile.runs().size(); ++s) {
    if (columns_[s].width() == 0) continue;
    ops::gemm(false, false, rows, d, columns_[s].width(), 1.0f, scores_.data() + offsets_[s], ld,
              first_computed(tile, v, s), tile.runs()[s].step * d, beta, out, out_ld);
    beta = 1.0f;
  }
}

// Row-wise softmax over the visible score columns; every other computed column becomes 0.
std::int64_t TileAttention::softmax_rows(const TilePattern& tile, std::int64_t width, std::int64_t ld) {
  const auto& runs = tile.runs();
  std::int64_t visible_total = 0;
  for (std::int64_t r = 0; r < tile.rows(); ++r) {
    float* row = scores_.data() + r * ld;
    // The row's visible spans as score columns [begin, begin + length), in column order.
    spans_.clear();
    for (std::size_t s = 0; s < runs.size(); ++s) {
      const ColumnRange& seen = tile.visible(r, s);
      if (seen.width() > 0) spans_.push_back({offsets_[s] + seen.lo - columns_[s].lo, seen.width()});
    }
    float peak = -INFINITY;
    for (const auto& [begin, length] : spans_) peak = std::max(peak, span_max(row + begin, length));
    float sum = 0.0f;
    std::int64_t next = 0;  // first score column not yet written in this row
    for (const auto& [begin, length] : spans_) {
      std::fill(row + next, row + begin, 0.0f);
      sum += ops::exp_and_sum(row + begin, length, peak);
      next = begin + length;
      visible_total += length;
    }
    std::fill(row + next, row + width, 0.0f);
    if (spans_.empty()) continue;
    const float inverse = 1.0f / sum;
    for (const auto& [begin, length] : spans_) scale_span(row + begin, length, inverse);
  }
  return kSoftmaxFlopsPerElement * visible_total;
}

}  // namespace xfb::fixed
