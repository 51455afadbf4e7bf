#include "taxonomy/engines/decode_common.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels_bf16.hpp"

namespace xfb {

KvCache::KvCache(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim, DType dtype)
    : keys_(Shape{heads, capacity, head_dim}, dtype), values_(Shape{heads, capacity, head_dim}, dtype) {}

void KvCache::load_context(const Tensor& k, const Tensor& v, int threads) {
  const std::int64_t heads = k.dim(0) * k.dim(1), n = k.dim(2), d = k.dim(3), capacity = this->capacity();
  const std::int64_t kept = std::min(n, capacity), first = n - kept;
  const bool bf16_rows = keys_.dtype() == DType::BF16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head) {
    const std::int64_t row = (head * n + first) * d;
    if (bf16_rows)
      store(head, first % capacity, k.bf16_data() + row, v.bf16_data() + row, kept);
    else
      store(head, first % capacity, k.data() + row, v.data() + row, kept);
  }
}

RowSoftmax begin_row(float* acc, std::int64_t head_dim) {
  std::fill_n(acc, head_dim, 0.0f);
  RowSoftmax row;
  row.acc = acc;
  row.head_dim = head_dim;
  return row;
}

std::int64_t scale_query(const float* q, std::int64_t head_dim, float* q_scaled) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (std::int64_t c = 0; c < head_dim; ++c) q_scaled[c] = q[c] * scale;
  return head_dim;
}

std::int64_t scale_query(const bf16* q, std::int64_t head_dim, float* q_scaled) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (std::int64_t c = 0; c < head_dim; ++c) q_scaled[c] = to_float(q[c]) * scale;
  return head_dim;
}

namespace {

// Moves the row's state to the running max new_max (rescaling acc and l) and adds the chunk's
// exponentials: scores[j] := exp(scores[j] − new_max), l += Σ of them.
void absorb_scores(RowSoftmax& row, float* scores, std::int64_t count, float new_max) {
  const float factor = ops::fast_exp(row.max - new_max);  // 0 (to rounding) for the first keys
#pragma omp simd
  for (std::int64_t c = 0; c < row.head_dim; ++c) row.acc[c] *= factor;
  row.sum = row.sum * factor + ops::exp_and_sum(scores, count, new_max);
  row.max = new_max;
}

float element(float x) { return x; }
float element(bf16 x) { return to_float(x); }

// attend_rows and attend_ring on rows of T (header comment).
template <class T>
std::int64_t attend_rows_of(RowSoftmax& row, const float* q_scaled, const T* keys, const T* values, std::int64_t rows,
                            std::int64_t stride) {
  const std::int64_t d = row.head_dim, step = stride > 0 ? stride : d;
  float scores[kDecodeChunk];
  float* acc = row.acc;
  for (std::int64_t c0 = 0; c0 < rows; c0 += kDecodeChunk) {
    const std::int64_t n = std::min(kDecodeChunk, rows - c0);
    float chunk_max = -std::numeric_limits<float>::infinity();
    for (std::int64_t j = 0; j < n; ++j) {
      const T* key = keys + (c0 + j) * step;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t c = 0; c < d; ++c) dot += q_scaled[c] * element(key[c]);
      scores[j] = dot;
      chunk_max = std::max(chunk_max, dot);
    }
    absorb_scores(row, scores, n, std::max(row.max, chunk_max));
    for (std::int64_t j = 0; j < n; ++j) {
      const float p = std::is_same_v<T, bf16> && !row.fp32_probabilities ? round_to_bf16(scores[j]) : scores[j];
      const T* value = values + (c0 + j) * step;
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) acc[c] += p * element(value[c]);
    }
  }
  return attend_rows_flops(rows, d);
}

template <class T>
std::int64_t attend_ring_of(RowSoftmax& row, const float* q_scaled, const T* keys, const T* values,
                            std::int64_t capacity, std::int64_t first, std::int64_t count, std::int64_t step) {
  if (count <= 0) return 0;
  const std::int64_t d = row.head_dim, begin = first % capacity;
  const std::int64_t head_run = std::min(count, (capacity - 1 - begin) / step + 1);  // before the ring wraps
  std::int64_t flops = attend_rows_of(row, q_scaled, keys + begin * d, values + begin * d, head_run, step * d);
  if (count > head_run) {
    const std::int64_t wrapped = begin + head_run * step - capacity;
    flops += attend_rows_of(row, q_scaled, keys + wrapped * d, values + wrapped * d, count - head_run, step * d);
  }
  return flops;
}

}  // namespace

