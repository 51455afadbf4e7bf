#include "taxonomy/engines/block_sparse_bf16.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb::block_sparse {
namespace {

constexpr std::int64_t kFloat = sizeof(float), kHalf = sizeof(bf16);

// Columns the score tiles hold for hulls of ≤ max_cols keys: whole key panels.
std::int64_t tile_ld(std::int64_t max_cols) { return tiles::panels_for(max_cols) * tiles::kPanel; }

std::int64_t forward_floats(std::int64_t max_cols, std::int64_t d) {
  return kTaskRows * tile_ld(max_cols) + kTaskRows * d + 2 * kTaskRows;
}
std::int64_t forward_halves(std::int64_t max_cols, std::int64_t d) {
  return kTaskRows * tile_ld(max_cols) + 2 * tile_ld(max_cols) * d;
}
std::int64_t backward_floats(std::int64_t max_cols, std::int64_t tokens, std::int64_t d) {
  return 2 * kTaskRows * tile_ld(max_cols) + kTaskRows * d + 2 * key_window_rows(max_cols) * d + tokens;
}
std::int64_t backward_halves(std::int64_t max_cols, std::int64_t d) {
  return 3 * kTaskRows * tile_ld(max_cols) + 3 * tile_ld(max_cols) * d + 2 * kTaskRows * d;
}

struct Hull {
  std::int64_t begin = 0, end = 0;
  std::int64_t width() const { return end - begin; }
};

Hull hull_of(std::int64_t rows, const std::int64_t* lo, const std::int64_t* hi) {
  Hull hull{std::numeric_limits<std::int64_t>::max(), std::numeric_limits<std::int64_t>::min()};
  for (std::int64_t r = 0; r < rows; ++r) {
    if (hi[r] <= lo[r]) continue;
    hull.begin = std::min(hull.begin, lo[r]);
    hull.end = std::max(hull.end, hi[r]);
  }
  return hull.end > hull.begin ? hull : Hull{};
}

// A row's columns [begin, end) of the hull; none for an empty row.
std::int64_t row_begin(const Hull& hull, std::int64_t lo, std::int64_t hi) { return hi > lo ? lo - hull.begin : 0; }
std::int64_t row_end(const Hull& hull, std::int64_t lo, std::int64_t hi) { return hi > lo ? hi - hull.begin : 0; }

// dst[f] = bf16(src[f]·factor) for f < d.
void round_scaled(const float* src, float factor, std::int64_t d, bf16* dst) {
#pragma omp simd
  for (std::int64_t f = 0; f < d; ++f) dst[f] = to_bf16(src[f] * factor);
}

// Requests every cache line of `count` rows of d bf16 values (row stride ld) ahead of their use.
void prefetch_rows(const bf16* data, std::int64_t ld, std::int64_t count, std::int64_t d) {
  for (std::int64_t r = 0; r < count; ++r)
    for (std::int64_t j = 0; j < d; j += 32) __builtin_prefetch(data + r * ld + j);
}

}  // namespace

HeadViewBf16 head_view_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t head) {
  const std::int64_t d = q.dim(3), offset = head * q.dim(2) * d;
  return {q.bf16_data() + offset, k.bf16_data() + offset, v.bf16_data() + offset, out.bf16_data() + offset, d};
}

ThreadScratchBf16::ThreadScratchBf16(std::int64_t threads, std::int64_t max_cols, std::int64_t d)
    : threads_(static_cast<int>(threads)),
      ld_(tile_ld(max_cols)),
      d_(d),
      float_stride_(forward_floats(max_cols, d)),
      half_stride_(forward_halves(max_cols, d)),
      floats_(Shape{threads, float_stride_}),
      halves_(Shape{threads, half_stride_}, DType::BF16),
      bounds_(static_cast<std::size_t>(threads * 2 * kTaskRows)) {}

std::int64_t ThreadScratchBf16::tracked_bytes(std::int64_t threads, std::int64_t max_cols, std::int64_t d) {
  return threads * (forward_floats(max_cols, d) * kFloat + forward_halves(max_cols, d) * kHalf);
}

