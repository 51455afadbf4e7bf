#include "taxonomy/engines/gathered_attention_bf16.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "lib/core/tile_kernels_bf16.hpp"

namespace xfb::fixed {
namespace {

constexpr std::int64_t kFloat = sizeof(float), kHalf = sizeof(bf16);

std::int64_t even_rows(const TileCapacity& c) { return c.rows + (c.rows & 1); }
std::int64_t tile_elements(const TileCapacity& c) { return std::max<std::int64_t>(even_rows(c) * c.cols, 1); }
std::int64_t column_elements(const TileCapacity& c, std::int64_t d) { return std::max<std::int64_t>(c.cols * d, 1); }
std::int64_t row_elements(const TileCapacity& c, std::int64_t d) { return std::max<std::int64_t>(even_rows(c) * d, 1); }

std::int64_t forward_floats(const TileCapacity& c, std::int64_t d) { return tile_elements(c) + row_elements(c, d); }
std::int64_t forward_halves(const TileCapacity& c, std::int64_t d) {
  return tile_elements(c) + 2 * column_elements(c, d);
}
std::int64_t backward_halves(const TileCapacity& c, std::int64_t d) {
  return 3 * tile_elements(c) + 2 * column_elements(c, d) + 2 * row_elements(c, d);
}

// dst[f] = src[f]·factor for f < d, rounded to bf16 or kept fp32.
void store_row(const float* src, float factor, std::int64_t d, bf16* dst) {
#pragma omp simd
  for (std::int64_t f = 0; f < d; ++f) dst[f] = to_bf16(src[f] * factor);
}
void store_row(const float* src, float factor, std::int64_t d, float* dst) {
#pragma omp simd
  for (std::int64_t f = 0; f < d; ++f) dst[f] = src[f] * factor;
}

}  // namespace

std::int64_t panel_width(const TilePattern& tile) {
  std::int64_t width = 0;
  for (std::size_t s = 0; s < tile.runs().size(); ++s)
    width += tiles::panels_for(tile.computed_columns(s).width()) * tiles::kPanel;
  return width;
}

TileAttentionBf16::TileAttentionBf16(TileCapacity capacity, std::int64_t d)
    : d_(d),
      capacity_(capacity),
      floats_(Shape{forward_floats(capacity, d)}),
      halves_(Shape{forward_halves(capacity, d)}, DType::BF16),
      row_sum_(static_cast<std::size_t>(std::max<std::int64_t>(capacity.rows, 1))) {}

std::int64_t TileAttentionBf16::bytes(TileCapacity capacity, std::int64_t d) {
  return forward_floats(capacity, d) * kFloat + forward_halves(capacity, d) * kHalf;
}

void TileAttentionBf16::enable_backward() {
  grads_ = Tensor(Shape{tile_elements(capacity_)});
  pairs_ = Tensor(Shape{backward_halves(capacity_, d_)}, DType::BF16);
  dq_ = Tensor(Shape{row_elements(capacity_, d_)});
}

std::int64_t TileAttentionBf16::backward_bytes(TileCapacity capacity, std::int64_t d) {
  return (tile_elements(capacity) + row_elements(capacity, d)) * kFloat + backward_halves(capacity, d) * kHalf;
}

void TileAttentionBf16::products(const TilePattern& tile, const bf16* x, std::int64_t x_ld, const bf16* y, float alpha,
                                 bf16* panels, float* s, std::int64_t ld) {
  const auto& runs = tile.runs();
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const std::int64_t w = cols_.columns(r).width(), offset = cols_.offset(r);
    if (w == 0) continue;
    bf16* packed = panels + offset * d_;
    tiles::pack_key_pair_panels(cols_.first_computed(tile, y, r, d_), runs[r].step * d_, w, d_, packed);
    tiles::scores_bf16(x, x_ld, tile.rows(), packed, tiles::panels_for(w), d_, alpha, s + offset, ld);
  }
}

void TileAttentionBf16::weighted_rows(const TilePattern& tile, const bf16* p, std::int64_t ld, const bf16* y,
                                      float alpha, float* out, bf16* pairs) {
  const auto& runs = tile.runs();
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const std::int64_t w = cols_.columns(r).width(), offset = cols_.offset(r);
    if (w == 0) continue;
    tiles::pack_row_pairs(cols_.first_computed(tile, y, r, d_), runs[r].step * d_, w, d_, pairs + offset * d_);
    tiles::accumulate_pv_bf16(p + offset, ld, tile.rows(), w, pairs + offset * d_, d_, out, d_, alpha);
  }
}