std::int64_t attend_rows(RowSoftmax& row, const float* q_scaled, const float* keys, const float* values,
                         std::int64_t rows, std::int64_t stride) {
  return attend_rows_of(row, q_scaled, keys, values, rows, stride);
}
std::int64_t attend_rows(RowSoftmax& row, const float* q_scaled, const bf16* keys, const bf16* values,
                         std::int64_t rows, std::int64_t stride) {
  return attend_rows_of(row, q_scaled, keys, values, rows, stride);
}
std::int64_t attend_ring(RowSoftmax& row, const float* q_scaled, const float* keys, const float* values,
                         std::int64_t capacity, std::int64_t first, std::int64_t count, std::int64_t step) {
  return attend_ring_of(row, q_scaled, keys, values, capacity, first, count, step);
}
std::int64_t attend_ring(RowSoftmax& row, const float* q_scaled, const bf16* keys, const bf16* values,
                         std::int64_t capacity, std::int64_t first, std::int64_t count, std::int64_t step) {
  return attend_ring_of(row, q_scaled, keys, values, capacity, first, count, step);
}

std::int64_t row_scores(const float* q, const float* rows, std::int64_t count, std::int64_t d, float scale,
                        float* scores) {
  ops::gemm(false, true, 1, count, d, scale, q, d, rows, d, 0.0f, scores, count);
  return 0;
}

std::int64_t row_scores(const float* q, const bf16* rows, std::int64_t count, std::int64_t d, float scale,
                        float* scores) {
  for (std::int64_t x = 0; x < count; ++x) {
    const bf16* row = rows + x * d;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t j = 0; j < d; ++j) dot += q[j] * to_float(row[j]);
    scores[x] = dot * scale;
  }
  return matmul_flops(1, count, d);
}

std::int64_t weigh_rows(const float* p, const float* rows, std::int64_t count, std::int64_t d, float* out) {
  ops::gemm(false, false, 1, d, count, 1.0f, p, count, rows, d, 0.0f, out, d);
  return 0;
}

std::int64_t weigh_rows(const float* p, const bf16* rows, std::int64_t count, std::int64_t d, float* out) {
  std::fill(out, out + d, 0.0f);
  for (std::int64_t x = 0; x < count; ++x) {
    if (p[x] == 0.0f) continue;
    const bf16* row = rows + x * d;
    const float weight = p[x];
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) out[j] += weight * to_float(row[j]);
  }
  return matmul_flops(1, d, count);
}

std::int64_t attend_rows_flops(std::int64_t rows, std::int64_t head_dim) {
  const std::int64_t chunks = (rows + kDecodeChunk - 1) / kDecodeChunk;
  return rows * (4 * head_dim + 4) + chunks * (head_dim + 2);
}

std::int64_t attend_block(RowSoftmax& row, const float* q_scaled, const float* keys, const float* values,
                          std::int64_t rows, float* scores) {
  if (rows == 0) return 0;
  const std::int64_t d = row.head_dim;
  ops::gemm(false, true, 1, rows, d, 1.0f, q_scaled, d, keys, d, 0.0f, scores, rows);
  absorb_scores(row, scores, rows, std::max(row.max, ops::row_max(scores, rows, scores[0])));
  ops::gemm(false, false, 1, d, rows, 1.0f, scores, rows, values, d, 1.0f, row.acc, d);
  return 4 * rows + d + 2;
}

Bf16KvCache::Bf16KvCache(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim)
    : capacity_(capacity),
      head_dim_(head_dim),
      keys_(Shape{heads, tiles::panels_for(capacity) * tiles::kPanel * head_dim}, DType::BF16),
      values_(Shape{heads, (capacity + 1) / 2 * 2 * head_dim}, DType::BF16) {}

std::int64_t Bf16KvCache::bytes(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim) {
  return heads * (tiles::panels_for(capacity) * tiles::kPanel + (capacity + 1) / 2 * 2) * head_dim *
         element_bytes(DType::BF16);
}

void Bf16KvCache::store(std::int64_t head, std::int64_t slot, const bf16* k, const bf16* v) {
  const std::int64_t d = head_dim_;
  bf16* panel = keys_.bf16_data() + head * keys_.dim(1) + slot / tiles::kPanel * d * tiles::kPanel;
  const std::int64_t lane = slot % tiles::kPanel;
  for (std::int64_t c2 = 0; c2 < d / 2; ++c2) {
    panel[(c2 * tiles::kPanel + lane) * 2] = k[2 * c2];
    panel[(c2 * tiles::kPanel + lane) * 2 + 1] = k[2 * c2 + 1];
  }
  bf16* pair = values_.bf16_data() + head * values_.dim(1) + slot / 2 * 2 * d + slot % 2;
  for (std::int64_t f = 0; f < d; ++f) pair[2 * f] = v[f];
}

