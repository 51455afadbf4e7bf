#include "taxonomy/low_rank/long_short.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {
namespace {

constexpr std::int64_t kFloat = static_cast<std::int64_t>(sizeof(float));
constexpr float kLayerNormEps = 1e-5f;  // torch's and fairseq's LayerNorm default
// ln_backward_rows per element, as executed: moments again (4), x̂ (2), dx̂ = dy·g (1), Σdx̂ and
// Σdx̂·x̂ (3), dgain += dy·x̂ (2), dshift += dy (1); then dx = rstd·(dx̂ − mean(dx̂) − x̂·mean(dx̂·x̂))
// with x̂ and dx̂ recomputed (3), two subtracts and two multiplies (4). Not the shared
// kLayerNormBackwardFlopsPerElement (19) of ops::layer_norm_backward, whose work differs: that kernel
// keeps x̂ in a scratch [rows, cols] (no recomputation, −2) and adds dx into its output (+1); this
// one runs on one head's rows inside the caller's parallel tasks, may write dx over dy and adds
// into dgain, dshift (shared by K and V), where ops::layer_norm_backward forks its own parallel
// regions and overwrites dgamma, dbeta.
constexpr std::int64_t kLnBackwardFlopsPerElement = 20;
// Compressed rows from which a decode step attends to them as one block (attend_block: two sgemm
// calls, their overhead amortised) rather than by attend_rows' online-softmax chunks.
constexpr std::int64_t kBlockStepRows = kDecodeChunk;

// The shape of one problem's computation (see the header): G groups of L tokens compressed to R rows
// each (N' = G·L tokens compressed, C = G·R rows), and query tiles of `block` queries.
struct Geometry {
  std::int64_t n = 0, d = 0;
  bool causal = false;
  std::int64_t rank = 0, group_len = 0, groups = 0;
  std::int64_t window = 0;  // causal: the recent tokens seen; non-causal: the segment length
  std::int64_t block = 0;   // queries per tile: the causal chunk, the non-causal segment
  std::int64_t grouped() const { return groups * group_len; }  // N'
  std::int64_t compressed() const { return groups * rank; }    // C
  std::int64_t tiles() const { return (n + block - 1) / block; }
};

Geometry geometry(const Problem& p, const LongShortConfig& c) {
  // A causal tile is one chunk; a chunk longer than N is one tile of N queries (no chunk completes).
  if (p.causal)
    return {.n = p.seq_len,
            .d = p.head_dim,
            .causal = true,
            .rank = c.chunk_rank,
            .group_len = c.chunk,
            .groups = p.seq_len / c.chunk,
            .window = c.window,
            .block = std::min(c.chunk, p.seq_len)};
  return {.n = p.seq_len,
          .d = p.head_dim,
          .causal = false,
          .rank = c.rank,
          .group_len = p.seq_len,
          .groups = 1,
          .window = c.segment,
          .block = c.segment};
}

// One query tile: queries [q0, q0 + rows), compressed rows [0, comp), window keys [k0, k1).
struct Tile {
  std::int64_t q0, rows, comp, k0, k1;
  std::int64_t width() const { return comp + k1 - k0; }
};

Tile tile_of(const Geometry& g, std::int64_t index) {
  const std::int64_t q0 = index * g.block, rows = std::min(g.block, g.n - q0);
  if (g.causal) return {q0, rows, index * g.rank, std::max<std::int64_t>(0, q0 - g.window + 1), q0 + rows};
  const std::int64_t extension = std::max<std::int64_t>(g.window / 2, 1);
  return {q0, rows, g.rank, std::max<std::int64_t>(0, q0 - extension), std::min(g.n, q0 + g.window + extension)};
}

// Consecutive tiles that see the same compressed rows, whose compressed columns run as one product:
// every tile when non-causal, one tile (one chunk) when causal.
struct Span {
  std::int64_t first, last;  // tiles [first, last)
  std::int64_t q0(const Geometry& g) const { return tile_of(g, first).q0; }
  std::int64_t comp(const Geometry& g) const { return tile_of(g, first).comp; }
  std::int64_t rows(const Geometry& g) const {
    const Tile end = tile_of(g, last - 1);
    return end.q0 + end.rows - q0(g);
  }
};
std::int64_t spans(const Geometry& g) { return g.causal ? g.tiles() : 1; }
Span span_of(const Geometry& g, std::int64_t index) { return g.causal ? Span{index, index + 1} : Span{0, g.tiles()}; }
// The rows of a span's score buffer.
std::int64_t span_rows(const Geometry& g) { return g.causal ? g.block : g.n; }

std::int64_t widest_tile(const Geometry& g) {
  std::int64_t widest = 1;
  for (std::int64_t t = 0; t < g.tiles(); ++t) widest = std::max(widest, tile_of(g, t).width());
  return widest;
}

// FLOPs per (batch, head) of the projection, compression and LayerNorms (forward, and again in the
// backward): K·W_P, the softmaxes over each group, Pᵀ·K and Pᵀ·V, LN of C + C + N + N rows.
std::int64_t prep_flops(const Geometry& g) {
  const std::int64_t np = g.grouped(), r = g.rank, d = g.d;
  return matmul_flops(r, np, d) + kSoftmaxFlopsPerElement * r * np + 2 * matmul_flops(r, d, np) +
         kLayerNormFlopsPerElement * 2 * (g.compressed() + g.n) * d;
}

// A tile's forward: scores, the joint softmax with its log-sum-exp (2 per row), the value products.
std::int64_t tile_flops(const Tile& t, std::int64_t d) {
  return 2 * matmul_flops(t.rows, t.width(), d) + kSoftmaxFlopsPerElement * t.rows * t.width() + 2 * t.rows;
}

// A tile's backward: scores again, p = exp(s − lse) (2), Δ = dO·O (2·D per row), dP, dZ = p·(dP − Δ)
// (2), then dQ, dK̄|dK_s and dV̄|dV_s.
std::int64_t tile_backward_flops(const Tile& t, std::int64_t d) {
  return 5 * matmul_flops(t.rows, t.width(), d) + 4 * t.rows * t.width() + 2 * t.rows * d;
}

// The backward of the LayerNorms (C + C + N + N rows) and of the projection: dPᵀ per group (two
// products), its softmax backward, dK, dV += P·dK̄raw, P·dV̄raw, dW_P and dK += dSᵀ·W_Pᵀ.
std::int64_t prep_backward_flops(const Geometry& g) {
  const std::int64_t np = g.grouped(), r = g.rank, d = g.d;
  return kLnBackwardFlopsPerElement * 2 * (g.compressed() + g.n) * d + 2 * matmul_flops(r, np, d) +
         kSoftmaxBackwardFlopsPerElement * r * np + 2 * matmul_flops(np, d, r) + 2 * matmul_flops(d, r, np);
}

// Per-thread buffer floats, shared by the mechanism and the workspace functions.
struct ThreadFloats {
  std::int64_t projection, compressed, window, tile, lse;
};
ThreadFloats thread_floats(const Geometry& g) {
  return {g.rank * std::max<std::int64_t>(g.grouped(), 1), 2 * std::max<std::int64_t>(g.compressed(), 1) * g.d,
          2 * g.n * g.d, span_rows(g) * ops::padded_ld(widest_tile(g)), g.n};
}

// dst = LN(x) over `rows` rows of d features (gain, shift). Counts nothing (the caller does).
void ln_rows(const float* x, float* dst, std::int64_t rows, std::int64_t d, const float* gain, const float* shift) {
  ops::layer_norm_rows(x, dst, rows, d, gain, shift, kLayerNormEps);
}

// The LayerNorm's backward over `rows` rows of x (the LN's input): dx = rstd·(dx̂ − mean(dx̂) −
// x̂·mean(dx̂·x̂)), dx̂ = dy·gain; dgain += Σ dy·x̂, dshift += Σ dy. dx may alias dy.
void ln_backward_rows(const float* x, const float* dy, float* dx, std::int64_t rows, std::int64_t d, const float* gain,
                      float* dgain, float* dshift) {
  const float inverse_d = 1.0f / static_cast<float>(d);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * d;
    const float* g_in = dy + r * d;
    float* out = dx + r * d;
    const auto [mean, inverse_std] = ops::row_moments(in, d, kLayerNormEps);
    float sum = 0.0f, sum_x = 0.0f;
    for (std::int64_t j = 0; j < d; ++j) {
      const float xhat = (in[j] - mean) * inverse_std, dxhat = g_in[j] * gain[j];
      sum += dxhat;
      sum_x += dxhat * xhat;
      dgain[j] += g_in[j] * xhat;
      dshift[j] += g_in[j];
    }
    sum *= inverse_d;
    sum_x *= inverse_d;
    for (std::int64_t j = 0; j < d; ++j) {
      const float xhat = (in[j] - mean) * inverse_std;
      out[j] = inverse_std * (g_in[j] * gain[j] - sum - xhat * sum_x);
    }
  }
}

