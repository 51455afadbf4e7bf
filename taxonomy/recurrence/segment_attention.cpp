#include "taxonomy/recurrence/segment_attention.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "lib/core/bf16.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {
namespace {

// FLOPs per visible score entry beyond the products: add the relative term, then max,
// subtract + exp, sum (the 1/sum scaling is applied to the D outputs of the row instead).
constexpr std::int64_t kFlopsPerVisibleEntry = 1 + kOnlineSoftmaxFlopsPerElement;
// Backward, per visible entry: add the relative term, then P and dS from the saved L.
constexpr std::int64_t kBackwardFlopsPerVisibleEntry = 1 + kRecomputedSoftmaxBackwardFlopsPerElement;

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// The cache after a segment of `rows` tokens (FIFO memory, compressed memory). Returns the
// number of rows evicted from the memory.
std::int64_t advance(SegmentCache& state, std::int64_t rows, const SegmentAttentionConfig& c) {
  const std::int64_t total = state.memory + rows;
  state.memory = std::min(c.memory_len, total);
  const std::int64_t evicted = total - state.memory;
  if (c.compression != Compression::None)
    state.compressed = std::min(c.compressed_len, state.compressed + ceil_div(evicted, c.rate));
  return evicted;
}

struct Sizes {
  std::int64_t segment, context, rows, block, relative;  // L clamped to N, W, W + L, tile rows, n_rel
};

Sizes sizes_of(const Problem& p, const SegmentAttentionConfig& c) {
  Sizes s{};
  s.segment = std::min(c.segment_len, p.seq_len);
  s.context = c.compressed_len + c.memory_len;
  s.rows = s.context + s.segment;
  s.block = std::min(c.block_q, s.segment);
  s.relative = p.causal ? s.rows : s.rows + s.segment - 1;
  return s;
}

// FLOPs of one query tile: rows r0 … r0 + rows − 1 of a segment of `segment_rows` tokens that
// sees `context` valid cache slots.
std::int64_t tile_flops(const Problem& p, std::int64_t context, std::int64_t r0, std::int64_t rows,
                        std::int64_t segment_rows) {
  const std::int64_t d = p.head_dim;
  const std::int64_t cols = context + (p.causal ? r0 + rows : segment_rows);
  const std::int64_t relative = p.causal ? cols : cols + rows - 1;
  const std::int64_t visible = p.causal ? rows * (context + r0) + rows * (rows + 1) / 2 : rows * cols;
  return matmul_flops(rows, cols, d) + matmul_flops(rows, relative, d) + matmul_flops(rows, d, cols) + 3 * rows * d +
         kFlopsPerVisibleEntry * visible;
}

// row[x] = exp(row[x] + relative[x] − max) for x < valid; the rest of the row up to cols becomes
// 0. Returns 1 / (sum of the exponentials); with `lse`, also writes max + log(sum) there.
float add_relative_and_exponentiate(float* row, const float* relative, std::int64_t valid, std::int64_t cols,
                                    float* lse) {
#pragma omp simd
  for (std::int64_t x = 0; x < valid; ++x) row[x] += relative[x];
  const float peak = ops::row_max(row, valid, -std::numeric_limits<float>::infinity());
  const float sum = ops::exp_and_sum(row, valid, peak);
  std::fill(row + valid, row + cols, 0.0f);
  if (lse != nullptr) *lse = peak + std::log(sum);
  return 1.0f / sum;
}

// The bf16 form's slots: each compressed slot rounded to bf16 once, as the compressed memory keeps it.
void round_slots(float* slots, std::int64_t count) {
#pragma omp simd
  for (std::int64_t i = 0; i < count; ++i) slots[i] = round_to_bf16(slots[i]);
}

}  // namespace

std::int64_t compress_rows(Compression f, const float* rows, std::int64_t count, std::int64_t d, std::int64_t rate,
                           const float* conv_weights, float* out) {
  const std::int64_t full = count / rate, rest = count % rate;
  if (f == Compression::Conv) {
    if (full > 0) ops::gemm(false, false, full, d, rate * d, 1.0f, rows, rate * d, conv_weights, d, 0.0f, out, d);
    if (rest > 0)
      ops::gemm(false, false, 1, d, rest * d, 1.0f, rows + full * rate * d, rest * d, conv_weights, d, 0.0f,
                out + full * d, d);
    return 0;
  }
  std::int64_t flops = 0;
  for (std::int64_t g = 0; g * rate < count; ++g) {
    const float* group = rows + g * rate * d;
    const std::int64_t members = std::min(rate, count - g * rate);
    float* dst = out + g * d;
    std::copy(group, group + d, dst);
    for (std::int64_t t = 1; t < members; ++t) {
      const float* src = group + t * d;
      if (f == Compression::MaxPool) {
#pragma omp simd
        for (std::int64_t j = 0; j < d; ++j) dst[j] = std::max(dst[j], src[j]);
      } else {
#pragma omp simd
        for (std::int64_t j = 0; j < d; ++j) dst[j] += src[j];
      }
    }
    if (f == Compression::MeanPool) {
      const float inverse = 1.0f / static_cast<float>(members);
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) dst[j] *= inverse;
      flops += members * d;
    } else {
      flops += (members - 1) * d;
    }
  }
  return flops;
}

std::int64_t compress_flops(Compression f, std::int64_t count, std::int64_t d, std::int64_t rate) {
  switch (f) {
    case Compression::Conv:
      return 2 * count * d * d;
    case Compression::MaxPool:
      return (count - ceil_div(count, rate)) * d;
    case Compression::MeanPool:
      return count * d;
    case Compression::None:
      break;
  }
  return 0;
}

SegmentAttention::SegmentAttention(const Problem& problem, const SegmentAttentionConfig& config, std::uint64_t seed)
    : p_(problem), c_(config), seed_(seed) {}