template <class Out>
std::int64_t TileAttentionBf16::attend(const TilePattern& tile, const bf16* q, std::int64_t q_ld, const bf16* k,
                                       const bf16* v, Out* out, std::int64_t out_ld, float* lse,
                                       std::int64_t lse_step) {
  const std::int64_t width = cols_.layout(tile, tiles::kPanel), rows = tile.rows(), d = d_;
  if (rows > capacity_.rows || width > capacity_.cols)
    throw std::logic_error("TileAttentionBf16: tile larger than the buffers sized in prepare");
  float* scores = floats_.data();
  float* acc = scores + tile_elements(capacity_);
  bf16* probs = halves_.bf16_data();
  bf16* panels = probs + tile_elements(capacity_);
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_sum_.begin(), row_sum_.begin() + rows, 0.0f);
  if (width > 0) {
    products(tile, q, q_ld, k, 1.0f / std::sqrt(static_cast<float>(d)), panels, scores, width);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = scores + r * width;
      const TileColumns::RowStats stats = cols_.exponentials(tile, r, row, width);
      row_sum_[static_cast<std::size_t>(r)] = stats.sum;
      if (lse != nullptr) lse[r * lse_step] = stats.visible == 0 ? -INFINITY : stats.max + std::log(stats.sum);
      tiles::round_row(row, width, probs + r * width);
    }
    weighted_rows(tile, probs, width, v, 1.0f, acc, panels + column_elements(capacity_, d));
  } else if (lse != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) lse[r * lse_step] = -INFINITY;
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    const float sum = row_sum_[static_cast<std::size_t>(r)];
    store_row(acc + r * d, sum > 0.0f ? 1.0f / sum : 0.0f, d, out + r * out_ld);
  }
  return tile_flops(tile, d);
}

template std::int64_t TileAttentionBf16::attend<bf16>(const TilePattern&, const bf16*, std::int64_t, const bf16*,
                                                      const bf16*, bf16*, std::int64_t, float*, std::int64_t);
template std::int64_t TileAttentionBf16::attend<float>(const TilePattern&, const bf16*, std::int64_t, const bf16*,
                                                       const bf16*, float*, std::int64_t, float*, std::int64_t);

std::int64_t TileAttentionBf16::backward(const TilePattern& tile, const Grads& g, const bf16* k, const bf16* v,
                                         bool gather) {
  if (grads_.empty()) throw std::logic_error("TileAttentionBf16::backward before enable_backward");
  const std::int64_t width = cols_.layout(tile, tiles::kPanel), rows = tile.rows(), d = d_;
  if (rows > capacity_.rows || width > capacity_.cols)
    throw std::logic_error("TileAttentionBf16: tile larger than the buffers sized in prepare");
  float* dq = dq_.data();
  std::fill(dq, dq + rows * d, 0.0f);
  if (width > 0) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const std::int64_t tile_size = tile_elements(capacity_), columns = column_elements(capacity_, d);
    float *probs = floats_.data(), *grads = grads_.data();
    bf16* key_panels = halves_.bf16_data() + tile_size;
    bf16 *prob_pairs = pairs_.bf16_data(), *grad_pairs = prob_pairs + tile_size, *grad_rows = grad_pairs + tile_size;
    bf16 *value_panels = grad_rows + tile_size, *key_pairs = value_panels + columns;
    bf16 *query_pairs = key_pairs + columns, *dout_pairs = query_pairs + row_elements(capacity_, d);
    products(tile, g.q, g.ld, k, scale, key_panels, probs, width);
    products(tile, g.dout, g.ld, v, 1.0f, value_panels, grads, width);
    for (std::int64_t r = 0; r < rows; ++r) {
      cols_.softmax_grad(tile, r, probs + r * width, grads + r * width, width, g.lse[r * g.stats_step],
                         g.delta[r * g.stats_step]);
      tiles::round_row(grads + r * width, width, grad_rows + r * width);
    }
    for (std::int64_t r2 = 0; 2 * r2 < rows; ++r2) {
      const bool odd = 2 * r2 + 1 < rows;
      const std::int64_t row = 2 * r2 * width;
      tiles::round_row_pair(probs + row, odd ? probs + row + width : nullptr, width, prob_pairs + row);
      tiles::round_row_pair(grads + row, odd ? grads + row + width : nullptr, width, grad_pairs + row);
    }
    tiles::pack_row_pairs(g.q, g.ld, rows, d, query_pairs);
    tiles::pack_row_pairs(g.dout, g.ld, rows, d, dout_pairs);
    for (std::size_t s = 0; s < tile.runs().size(); ++s) {
      const std::int64_t w = cols_.columns(s).width(), offset = cols_.offset(s), step = tile.runs()[s].step;
      if (w == 0) continue;
      const std::int64_t first = tile.runs()[s].first + cols_.columns(s).lo * step;
      tiles::accumulate_transposed_bf16(prob_pairs + 2 * offset, width, rows, w, dout_pairs, d, 1.0f, g.dv + first * d,
                                        step * d);
      tiles::accumulate_transposed_bf16(grad_pairs + 2 * offset, width, rows, w, query_pairs, d, scale,
                                        g.dk + first * d, step * d);
    }
    weighted_rows(tile, grad_rows, width, k, scale, dq, key_pairs);
  }
  if (g.dq != nullptr)
    for (std::int64_t r = 0; r < rows; ++r) store_row(dq + r * d, 1.0f, d, g.dq + r * g.ld);
  return tile_backward_flops(tile, d, gather);
}