// The bf16 form's fp32 rows per thread (long_short.hpp): q, k, v, out [N, D] each in the forward and
// as many again (dO, dQ, dK, dV) in the backward.
std::int64_t bf16_floats(const Problem& p) { return p.dtype == DType::BF16 ? 4 * p.seq_len * p.head_dim : 0; }
// A decode chunk's compression scratch per thread: Pᵀ [R, l]; bf16 also its widened raw rows [2, l, D]
// and the compressed rows before rounding [2, R, D].
std::int64_t chunk_scratch_floats(const Problem& p, const LongShortConfig& c) {
  const std::int64_t widened = p.dtype == DType::BF16 ? 2 * (c.chunk + c.chunk_rank) * p.head_dim : 0;
  return c.chunk_rank * c.chunk + widened;
}

std::int64_t parameter_floats(const Problem& p, const Geometry& g) { return p.heads * p.head_dim * (g.rank + 4); }

class LongShort final : public Mechanism {
 public:
  LongShort(const Problem& problem, const LongShortConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed), g_(geometry(problem, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, d = p_.head_dim, r = g_.rank, threads = p_.threads;
    projection_ = Tensor(Shape{h, d, r});
    const CounterRng rng(seed_, "long-short/projection");
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int64_t head = 0; head < h; ++head)
      for (std::int64_t f = 0; f < d; ++f)
        for (std::int64_t j = 0; j < r; ++j)
          projection_[(head * d + f) * r + j] = scale * static_cast<float>(rng.normal_at(head, f, j));
    draw_norm(long_gain_, "long-short/long_gain", 1.0f);
    draw_norm(long_shift_, "long-short/long_shift", 0.0f);
    draw_norm(short_gain_, "long-short/short_gain", 1.0f);
    draw_norm(short_shift_, "long-short/short_shift", 0.0f);
    const ThreadFloats f = thread_floats(g_);
    ld_ = ops::padded_ld(widest_tile(g_));
    projected_ = Tensor(Shape{threads, f.projection});
    raw_ = Tensor(Shape{threads, f.compressed});
    normed_ = Tensor(Shape{threads, f.compressed});
    window_ = Tensor(Shape{threads, f.window});
    tile_ = Tensor(Shape{threads, f.tile});
    lse_ = Tensor(Shape{threads, f.lse});
    if (bf16_form()) widened_ = Tensor(Shape{threads, bf16_floats(p_)});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t tasks = p_.batch * p_.heads, nd = p_.seq_len * p_.head_dim;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < tasks; ++bh) {
      const int thread = omp_get_thread_num();
      const std::int64_t at = bh * nd;
      if (!bf16_form()) {
        flops += forward_head(bh, q.data() + at, k.data() + at, v.data() + at, out.data() + at, thread);
        continue;
      }
      float* rows = thread_rows(widened_, thread);  // q, k, v, out
      const Tensor* inputs[] = {&q, &k, &v};
      widen_spans(inputs, at, nd, rows, nd);
      flops += forward_head(bh, rows, rows + nd, rows + 2 * nd, rows + 3 * nd, thread);
      narrow(rows + 3 * nd, out.bf16_data() + at, nd);
    }
    if (!decode_comp_k_.empty()) length_ = p_.seq_len;
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> parameters() const override {
    return {{"projection", &projection_},
            {"long_gain", &long_gain_},
            {"long_shift", &long_shift_},
            {"short_gain", &short_gain_},
            {"short_shift", &short_shift_}};
  }