void SegmentAttention::prepare(const Tensor&, const Tensor&, const Tensor&) {
  const Sizes s = sizes_of(p_, c_);
  const std::int64_t h = p_.heads, d = p_.head_dim, d_r = h * d, threads = p_.threads;
  segment_ = s.segment;
  context_ = s.context;
  rows_ = s.rows;
  delta_max_ = s.rows - 1;

  bias_u_ = Tensor(Shape{h, d});
  bias_v_ = Tensor(Shape{h, d});
  w_r_ = Tensor(Shape{h, d_r, d});
  CounterRng(seed_, c_.model + "/pos_bias_u").fill_normal(bias_u_, 0.0f, 0.5f);
  CounterRng(seed_, c_.model + "/pos_bias_v").fill_normal(bias_v_, 0.0f, 0.5f);
  CounterRng(seed_, c_.model + "/w_r").fill_normal(w_r_, 0.0f, 1.0f / std::sqrt(static_cast<float>(d_r)));
  build_relative_table(s.relative);
  if (c_.compression == Compression::Conv) {
    conv_weights_ = Tensor(Shape{2, h, c_.rate * d, d});
    CounterRng(seed_, c_.model + "/conv_weights")
        .fill_normal(conv_weights_, 0.0f, 1.0f / std::sqrt(static_cast<float>(c_.rate * d)));
  }
  if (c_.compression != Compression::None) compressed_slots_ = Tensor(Shape{threads, ceil_div(s.segment, c_.rate), d});

  windows_ = Tensor(Shape{2, p_.batch * h, s.rows, d}, p_.dtype);
  if (p_.dtype == DType::BF16) widened_ = Tensor(Shape{threads, 2 * s.rows * d + 2 * s.block * d});
  biased_queries_ = Tensor(Shape{threads, 2, s.block, d});
  scores_ = Tensor(Shape{threads, s.block, ops::padded_ld(s.rows)});
  relative_scores_ = Tensor(Shape{threads, s.block, ops::padded_ld(s.rows + s.block - 1)});
}

// Table row t holds δ = delta_max_ − t; the causal forward's δ_max is its window's last row.
void SegmentAttention::build_relative_table(std::int64_t rows) {
  const std::int64_t h = p_.heads, d = p_.head_dim, d_r = h * d;
  sinusoid_ = Tensor();
  relative_keys_ = Tensor();  // released first: the new tables never coexist with the old
  sinusoid_ = Tensor(Shape{rows, d_r});
  for (std::int64_t t = 0; t < rows; ++t)
    for (std::int64_t k = 0; k < d_r; ++k) {
      const double omega = std::pow(10000.0, -static_cast<double>(k - k % 2) / static_cast<double>(d_r));
      const double angle = static_cast<double>(delta_max_ - t) * omega;
      sinusoid_[t * d_r + k] = static_cast<float>(k % 2 == 0 ? std::sin(angle) : std::cos(angle));
    }
  relative_keys_ = Tensor(Shape{h, rows, d});
  for (std::int64_t head = 0; head < h; ++head)
    ops::gemm(false, false, rows, d, d_r, 1.0f, sinusoid_.data(), d_r, w_r_.data() + head * d_r * d, d, 0.0f,
              relative_keys_.data() + head * rows * d, d);
}

void SegmentAttention::prepare_decode(std::int64_t tokens) {
  if (!p_.causal) throw std::logic_error("SegmentAttention: decoding needs a causal problem");
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim;
  decode_segment_ = std::min(c_.segment_len, p_.seq_len + tokens);
  const std::int64_t rows = context_ + decode_segment_;
  if (rows > relative_keys_.dim(1)) {  // a context shorter than L: the segment grows past it
    delta_max_ = rows - 1;
    build_relative_table(rows);
  }
  if (c_.compression != Compression::None && ceil_div(decode_segment_, c_.rate) > compressed_slots_.dim(1)) {
    compressed_slots_ = Tensor();
    compressed_slots_ = Tensor(Shape{p_.threads, ceil_div(decode_segment_, c_.rate), d});
  }
  if (p_.dtype == DType::BF16 && decode_segment_ * d > widened_.dim(1)) {  // the update widens ≤ L_dec rows
    widened_ = Tensor();
    widened_ = Tensor(Shape{p_.threads, decode_segment_ * d});
  }
  decode_windows_ = Tensor(Shape{2, heads, rows, d}, p_.dtype);
  decode_scores_ = Tensor(Shape{heads, 2, ops::padded_ld(rows)});
  decode_queries_ = Tensor(Shape{heads, 2, d});
}

template <class T>
void SegmentAttention::load_decode_context(const Tensor& k, const Tensor& v) {
  const std::int64_t n = p_.seq_len, segment = decode_segment_, complete = n / segment * segment;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1)
  for (std::int64_t bh = 0; bh < p_.batch * p_.heads; ++bh) {
    T* const win[2] = {decode_window<T>(false, bh), decode_window<T>(true, bh)};
    SegmentCache cache;
    for (std::int64_t s0 = 0; s0 <= complete; s0 += segment) {
      copy_segment(k, v, win, bh, s0, std::min(segment, n - s0));
      if (s0 == complete) break;  // the open segment (possibly empty) stays in the window
      update_memory(win, bh % p_.heads, segment, cache, omp_get_thread_num());
      advance(cache, segment, c_);
    }
  }
  decode_cache_ = {};
  for (std::int64_t s0 = 0; s0 < complete; s0 += segment) advance(decode_cache_, segment, c_);
  decode_filled_ = n - complete;
}

void SegmentAttention::decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (p_.dtype == DType::BF16) return decode_rows<bf16>(q, k, v, out);
  decode_rows<float>(q, k, v, out);
}