std::int64_t accumulate_bf16(const QueryBlockBf16& q, const KeyBlockBf16& k, std::int64_t d, float scale, bool fresh,
                             ThreadScratchBf16& scratch, int thread) {
  const Hull hull = hull_of(q.rows, k.lo, k.hi);
  const std::int64_t width = hull.width(), even = width + (width & 1), ld = scratch.ld();
  if (width == 0) {
    if (fresh)
      for (std::int64_t r = 0; r < q.rows; ++r) {
        std::fill(q.acc + r * q.ld_acc, q.acc + r * q.ld_acc + d, 0.0f);
        q.row_max[r * q.ld_stats] = -std::numeric_limits<float>::infinity();
        q.row_sum[r * q.ld_stats] = 0.0f;
      }
    return 0;
  }
  const bf16* keys = k.keys + hull.begin * k.ld_keys;
  const bf16* values = k.values + hull.begin * k.ld_values;
  // This block's rows, then as many rows past them: the next task's in consecutive tilings (the
  // prefetcher alone left local attention's 16K-token forward 10% slower than fp32's).
  for (std::int64_t ahead : {std::int64_t{0}, width}) {
    prefetch_rows(keys + ahead * k.ld_keys, k.ld_keys, width, d);
    prefetch_rows(q.queries + ahead * q.ld_queries, q.ld_queries, q.rows, d);
    prefetch_rows(values + ahead * k.ld_values, k.ld_values, width, d);
  }
  float* scores = scratch.scores(thread);
  bf16* probs = scratch.probs(thread);
  tiles::pack_key_pair_panels(keys, k.ld_keys, width, d, scratch.key_panels(thread));
  tiles::scores_bf16(q.queries, q.ld_queries, q.rows, scratch.key_panels(thread), tiles::panels_for(width), d, scale,
                     scores, ld);
  for (std::int64_t r = 0; r < q.rows; ++r) {
    float* row = scores + r * ld;  // over [0, even): column `width` (odd) comes out 0, the bf16 rows' pad
    online_softmax_row(row, even, k.lo[r] - hull.begin, k.hi[r] - hull.begin, q.row_max[r * q.ld_stats],
                       q.row_sum[r * q.ld_stats], q.acc + r * q.ld_acc, d, fresh);
    tiles::round_row(row, even, probs + r * ld);
  }
  tiles::pack_row_pairs(values, k.ld_values, width, d, scratch.value_pairs(thread));
  if (fresh)
    for (std::int64_t r = 0; r < q.rows; ++r) std::fill(q.acc + r * q.ld_acc, q.acc + r * q.ld_acc + d, 0.0f);
  tiles::accumulate_pv_bf16(probs, ld, q.rows, width, scratch.value_pairs(thread), d, q.acc, q.ld_acc);
  return accumulate_flops(q.rows, k.lo, k.hi, d, fresh);
}

std::int64_t finish_bf16(const QueryBlockBf16& q, std::int64_t d, bf16* out, std::int64_t ld_out) {
  for (std::int64_t r = 0; r < q.rows; ++r) {
    const float sum = q.row_sum[r * q.ld_stats];
    round_scaled(q.acc + r * q.ld_acc, sum > 0.0f ? 1.0f / sum : 0.0f, d, out + r * ld_out);
  }
  return finish_flops(q.rows, d);
}

