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

std::int64_t TileAttention::score_floats(std::int64_t rows, std::int64_t width) { return rows * ops::padded_ld(width); }

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

std::int64_t TileColumns::layout(const TilePattern& tile, std::int64_t align) {
  const auto& runs = tile.runs();
  columns_.resize(runs.size());
  offsets_.resize(runs.size());
  std::int64_t width = 0;
  for (std::size_t s = 0; s < runs.size(); ++s) {
    columns_[s] = tile.computed_columns(s);
    offsets_[s] = width;
    width += (columns_[s].width() + align - 1) / align * align;
  }
  return width;
}

const std::vector<std::pair<std::int64_t, std::int64_t>>& TileColumns::spans(const TilePattern& tile,
                                                                             std::int64_t row) {
  spans_.clear();
  for (std::size_t s = 0; s < tile.runs().size(); ++s) {
    const ColumnRange& seen = tile.visible(row, s);
    if (seen.width() > 0) spans_.push_back({offsets_[s] + seen.lo - columns_[s].lo, seen.width()});
  }
  return spans_;
}

TileColumns::RowStats TileColumns::exponentials(const TilePattern& tile, std::int64_t r, float* row,
                                                std::int64_t width) {
  RowStats stats{-INFINITY, 0.0f, 0};
  spans(tile, r);
  for (const auto& [begin, length] : spans_) stats.max = std::max(stats.max, span_max(row + begin, length));
  std::int64_t next = 0;  // first score column not yet written in this row
  for (const auto& [begin, length] : spans_) {
    std::fill(row + next, row + begin, 0.0f);
    stats.sum += ops::exp_and_sum(row + begin, length, stats.max);
    next = begin + length;
    stats.visible += length;
  }
  std::fill(row + next, row + width, 0.0f);
  return stats;
}

std::int64_t TileColumns::softmax_grad(const TilePattern& tile, std::int64_t r, float* p, float* g, std::int64_t width,
                                       float shift, float dot) {
  spans(tile, r);
  std::int64_t next = 0, visible = 0;
  for (const auto& [begin, length] : spans_) {
    std::fill(p + next, p + begin, 0.0f);
    std::fill(g + next, g + begin, 0.0f);
#pragma omp simd
    for (std::int64_t j = begin; j < begin + length; ++j) {
      p[j] = ops::fast_exp(p[j] - shift);
      g[j] = p[j] * (g[j] - dot);
    }
    next = begin + length;
    visible += length;
  }
  std::fill(p + next, p + width, 0.0f);
  std::fill(g + next, g + width, 0.0f);
  return visible;
}

void TileAttention::gather_union(const TilePattern& tile, const float* k, const float* v) {
  const auto& runs = tile.runs();
  for (std::size_t s = 0; s < runs.size(); ++s) {
    copy_rows(first_computed(tile, k, s), runs[s].step, cols_.columns(s).width(), d_,
              keys_.data() + cols_.offset(s) * d_);
    copy_rows(first_computed(tile, v, s), runs[s].step, cols_.columns(s).width(), d_,
              values_.data() + cols_.offset(s) * d_);
  }
}

std::int64_t TileAttention::run(const TilePattern& tile, const float* q, std::int64_t q_ld, const float* k,
                                const float* v, float* out, std::int64_t out_ld, bool gather, float* lse,
                                std::int64_t lse_step) {
  const std::int64_t width = cols_.layout(tile, 1);
  if (width == 0) {
    for (std::int64_t r = 0; r < tile.rows(); ++r) {
      std::fill_n(out + r * out_ld, d_, 0.0f);
      if (lse != nullptr) lse[r * lse_step] = -INFINITY;
    }
    return 0;
  }
  const std::int64_t ld = ops::padded_ld(width);
  if (tile.rows() * ld > scores_.size() || (gather && width * d_ > keys_.size()))
    throw std::logic_error("TileAttention: tile larger than the buffers sized in prepare");
  if (gather) gather_union(tile, k, v);
  scores(tile, q, q_ld, k, width, ld, gather);
  const std::int64_t flops = softmax_rows(tile, width, ld, lse, lse_step);
  weighted_values(tile, v, out, out_ld, width, ld, gather);
  return flops;
}

void TileAttention::enable_backward() {
  grads_ = Tensor(Shape{scores_.size()});
  key_grads_ = Tensor(Shape{keys_.size()});
  value_grads_ = Tensor(Shape{values_.size()});
}

std::int64_t TileAttention::backward_bytes(std::int64_t score_capacity, std::int64_t gather_capacity, std::int64_t d) {
  return bytes(score_capacity, gather_capacity, d);
}

std::int64_t tile_backward_flops(const TilePattern& tile, std::int64_t d, bool gather) {
  const std::int64_t width = tile.computed_width();
  if (width == 0) return 0;
  return 5 * matmul_flops(tile.rows(), width, d) + kRecomputedSoftmaxBackwardFlopsPerElement * tile.visible_entries() +
         (gather ? 2 * width * d : 0);
}