template <class T>
void SegmentAttention::decode_rows(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, segment = decode_segment_;
  std::int64_t flops = 0;
  if (decode_filled_ == segment) {  // the previous token closed a segment: the FIFO update
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      T* const win[2] = {decode_window<T>(false, bh), decode_window<T>(true, bh)};
      flops += update_memory(win, bh % p_.heads, segment, decode_cache_, omp_get_thread_num());
    }
    advance(decode_cache_, segment, c_);
    decode_filled_ = 0;
    stage_clock::lap("memory_update");
  }
  const std::int64_t row = context_ + decode_filled_;
  const std::int64_t lo = context_ - decode_cache_.memory - decode_cache_.compressed, cols = row - lo + 1;
  const std::int64_t table_rows = relative_keys_.dim(1), first_table_row = delta_max_ - row + lo;
  const std::int64_t ld = decode_scores_.dim(2);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
  for (std::int64_t bh = 0; bh < heads; ++bh) {
    T* const win[2] = {decode_window<T>(false, bh), decode_window<T>(true, bh)};
    std::copy_n(elements<T>(k) + bh * d, d, win[0] + row * d);
    std::copy_n(elements<T>(v) + bh * d, d, win[1] + row * d);
    const std::int64_t head = bh % p_.heads;
    const T* query = elements<T>(q) + bh * d;
    float* with_u = decode_queries_.data() + bh * 2 * d;
    float* with_v = with_u + d;
    for (std::int64_t j = 0; j < d; ++j) {
      with_u[j] = as_float(query[j]) + bias_u_[head * d + j];
      with_v[j] = as_float(query[j]) + bias_v_[head * d + j];
    }
    float* scores = decode_scores_.data() + bh * 2 * ld;
    float* relative = scores + ld;
    flops += row_scores(with_u, win[0] + lo * d, cols, d, scale, scores);
    ops::gemm(false, true, 1, cols, d, scale, with_v, d,
              relative_keys_.data() + (head * table_rows + first_table_row) * d, d, 0.0f, relative, ld);
    const float inverse = add_relative_and_exponentiate(scores, relative, cols, cols, nullptr);
    float* weighted = with_u;  // q + u is no longer needed
    flops += weigh_rows(scores, win[1] + lo * d, cols, d, weighted);
    T* dst = elements<T>(out) + bh * d;
    for (std::int64_t j = 0; j < d; ++j) dst[j] = stored<T>(weighted[j] * inverse);
    flops += 3 * d + kFlopsPerVisibleEntry * cols;
  }
  FlopCounter::add(flops);
  ++decode_filled_;
  stage_clock::lap("attend");
}

void SegmentAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  // Segments are sequential per (batch, head). With at least one (batch, head) per thread each
  // thread runs whole heads without synchronisation; otherwise the threads share each segment's
  // query tiles and meet at the memory update.
  const bool per_head = p_.batch * p_.heads >= p_.threads, bf16_form = p_.dtype == DType::BF16;
  if (bf16_form)
    FlopCounter::add(per_head ? run_heads<bf16>(q, k, v, out) : run_lockstep<bf16>(q, k, v, out));
  else
    FlopCounter::add(per_head ? run_heads<float>(q, k, v, out) : run_lockstep<float>(q, k, v, out));
  cache_ = {};
  for (std::int64_t s0 = 0; s0 < p_.seq_len; s0 += segment_) advance(cache_, std::min(segment_, p_.seq_len - s0), c_);
  if (decode_windows_.empty()) return;
  if (bf16_form)
    load_decode_context<bf16>(k, v);
  else
    load_decode_context<float>(k, v);
}

template <class T>
std::int64_t SegmentAttention::run_heads(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, block = biased_queries_.dim(2);
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t bh = 0; bh < p_.batch * p_.heads; ++bh) {
    const int thread = omp_get_thread_num();
    T* const win[2] = {window<T>(false, bh), window<T>(true, bh)};
    SegmentCache cache;
    for (std::int64_t s0 = 0; s0 < n; s0 += segment_) {
      const std::int64_t segment_rows = std::min(segment_, n - s0);
      copy_segment(k, v, win, bh, s0, segment_rows);
      for (std::int64_t r0 = 0; r0 < segment_rows; r0 += block) {
        const std::int64_t offset = (bh * n + s0 + r0) * d;
        flops += attend_tile<T>(elements<T>(q) + offset, elements<T>(out) + offset, saved_lse(bh, s0 + r0), win,
                                bh % p_.heads, r0, segment_rows, cache, thread);
      }
      flops += update_memory(win, bh % p_.heads, segment_rows, cache, thread);
      advance(cache, segment_rows, c_);
    }
  }
  return flops;
}

template <class T>
std::int64_t SegmentAttention::run_lockstep(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, bh_count = p_.batch * p_.heads;
  const std::int64_t block = biased_queries_.dim(2);
  SegmentCache cache;
  std::int64_t flops = 0;
  for (std::int64_t s0 = 0; s0 < n; s0 += segment_) {
    const std::int64_t segment_rows = std::min(segment_, n - s0), tiles = ceil_div(segment_rows, block);
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for
      for (std::int64_t bh = 0; bh < bh_count; ++bh) {
        T* const win[2] = {window<T>(false, bh), window<T>(true, bh)};
        copy_segment(k, v, win, bh, s0, segment_rows);
      }
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < bh_count * tiles; ++task) {
        const std::int64_t bh = task / tiles;
        // Causal tiles late in the segment see more keys: start them first.
        const std::int64_t tile = p_.causal ? tiles - 1 - task % tiles : task % tiles;
        const std::int64_t offset = (bh * n + s0 + tile * block) * d;
        const T* const win[2] = {window<T>(false, bh), window<T>(true, bh)};
        flops += attend_tile<T>(elements<T>(q) + offset, elements<T>(out) + offset, saved_lse(bh, s0 + tile * block),
                                win, bh % p_.heads, tile * block, segment_rows, cache, thread);
      }
#pragma omp for
      for (std::int64_t bh = 0; bh < bh_count; ++bh) {
        T* const win[2] = {window<T>(false, bh), window<T>(true, bh)};
        flops += update_memory(win, bh % p_.heads, segment_rows, cache, thread);
      }
    }
    advance(cache, segment_rows, c_);
  }
  return flops;
}

std::vector<NamedTensor> SegmentAttention::parameters() const {
  std::vector<NamedTensor> list{{"pos_bias_u", &bias_u_},
                                {"pos_bias_v", &bias_v_},
                                {"w_r", &w_r_},
                                {"sinusoid", &sinusoid_},
                                {"relative_keys", &relative_keys_}};
  if (c_.compression == Compression::Conv) list.push_back({"conv_weights", &conv_weights_});
  return list;
}