  void prepare_backward() override {
    const ThreadFloats f = thread_floats(g_);
    saved_lse_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
    d_projection_ = Tensor(projection_.shape());
    d_long_gain_ = Tensor(long_gain_.shape());
    d_long_shift_ = Tensor(long_shift_.shape());
    d_short_gain_ = Tensor(short_gain_.shape());
    d_short_shift_ = Tensor(short_shift_.shape());
    d_projected_ = Tensor(Shape{p_.threads, f.projection});
    d_compressed_ = Tensor(Shape{p_.threads, f.compressed});
    d_window_ = Tensor(Shape{p_.threads, f.window});
    d_tile_ = Tensor(Shape{p_.threads, f.tile});
    delta_ = Tensor(Shape{p_.threads, span_rows(g_)});
    if (bf16_form()) widened_grads_ = Tensor(Shape{p_.threads, bf16_floats(p_)});
  }

  std::vector<NamedTensor> saved() const override { return {{"log_sum_exp", &saved_lse_}}; }

  std::vector<NamedTensor> parameter_gradients() const override {
    return {{"dprojection", &d_projection_},
            {"dlong_gain", &d_long_gain_},
            {"dlong_shift", &d_long_shift_},
            {"dshort_gain", &d_short_gain_},
            {"dshort_shift", &d_short_shift_}};
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t nd = p_.seq_len * p_.head_dim, d = p_.head_dim, r = g_.rank;
    std::int64_t flops = 0;
    // One task per head (its parameter gradients), its batches in turn.
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < p_.heads; ++head) {
      const int thread = omp_get_thread_num();
      const HeadGrads grads{d_projection_.data() + head * d * r, d_long_gain_.data() + head * d,
                            d_long_shift_.data() + head * d, d_short_gain_.data() + head * d,
                            d_short_shift_.data() + head * d};
      std::fill(grads.projection, grads.projection + d * r, 0.0f);
      for (float* x : {grads.long_gain, grads.long_shift, grads.short_gain, grads.short_shift})
        std::fill(x, x + d, 0.0f);
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t bh = b * p_.heads + head, at = bh * nd;
        if (!bf16_form()) {
          const Rows x{q.data() + at, k.data() + at, v.data() + at, out.data() + at, dout.data() + at};
          flops += head_backward(bh, x, dq.data() + at, dk.data() + at, dv.data() + at, grads, thread);
          continue;
        }
        // bf16: the head's q, k, v, out and dO widened, its dQ, dK, dV in fp32, rounded once.
        float* rows = thread_rows(widened_, thread);
        float* grad_rows = thread_rows(widened_grads_, thread);
        const Tensor* inputs[] = {&q, &k, &v, &out};
        widen_spans(inputs, at, nd, rows, nd);
        widen(dout.bf16_data() + at, grad_rows, nd);
        const Rows x{rows, rows + nd, rows + 2 * nd, rows + 3 * nd, grad_rows};
        flops += head_backward(bh, x, grad_rows + nd, grad_rows + 2 * nd, grad_rows + 3 * nd, grads, thread);
        Tensor* const gradients[] = {&dq, &dk, &dv};
        narrow_spans(grad_rows + nd, nd, gradients, at, nd);
      }
    }
    FlopCounter::add(flops);
  }

  void prepare_decode(std::int64_t tokens) override {
    if (!p_.causal) throw std::logic_error("long-short: decoding needs a causal problem");
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, total = p_.seq_len + tokens;
    const std::int64_t rows = std::max<std::int64_t>(total / c_.chunk * g_.rank, 1);
    decode_comp_k_ = Tensor(Shape{heads, rows, d}, p_.dtype);
    decode_comp_v_ = Tensor(Shape{heads, rows, d}, p_.dtype);
    ring_ = KvCache(heads, std::min(c_.window, total), d, p_.dtype);
    chunk_k_ = Tensor(Shape{heads, c_.chunk, d}, p_.dtype);
    chunk_v_ = Tensor(Shape{heads, c_.chunk, d}, p_.dtype);
    step_buffers_ = Tensor(Shape{heads, 2, d});
    step_scores_ = Tensor(Shape{p_.threads, chunk_scratch_floats(p_, c_)});
    compressed_scores_ = Tensor(Shape{heads, rows});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (bf16_form())
      step<bf16>(q, k, v, out);
    else
      step<float>(q, k, v, out);
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"compressed_keys", &decode_comp_k_},
            {"compressed_values", &decode_comp_v_},
            {"key_window", &ring_.key_tensor()},
            {"value_window", &ring_.value_tensor()},
            {"chunk_keys", &chunk_k_},
            {"chunk_values", &chunk_v_}};
  }
  std::int64_t state_bytes() const override {
    return total_bytes(decode_state()) + static_cast<std::int64_t>(sizeof(length_));
  }

 private:
  struct Rows {
    const float *q, *k, *v, *out, *dout;
  };

  bool bf16_form() const { return p_.dtype == DType::BF16; }
  static float* thread_rows(Tensor& t, int thread) { return t.data() + thread * t.dim(1); }

  // One (batch, head)'s forward on fp32 rows [N, D]; the prefill's decode state from them.
  std::int64_t forward_head(std::int64_t bh, const float* q, const float* k, const float* v, float* out, int thread) {
    std::int64_t flops = prepare_keys(bh % p_.heads, k, v, thread);
    float* lse = saved_lse_.empty() ? lse_.data() + thread * p_.seq_len : saved_lse_.data() + bh * p_.seq_len;
    for (std::int64_t i = 0; i < spans(g_); ++i) flops += attend_span(span_of(g_, i), q, out, lse, thread);
    if (decode_comp_k_.empty()) return flops;
    if (bf16_form())
      load_decode_state<bf16>(bh, k, v, thread);
    else
      load_decode_state<float>(bh, k, v, thread);
    return flops;
  }

  // A decode step on T = float or bf16 tensors and state (long_short.hpp): the token's LN'd key and
  // value into the ring and its raw ones into the chunk (rounded once in bf16), the query over the
  // compressed rows and the ring (bf16: attend_rows on the bf16 rows with fp32 P), a completed chunk
  // compressed.
  template <class T>
  void step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, pos = length_, l = c_.chunk;
    const std::int64_t cap = ring_.capacity(), slot = pos % cap;
    const bool parallel = heads * (cap + pos / l * g_.rank) * d >= kParallelStepFloats;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops) if (parallel)
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      const std::int64_t h = bh % p_.heads, chunk_at = (bh * l + pos % l) * d;
      float* scratch = step_buffers_.data() + bh * 2 * d;  // bf16: the widened token, its LN; until attend_every_head
      const T* token[2] = {elements<T>(k) + bh * d, elements<T>(v) + bh * d};
      T* windows[2] = {ring_.keys<T>(bh) + slot * d, ring_.values<T>(bh) + slot * d};
      T* chunks[2] = {elements<T>(chunk_k_) + chunk_at, elements<T>(chunk_v_) + chunk_at};
      for (int x = 0; x < 2; ++x) {
        float* normed_row = fp32_target(windows[x], 0, d, scratch + d);
        ln_rows(fp32_elements(token[x], d, scratch), normed_row, 1, d, short_gain_.data() + h * d,
                short_shift_.data() + h * d);
        store_rows(normed_row, windows[x], 0, 1, d);
        std::copy_n(token[x], d, chunks[x]);
      }
      flops += 2 * kLayerNormFlopsPerElement * d;
    }
    FlopCounter::add(flops);
    const std::int64_t comp_rows = pos / l * g_.rank, first = std::max<std::int64_t>(0, pos - c_.window + 1);
    attend_every_head(
        q, out, step_buffers_, p_.threads,
        [&](std::int64_t bh, RowSoftmax& row, const float* query) {
          const std::int64_t rows_at = bh * decode_comp_k_.dim(1) * d;
          const T *comp_k = elements<T>(decode_comp_k_) + rows_at, *comp_v = elements<T>(decode_comp_v_) + rows_at;
          row.fp32_probabilities = true;
          return attend_compressed(row, query, comp_k, comp_v, comp_rows, bh) +
                 attend_ring(row, query, ring_.keys<T>(bh), ring_.values<T>(bh), cap, first, pos - first + 1);
        },
        parallel);
    if ((pos + 1) % l == 0) compress_decoded_chunk<T>((pos + 1) / l - 1, parallel);
    ++length_;
  }
  // A step's query over head bh's first `rows` compressed rows: fp32 rows from kBlockStepRows on as
  // one attend_block (two sgemm calls), bf16 rows always by attend_rows (long_short.hpp).
  std::int64_t attend_compressed(RowSoftmax& row, const float* query, const float* keys, const float* values,
                                 std::int64_t rows, std::int64_t bh) {
    if (rows < kBlockStepRows) return attend_rows(row, query, keys, values, rows);
    return attend_block(row, query, keys, values, rows, compressed_scores_.data() + bh * compressed_scores_.dim(1));
  }
  std::int64_t attend_compressed(RowSoftmax& row, const float* query, const bf16* keys, const bf16* values,
                                 std::int64_t rows, std::int64_t) {
    return attend_rows(row, query, keys, values, rows);
  }

  struct HeadGrads {
    float *projection, *long_gain, *long_shift, *short_gain, *short_shift;
  };

  void draw_norm(Tensor& t, const char* stream, float centre) const {
    t = Tensor(Shape{p_.heads, p_.head_dim});
    const CounterRng rng(seed_, stream);
    for (std::int64_t h = 0; h < p_.heads; ++h)
      for (std::int64_t f = 0; f < p_.head_dim; ++f)
        t[h * p_.head_dim + f] = centre + 0.02f * static_cast<float>(rng.normal_at(h, f, 0));
  }

  float scale() const { return 1.0f / std::sqrt(static_cast<float>(p_.head_dim)); }
  const float* weights(std::int64_t head) const { return projection_.data() + head * p_.head_dim * g_.rank; }
  // The thread's buffers: Pᵀ [R, N'], compressed rows raw and LN'd ([2, C, D]: keys then values),
  // the window's LN'd keys and values ([2, N, D]).
  float* projected(int thread) { return projected_.data() + thread * projected_.dim(1); }
  float* raw(int thread) { return raw_.data() + thread * raw_.dim(1); }
  float* normed(int thread) { return normed_.data() + thread * normed_.dim(1); }
  float* window(int thread) { return window_.data() + thread * window_.dim(1); }
  std::int64_t values_at() const { return std::max<std::int64_t>(g_.compressed(), 1) * p_.head_dim; }

  // The projection Pᵀ = softmax over each group's tokens of (K·W_P)ᵀ ([R, N'], ld N'), the compressed
  // rows K̄, V̄ (raw and LN_long'd) and the window's LN_short'd K_s, V_s of one (batch, head) into the
  // thread's buffers. Returns the FLOPs outside ops::gemm.
  std::int64_t prepare_keys(std::int64_t head, const float* k, const float* v, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, r = g_.rank, np = g_.grouped(), len = g_.group_len;
    float* pt = projected(thread);
    float *raw_k = raw(thread), *raw_v = raw_k + values_at();
    if (np > 0) {
      ops::gemm(true, true, r, np, d, 1.0f, weights(head), r, k, d, 0.0f, pt, np);
      for (std::int64_t group = 0; group < g_.groups; ++group) {
        for (std::int64_t j = 0; j < r; ++j) ops::softmax_in_place(pt + j * np + group * len, len);
        const float* p_group = pt + group * len;
        ops::gemm(false, false, r, d, len, 1.0f, p_group, np, k + group * len * d, d, 0.0f, raw_k + group * r * d, d);
        ops::gemm(false, false, r, d, len, 1.0f, p_group, np, v + group * len * d, d, 0.0f, raw_v + group * r * d, d);
      }
    }
    const std::int64_t c = g_.compressed();
    float *comp_k = normed(thread), *comp_v = comp_k + values_at();
    ln_rows(raw_k, comp_k, c, d, long_gain_.data() + head * d, long_shift_.data() + head * d);
    ln_rows(raw_v, comp_v, c, d, long_gain_.data() + head * d, long_shift_.data() + head * d);
    float *win_k = window(thread), *win_v = win_k + n * d;
    ln_rows(k, win_k, n, d, short_gain_.data() + head * d, short_shift_.data() + head * d);
    ln_rows(v, win_v, n, d, short_gain_.data() + head * d, short_shift_.data() + head * d);
    return kSoftmaxFlopsPerElement * r * np + kLayerNormFlopsPerElement * 2 * (c + n) * d;
  }

  // The span's scores c·Q·[K̄ | K_s,win]ᵀ into `scores` ([rows, ld], row 0 its first query): the
  // compressed columns of every row by one product, each tile's window columns by its own; the causal
  // band masked to −∞.
  void span_scores(const Span& span, const float* q, float* scores, int thread) {
    const std::int64_t d = p_.head_dim, q0 = span.q0(g_), comp = span.comp(g_);
    if (comp > 0)
      ops::gemm(false, true, span.rows(g_), comp, d, scale(), q + q0 * d, d, normed(thread), d, 0.0f, scores, ld_);
    for (std::int64_t index = span.first; index < span.last; ++index) {
      const Tile t = tile_of(g_, index);
      float* tile_scores = scores + (t.q0 - q0) * ld_ + comp;
      ops::gemm(false, true, t.rows, t.k1 - t.k0, d, scale(), q + t.q0 * d, d, window(thread) + t.k0 * d, d, 0.0f,
                tile_scores, ld_);
      if (!g_.causal) continue;
      constexpr float kMasked = -std::numeric_limits<float>::infinity();
      for (std::int64_t row = 0; row < t.rows; ++row) {
        const std::int64_t i = t.q0 + row;
        for (std::int64_t key = t.k0; key < t.k1; ++key)
          if (key > i || key < i - g_.window + 1) tile_scores[row * ld_ + key - t.k0] = kMasked;
      }
    }
  }

  // out = A·[V̄ | V_s,win] over the span's rows, A = probabilities as span_scores lays them out.
  void span_values(const Span& span, const float* probs, float* out, int thread) {
    const std::int64_t d = p_.head_dim, q0 = span.q0(g_), comp = span.comp(g_);
    if (comp > 0)
      ops::gemm(false, false, span.rows(g_), d, comp, 1.0f, probs, ld_, normed(thread) + values_at(), d, 0.0f,
                out + q0 * d, d);
    for (std::int64_t index = span.first; index < span.last; ++index) {
      const Tile t = tile_of(g_, index);
      ops::gemm(false, false, t.rows, d, t.k1 - t.k0, 1.0f, probs + (t.q0 - q0) * ld_ + comp, ld_,
                window(thread) + (p_.seq_len + t.k0) * d, d, comp > 0 ? 1.0f : 0.0f, out + t.q0 * d, d);
    }
  }

  // The forward of one span: the joint softmax of each row over its tile's width, its log-sum-exp into
  // lse. Returns the FLOPs outside ops::gemm.
  std::int64_t attend_span(const Span& span, const float* q, float* out, float* lse, int thread) {
    float* scores = tile_.data() + thread * tile_.dim(1);
    span_scores(span, q, scores, thread);
    const std::int64_t q0 = span.q0(g_);
    std::int64_t flops = 0;
    for (std::int64_t index = span.first; index < span.last; ++index) {
      const Tile t = tile_of(g_, index);
      const std::int64_t width = t.width();
      for (std::int64_t row = 0; row < t.rows; ++row) {
        float* s = scores + (t.q0 - q0 + row) * ld_;
        const float peak = ops::row_max(s, width, s[0]);
        const float sum = ops::exp_and_sum(s, width, peak);
        const float inverse = 1.0f / sum;
#pragma omp simd
        for (std::int64_t j = 0; j < width; ++j) s[j] *= inverse;
        lse[t.q0 + row] = peak + std::log(sum);
      }
      flops += kSoftmaxFlopsPerElement * t.rows * width + 2 * t.rows;
    }
    span_values(span, scores, out, thread);
    return flops;
  }

  // The backward of one (batch, head). dq, dk, dv: its [N, D] rows.
  std::int64_t head_backward(std::int64_t bh, const Rows& x, float* dq, float* dk, float* dv, const HeadGrads& grads,
                             int thread) {
    const std::int64_t head = bh % p_.heads, n = p_.seq_len, d = p_.head_dim, c = g_.compressed();
    std::int64_t flops = prepare_keys(head, x.k, x.v, thread);
    float *d_comp_k = d_compressed_.data() + thread * d_compressed_.dim(1), *d_comp_v = d_comp_k + values_at();
    float *d_win_k = d_window_.data() + thread * d_window_.dim(1), *d_win_v = d_win_k + n * d;
    std::fill(d_comp_k, d_comp_k + d_compressed_.dim(1), 0.0f);
    std::fill(d_win_k, d_win_k + 2 * n * d, 0.0f);
    const float* lse = saved_lse_.data() + bh * n;
    for (std::int64_t i = 0; i < spans(g_); ++i) flops += span_backward(span_of(g_, i), x, lse, dq, thread);
    // LayerNorms' backward: the window's into dk, dv (written); the compressed rows' in place.
    ln_backward_rows(x.k, d_win_k, dk, n, d, short_gain_.data() + head * d, grads.short_gain, grads.short_shift);
    ln_backward_rows(x.v, d_win_v, dv, n, d, short_gain_.data() + head * d, grads.short_gain, grads.short_shift);
    const float *raw_k = raw(thread), *raw_v = raw_k + values_at();
    ln_backward_rows(raw_k, d_comp_k, d_comp_k, c, d, long_gain_.data() + head * d, grads.long_gain, grads.long_shift);
    ln_backward_rows(raw_v, d_comp_v, d_comp_v, c, d, long_gain_.data() + head * d, grads.long_gain, grads.long_shift);
    flops += kLnBackwardFlopsPerElement * 2 * (c + n) * d;
    flops += projection_backward(head, x, d_comp_k, d_comp_v, dk, dv, grads, thread);
    return flops;
  }

  // A span's backward from the saved log-sum-exp: its dq rows written; the thread's dK̄, dV̄, dK_s, dV_s
  // accumulated. Returns the FLOPs outside ops::gemm.
  std::int64_t span_backward(const Span& span, const Rows& x, const float* lse, float* dq, int thread) {
    const std::int64_t d = p_.head_dim, n = p_.seq_len, q0 = span.q0(g_), comp = span.comp(g_), rows = span.rows(g_);
    float* probs = tile_.data() + thread * tile_.dim(1);
    float* grads = d_tile_.data() + thread * d_tile_.dim(1);
    float* delta = delta_.data() + thread * delta_.dim(1);
    span_scores(span, x.q, probs, thread);
    const float *dout = x.dout + q0 * d, *q_span = x.q + q0 * d;
    std::int64_t flops = 0;
    for (std::int64_t index = span.first; index < span.last; ++index) {
      const Tile t = tile_of(g_, index);
      for (std::int64_t row = t.q0 - q0; row < t.q0 - q0 + t.rows; ++row) {
        float* s = probs + row * ld_;
        const float shift = lse[q0 + row];
        for (std::int64_t j = 0; j < t.width(); ++j) s[j] = ops::fast_exp(s[j] - shift);
        float dot = 0.0f;
        for (std::int64_t f = 0; f < d; ++f) dot += dout[row * d + f] * x.out[(q0 + row) * d + f];
        delta[row] = dot;
      }
      flops += 4 * t.rows * t.width() + 2 * t.rows * d;
    }
    float *comp_k = normed(thread), *comp_v = comp_k + values_at();
    float *d_comp_k = d_compressed_.data() + thread * d_compressed_.dim(1), *d_comp_v = d_comp_k + values_at();
    float* d_window = d_window_.data() + thread * d_window_.dim(1);
    const float* win = window(thread);
    if (comp > 0) ops::gemm(false, true, rows, comp, d, 1.0f, dout, d, comp_v, d, 0.0f, grads, ld_);
    for (std::int64_t index = span.first; index < span.last; ++index) {
      const Tile t = tile_of(g_, index);
      const std::int64_t at = (t.q0 - q0) * ld_ + comp;
      ops::gemm(false, true, t.rows, t.k1 - t.k0, d, 1.0f, x.dout + t.q0 * d, d, win + (n + t.k0) * d, d, 0.0f,
                grads + at, ld_);
      for (std::int64_t row = t.q0 - q0; row < t.q0 - q0 + t.rows; ++row) {
        const float* p = probs + row * ld_;
        float* gr = grads + row * ld_;
        const float shift = delta[row];
#pragma omp simd
        for (std::int64_t j = 0; j < t.width(); ++j) gr[j] = p[j] * (gr[j] - shift);
      }
    }
    const float c = scale();
    if (comp > 0) {
      ops::gemm(false, false, rows, d, comp, c, grads, ld_, comp_k, d, 0.0f, dq + q0 * d, d);
      ops::gemm(true, false, comp, d, rows, c, grads, ld_, q_span, d, 1.0f, d_comp_k, d);
      ops::gemm(true, false, comp, d, rows, 1.0f, probs, ld_, dout, d, 1.0f, d_comp_v, d);
    }
    for (std::int64_t index = span.first; index < span.last; ++index) {
      const Tile t = tile_of(g_, index);
      const std::int64_t at = (t.q0 - q0) * ld_ + comp, keys = t.k1 - t.k0;
      ops::gemm(false, false, t.rows, d, keys, c, grads + at, ld_, win + t.k0 * d, d, comp > 0 ? 1.0f : 0.0f,
                dq + t.q0 * d, d);
      ops::gemm(true, false, keys, d, t.rows, c, grads + at, ld_, x.q + t.q0 * d, d, 1.0f, d_window + t.k0 * d, d);
      ops::gemm(true, false, keys, d, t.rows, 1.0f, probs + at, ld_, x.dout + t.q0 * d, d, 1.0f,
                d_window + (n + t.k0) * d, d);
    }
    return flops;
  }

  // The projection's backward: dPᵀ per group from the compressed rows' input gradients, the softmax
  // backward over each group's tokens, then dk, dv += P·d(raw), dW_P += Kᵀ·dSᵀ, dk += dSᵀ·W_Pᵀ.
  std::int64_t projection_backward(std::int64_t head, const Rows& x, const float* d_raw_k, const float* d_raw_v,
                                   float* dk, float* dv, const HeadGrads& grads, int thread) {
    const std::int64_t d = p_.head_dim, r = g_.rank, np = g_.grouped(), len = g_.group_len;
    if (np == 0) return 0;
    const float* pt = projected(thread);
    float* dpt = d_projected_.data() + thread * d_projected_.dim(1);
    for (std::int64_t group = 0; group < g_.groups; ++group) {
      const std::int64_t at = group * len;
      ops::gemm(false, true, r, len, d, 1.0f, d_raw_k + group * r * d, d, x.k + at * d, d, 0.0f, dpt + at, np);
      ops::gemm(false, true, r, len, d, 1.0f, d_raw_v + group * r * d, d, x.v + at * d, d, 1.0f, dpt + at, np);
      ops::gemm(true, false, len, d, r, 1.0f, pt + at, np, d_raw_k + group * r * d, d, 1.0f, dk + at * d, d);
      ops::gemm(true, false, len, d, r, 1.0f, pt + at, np, d_raw_v + group * r * d, d, 1.0f, dv + at * d, d);
      softmax_backward_rows(pt + at, dpt + at, r, len, np);
    }
    ops::gemm(true, true, d, r, np, 1.0f, x.k, d, dpt, np, 1.0f, grads.projection, r);
    ops::gemm(true, true, np, d, r, 1.0f, dpt, np, weights(head), r, 1.0f, dk, d);
    return kSoftmaxBackwardFlopsPerElement * r * np;
  }

  // After a prefill's (batch, head) (its fp32 rows k, v): its compressed rows, the last window of
  // LN'd keys and values in the ring, and the raw keys and values of its incomplete last chunk, as T.
  template <class T>
  void load_decode_state(std::int64_t bh, const float* k, const float* v, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, c = g_.compressed(), np = g_.grouped();
    const std::int64_t rows_at = bh * decode_comp_k_.dim(1) * d;
    const float* comp_k = normed(thread);
    convert(comp_k, elements<T>(decode_comp_k_) + rows_at, c * d);
    convert(comp_k + values_at(), elements<T>(decode_comp_v_) + rows_at, c * d);
    const std::int64_t cap = ring_.capacity(), from = std::max<std::int64_t>(0, n - cap);
    const float* win_k = window(thread);
    for (std::int64_t i = from; i < n; ++i) {
      convert(win_k + i * d, ring_.keys<T>(bh) + i % cap * d, d);
      convert(win_k + (n + i) * d, ring_.values<T>(bh) + i % cap * d, d);
    }
    convert(k + np * d, elements<T>(chunk_k_) + bh * c_.chunk * d, (n - np) * d);
    convert(v + np * d, elements<T>(chunk_v_) + bh * c_.chunk * d, (n - np) * d);
  }

  // Compresses chunk `group` (its raw keys and values in chunk_k_, chunk_v_) into the compressed rows
  // (bf16: the chunk widened and the rows computed in the thread's scratch, rounded once).
  template <class T>
  void compress_decoded_chunk(std::int64_t group, bool parallel) {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, r = g_.rank, l = c_.chunk;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops) if (parallel)
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      const std::int64_t h = bh % p_.heads, rows_at = (bh * decode_comp_k_.dim(1) + group * r) * d;
      float* pt = step_scores_.data() + omp_get_thread_num() * step_scores_.dim(1);
      float* scratch = pt + r * l;  // bf16: raw k, v [2, l, D], then comp k, v [2, R, D]
      const T *chunk_k = elements<T>(chunk_k_) + bh * l * d, *chunk_v = elements<T>(chunk_v_) + bh * l * d;
      const float* k = fp32_elements(chunk_k, l * d, scratch);
      const float* v = fp32_elements(chunk_v, l * d, scratch + l * d);
      T *state_k = elements<T>(decode_comp_k_) + rows_at, *state_v = elements<T>(decode_comp_v_) + rows_at;
      float* comp_k = fp32_target(state_k, 0, d, scratch + 2 * l * d);
      float* comp_v = fp32_target(state_v, 0, d, scratch + 2 * l * d + r * d);
      ops::gemm(true, true, r, l, d, 1.0f, weights(h), r, k, d, 0.0f, pt, l);
      for (std::int64_t j = 0; j < r; ++j) ops::softmax_in_place(pt + j * l, l);
      ops::gemm(false, false, r, d, l, 1.0f, pt, l, k, d, 0.0f, comp_k, d);
      ops::gemm(false, false, r, d, l, 1.0f, pt, l, v, d, 0.0f, comp_v, d);
      ln_rows(comp_k, comp_k, r, d, long_gain_.data() + h * d, long_shift_.data() + h * d);
      ln_rows(comp_v, comp_v, r, d, long_gain_.data() + h * d, long_shift_.data() + h * d);
      store_rows(comp_k, state_k, 0, r, d);
      store_rows(comp_v, state_v, 0, r, d);
      flops += kSoftmaxFlopsPerElement * r * l + 2 * kLayerNormFlopsPerElement * r * d;
    }
    FlopCounter::add(flops);
  }

  Problem p_;
  LongShortConfig c_;
  std::uint64_t seed_;
  Geometry g_;
  std::int64_t ld_ = 0;  // row stride of a tile's scores
  Tensor projection_, long_gain_, long_shift_, short_gain_, short_shift_;
  // Per thread: Pᵀ, the compressed rows raw and LN'd, the window's LN'd keys and values, a tile, N lse.
  Tensor projected_, raw_, normed_, window_, tile_, lse_;
  // Backward: the saved log-sum-exps, the parameter gradients, per thread dPᵀ, dK̄|dV̄, dK_s|dV_s, a
  // tile's dP and the rows' Δ.
  Tensor saved_lse_, d_projection_, d_long_gain_, d_long_shift_, d_short_gain_, d_short_shift_;
  Tensor d_projected_, d_compressed_, d_window_, d_tile_, delta_;
  // Decoding: compressed rows, the window ring, the incomplete chunk's raw rows, step buffers.
  Tensor decode_comp_k_, decode_comp_v_, chunk_k_, chunk_v_, step_buffers_, step_scores_;
  Tensor compressed_scores_;        // per head a step's scores over the compressed rows [heads, rows] (attend_block)
  Tensor widened_, widened_grads_;  // bf16: per thread bf16_floats of fp32 rows, forward and backward
  KvCache ring_;
  std::int64_t length_ = 0;
};