std::int64_t attend_bf16(const HeadViewBf16& head, const Tile& tile, ThreadScratchBf16& scratch, int thread) {
  const std::int64_t d = head.d, ldq = tile.q_step * d, ldk = tile.k_step * d;
  const QueryBlockBf16 queries{.queries = head.q + tile.q_first * d,
                               .ld_queries = ldq,
                               .rows = tile.rows,
                               .acc = scratch.acc(thread),
                               .ld_acc = d,
                               .row_max = scratch.row_max(thread),
                               .row_sum = scratch.row_sum(thread)};
  const KeyBlockBf16 keys{.keys = head.k + tile.k_first * d,
                          .ld_keys = ldk,
                          .values = head.v + tile.k_first * d,
                          .ld_values = ldk,
                          .lo = scratch.lo(thread),
                          .hi = scratch.hi(thread)};
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int64_t flops = accumulate_bf16(queries, keys, d, scale, true, scratch, thread);
  if (head.lse != nullptr)
    for (std::int64_t r = 0; r < tile.rows; ++r)
      head.lse[tile.q_first + r * tile.q_step] = log_sum_exp(queries.row_max[r], queries.row_sum[r]);
  return flops + finish_bf16(queries, d, head.out + tile.q_first * d, ldq);
}

BackwardScratchBf16::BackwardScratchBf16(std::int64_t threads, std::int64_t max_cols, std::int64_t tokens,
                                         std::int64_t d)
    : threads_(static_cast<int>(threads)),
      ld_(tile_ld(max_cols)),
      d_(d),
      tokens_(tokens),
      window_(key_window_rows(max_cols)),
      float_stride_(backward_floats(max_cols, tokens, d)),
      half_stride_(backward_halves(max_cols, d)),
      floats_(Shape{threads, float_stride_}),
      halves_(Shape{threads, half_stride_}, DType::BF16),
      bounds_(static_cast<std::size_t>(threads * 2 * kTaskRows)) {}

std::int64_t BackwardScratchBf16::tracked_bytes(std::int64_t threads, std::int64_t max_cols, std::int64_t tokens,
                                                std::int64_t d) {
  return threads * (backward_floats(max_cols, tokens, d) * kFloat + backward_halves(max_cols, d) * kHalf);
}

std::int64_t row_dots_bf16(const bf16* a, const bf16* b, std::int64_t rows, std::int64_t d, float* dots) {
  for (std::int64_t i = 0; i < rows; ++i) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t c = 0; c < d; ++c) dot += to_float(a[i * d + c]) * to_float(b[i * d + c]);
    dots[i] = dot;
  }
  return 2 * rows * d;
}

std::int64_t begin_head_bf16(HeadGradsBf16& g) {
  g.zeroed = g.flushed = g.base = 0;
  return row_dots_bf16(g.dout, g.out, g.tokens, g.d, g.delta);
}

namespace {

// Rounds the dK/dV sums of key rows [g.flushed, end) into dk/dv (zeros for rows no tile reached).
void flush_through(HeadGradsBf16& g, std::int64_t end) {
  const std::int64_t d = g.d;
  for (std::int64_t r = g.flushed; r < end; ++r) {
    if (r < g.zeroed) {
      round_scaled(g.dk_acc + (r - g.base) * d, 1.0f, d, g.dk + r * d);
      round_scaled(g.dv_acc + (r - g.base) * d, 1.0f, d, g.dv + r * d);
    } else {
      std::fill(g.dk + r * d, g.dk + (r + 1) * d, to_bf16(0.0f));
      std::fill(g.dv + r * d, g.dv + (r + 1) * d, to_bf16(0.0f));
    }
  }
  g.flushed = std::max(g.flushed, end);
  g.zeroed = std::max(g.zeroed, g.flushed);
}

}  // namespace

void finish_head_bf16(HeadGradsBf16& g) { flush_through(g, g.tokens); }