template <class T>
void SegmentAttention::copy_segment(const Tensor& k, const Tensor& v, T* const* win, std::int64_t bh, std::int64_t s0,
                                    std::int64_t rows) const {
  const std::int64_t d = p_.head_dim, offset = (bh * p_.seq_len + s0) * d;
  const Tensor* inputs[2] = {&k, &v};
  for (int t = 0; t < 2; ++t) {
    if (inputs[t]->dtype() == DType::BF16)
      convert(inputs[t]->bf16_data() + offset, win[t] + context_ * d, rows * d);
    else
      convert(inputs[t]->data() + offset, win[t] + context_ * d, rows * d);
  }
}

SegmentAttention::TileGeometry SegmentAttention::tile_geometry(std::int64_t r0, std::int64_t segment_rows,
                                                               const SegmentCache& cache) const {
  TileGeometry t{};
  t.r0 = r0;
  t.rows = std::min(biased_queries_.dim(2), segment_rows - r0);
  t.lo = context_ - cache.memory - cache.compressed;
  t.cols = (p_.causal ? context_ + r0 + t.rows : context_ + segment_rows) - t.lo;
  t.relative = p_.causal ? t.cols : t.cols + t.rows - 1;
  t.first_table_row = delta_max_ - (context_ + r0 + t.rows - 1 - t.lo);
  return t;
}

std::int64_t SegmentAttention::valid_columns(const TileGeometry& t, std::int64_t r) const {
  return p_.causal ? context_ - t.lo + t.r0 + r + 1 : t.cols;
}

// q + u and q + v of a tile's rows into the thread's biased-query buffers; then the content and
// relative score products (scaled by 1/√D) into the thread's score tiles.
void SegmentAttention::tile_scores(const float* q, const float* keys, std::int64_t head, const TileGeometry& t,
                                   int thread) {
  const std::int64_t d = p_.head_dim, block = biased_queries_.dim(2);
  float* with_u = biased_queries_.data() + thread * 2 * block * d;
  float* with_v = with_u + block * d;
  const float* u = bias_u_.data() + head * d;
  const float* v = bias_v_.data() + head * d;
  for (std::int64_t r = 0; r < t.rows; ++r)
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) {
      with_u[r * d + j] = q[r * d + j] + u[j];
      with_v[r * d + j] = q[r * d + j] + v[j];
    }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int64_t ld = scores_.dim(2), ld_relative = relative_scores_.dim(2);
  ops::gemm(false, true, t.rows, t.cols, d, scale, with_u, d, keys + t.lo * d, d, 0.0f,
            scores_.data() + thread * block * ld, ld);
  ops::gemm(false, true, t.rows, t.relative, d, scale, with_v, d,
            relative_keys_.data() + (head * relative_keys_.dim(1) + t.first_table_row) * d, d, 0.0f,
            relative_scores_.data() + thread * block * ld_relative, ld_relative);
}

// Rows r0 … r0 + rows − 1 of the current segment for one (batch, head); q and out point at row r0
// (and lse, when given). Score column x is window row lo + x; the relative term of (r, x) is
// column rows − 1 − r + x of the relative product, whose column y holds distance δ_hi − y (δ_hi:
// row r0 + rows − 1, column 0).
template <class T>
std::int64_t SegmentAttention::attend_tile(const T* q, T* out, float* lse, const T* const* win, std::int64_t head,
                                           std::int64_t r0, std::int64_t segment_rows, const SegmentCache& cache,
                                           int thread) {
  const TileGeometry t = tile_geometry(r0, segment_rows, cache);
  if constexpr (std::is_same_v<T, float>) {
    return attend_tile_rows(q, out, lse, win, head, t, thread);
  } else {  // the tile's visible window rows, its queries and its output in fp32
    const std::int64_t d = p_.head_dim, block = biased_queries_.dim(2);
    float* keys = tile_window(thread);
    float* values = keys + rows_ * d;
    float* queries = values + rows_ * d;
    float* outputs = queries + block * d;
    widen(win[0] + t.lo * d, keys + t.lo * d, t.cols * d);
    widen(win[1] + t.lo * d, values + t.lo * d, t.cols * d);
    widen(q, queries, t.rows * d);
    const float* const widened[2] = {keys, values};
    const std::int64_t flops = attend_tile_rows(queries, outputs, lse, widened, head, t, thread);
    narrow(outputs, out, t.rows * d);
    return flops;
  }
}

std::int64_t SegmentAttention::attend_tile_rows(const float* q, float* out, float* lse, const float* const* win,
                                                std::int64_t head, const TileGeometry& t, int thread) {
  const std::int64_t d = p_.head_dim, block = biased_queries_.dim(2);
  tile_scores(q, win[0], head, t, thread);
  const std::int64_t ld = scores_.dim(2), ld_relative = relative_scores_.dim(2);
  float* scores = scores_.data() + thread * block * ld;
  const float* relative_scores = relative_scores_.data() + thread * block * ld_relative;
  std::int64_t visible = 0;
  float* inverse_sums = biased_queries_.data() + thread * 2 * block * d;  // q + u is no longer needed
  for (std::int64_t r = 0; r < t.rows; ++r) {
    const std::int64_t valid = valid_columns(t, r);
    inverse_sums[r] = add_relative_and_exponentiate(scores + r * ld, relative_scores + r * ld_relative + t.rows - 1 - r,
                                                    valid, t.cols, lse != nullptr ? lse + r : nullptr);
    visible += valid;
  }
  ops::gemm(false, false, t.rows, d, t.cols, 1.0f, scores, ld, win[1] + t.lo * d, d, 0.0f, out, d);
  for (std::int64_t r = 0; r < t.rows; ++r)
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) out[r * d + j] *= inverse_sums[r];
  return 3 * t.rows * d + kFlopsPerVisibleEntry * visible;
}