std::int64_t heads_of(const Problem& p) { return p.batch * p.heads; }

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const LongShortConfig& c, std::uint64_t seed) {
  return std::make_unique<LongShort>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const LongShortConfig& c) {
  const Geometry g = geometry(p, c);
  std::int64_t per_head = prep_flops(g);
  for (std::int64_t t = 0; t < g.tiles(); ++t) per_head += tile_flops(tile_of(g, t), g.d);
  return heads_of(p) * per_head;
}

std::int64_t workspace(const Problem& p, const LongShortConfig& c) {
  const Geometry g = geometry(p, c);
  const ThreadFloats f = thread_floats(g);
  return (parameter_floats(p, g) +
          p.threads * (f.projection + 2 * f.compressed + f.window + f.tile + f.lse + bf16_floats(p))) *
         kFloat;
}

std::int64_t backward_flops(const Problem& p, const LongShortConfig& c) {
  const Geometry g = geometry(p, c);
  std::int64_t per_head = prep_flops(g) + prep_backward_flops(g);
  for (std::int64_t t = 0; t < g.tiles(); ++t) per_head += tile_backward_flops(tile_of(g, t), g.d);
  return heads_of(p) * per_head;
}

std::int64_t backward_workspace(const Problem& p, const LongShortConfig& c) {
  const Geometry g = geometry(p, c);
  const ThreadFloats f = thread_floats(g);
  return (heads_of(p) * p.seq_len + parameter_floats(p, g) +
          p.threads * (f.projection + f.compressed + f.window + f.tile + span_rows(g) + bf16_floats(p))) *
         kFloat;
}