void Bf16KvCache::load_context(const Tensor& k, const Tensor& v, int threads) {
  const std::int64_t heads = k.dim(0) * k.dim(1), n = k.dim(2), d = k.dim(3);
  if (n > capacity_) throw std::logic_error("Bf16KvCache: context longer than the capacity");
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head) {
    tiles::pack_key_pair_panels(k.bf16_data() + head * n * d, d, n, d, keys_.bf16_data() + head * keys_.dim(1));
    tiles::pack_row_pairs(v.bf16_data() + head * n * d, d, n, d, values_.bf16_data() + head * values_.dim(1));
  }
}

std::int64_t attend_block_bf16(RowSoftmax& row, const bf16* q, const Bf16KvCache& cache, std::int64_t head,
                               std::int64_t begin, std::int64_t rows, float* scores, bf16* probs) {
  if (rows == 0) return 0;
  const std::int64_t d = row.head_dim, panels = tiles::panels_for(rows);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  tiles::scores_bf16(q, d, 1, cache.key_panels(head) + begin * d, panels, d, scale, scores, panels * tiles::kPanel);
  const float new_max = tiles::interval_max(scores, 0, rows, row.max);
  const float factor = ops::fast_exp(row.max - new_max);
#pragma omp simd
  for (std::int64_t c = 0; c < d; ++c) row.acc[c] *= factor;
  row.sum = row.sum * factor + tiles::exp_interval(scores, 0, rows, rows, new_max);
  row.max = new_max;
  tiles::round_row(scores, rows, probs);
  if (rows % 2 == 1) probs[rows] = bf16{};
  tiles::accumulate_pv_bf16(probs, 0, 1, rows, cache.value_pairs(head) + begin * d, d, row.acc, d);
  return 4 * rows * d + 4 * rows + d + 2;
}

std::int64_t merge_rows(RowSoftmax& into, const RowSoftmax& from) {
  if (from.sum == 0.0f) return 0;  // a partial over no keys adds nothing
  const float new_max = std::max(into.max, from.max);
  const float mine = ops::fast_exp(into.max - new_max), theirs = ops::fast_exp(from.max - new_max);
#pragma omp simd
  for (std::int64_t c = 0; c < into.head_dim; ++c) into.acc[c] = into.acc[c] * mine + from.acc[c] * theirs;
  into.sum = into.sum * mine + from.sum * theirs;
  into.max = new_max;
  return 3 * into.head_dim + 7;
}

std::int64_t finish_row(const RowSoftmax& row, float* out) {
  if (row.sum == 0.0f) {
    std::fill_n(out, row.head_dim, 0.0f);
    return 0;
  }
  const float inverse = 1.0f / row.sum;
  for (std::int64_t c = 0; c < row.head_dim; ++c) out[c] = row.acc[c] * inverse;
  return row.head_dim;
}

std::int64_t finish_row(const RowSoftmax& row, bf16* out) {
  if (row.sum == 0.0f) {
    std::fill_n(out, row.head_dim, bf16{});
    return 0;
  }
  const float inverse = 1.0f / row.sum;
  for (std::int64_t c = 0; c < row.head_dim; ++c) out[c] = to_bf16(row.acc[c] * inverse);
  return row.head_dim;
}

WindowCache::WindowCache(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim)
    : cache_(heads, capacity, head_dim), buffers_(Shape{heads, 2, head_dim}) {}

void WindowCache::load_context(const Tensor& k, const Tensor& v, int threads) {
  cache_.load_context(k, v, threads);
  length_ = k.dim(2);
}

void WindowCache::step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t first,
                       int threads) {
  const std::int64_t heads = q.dim(0) * q.dim(1), d = q.dim(3), capacity = cache_.capacity();
  const std::int64_t last = length_;  // the new token
  if (first > last || last - first >= capacity) throw std::logic_error("WindowCache: the run does not fit the window");
  attend_every_head(
      q, out, buffers_, threads,
      [&](std::int64_t head, RowSoftmax& row, const float* query) {
        cache_.store(head, last % capacity, k.data() + head * d, v.data() + head * d, 1);
        return attend_ring(row, query, cache_.keys(head), cache_.values(head), capacity, first, last - first + 1);
      },
      2 * heads * (last - first + 1) * d >= kParallelStepFloats);
  ++length_;
}

}  // namespace xfb