// FIFO update of one (batch, head) after a segment of `segment_rows` tokens; compresses the
// evicted rows first. Returns the non-gemm FLOPs executed.
template <class T>
std::int64_t SegmentAttention::update_memory(T* const* win, std::int64_t head, std::int64_t segment_rows,
                                             const SegmentCache& cache, int thread) {
  const std::int64_t d = p_.head_dim;
  const std::int64_t total = cache.memory + segment_rows;
  const std::int64_t kept = std::min(c_.memory_len, total), evicted = total - kept;
  std::int64_t flops = 0;
  for (bool values : {false, true}) {
    T* rows = win[values ? 1 : 0];
    if (c_.compression != Compression::None && evicted > 0) {
      float* slots = compressed_slots_.data() + thread * compressed_slots_.dim(1) * d;
      const float* weights = c_.compression == Compression::Conv
                                 ? conv_weights_.data() + ((values ? p_.heads : 0) + head) * c_.rate * d * d
                                 : nullptr;
      const float* oldest = fp32_rows(rows, context_ - cache.memory, evicted, d,
                                      std::is_same_v<T, float> ? nullptr : tile_window(thread));
      flops += compress_rows(c_.compression, oldest, evicted, d, c_.rate, weights, slots);
      const std::int64_t count = ceil_div(evicted, c_.rate);
      if (p_.dtype == DType::BF16) round_slots(slots, count * d);  // also on the backward's fp32 replay
      push_compressed(rows, slots, count, cache.compressed);
    }
    std::memmove(rows + (context_ - kept) * d, rows + (context_ + segment_rows - kept) * d,
                 static_cast<std::size_t>(kept * d) * sizeof(T));
  }
  return flops;
}

// Appends `count` slots to the compressed memory of one window, which holds `valid` slots,
// keeping the newest n_cm.
template <class T>
void SegmentAttention::push_compressed(T* window, const float* slots, std::int64_t count, std::int64_t valid) const {
  const std::int64_t d = p_.head_dim, capacity = c_.compressed_len;
  const std::int64_t length = std::min(capacity, valid + count);
  const std::int64_t fresh = std::min(count, length), kept = length - fresh;
  std::memmove(window + (capacity - length) * d, window + (capacity - kept) * d,
               static_cast<std::size_t>(kept * d) * sizeof(T));
  convert(slots + (count - fresh) * d, window + (capacity - fresh) * d, fresh * d);
}

void SegmentAttention::prepare_backward() {
  const Sizes s = sizes_of(p_, c_);
  const std::int64_t h = p_.heads, d = p_.head_dim, threads = p_.threads;
  lse_ = Tensor(Shape{p_.batch * h, p_.seq_len});
  replay_windows_ = Tensor(Shape{threads, 2, s.rows, d});
  bias_u_grads_ = Tensor(Shape{h, d});
  bias_v_grads_ = Tensor(Shape{h, d});
  relative_key_grads_ = Tensor(Shape{h, s.relative, d});
  w_r_grads_ = Tensor(Shape{h, h * d, d});
  score_grads_ = Tensor(Shape{threads, s.block, ops::padded_ld(s.rows)});
  relative_grads_ = Tensor(Shape{threads, s.block, ops::padded_ld(s.rows + s.block - 1)});
  query_grads_ = Tensor(Shape{threads, 2, s.block, d});
  if (p_.dtype == DType::BF16) widened_segments_ = Tensor(Shape{threads, 6, s.segment, d});
  if (c_.compression == Compression::Conv) conv_grads_ = Tensor(Shape{2, h, c_.rate * d, d});
  if (c_.aux_loss) {
    const std::int64_t slots = ceil_div(s.segment, c_.rate);
    reconstruction_slots_ = Tensor(Shape{threads, 4, slots, d});
    reconstruction_scores_ =
        Tensor(Shape{threads, s.segment * ops::padded_ld(s.segment) + 2 * s.segment * ops::padded_ld(slots)});
    reconstruction_outputs_ = Tensor(Shape{threads, 2, s.segment, d});
  }
}

std::vector<NamedTensor> SegmentAttention::parameter_gradients() const {
  std::vector<NamedTensor> list{
      {"dpos_bias_u", &bias_u_grads_}, {"dpos_bias_v", &bias_v_grads_}, {"dw_r", &w_r_grads_}};
  if (c_.compression == Compression::Conv) list.push_back({"dconv_weights", &conv_grads_});
  return list;
}

std::string SegmentAttention::gradient_note() const {
  std::string note = "memory of earlier segments under stop-gradient (no gradient into cached keys and values)";
  if (c_.compression == Compression::Conv)
    note += c_.aux_loss ? "; conv weights trained by the attention-reconstruction loss alone"
                        : "; conv weights get no gradient (aux_loss=off)";
  return note;
}

void SegmentAttention::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const Grads g{q, k, v, out, dout, dq, dk, dv};
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t head = 0; head < p_.heads; ++head) flops += backward_head(g, head, omp_get_thread_num());
  FlopCounter::add(flops);
}

// Every (batch, head) of head index `head` (its u, v, W_R gradients sum over the batch): the
// forward's segments replayed in order on the thread's own windows (the caches rebuilt, compression
// included), each tile's backward, then dW_R = sinusoidᵀ·d(relative keys).
std::int64_t SegmentAttention::backward_head(const Grads& g, std::int64_t head, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, block = biased_queries_.dim(2), n_rel = relative_keys_.dim(1);
  std::fill(bias_u_grads_.data() + head * d, bias_u_grads_.data() + (head + 1) * d, 0.0f);
  std::fill(bias_v_grads_.data() + head * d, bias_v_grads_.data() + (head + 1) * d, 0.0f);
  std::fill(relative_key_grads_.data() + head * n_rel * d, relative_key_grads_.data() + (head + 1) * n_rel * d, 0.0f);
  const std::int64_t conv_size = c_.rate * d * d;
  if (!conv_grads_.empty())
    for (std::int64_t tensor = 0; tensor < 2; ++tensor)
      std::fill(conv_grads_.data() + (tensor * p_.heads + head) * conv_size,
                conv_grads_.data() + (tensor * p_.heads + head + 1) * conv_size, 0.0f);
  float* const win[2] = {replay_windows_.data() + thread * 2 * rows_ * d,
                         replay_windows_.data() + (thread * 2 + 1) * rows_ * d};
  std::int64_t flops = 0;
  for (std::int64_t b = 0; b < p_.batch; ++b) {
    const std::int64_t bh = b * p_.heads + head;
    if (g.dk.dtype() == DType::F32) {  // fp32: the tiles accumulate into dK, dV themselves
      std::fill(g.dk.data() + bh * n * d, g.dk.data() + (bh + 1) * n * d, 0.0f);
      std::fill(g.dv.data() + bh * n * d, g.dv.data() + (bh + 1) * n * d, 0.0f);
    }
    SegmentCache cache;
    for (std::int64_t s0 = 0; s0 < n; s0 += segment_) {
      const std::int64_t segment_rows = std::min(segment_, n - s0);
      const SegmentRows rows = segment_view(g, bh, s0, segment_rows, thread);
      copy_segment(g.k, g.v, win, bh, s0, segment_rows);
      for (std::int64_t r0 = 0; r0 < segment_rows; r0 += block)
        flops += tile_backward(rows, win, head, tile_geometry(r0, segment_rows, cache), thread);
      if (c_.aux_loss) flops += reconstruction_backward(rows, win, head, segment_rows, cache, thread);
      store_segment_gradients(rows, g, bh, s0, segment_rows);
      flops += update_memory(win, head, segment_rows, cache, thread);
      advance(cache, segment_rows, c_);
    }
  }
  const std::int64_t d_r = p_.heads * d;
  ops::gemm(true, false, d_r, d, n_rel, 1.0f, sinusoid_.data(), d_r, relative_key_grads_.data() + head * n_rel * d, d,
            0.0f, w_r_grads_.data() + head * d_r * d, d);
  return flops;
}

