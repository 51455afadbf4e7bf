#include "taxonomy/engines/gathered_tile_bf16.hpp"

#include <algorithm>
#include <limits>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels_bf16.hpp"

namespace xfb {

namespace {

std::int64_t pairs_of(std::int64_t rows) { return (rows + 1) / 2; }
std::int64_t even(std::int64_t n) { return n + (n & 1); }
std::int64_t panel_elements(std::int64_t cols, std::int64_t d) { return tiles::panels_for(cols) * tiles::kPanel * d; }

// The row pairs of `rows` fp32 rows of x (stride ld), n entries each.
void round_pairs(const float* x, std::int64_t ld, std::int64_t rows, std::int64_t n, bf16* pairs) {
  for (std::int64_t r2 = 0; r2 < pairs_of(rows); ++r2) {
    const std::int64_t r = 2 * r2;
    tiles::round_row_pair(x + r * ld, r + 1 < rows ? x + (r + 1) * ld : nullptr, n, pairs + r2 * 2 * ld);
  }
}

// Row r of x (stride ld) to bf16 rows, n entries, a 0 at entry n when n is odd.
void round_rows(float* x, std::int64_t ld, std::int64_t rows, std::int64_t n, bf16* dst) {
  for (std::int64_t r = 0; r < rows; ++r) {
    if (n & 1) x[r * ld + n] = 0.0f;
    tiles::round_row(x + r * ld, even(n), dst + r * ld);
  }
}

}  // namespace

std::int64_t GatheredScratchBf16::elements(std::int64_t rows, std::int64_t cols, std::int64_t d, bool backward) {
  const std::int64_t ld = ops::padded_ld(cols);
  const std::int64_t forward = 2 * cols * d + 2 * panel_elements(cols, d) + rows * ld;
  if (!backward) return forward;
  return forward + 2 * pairs_of(rows) * 2 * ld + rows * ld + 2 * pairs_of(rows) * 2 * d + pairs_of(cols) * 2 * d;
}

GatheredScratchBf16::GatheredScratchBf16(std::int64_t threads, std::int64_t rows, std::int64_t cols, std::int64_t d,
                                         bool backward)
    : rows_(rows), cols_(cols), d_(d), backward_(backward) {
  halves_ = Tensor(Shape{threads, elements(rows, cols, d, backward)}, DType::BF16);
}

std::int64_t GatheredScratchBf16::bytes(std::int64_t threads, std::int64_t rows, std::int64_t cols, std::int64_t d,
                                        bool backward) {
  return threads * elements(rows, cols, d, backward) * static_cast<std::int64_t>(sizeof(bf16));
}

GatheredBf16Buffers GatheredScratchBf16::buffers(int thread) {
  const std::int64_t ld = ops::padded_ld(cols_), d = d_;
  GatheredBf16Buffers b;
  b.keys = halves_.bf16_data() + thread * elements(rows_, cols_, d, backward_);
  b.values = b.keys + cols_ * d;
  b.key_panels = b.values + cols_ * d;
  b.value_panels = b.key_panels + panel_elements(cols_, d);
  b.probs = b.value_panels + panel_elements(cols_, d);
  if (!backward_) return b;
  b.prob_pairs = b.probs + rows_ * ld;
  b.grad_pairs = b.prob_pairs + pairs_of(rows_) * 2 * ld;
  b.grads = b.grad_pairs + pairs_of(rows_) * 2 * ld;
  b.dout_pairs = b.grads + rows_ * ld;
  b.query_pairs = b.dout_pairs + pairs_of(rows_) * 2 * d;
  b.key_pairs = b.query_pairs + pairs_of(rows_) * 2 * d;
  return b;
}

std::int64_t gathered_scores_bf16(const bf16* q, std::int64_t rows, const bf16* keys, std::int64_t cols, std::int64_t d,
                                  float scale, const GatheredBf16Buffers& b, float* s, std::int64_t lds) {
  tiles::pack_key_pair_panels(keys, d, cols, d, b.key_panels);
  tiles::scores_bf16(q, d, rows, b.key_panels, tiles::panels_for(cols), d, scale, s, lds);
  return matmul_flops(rows, cols, d);
}

std::int64_t gathered_values_bf16(float* s, std::int64_t lds, std::int64_t rows, std::int64_t cols, const bf16* values,
                                  std::int64_t d, const float* inverse, const GatheredBf16Buffers& b, float* acc,
                                  bf16* out, std::int64_t ld_out) {
  round_rows(s, lds, rows, cols, b.probs);
  tiles::pack_row_pairs(values, d, cols, d, b.value_panels);
  std::fill(acc, acc + rows * d, 0.0f);
  tiles::accumulate_pv_bf16(b.probs, lds, rows, cols, b.value_panels, d, acc, d);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = acc + r * d;
#pragma omp simd
    for (std::int64_t c = 0; c < d; ++c) row[c] *= inverse[r];
    tiles::round_row(row, d, out + r * ld_out);
  }
  return matmul_flops(rows, cols, d) + rows * d;
}

std::int64_t gathered_tile_backward_bf16(const GatheredTileBf16& t, float scale, float* scores, float* grads,
                                         const GatheredBf16Buffers& b, float* dq, float* dk, float* dv) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::int64_t rows = t.rows, cols = t.cols, d = t.d, ld = t.ld;
  for (std::int64_t r = 0; r < rows; ++r) {
    float* p = scores + r * ld;
    const float shift = t.lse[r];
    if (shift == kNegInf) {
      std::fill(p, p + cols, 0.0f);
      continue;
    }
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) p[c] = p[c] == kNegInf ? 0.0f : ops::fast_exp(p[c] - shift);
  }
  round_pairs(scores, ld, rows, cols, b.prob_pairs);
  tiles::pack_row_pairs(t.dout, d, rows, d, b.dout_pairs);
  std::fill(dv, dv + cols * d, 0.0f);
  tiles::accumulate_transposed_bf16(b.prob_pairs, ld, rows, cols, b.dout_pairs, d, 1.0f, dv, d);
  tiles::pack_key_pair_panels(t.v, d, cols, d, b.value_panels);
  tiles::scores_bf16(t.dout, d, rows, b.value_panels, tiles::panels_for(cols), d, 1.0f, grads, ld);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* p = scores + r * ld;
    float* ds = grads + r * ld;
    const float delta = t.delta[r];
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c) ds[c] = p[c] * (ds[c] - delta);
  }
  round_pairs(grads, ld, rows, cols, b.grad_pairs);
  round_rows(grads, ld, rows, cols, b.grads);
  tiles::pack_row_pairs(t.k, d, cols, d, b.key_pairs);
  std::fill(dq, dq + rows * d, 0.0f);
  tiles::accumulate_pv_bf16(b.grads, ld, rows, cols, b.key_pairs, d, dq, d, scale);
  tiles::pack_row_pairs(t.q, d, rows, d, b.query_pairs);
  std::fill(dk, dk + cols * d, 0.0f);
  tiles::accumulate_transposed_bf16(b.grad_pairs, ld, rows, cols, b.query_pairs, d, scale, dk, d);
  return 4 * matmul_flops(rows, cols, d) + kRecomputedSoftmaxBackwardFlopsPerElement * rows * cols;
}

std::int64_t row_dots_bf16(const bf16* dout, const bf16* out, std::int64_t rows, std::int64_t d, float* delta) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t c = 0; c < d; ++c) dot += to_float(dout[r * d + c]) * to_float(out[r * d + c]);
    delta[r] = dot;
  }
  return 2 * rows * d;
}

}  // namespace xfb