template <class T>
HeadBackward<T>::HeadBackward(std::int64_t threads, std::int64_t tokens, std::int64_t d)
    : tokens_(tokens), d_(d), deltas_(Shape{threads, tokens}) {
  if constexpr (std::is_same_v<T, bf16>) accumulators_ = Tensor(Shape{threads, 2, tokens, d});
}

template <class T>
std::int64_t HeadBackward<T>::bytes(std::int64_t threads, std::int64_t tokens, std::int64_t d) {
  return threads * (tokens + (std::is_same_v<T, bf16> ? 2 * tokens * d : 0)) * kFloat;
}

template <class T>
HeadRowsOf<T> HeadBackward<T>::begin(const block_sparse::BackwardTensors& t, std::int64_t offset, const float* lse,
                                     int thread, std::int64_t& flops) {
  const std::int64_t n = tokens_, d = d_;
  float* delta = deltas_.data() + thread * n;
  const T *out = elements<T>(t.out) + offset, *dout = elements<T>(t.dout) + offset;
  T* dq = elements<T>(t.dq) + offset;
  if constexpr (std::is_same_v<T, bf16>) {
    for (std::int64_t i = 0; i < n; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t c = 0; c < d; ++c) dot += to_float(dout[i * d + c]) * to_float(out[i * d + c]);
      delta[i] = dot;
    }
    float* dk = accumulators_.data() + thread * 2 * n * d;
    std::fill(dk, dk + 2 * n * d, 0.0f);
    flops += 2 * n * d;
    return {elements<T>(t.q) + offset, dout, dq, lse, delta, dk, dk + n * d};
  } else {
    float *dk = t.dk.data() + offset, *dv = t.dv.data() + offset;
    flops += block_sparse::begin_head({.out = out, .dout = dout, .delta = delta, .dq = dq, .dk = dk, .dv = dv, .d = d},
                                      n, n);
    return {t.q.data() + offset, dout, dq, lse, delta, dk, dv};
  }
}

template <class T>
void HeadBackward<T>::finish(const block_sparse::BackwardTensors& t, std::int64_t offset, int thread) {
  if constexpr (std::is_same_v<T, bf16>) {
    const std::int64_t count = tokens_ * d_;
    const float* dk = accumulators_.data() + thread * 2 * count;
    tiles::round_row(dk, count, t.dk.bf16_data() + offset);
    tiles::round_row(dk + count, count, t.dv.bf16_data() + offset);
  }
}

template class HeadBackward<float>;
template class HeadBackward<bf16>;

std::string gathered_bf16_unsupported(const Problem& p) {
  return tiles::bf16_head_dim_unsupported("the bf16 gathered-attention engine", p.dtype, p.head_dim);
}

}  // namespace xfb::fixed