SegmentAttention::SegmentRows SegmentAttention::segment_view(const Grads& g, std::int64_t bh, std::int64_t s0,
                                                             std::int64_t rows, int thread) {
  const std::int64_t d = p_.head_dim, at = (bh * p_.seq_len + s0) * d;
  const float* lse = lse_.data() + bh * p_.seq_len + s0;
  if (g.q.dtype() == DType::F32)
    return {g.q.data() + at,  g.out.data() + at, g.dout.data() + at, lse,
            g.dq.data() + at, g.dk.data() + at,  g.dv.data() + at};
  float* buffers = widened_segments_.data() + thread * widened_segments_.dim(1) * widened_segments_.dim(2) * d;
  const std::int64_t stride = widened_segments_.dim(2) * d;
  const Tensor* inputs[3] = {&g.q, &g.out, &g.dout};
  widen_spans(inputs, at, rows * d, buffers, stride);
  std::fill(buffers + 4 * stride, buffers + 4 * stride + 2 * stride, 0.0f);  // dK, dV accumulate
  return {buffers,
          buffers + stride,
          buffers + 2 * stride,
          lse,
          buffers + 3 * stride,
          buffers + 4 * stride,
          buffers + 5 * stride};
}

// bf16: the segment's dQ, dK, dV rounded into the gradient tensors (fp32: written in place already).
void SegmentAttention::store_segment_gradients(const SegmentRows& s, const Grads& g, std::int64_t bh, std::int64_t s0,
                                               std::int64_t rows) const {
  if (g.dq.dtype() == DType::F32) return;
  const std::int64_t at = (bh * p_.seq_len + s0) * p_.head_dim, count = rows * p_.head_dim;
  narrow(s.dq, g.dq.bf16_data() + at, count);
  narrow(s.dk, g.dk.bf16_data() + at, count);
  narrow(s.dv, g.dv.bf16_data() + at, count);
}

// The backward of one query tile of segment s0 (FlashAttention-2 recomputation from the saved L):
// P = exp(A − L), dS = P ⊙ (dO·Vᵀ − δ); dQ = (dS·K + dS_rel·R)/√D with dS_rel the relative layout
// of dS; du, dv (biases) sum those two parts over the rows; dK, dV only for the current segment's
// columns (the cached memory is a constant: stop-gradient); d(relative keys) += dS_relᵀ·(q + v)/√D.
std::int64_t SegmentAttention::tile_backward(const SegmentRows& s, const float* const* win, std::int64_t head,
                                             const TileGeometry& t, int thread) {
  const std::int64_t d = p_.head_dim, block = biased_queries_.dim(2);
  const std::int64_t n_rel = relative_keys_.dim(1), at = t.r0 * d;
  tile_scores(s.q + at, win[0], head, t, thread);
  const std::int64_t ld = scores_.dim(2), ld_relative = relative_scores_.dim(2);
  float* p = scores_.data() + thread * block * ld;
  const float* relative = relative_scores_.data() + thread * block * ld_relative;
  float* ds = score_grads_.data() + thread * block * ld;
  float* ds_relative = relative_grads_.data() + thread * block * ld_relative;
  const float* with_u = biased_queries_.data() + thread * 2 * block * d;
  const float* with_v = with_u + block * d;
  const float* lse = s.lse + t.r0;
  const float* dout = s.dout + at;
  ops::gemm(false, true, t.rows, t.cols, d, 1.0f, dout, d, win[1] + t.lo * d, d, 0.0f, ds, ld);
  std::int64_t visible = 0;
  for (std::int64_t r = 0; r < t.rows; ++r) {
    const std::int64_t valid = valid_columns(t, r);
    const float* o = s.out + at + r * d;
    float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
    for (std::int64_t j = 0; j < d; ++j) delta += o[j] * dout[r * d + j];
    float* p_row = p + r * ld;
    float* ds_row = ds + r * ld;
    const float* relative_row = relative + r * ld_relative + t.rows - 1 - r;
#pragma omp simd
    for (std::int64_t x = 0; x < valid; ++x) {
      p_row[x] = ops::fast_exp(p_row[x] + relative_row[x] - lse[r]);
      ds_row[x] = p_row[x] * (ds_row[x] - delta);
    }
    std::fill(p_row + valid, p_row + t.cols, 0.0f);
    std::fill(ds_row + valid, ds_row + t.cols, 0.0f);
    float* ds_relative_row = ds_relative + r * ld_relative;
    std::fill(ds_relative_row, ds_relative_row + t.relative, 0.0f);
    std::copy(ds_row, ds_row + valid, ds_relative_row + t.rows - 1 - r);
    visible += valid;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int64_t first_segment_column = context_ - t.lo, segment_columns = t.cols - first_segment_column;
  float* dk = s.dk;
  float* dv = s.dv;
  ops::gemm(true, false, segment_columns, d, t.rows, 1.0f, p + first_segment_column, ld, dout, d, 1.0f, dv, d);
  ops::gemm(true, false, segment_columns, d, t.rows, scale, ds + first_segment_column, ld, with_u, d, 1.0f, dk, d);
  float* content = query_grads_.data() + thread * 2 * block * d;
  float* positional = content + block * d;
  const float* relative_keys = relative_keys_.data() + (head * n_rel + t.first_table_row) * d;
  ops::gemm(false, false, t.rows, d, t.cols, scale, ds, ld, win[0] + t.lo * d, d, 0.0f, content, d);
  ops::gemm(false, false, t.rows, d, t.relative, scale, ds_relative, ld_relative, relative_keys, d, 0.0f, positional,
            d);
  ops::gemm(true, false, t.relative, d, t.rows, scale, ds_relative, ld_relative, with_v, d, 1.0f,
            relative_key_grads_.data() + (head * n_rel + t.first_table_row) * d, d);
  float* dq = s.dq + at;
  float* du = bias_u_grads_.data() + head * d;
  float* dv_bias = bias_v_grads_.data() + head * d;
  for (std::int64_t r = 0; r < t.rows; ++r)
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) {
      dq[r * d + j] = content[r * d + j] + positional[r * d + j];
      du[j] += content[r * d + j];
      dv_bias[j] += positional[r * d + j];
    }
  return 7 * t.rows * d + kBackwardFlopsPerVisibleEntry * visible;
}