namespace {

// Where one tile's fp32 gradient sums go: dQ row r at dq + r·ld_dq (the tile's query rows), dK and
// dV row j at dk, dv + j·ld_kv (the hull's key rows).
struct TileSums {
  float* dq;
  std::int64_t ld_dq;
  float *dk, *dv;
  std::int64_t ld_kv;
};

// The products of one tile's backward (header comment) on a non-empty hull: S and dP on K and V pair
// panels, P = exp(S − L) and dS = P ⊙ (dP − δ) in fp32, rounded to bf16, then dV += Pᵀ·dO,
// dK += scale·dSᵀ·Q, dQ += scale·dS·K into the sums.
void tile_sums(const HeadGradsBf16& g, const Tile& tile, const Hull& hull, const std::int64_t* lo,
               const std::int64_t* hi, BackwardScratchBf16& scratch, int thread, const TileSums& sums) {
  const std::int64_t d = g.d, ld = scratch.ld(), ldq = tile.q_step * d, ldk = tile.k_step * d;
  const std::int64_t width = hull.width(), even = width + (width & 1), panels = tiles::panels_for(width);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const bf16 *q = g.q + tile.q_first * d, *dout = g.dout + tile.q_first * d;
  const std::int64_t key_offset = (tile.k_first + hull.begin * tile.k_step) * d;
  const bf16 *k = g.k + key_offset, *v = g.v + key_offset;
  float* probs = scratch.probs(thread);
  float* grads = scratch.grads(thread);
  tiles::pack_key_pair_panels(k, ldk, width, d, scratch.key_panels(thread));
  tiles::scores_bf16(q, ldq, tile.rows, scratch.key_panels(thread), panels, d, scale, probs, ld);
  tiles::pack_key_pair_panels(v, ldk, width, d, scratch.value_panels(thread));
  tiles::scores_bf16(dout, ldq, tile.rows, scratch.value_panels(thread), panels, d, 1.0f, grads, ld);
  bf16* prob_pairs = scratch.prob_pairs(thread);
  bf16* grad_pairs = scratch.grad_pairs(thread);
  bf16* grad_rows = scratch.grad_rows(thread);
  for (std::int64_t r = 0; r < tile.rows; ++r) {
    const std::int64_t token = tile.q_first + r * tile.q_step;
    const std::int64_t begin = row_begin(hull, lo[r], hi[r]), end = row_end(hull, lo[r], hi[r]);
    // Column `width` (odd) comes out 0: the pad entry of the bf16 rows.
    tiles::softmax_grad_interval(probs + r * ld, grads + r * ld, begin, end, even, g.lse[token], g.delta[token]);
    tiles::round_row(grads + r * ld, even, grad_rows + r * ld);
  }
  for (std::int64_t r2 = 0; 2 * r2 < tile.rows; ++r2) {
    const bool odd = 2 * r2 + 1 < tile.rows;
    tiles::round_row_pair(probs + 2 * r2 * ld, odd ? probs + (2 * r2 + 1) * ld : nullptr, width,
                          prob_pairs + 2 * r2 * ld);
    tiles::round_row_pair(grads + 2 * r2 * ld, odd ? grads + (2 * r2 + 1) * ld : nullptr, width,
                          grad_pairs + 2 * r2 * ld);
  }
  tiles::pack_row_pairs(dout, ldq, tile.rows, d, scratch.dout_pairs(thread));
  tiles::pack_row_pairs(q, ldq, tile.rows, d, scratch.query_pairs(thread));
  tiles::pack_row_pairs(k, ldk, width, d, scratch.key_pairs(thread));
  tiles::accumulate_transposed_bf16(prob_pairs, ld, tile.rows, width, scratch.dout_pairs(thread), d, 1.0f, sums.dv,
                                    sums.ld_kv);
  tiles::accumulate_transposed_bf16(grad_pairs, ld, tile.rows, width, scratch.query_pairs(thread), d, scale, sums.dk,
                                    sums.ld_kv);
  tiles::accumulate_pv_bf16(grad_rows, ld, tile.rows, width, scratch.key_pairs(thread), d, sums.dq, sums.ld_dq, scale);
}

}  // namespace