std::int64_t decode_workspace(const Problem& p, const LongShortConfig& c, std::int64_t tokens) {
  const std::int64_t heads = heads_of(p), d = p.head_dim, total = p.seq_len + tokens;
  const std::int64_t rows = std::max<std::int64_t>(total / c.chunk * c.chunk_rank, 1);
  const std::int64_t state = (2 * heads * rows * d + 2 * heads * c.chunk * d) * element_bytes(p.dtype);
  return KvCache::bytes(heads, std::min(c.window, total), d, p.dtype) + state +
         (2 * heads * d + p.threads * chunk_scratch_floats(p, c) + heads * rows) * kFloat;
}

FieldTable<LongShortConfig> config_fields(const LongShortConfig*) {
  return {
      int_field(
          "segment", &LongShortConfig::segment, 1, 65536,
          "non-causal: w, queries per window segment (each also sees max(w/2, 1) tokens either side), clamped to N"),
      int_field("rank", &LongShortConfig::rank, 1, 4096, "non-causal: r, rows of the dynamic projection"),
      int_field("window", &LongShortConfig::window, 1, 65536,
                "causal: w, most recent tokens a query sees, itself included"),
      int_field("chunk", &LongShortConfig::chunk, 1, 65536, "causal: l, tokens per compressed chunk"),
      int_field("chunk_rank", &LongShortConfig::chunk_rank, 1, 4096, "causal: r, compressed rows per chunk")};
}

LongShortConfig resolve(const Problem& p, LongShortConfig c) {
  c.segment = std::min(c.segment, p.seq_len);
  return c;
}

template <>
Implementation implementation<LongShortConfig>() {
  Implementation impl = implement<LongShortConfig>();
  impl.bf16_forward = true;  // storage only (long_short.hpp): forward, decode and backward
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