// The attention-reconstruction loss of one segment that evicts rows (the paper's L_attn for this
// head): a = attn(Q_s, K_e, V_e), b = attn(Q_s, f_c(K_e), f_c(V_e)), loss ‖a − b‖²; its gradient
// −2(a − b) through b's attention to f_c(K_e), f_c(V_e) and into the conv weights (K_e, V_e, Q_s
// are constants to this loss). Runs before update_memory, while the evicted rows are in the window.
std::int64_t SegmentAttention::reconstruction_backward(const SegmentRows& s, const float* const* win, std::int64_t head,
                                                       std::int64_t segment_rows, const SegmentCache& cache,
                                                       int thread) {
  const std::int64_t d = p_.head_dim, rate = c_.rate;
  const std::int64_t total = cache.memory + segment_rows, evicted = total - std::min(c_.memory_len, total);
  if (evicted == 0) return 0;
  const std::int64_t slots = ceil_div(evicted, rate), capacity = reconstruction_slots_.dim(2);
  const std::int64_t ld_evicted = ops::padded_ld(segment_), ld_slots = ops::padded_ld(capacity);
  const float* rows[2] = {win[0] + (context_ - cache.memory) * d, win[1] + (context_ - cache.memory) * d};
  float* compressed[2] = {reconstruction_slots_.data() + thread * 4 * capacity * d,
                          reconstruction_slots_.data() + (thread * 4 + 1) * capacity * d};
  float* slot_grads[2] = {compressed[1] + capacity * d, compressed[1] + 2 * capacity * d};
  const float* weights[2] = {conv_weights_.data() + head * rate * d * d,
                             conv_weights_.data() + (p_.heads + head) * rate * d * d};
  for (std::int64_t t = 0; t < 2; ++t)
    compress_rows(Compression::Conv, rows[t], evicted, d, rate, weights[t], compressed[t]);
  float* evicted_scores = reconstruction_scores_.data() + thread * reconstruction_scores_.dim(1);
  float* slot_scores = evicted_scores + segment_ * ld_evicted;
  float* slot_score_grads = slot_scores + segment_ * ld_slots;
  float* target = reconstruction_outputs_.data() + thread * 2 * segment_ * d;
  float* reconstructed = target + segment_ * d;
  const float* q = s.q;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto softmax_rows = [&](float* scores, std::int64_t cols, std::int64_t ld) {
    for (std::int64_t r = 0; r < segment_rows; ++r) {
      float* row = scores + r * ld;
      const float inverse = 1.0f / ops::exp_and_sum(row, cols, ops::row_max(row, cols, row[0]));
#pragma omp simd
      for (std::int64_t x = 0; x < cols; ++x) row[x] *= inverse;
    }
    return kSoftmaxFlopsPerElement * segment_rows * cols;
  };
  ops::gemm(false, true, segment_rows, evicted, d, scale, q, d, rows[0], d, 0.0f, evicted_scores, ld_evicted);
  std::int64_t flops = softmax_rows(evicted_scores, evicted, ld_evicted);
  ops::gemm(false, false, segment_rows, d, evicted, 1.0f, evicted_scores, ld_evicted, rows[1], d, 0.0f, target, d);
  ops::gemm(false, true, segment_rows, slots, d, scale, q, d, compressed[0], d, 0.0f, slot_scores, ld_slots);
  flops += softmax_rows(slot_scores, slots, ld_slots);
  ops::gemm(false, false, segment_rows, d, slots, 1.0f, slot_scores, ld_slots, compressed[1], d, 0.0f, reconstructed,
            d);
  for (std::int64_t e = 0; e < segment_rows * d; ++e) reconstructed[e] = -2.0f * (target[e] - reconstructed[e]);
  const float* output_grads = reconstructed;
  ops::gemm(true, false, slots, d, segment_rows, 1.0f, slot_scores, ld_slots, output_grads, d, 0.0f, slot_grads[1], d);
  ops::gemm(false, true, segment_rows, slots, d, 1.0f, output_grads, d, compressed[1], d, 0.0f, slot_score_grads,
            ld_slots);
  flops += softmax_backward_rows(slot_scores, slot_score_grads, segment_rows, slots, ld_slots);
  ops::gemm(true, false, slots, d, segment_rows, scale, slot_score_grads, ld_slots, q, d, 0.0f, slot_grads[0], d);
  // f_c's backward: the weights of tap t gather row t of every group (a short last group: its taps).
  const std::int64_t full = evicted / rate, rest = evicted % rate;
  for (std::int64_t t = 0; t < 2; ++t) {
    float* conv_grads = conv_grads_.data() + (t * p_.heads + head) * rate * d * d;
    if (full > 0)
      ops::gemm(true, false, rate * d, d, full, 1.0f, rows[t], rate * d, slot_grads[t], d, 1.0f, conv_grads, d);
    if (rest > 0)
      ops::gemm(true, false, rest * d, d, 1, 1.0f, rows[t] + full * rate * d, rest * d, slot_grads[t] + full * d, d,
                1.0f, conv_grads, d);
  }
  return flops + 2 * segment_rows * d;
}