std::int64_t TileAttention::backward(const TilePattern& tile, const TileGrads& g, const float* k, const float* v,
                                     bool gather) {
  if (grads_.empty()) throw std::logic_error("TileAttention::backward before enable_backward");
  const std::int64_t width = cols_.layout(tile, 1), rows = tile.rows(), d = d_;
  if (width == 0) return 0;
  const std::int64_t ld = ops::padded_ld(width);
  if (rows * ld > grads_.size() || (gather && width * d > key_grads_.size()))
    throw std::logic_error("TileAttention: tile larger than the buffers sized in prepare");
  if (gather) gather_union(tile, k, v);
  scores(tile, g.q, g.ld, k, width, ld, gather);  // S, turned into P below
  // dP = dO·Vᵀ into grads_, turned into dS below.
  if (gather) {
    ops::gemm(false, true, rows, width, d, 1.0f, g.dout, g.ld, values_.data(), d, 0.0f, grads_.data(), ld);
  } else {
    for (std::size_t s = 0; s < tile.runs().size(); ++s)
      if (cols_.columns(s).width() > 0)
        ops::gemm(false, true, rows, cols_.columns(s).width(), d, 1.0f, g.dout, g.ld, first_computed(tile, v, s),
                  tile.runs()[s].step * d, 0.0f, grads_.data() + cols_.offset(s), ld);
  }
  std::int64_t visible_total = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    visible_total += cols_.softmax_grad(tile, r, scores_.data() + r * ld, grads_.data() + r * ld, width,
                                        g.lse[r * g.stats_step], g.delta[r * g.stats_step]);
  per_run_products(tile, g, k, width, ld, gather);
  return kRecomputedSoftmaxBackwardFlopsPerElement * visible_total;
}

// dV[cols] += Pᵀ·dO, dK[cols] += dSᵀ·Q/√D, dQ += dS·K[cols]/√D: one product each on the gathered
// union (its dK, dV then added back row by row), else one per run in place.
void TileAttention::per_run_products(const TilePattern& tile, const TileGrads& g, const float* k, std::int64_t width,
                                     std::int64_t ld, bool gather) {
  const std::int64_t rows = tile.rows(), d = d_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const auto& runs = tile.runs();
  if (gather) {
    ops::gemm(true, false, width, d, rows, 1.0f, scores_.data(), ld, g.dout, g.ld, 0.0f, value_grads_.data(), d);
    ops::gemm(true, false, width, d, rows, scale, grads_.data(), ld, g.q, g.ld, 0.0f, key_grads_.data(), d);
    ops::gemm(false, false, rows, d, width, scale, grads_.data(), ld, keys_.data(), d, 1.0f, g.dq, g.ld);
    for (std::size_t s = 0; s < runs.size(); ++s)
      for (std::int64_t c = 0; c < cols_.columns(s).width(); ++c) {
        const std::int64_t row = runs[s].first + (cols_.columns(s).lo + c) * runs[s].step;
        const float* dk_src = key_grads_.data() + (cols_.offset(s) + c) * d;
        const float* dv_src = value_grads_.data() + (cols_.offset(s) + c) * d;
#pragma omp simd
        for (std::int64_t j = 0; j < d; ++j) {
          g.dk[row * d + j] += dk_src[j];
          g.dv[row * d + j] += dv_src[j];
        }
      }
    FlopCounter::add(2 * width * d);
    return;
  }
  for (std::size_t s = 0; s < runs.size(); ++s) {
    const std::int64_t w = cols_.columns(s).width(), step_ld = runs[s].step * d;
    if (w == 0) continue;
    const std::int64_t first_row = runs[s].first + cols_.columns(s).lo * runs[s].step;
    ops::gemm(true, false, w, d, rows, 1.0f, scores_.data() + cols_.offset(s), ld, g.dout, g.ld, 1.0f,
              g.dv + first_row * d, step_ld);
    ops::gemm(true, false, w, d, rows, scale, grads_.data() + cols_.offset(s), ld, g.q, g.ld, 1.0f,
              g.dk + first_row * d, step_ld);
    ops::gemm(false, false, rows, d, w, scale, grads_.data() + cols_.offset(s), ld, first_computed(tile, k, s), step_ld,
              1.0f, g.dq, g.ld);
  }
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
    if (cols_.columns(s).width() > 0)
      ops::gemm(false, true, rows, cols_.columns(s).width(), d, scale, q, q_ld, first_computed(tile, k, s),
                tile.runs()[s].step * d, 0.0f, scores_.data() + cols_.offset(s), ld);
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
    if (cols_.columns(s).width() == 0) continue;
    ops::gemm(false, false, rows, d, cols_.columns(s).width(), 1.0f, scores_.data() + cols_.offset(s), ld,
              first_computed(tile, v, s), tile.runs()[s].step * d, beta, out, out_ld);
    beta = 1.0f;
  }
}

// Row-wise softmax over the visible score columns; every other computed column becomes 0.
std::int64_t TileAttention::softmax_rows(const TilePattern& tile, std::int64_t width, std::int64_t ld, float* lse,
                                         std::int64_t lse_step) {
  std::int64_t visible_total = 0;
  for (std::int64_t r = 0; r < tile.rows(); ++r) {
    float* row = scores_.data() + r * ld;
    const TileColumns::RowStats stats = cols_.exponentials(tile, r, row, width);
    visible_total += stats.visible;
    if (lse != nullptr) lse[r * lse_step] = stats.visible == 0 ? -INFINITY : stats.max + std::log(stats.sum);
    if (stats.visible == 0) continue;
    for (const auto& [begin, length] : cols_.spans(tile, r)) scale_span(row + begin, length, 1.0f / stats.sum);
  }
  return kSoftmaxFlopsPerElement * visible_total;
}

}  // namespace xfb::fixed