std::int64_t attend_backward_bf16(HeadGradsBf16& g, const Tile& tile, const std::int64_t* lo, const std::int64_t* hi,
                                  BackwardScratchBf16& scratch, int thread) {
  const std::int64_t d = g.d, ldq = tile.q_step * d;
  const Hull hull = hull_of(tile.rows, lo, hi);
  bf16* dq = g.dq + tile.q_first * d;
  if (hull.width() == 0) {
    for (std::int64_t r = 0; r < tile.rows; ++r) std::fill(dq + r * ldq, dq + r * ldq + d, to_bf16(0.0f));
    return 0;
  }
  if (tile.k_step != 1) throw std::logic_error("attend_backward_bf16: key rows must be consecutive (k_step 1)");
  const std::int64_t first_key = tile.k_first + hull.begin, end_key = tile.k_first + hull.end;
  if (first_key < g.flushed) throw std::logic_error("attend_backward_bf16: a tile reaches dK/dV rows already rounded");
  flush_through(g, first_key);        // no later tile reaches below this one's hull
  if (end_key - g.base > g.window) {  // the live rows [flushed, zeroed) move to the window's start
    const std::int64_t live = g.zeroed - g.flushed, from = (g.flushed - g.base) * d;
    std::copy(g.dk_acc + from, g.dk_acc + from + live * d, g.dk_acc);
    std::copy(g.dv_acc + from, g.dv_acc + from + live * d, g.dv_acc);
    g.base = g.flushed;
  }
  if (end_key - g.base > g.window) throw std::logic_error("attend_backward_bf16: a hull wider than the key window");
  if (end_key > g.zeroed) {
    std::fill(g.dk_acc + (g.zeroed - g.base) * d, g.dk_acc + (end_key - g.base) * d, 0.0f);
    std::fill(g.dv_acc + (g.zeroed - g.base) * d, g.dv_acc + (end_key - g.base) * d, 0.0f);
    g.zeroed = end_key;
  }
  float* dq_acc = scratch.dq(thread);
  std::fill(dq_acc, dq_acc + tile.rows * d, 0.0f);
  const std::int64_t window_row = (first_key - g.base) * d;
  tile_sums(g, tile, hull, lo, hi, scratch, thread, {dq_acc, d, g.dk_acc + window_row, g.dv_acc + window_row, d});
  for (std::int64_t r = 0; r < tile.rows; ++r) round_scaled(dq_acc + r * d, 1.0f, d, dq + r * ldq);
  return attend_backward_flops(tile.rows, lo, hi, d);
}

std::int64_t accumulate_backward_bf16(const HeadGradsBf16& g, const Tile& tile, const std::int64_t* lo,
                                      const std::int64_t* hi, float* dq_sum, float* dk_sum, float* dv_sum,
                                      BackwardScratchBf16& scratch, int thread) {
  const Hull hull = hull_of(tile.rows, lo, hi);
  if (hull.width() == 0) return 0;
  const std::int64_t d = g.d, ldq = tile.q_step * d, ldk = tile.k_step * d;
  const std::int64_t key_offset = (tile.k_first + hull.begin * tile.k_step) * d;
  tile_sums(g, tile, hull, lo, hi, scratch, thread,
            {dq_sum + tile.q_first * d, ldq, dk_sum + key_offset, dv_sum + key_offset, ldk});
  return attend_backward_flops(tile.rows, lo, hi, d);
}

void TileTrainingBf16::prepare(std::int64_t heads, std::int64_t tokens, std::int64_t threads, std::int64_t max_cols,
                               std::int64_t d) {
  tokens_ = tokens;
  lse_ = Tensor(Shape{heads, tokens});
  scratch_ = BackwardScratchBf16(threads, max_cols, tokens, d);
}

std::int64_t TileTrainingBf16::tracked_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t threads,
                                             std::int64_t max_cols, std::int64_t d) {
  return heads * tokens * kFloat + BackwardScratchBf16::tracked_bytes(threads, max_cols, tokens, d);
}