std::int64_t segment_attention_flops(const Problem& p, const SegmentAttentionConfig& c) {
  const Sizes s = sizes_of(p, c);
  SegmentCache state;
  std::int64_t per_head = 0;
  for (std::int64_t s0 = 0; s0 < p.seq_len; s0 += s.segment) {
    const std::int64_t segment_rows = std::min(s.segment, p.seq_len - s0);
    for (std::int64_t r0 = 0; r0 < segment_rows; r0 += s.block)
      per_head +=
          tile_flops(p, state.memory + state.compressed, r0, std::min(s.block, segment_rows - r0), segment_rows);
    const std::int64_t evicted = advance(state, segment_rows, c);
    per_head += 2 * compress_flops(c.compression, evicted, p.head_dim, c.rate);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t segment_attention_decode_workspace(const Problem& p, const SegmentAttentionConfig& c,
                                                std::int64_t tokens) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, segment = std::min(c.segment_len, p.seq_len + tokens);
  const std::int64_t rows = s.context + segment;
  std::int64_t floats = heads * 2 * ops::padded_ld(rows) + heads * 2 * d;
  if (rows > s.relative)
    floats += (rows - s.relative) * (p.heads * d + p.heads * d);  // sinusoid [·, d_r], relative keys
  if (c.compression != Compression::None)
    floats += p.threads * std::max<std::int64_t>(0, ceil_div(segment, c.rate) - ceil_div(s.segment, c.rate)) * d;
  if (p.dtype == DType::BF16)  // the widening scratch grows to the evicted rows of an L_dec segment
    floats += p.threads * std::max<std::int64_t>(0, segment * d - (2 * s.rows * d + 2 * s.block * d));
  return floats * static_cast<std::int64_t>(sizeof(float)) + 2 * heads * rows * d * element_bytes(p.dtype);
}

std::int64_t segment_attention_workspace(const Problem& p, const SegmentAttentionConfig& c) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t h = p.heads, d = p.head_dim, d_r = h * d, threads = p.threads;
  std::int64_t floats = 2 * h * d + h * d_r * d + s.relative * d_r + h * s.relative * d;
  if (c.compression == Compression::Conv) floats += 2 * h * c.rate * d * d;
  if (c.compression != Compression::None) floats += threads * ceil_div(s.segment, c.rate) * d;
  floats +=
      threads * (2 * s.block * d + s.block * ops::padded_ld(s.rows) + s.block * ops::padded_ld(s.rows + s.block - 1));
  if (p.dtype == DType::BF16) floats += threads * (2 * s.rows * d + 2 * s.block * d);  // tile_window
  return floats * static_cast<std::int64_t>(sizeof(float)) + 2 * p.batch * h * s.rows * d * element_bytes(p.dtype);
}

std::int64_t segment_attention_backward_flops(const Problem& p, const SegmentAttentionConfig& c) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t d = p.head_dim;
  SegmentCache state;
  std::int64_t per_head = 0;
  for (std::int64_t s0 = 0; s0 < p.seq_len; s0 += s.segment) {
    const std::int64_t segment_rows = std::min(s.segment, p.seq_len - s0), context = state.memory + state.compressed;
    for (std::int64_t r0 = 0; r0 < segment_rows; r0 += s.block) {
      const std::int64_t rows = std::min(s.block, segment_rows - r0);
      const std::int64_t segment_columns = p.causal ? r0 + rows : segment_rows, cols = context + segment_columns;
      const std::int64_t relative = p.causal ? cols : cols + rows - 1;
      const std::int64_t visible = p.causal ? rows * (context + r0) + rows * (rows + 1) / 2 : rows * cols;
      per_head += 2 * matmul_flops(rows, cols, d) + 2 * matmul_flops(segment_columns, d, rows) +
                  matmul_flops(rows, d, cols) + 3 * matmul_flops(rows, relative, d) + 7 * rows * d +
                  kBackwardFlopsPerVisibleEntry * visible;
    }
    const std::int64_t evicted = advance(state, segment_rows, c);
    per_head += 2 * compress_flops(c.compression, evicted, d, c.rate);
    if (c.aux_loss && evicted > 0) {
      const std::int64_t slots = ceil_div(evicted, c.rate);
      per_head += 4 * compress_flops(c.compression, evicted, d, c.rate) + 2 * matmul_flops(segment_rows, evicted, d) +
                  kSoftmaxFlopsPerElement * segment_rows * evicted + 5 * matmul_flops(segment_rows, slots, d) +
                  (kSoftmaxFlopsPerElement + kSoftmaxBackwardFlopsPerElement) * segment_rows * slots +
                  2 * segment_rows * d;
    }
  }
  return p.batch * p.heads * per_head + p.heads * matmul_flops(p.heads * d, d, s.relative);
}

std::int64_t segment_attention_backward_workspace(const Problem& p, const SegmentAttentionConfig& c) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t h = p.heads, d = p.head_dim, threads = p.threads;
  std::int64_t floats =
      p.batch * h * p.seq_len + threads * 2 * s.rows * d + 2 * h * d + h * s.relative * d + h * h * d * d +
      threads * (s.block * ops::padded_ld(s.rows) + s.block * ops::padded_ld(s.rows + s.block - 1) + 2 * s.block * d);
  if (c.compression == Compression::Conv) floats += 2 * h * c.rate * d * d;
  if (c.aux_loss) {
    const std::int64_t slots = ceil_div(s.segment, c.rate);
    floats += threads * (4 * slots * d + s.segment * ops::padded_ld(s.segment) + 2 * s.segment * ops::padded_ld(slots) +
                         2 * s.segment * d);
  }
  if (p.dtype == DType::BF16) floats += threads * 6 * s.segment * d;  // widened_segments_
  return floats * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace xfb