HeadGradsBf16 TileTrainingBf16::grads(const BackwardTensors& t, std::int64_t head, int thread) {
  const std::int64_t n = t.q.dim(2), d = t.q.dim(3), offset = head * n * d;
  return {.q = t.q.bf16_data() + offset,
          .k = t.k.bf16_data() + offset,
          .v = t.v.bf16_data() + offset,
          .out = t.out.bf16_data() + offset,
          .dout = t.dout.bf16_data() + offset,
          .lse = lse_.data() + head * tokens_,
          .delta = scratch_.delta(thread),
          .dq = t.dq.bf16_data() + offset,
          .dk = t.dk.bf16_data() + offset,
          .dv = t.dv.bf16_data() + offset,
          .dk_acc = scratch_.dk(thread),
          .dv_acc = scratch_.dv(thread),
          .window = scratch_.key_window(),
          .d = d,
          .tokens = n};
}

WindowCacheBf16::WindowCacheBf16(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim)
    : capacity_(capacity),
      d_(head_dim),
      keys_(Shape{heads, capacity, head_dim}, DType::BF16),
      values_(Shape{heads, capacity, head_dim}, DType::BF16),
      buffers_(Shape{heads, capacity + head_dim}) {}

void WindowCacheBf16::load_context(const Tensor& k, const Tensor& v, int threads) {
  const std::int64_t heads = k.dim(0) * k.dim(1), n = k.dim(2), d = d_;
  const std::int64_t kept = std::min(n, capacity_), first = n - kept;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head)
    for (std::int64_t t = first; t < n; ++t) {
      const std::int64_t slot = (head * capacity_ + t % capacity_) * d, row = (head * n + t) * d;
      std::copy_n(k.bf16_data() + row, d, keys_.bf16_data() + slot);
      std::copy_n(v.bf16_data() + row, d, values_.bf16_data() + slot);
    }
  length_ = n;
}

void WindowCacheBf16::step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t first,
                           int threads) {
  const std::int64_t heads = q.dim(0) * q.dim(1), d = d_, capacity = capacity_;
  const std::int64_t last = length_, count = last - first + 1;
  if (first > last || last - first >= capacity)
    throw std::logic_error("WindowCacheBf16: the run does not fit the window");
  // The ring's runs as WindowCache's attend_ring splits them (its FLOPs per run).
  const std::int64_t begin = first % capacity, head_run = std::min(count, capacity - begin);
  const std::int64_t flops_per_head =
      2 * d + attend_rows_flops(head_run, d) + (count > head_run ? attend_rows_flops(count - head_run, d) : 0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const auto attend_head = [&](std::int64_t head) {
    bf16* keys = keys_.bf16_data() + head * capacity * d;
    bf16* values = values_.bf16_data() + head * capacity * d;
    std::copy_n(k.bf16_data() + head * d, d, keys + last % capacity * d);
    std::copy_n(v.bf16_data() + head * d, d, values + last % capacity * d);
    float* scores = buffers_.data() + head * (capacity + d);
    float* acc = scores + capacity;
    widen(q.bf16_data() + head * d, acc, d);  // the query, widened exactly, until the scores are done
    float peak = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < count; ++j) {
      const bf16* key = keys + (j < head_run ? begin + j : j - head_run) * d;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t c = 0; c < d; ++c) dot += acc[c] * to_float(key[c]);
      scores[j] = scale * dot;
      peak = std::max(peak, scores[j]);
    }
    float sum = 0.0f;
    std::fill(acc, acc + d, 0.0f);
#pragma omp simd reduction(+ : sum)
    for (std::int64_t j = 0; j < count; ++j) sum += scores[j] = ops::fast_exp(scores[j] - peak);
    for (std::int64_t j = 0; j < count; ++j) {
      const float weight = round_to_bf16(scores[j]);
      const bf16* value = values + (j < head_run ? begin + j : j - head_run) * d;
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) acc[c] += weight * to_float(value[c]);
    }
    round_scaled(acc, 1.0f / sum, d, out.bf16_data() + head * d);
  };
  if (2 * heads * count * d >= kParallelStepFloats) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (std::int64_t head = 0; head < heads; ++head) attend_head(head);
  } else {
    for (std::int64_t head = 0; head < heads; ++head) attend_head(head);  // too small for a fork and join
  }
  FlopCounter::add(heads * flops_per_head);
  ++length_;
}

}  // namespace xfb::block_sparse
