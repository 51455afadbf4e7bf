// The bf16 form of `reformer` (reformer.hpp, "bf16"): the fp32 form's hashing, sorting and masks
// (hash_and_sort, mask_scores) on bf16 tiles and the bf16 tile kernels.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/learnable_patterns/reformer.hpp"

namespace xfb {

namespace {

std::int64_t pairs_of(std::int64_t rows) { return (rows + 1) / 2; }
std::int64_t even(std::int64_t n) { return n + (n & 1); }

// Sizes of one thread's tiles for chunk length m, kc candidate keys, score stride ld, head size d
// (bf16 elements). Forward: gathered query rows [m, d], key and value rows [kc, d], the keys' pair
// panels, the values' row pairs, bf16 P [m, ld]. Backward: dO rows [m, d] and row pairs, the
// queries' and keys' row pairs, the values' pair panels, P in row pairs, dS in rows and row pairs.
struct TileSizes {
  std::int64_t m, kc, ld, d;
  std::int64_t panels() const { return tiles::panels_for(kc) * tiles::kPanel * d; }
  std::int64_t forward() const { return m * d + 2 * kc * d + panels() + pairs_of(kc) * 2 * d + m * ld; }
  std::int64_t backward() const {
    return m * d + 2 * pairs_of(m) * 2 * d + pairs_of(kc) * 2 * d + panels() + 2 * pairs_of(m) * 2 * ld + m * ld;
  }
};

TileSizes tile_sizes(const Problem& p, std::int64_t m) {
  const std::int64_t kc = std::min(p.seq_len, (p.causal ? 3 : 2) * m);
  return {m, kc, ops::padded_ld(kc), p.head_dim};
}

// Rows of d bf16 values: dst row r = rows[ids[r]] for r < count (the rows kGatherAhead ahead requested first).
void gather_bf16_rows(const bf16* rows, const std::int32_t* ids, std::int64_t count, std::int64_t d, bf16* dst) {
  for (std::int64_t r = 0; r < count; ++r) {
    if (r + kGatherAhead < count) __builtin_prefetch(rows + ids[r + kGatherAhead] * d);
    std::memcpy(dst + r * d, rows + ids[r] * d, static_cast<std::size_t>(d) * sizeof(bf16));
  }
}

// One token's hashing inputs from its bf16 query row x [d] (d % 16 == 0): k̂ = x/‖x‖ in fp32 into
// `key` (0 for x = 0), k̂ rounded to bf16 into `rounded`, and rotated[j] = Σ_c k̂[c]·Rᵀ[j, c] for
// j < cols (Rᵀ: the rotations transposed, [cols, d]); returns 1/‖x‖. One out-of-line function for
// the forward and the decode step, so a token's k̂ and rotations (so its buckets) are the same bits.
using Lanes = float __attribute__((vector_size(32)));  // 8 fp32 lanes (AVX2 and AVX-512 alike)
constexpr std::int64_t kLanes = 8;

inline float lane_sum(Lanes v) {
  float sum = 0.0f;
  for (std::int64_t t = 0; t < kLanes; ++t) sum += v[t];
  return sum;
}

[[gnu::noinline]] float hash_row(const bf16* x, std::int64_t d, const float* transposed, std::int64_t cols, float* key,
                                 bf16* rounded, float* rotated) {
  Lanes squares{};
  for (std::int64_t c = 0; c < d; c += kLanes) {
    Lanes v{};
    for (std::int64_t t = 0; t < kLanes; ++t) v[t] = to_float(x[c + t]);
    squares += v * v;
    std::memcpy(key + c, &v, sizeof v);
  }
  const float total = lane_sum(squares);
  const float inverse = total > 0.0f ? 1.0f / std::sqrt(total) : 0.0f;
#pragma omp simd
  for (std::int64_t c = 0; c < d; ++c) {
    key[c] *= inverse;
    rounded[c] = to_bf16(key[c]);
  }
  for (std::int64_t j = 0; j < cols; ++j) {
    const float* r = transposed + j * d;
    Lanes acc{};
    for (std::int64_t c = 0; c < d; c += kLanes) {
      Lanes k, w;
      std::memcpy(&k, key + c, sizeof k);
      std::memcpy(&w, r + c, sizeof w);
      acc += k * w;
    }
    rotated[j] = lane_sum(acc);
  }
  return inverse;
}

// k̂ = x/‖x‖ of a bf16 row x in fp32 (the same bits as hash_row's); returns 1/‖x‖.
float normalise_row(const bf16* x, std::int64_t d, float* key) {
  Lanes squares{};
  for (std::int64_t c = 0; c < d; c += kLanes) {
    Lanes v{};
    for (std::int64_t t = 0; t < kLanes; ++t) v[t] = to_float(x[c + t]);
    squares += v * v;
    std::memcpy(key + c, &v, sizeof v);
  }
  const float total = lane_sum(squares);
  const float inverse = total > 0.0f ? 1.0f / std::sqrt(total) : 0.0f;
  for (std::int64_t c = 0; c < d; ++c) key[c] *= inverse;
  return inverse;
}

// argmax([x ; −x]) over 2·half entries, first maximum winning (hash_and_sort's rule).
std::int32_t lsh_bucket(const float* x, std::int64_t half) {
  float best = x[0];
  std::int32_t arg = 0;
  for (std::int64_t j = 0; j < half; ++j)
    if (x[j] > best) {
      best = x[j];
      arg = static_cast<std::int32_t>(j);
    }
  for (std::int64_t j = 0; j < half; ++j)
    if (-x[j] > best) {
      best = -x[j];
      arg = static_cast<std::int32_t>(half + j);
    }
  return arg;
}

// Row r of an fp32 tile, with a zero past `cols` when cols is odd (the pair products read it).
void pad_odd(float* row, std::int64_t cols) {
  if (cols & 1) row[cols] = 0.0f;
}

}  // namespace

struct ReformerAttention::Bf16Tile {
  bf16 *q, *k, *v, *k_panels, *v_pairs, *p;
};

struct ReformerAttention::Bf16Grads {
  bf16 *dout, *dout_pairs, *q_pairs, *k_pairs, *v_panels, *p_pairs, *ds, *ds_pairs;
};

ReformerAttention::Bf16Tile ReformerAttention::bf16_tile(int thread) {
  const TileSizes t = tile_sizes(p_, chunk_);
  bf16* base = tile16_.bf16_data() + thread * t.forward();
  Bf16Tile tile{};
  tile.q = base;
  tile.k = tile.q + t.m * t.d;
  tile.v = tile.k + t.kc * t.d;
  tile.k_panels = tile.v + t.kc * t.d;
  tile.v_pairs = tile.k_panels + t.panels();
  tile.p = tile.v_pairs + pairs_of(t.kc) * 2 * t.d;
  return tile;
}

ReformerAttention::Bf16Grads ReformerAttention::bf16_grads(int thread) {
  const TileSizes t = tile_sizes(p_, chunk_);
  bf16* base = grads16_.bf16_data() + thread * t.backward();
  Bf16Grads g{};
  g.dout = base;
  g.dout_pairs = g.dout + t.m * t.d;
  g.q_pairs = g.dout_pairs + pairs_of(t.m) * 2 * t.d;
  g.k_pairs = g.q_pairs + pairs_of(t.m) * 2 * t.d;
  g.v_panels = g.k_pairs + pairs_of(t.kc) * 2 * t.d;
  g.p_pairs = g.v_panels + t.panels();
  g.ds = g.p_pairs + pairs_of(t.m) * 2 * t.ld;
  g.ds_pairs = g.ds + t.m * t.ld;
  return g;
}

void ReformerAttention::prepare_bf16() {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  threads_ = p_.threads;
  if (half_ > 0) {
    rotations_ = Tensor(Shape{d, c_.n_rounds, half_});
    CounterRng(seed_, "reformer/rotations").fill_normal(rotations_);
    rotated_ = Tensor(Shape{heads * n, c_.n_rounds * half_});
    const std::int64_t cols = c_.n_rounds * half_;
    rotation_rows_ = Tensor(Shape{cols, d});
    for (std::int64_t c = 0; c < d; ++c)
      for (std::int64_t j = 0; j < cols; ++j) rotation_rows_.data()[j * d + c] = rotations_.data()[c * cols + j];
  }
  keys_ = Tensor::bhnd(p_.batch, p_.heads, n, d, DType::BF16);
  inverse_norms_ = Tensor(Shape{heads, n});
  running_lse_ = Tensor(Shape{heads, n});
  buckets_ = IndexBuffer(c_.n_rounds * heads * n);
  orders_ = IndexBuffer(c_.n_rounds * heads * n);
  sorted_buckets_ = IndexBuffer(c_.n_rounds * heads * n);
  ranks_ = IndexBuffer(c_.n_rounds * heads * n);
  if (c_.n_rounds > 1) positions_ = IndexBuffer(c_.n_rounds * heads * n);
  bucket_counts_ = IndexBuffer(threads_ * c_.n_buckets);
  scores_ = Tensor(Shape{threads_, chunk_, score_ld_});
  tile_out_ = Tensor(Shape{threads_, chunk_, d});
  row_stats_ = Tensor(Shape{threads_, 2, chunk_});
  tile16_ = Tensor(Shape{threads_, tile_sizes(p_, chunk_).forward()}, DType::BF16);
  if (c_.n_rounds > 1) accumulators_ = Tensor(Shape{threads_, n, d});
  held_rows_.assign(static_cast<std::size_t>(threads_), HeldRows{});
}

// k̂ (bf16, rounded from fp32 k̂ = q/‖q‖), 1/‖q‖ and, with several buckets, the rotations x = k̂·R of
// every token (fp32 k̂ rows, one at a time in the thread's tile_out_ row).
std::int64_t ReformerAttention::normalise_keys_bf16(const Tensor& q) {
  const std::int64_t rows = q.size() / p_.head_dim, d = p_.head_dim, cols = c_.n_rounds * half_;
#pragma omp parallel num_threads(threads_)
  {
    float* key = tile_out_.data() + omp_get_thread_num() * chunk_ * d;
#pragma omp for schedule(static)
    for (std::int64_t row = 0; row < rows; ++row)
      inverse_norms_.data()[row] =
          hash_row(q.bf16_data() + row * d, d, rotation_rows_.empty() ? nullptr : rotation_rows_.data(), cols, key,
                   keys_.bf16_data() + row * d, half_ > 0 ? rotated_.data() + row * cols : nullptr);
  }
  return 3 * rows * d + (half_ > 0 ? matmul_flops(rows, cols, d) : 0);
}

void ReformerAttention::forward_bf16(const Tensor& q, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  std::int64_t flops = normalise_keys_bf16(q);
  const std::int64_t chunks = (n + chunk_ - 1) / chunk_;
  forget_held_rows();
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < c_.n_rounds * heads; ++task) flops += hash_and_sort(task / heads, task % heads);
#pragma omp master
    stage_clock::lap("route");
    if (c_.n_rounds == 1) {
#pragma omp for schedule(dynamic, 8)
      for (std::int64_t task = 0; task < heads * chunks; ++task)
        flops += attend_chunk_bf16(0, task / chunks, task % chunks, q, v, out, nullptr, thread);
    } else {
      // Several rounds merge into a head's fp32 accumulator, rounded to bf16 once at the end.
      float* accumulator = accumulators_.data() + thread * n * d;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t head = 0; head < heads; ++head) {
        for (std::int64_t round = 0; round < c_.n_rounds; ++round)
          for (std::int64_t chunk = 0; chunk < chunks; ++chunk)
            flops += attend_chunk_bf16(round, head, chunk, q, v, out, accumulator, thread);
        tiles::round_row(accumulator, n * d, out.bf16_data() + head * n * d);
      }
    }
#pragma omp master
    stage_clock::lap("attend");
  }
  FlopCounter::add(flops);
  if (!ring_keys_.empty()) load_decode_context_bf16(v);
}

// The bf16 tile of a chunk (query rows, candidate key and value rows, the keys' pair panels), its
// fp32 scores S = Q·K̂ᵀ/√D on scores_bf16, discounted and masked (mask_scores). Returns the FLOPs:
// the product, the own keys' scaling and the discount.
std::int64_t ReformerAttention::chunk_scores_bf16(std::int64_t round, std::int64_t head, const ChunkRange& c,
                                                  const Tensor& q, const Tensor& v, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  const std::int32_t* order = orders_.data() + (round * p_.batch * p_.heads + head) * n;
  const Bf16Tile t = bf16_tile(thread);
  gather_bf16_rows(q.bf16_data() + head * n * d, order + c.q0, c.rows, d, t.q);
  const std::int64_t held_begin = held_rows_[static_cast<std::size_t>(thread)].begin;
  const std::int64_t kept = keep_held_rows(round, head, c, t.k, t.v, d * sizeof(bf16), thread);
  // The chunk's own keys from its gathered queries: the same rounding of the same products as
  // normalise_keys_bf16, so equal to the stored k̂.
  const std::int64_t own_rows = c.q0 - c.k0;
  if (kept < own_rows)
    gather_bf16_rows(keys_.bf16_data() + head * n * d, order + c.k0 + kept, own_rows - kept, d, t.k + kept * d);
  gather_bf16_rows(v.bf16_data() + head * n * d, order + c.k0 + kept, c.cols - kept, d, t.v + kept * d);
  const float* inverse_norms = inverse_norms_.data() + head * n;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    const float inverse = inverse_norms[order[c.q0 + r]];
    const bf16* x = t.q + r * d;
    bf16* key = t.k + (own_rows + r) * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) key[j] = to_bf16(to_float(x[j]) * inverse);
  }
  // Kept rows that start on a panel boundary keep their whole panels (moved like the rows); the
  // rest of the candidates are packed.
  const std::int64_t panel = tiles::kPanel * d;
  std::int64_t whole = 0;
  if (kept > 0 && (c.k0 - held_begin) % tiles::kPanel == 0) {
    whole = kept / tiles::kPanel;
    std::memmove(t.k_panels, t.k_panels + (c.k0 - held_begin) / tiles::kPanel * panel,
                 static_cast<std::size_t>(whole * panel) * sizeof(bf16));
  }
  tiles::pack_key_pair_panels(t.k + whole * tiles::kPanel * d, d, c.cols - whole * tiles::kPanel, d,
                              t.k_panels + whole * panel);
  float* scores = scores_.data() + thread * chunk_ * score_ld_;
  tiles::scores_bf16(t.q, d, c.rows, t.k_panels, tiles::panels_for(c.cols), d, 1.0f / std::sqrt(static_cast<float>(d)),
                     scores, score_ld_);
  return matmul_flops(c.rows, c.cols, d) + c.rows * d + mask_scores(round, head, c, scores);
}

// One chunk of one round: masked softmax in fp32 (lse per row), P = exp(S − max) rounded to bf16,
// O = P·V on accumulate_pv_bf16. One round: out = O/Σ rounded to bf16 and lse saved; several: merged
// into the head's fp32 accumulator (reformer.hpp's log-sum-exp combination).
std::int64_t ReformerAttention::attend_chunk_bf16(std::int64_t round, std::int64_t head, std::int64_t chunk,
                                                  const Tensor& q, const Tensor& v, Tensor& out, float* accumulator,
                                                  int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, m = chunk_;
  const ChunkRange c = chunk_range(chunk);
  std::int64_t flops = chunk_scores_bf16(round, head, c, q, v, thread);
  const std::int32_t* order = orders_.data() + (round * p_.batch * p_.heads + head) * n;
  float* scores = scores_.data() + thread * m * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * m;
  float* inverse = lse + m;
  flops += exp_rows_masked(
      scores, c.rows, c.cols, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, inverse);
  const Bf16Tile t = bf16_tile(thread);
  for (std::int64_t r = 0; r < c.rows; ++r) {
    pad_odd(scores + r * score_ld_, c.cols);
    tiles::round_row(scores + r * score_ld_, even(c.cols), t.p + r * score_ld_);
  }
  tiles::pack_row_pairs(t.v, d, c.cols, d, t.v_pairs);
  float* o = tile_out_.data() + thread * m * d;
  std::fill(o, o + c.rows * d, 0.0f);
  tiles::accumulate_pv_bf16(t.p, score_ld_, c.rows, c.cols, t.v_pairs, d, o, d);
  flops += matmul_flops(c.rows, c.cols, d);

  float* running = running_lse_.data() + head * n;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    const std::int64_t token = order[c.q0 + r];
    float* src = o + r * d;
    if (accumulator == nullptr) {
      scale_row(src, src, inverse[r], d);
      tiles::round_row(src, d, out.bf16_data() + (head * n + token) * d);
      running[token] = lse[r];
      continue;
    }
    float* dst = accumulator + token * d;
    if (round == 0) {
      scale_row(dst, src, inverse[r], d);
      running[token] = lse[r];
      continue;
    }
    const float merged = log_add_exp(running[token], lse[r]);
    const float keep = std::exp(running[token] - merged), add = std::exp(lse[r] - merged) * inverse[r];
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) dst[j] = dst[j] * keep + src[j] * add;
    running[token] = merged;
  }
  return flops + c.rows * d + (round > 0 ? 3 * c.rows * d : 0);
}

// ---- backward -----------------------------------------------------------------------------------

void ReformerAttention::prepare_backward_bf16() {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  deltas_ = Tensor(Shape{heads, n});
  grad_rows_ = Tensor(Shape{threads_, chunk_ + 2 * key_cols_, d});
  score_grads_ = Tensor(Shape{threads_, chunk_, score_ld_});
  grads16_ = Tensor(Shape{threads_, tile_sizes(p_, chunk_).backward()}, DType::BF16);
  grad_accumulators_ = Tensor(Shape{threads_, 3, n, d});
}

void ReformerAttention::backward_bf16(const Tensor& q, const Tensor& v, const Tensor& out, const Tensor& dout,
                                      Tensor& dq, Tensor& dk, Tensor& dv) {
  const std::int64_t heads = p_.batch * p_.heads;
  std::fill_n(dk.bf16_data(), dk.size(), bf16{});  // shared QK: the k input is not read
  forget_held_rows();
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head)
    flops += backward_head_bf16(head, q, v, out, dout, dq, dv, omp_get_thread_num());
  FlopCounter::add(flops);
}

// One head: δ, every round's chunks into the thread's fp32 dQ, dK̂, dV of the head, then dQ +=
// (dK̂ − k̂·(k̂·dK̂))/‖q‖ with k̂ recomputed in fp32 from q, and dq, dv rounded to bf16.
std::int64_t ReformerAttention::backward_head_bf16(std::int64_t head, const Tensor& q, const Tensor& v,
                                                   const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dv,
                                                   int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, at = head * n * d;
  float* deltas = deltas_.data() + head * n;
  for (std::int64_t i = 0; i < n; ++i) {
    const bf16 *o = out.bf16_data() + at + i * d, *g = dout.bf16_data() + at + i * d;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t c = 0; c < d; ++c) dot += to_float(o[c]) * to_float(g[c]);
    deltas[i] = dot;
  }
  std::int64_t flops = 2 * n * d;
  float* accumulators = grad_accumulators_.data() + thread * 3 * n * d;
  std::fill(accumulators, accumulators + 3 * n * d, 0.0f);
  const std::int64_t chunks = (n + chunk_ - 1) / chunk_;
  for (std::int64_t round = 0; round < c_.n_rounds; ++round)
    for (std::int64_t chunk = 0; chunk < chunks; ++chunk)
      flops += chunk_backward_bf16(round, head, chunk_range(chunk), q, v, dout, accumulators, thread);

  float* query_grads = accumulators;
  const float* key_grads = accumulators + n * d;
  const float* value_grads = accumulators + 2 * n * d;
  float* key = tile_out_.data() + thread * chunk_ * d;  // one fp32 k̂ row
  for (std::int64_t i = 0; i < n; ++i) {
    const float inverse_norm = normalise_row(q.bf16_data() + at + i * d, d, key);
    const float* dk = key_grads + i * d;
    float* grad = query_grads + i * d;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t c = 0; c < d; ++c) dot += key[c] * dk[c];
#pragma omp simd
    for (std::int64_t c = 0; c < d; ++c) grad[c] += (dk[c] - key[c] * dot) * inverse_norm;
  }
  tiles::round_row(query_grads, n * d, dq.bf16_data() + at);
  tiles::round_row(value_grads, n * d, dv.bf16_data() + at);
  return flops + 8 * n * d;
}

// The backward of one chunk of one round: recomputed scores, P = exp(S − L) with the merged L (each
// round's share of the union's softmax), dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ⊙ (dP − δ), dQ = dS·K̂/√D,
// dK̂ = dSᵀ·Q/√D on the bf16 kernels (P and dS rounded to bf16, fp32 accumulation), the rows' fp32
// gradients added to the head's accumulators [3, N, D] (dQ, dK̂, dV).
std::int64_t ReformerAttention::chunk_backward_bf16(std::int64_t round, std::int64_t head, const ChunkRange& c,
                                                    const Tensor& q, const Tensor& v, const Tensor& dout,
                                                    float* accumulators, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, m = chunk_, ld = score_ld_;
  std::int64_t flops = chunk_scores_bf16(round, head, c, q, v, thread);
  const std::int32_t* order = orders_.data() + (round * p_.batch * p_.heads + head) * n;
  const Bf16Tile t = bf16_tile(thread);
  const Bf16Grads g = bf16_grads(thread);
  float* scores = scores_.data() + thread * m * ld;
  float* grads = score_grads_.data() + thread * m * ld;
  float* dq_rows = grad_rows_.data() + thread * (m + 2 * key_cols_) * d;
  float* dk_rows = dq_rows + m * d;
  float* dv_rows = dk_rows + key_cols_ * d;
  gather_bf16_rows(dout.bf16_data() + head * n * d, order + c.q0, c.rows, d, g.dout);

  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (std::int64_t r = 0; r < c.rows; ++r) {
    float* p = scores + r * ld;
    const float shift = running_lse_.data()[head * n + order[c.q0 + r]];
    if (shift == kNegInf) {
      std::fill(p, p + c.cols, 0.0f);
    } else {
#pragma omp simd
      for (std::int64_t j = 0; j < c.cols; ++j) p[j] = p[j] == kNegInf ? 0.0f : ops::fast_exp(p[j] - shift);
    }
  }
  for (std::int64_t r2 = 0; r2 < pairs_of(c.rows); ++r2) {
    const std::int64_t r = 2 * r2;
    tiles::round_row_pair(scores + r * ld, r + 1 < c.rows ? scores + (r + 1) * ld : nullptr, c.cols,
                          g.p_pairs + r2 * 2 * ld);
  }
  // dV = Pᵀ·dO; dP = dO·Vᵀ.
  tiles::pack_row_pairs(g.dout, d, c.rows, d, g.dout_pairs);
  std::fill(dv_rows, dv_rows + c.cols * d, 0.0f);
  tiles::accumulate_transposed_bf16(g.p_pairs, ld, c.rows, c.cols, g.dout_pairs, d, 1.0f, dv_rows, d);
  tiles::pack_key_pair_panels(t.v, d, c.cols, d, g.v_panels);
  tiles::scores_bf16(g.dout, d, c.rows, g.v_panels, tiles::panels_for(c.cols), d, 1.0f, grads, ld);
  // dS = P ⊙ (dP − δ) in fp32, rounded to bf16 rows and row pairs.
  for (std::int64_t r = 0; r < c.rows; ++r) {
    const float* p = scores + r * ld;
    float* ds = grads + r * ld;
    const float delta = deltas_.data()[head * n + order[c.q0 + r]];
#pragma omp simd
    for (std::int64_t j = 0; j < c.cols; ++j) ds[j] = p[j] * (ds[j] - delta);
    pad_odd(ds, c.cols);
    tiles::round_row(ds, even(c.cols), g.ds + r * ld);
  }
  for (std::int64_t r2 = 0; r2 < pairs_of(c.rows); ++r2) {
    const std::int64_t r = 2 * r2;
    tiles::round_row_pair(grads + r * ld, r + 1 < c.rows ? grads + (r + 1) * ld : nullptr, c.cols,
                          g.ds_pairs + r2 * 2 * ld);
  }
  // dQ = dS·K̂/√D; dK̂ = dSᵀ·Q/√D.
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  tiles::pack_row_pairs(t.k, d, c.cols, d, g.k_pairs);
  std::fill(dq_rows, dq_rows + c.rows * d, 0.0f);
  tiles::accumulate_pv_bf16(g.ds, ld, c.rows, c.cols, g.k_pairs, d, dq_rows, d, scale);
  tiles::pack_row_pairs(t.q, d, c.rows, d, g.q_pairs);
  std::fill(dk_rows, dk_rows + c.cols * d, 0.0f);
  tiles::accumulate_transposed_bf16(g.ds_pairs, ld, c.rows, c.cols, g.q_pairs, d, scale, dk_rows, d);
  flops += 4 * matmul_flops(c.rows, c.cols, d) + kRecomputedSoftmaxBackwardFlopsPerElement * c.rows * c.cols;

  float* dq_head = accumulators;
  float* dk_head = accumulators + n * d;
  float* dv_head = accumulators + 2 * n * d;
  for (std::int64_t r = 0; r < c.rows; ++r) add_row(dq_head + order[c.q0 + r] * d, dq_rows + r * d, d);
  for (std::int64_t j = 0; j < c.cols; ++j) {
    add_row(dk_head + order[c.k0 + j] * d, dk_rows + j * d, d);
    add_row(dv_head + order[c.k0 + j] * d, dv_rows + j * d, d);
  }
  return flops + (c.rows + 2 * c.cols) * d;
}

// ---- decode -------------------------------------------------------------------------------------

// Per head: the scaled query, the accumulator, the fp32 k̂ [D] each, the rotations [rounds·n_buckets/2]
// and the union's scores [rounds·2m].
std::int64_t ReformerAttention::step_floats() const {
  return 3 * p_.head_dim + c_.n_rounds * half_ + c_.n_rounds * 2 * chunk_;
}

void ReformerAttention::prepare_decode_bf16() {
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, ring = 2 * chunk_;
  const std::int64_t slots = heads * c_.n_rounds * c_.n_buckets * ring, gathered = c_.n_rounds * ring;
  ring_positions_ = IndexBuffer(slots);
  ring_keys_ = Tensor(Shape{slots, d}, DType::BF16);
  ring_values_ = Tensor(Shape{slots, d}, DType::BF16);
  member_counts_ = IndexBuffer(heads * c_.n_rounds * c_.n_buckets);
  step_buckets_ = IndexBuffer(heads * c_.n_rounds);
  step_buffers_ = Tensor(Shape{heads, step_floats()});
  step_keys_ = Tensor(Shape{heads, d}, DType::BF16);
  union_pairs_.assign(static_cast<std::size_t>(p_.threads),
                      std::vector<std::int64_t>(static_cast<std::size_t>(gathered)));
}

void ReformerAttention::append_member_bf16(std::int64_t head, std::int64_t round, std::int32_t bucket,
                                           std::int64_t position, const bf16* key, const bf16* value) {
  const std::int64_t d = p_.head_dim, ring = 2 * chunk_;
  std::int32_t& count = member_counts_.data()[(head * c_.n_rounds + round) * c_.n_buckets + bucket];
  const std::int64_t row = ring_row(head, round, bucket) + count % ring;
  ring_positions_.data()[row] = static_cast<std::int32_t>(position);
  std::copy_n(key, d, ring_keys_.bf16_data() + row * d);
  std::copy_n(value, d, ring_values_.bf16_data() + row * d);
  ++count;
}

void ReformerAttention::load_decode_context_bf16(const Tensor& v) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  std::fill_n(member_counts_.data(), member_counts_.size(), 0);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head)
    for (std::int64_t round = 0; round < c_.n_rounds; ++round) {
      const std::int32_t* bucket = buckets_.data() + (round * heads + head) * n;
      for (std::int64_t i = 0; i < n; ++i)
        append_member_bf16(head, round, bucket[i], i, keys_.bf16_data() + (head * n + i) * d,
                           v.bf16_data() + (head * n + i) * d);
    }
  length_ = n;
}

void ReformerAttention::decode_step_bf16(const Tensor& q, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, i = length_, cols = c_.n_rounds * half_;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
#pragma omp for schedule(static)
    for (std::int64_t head = 0; head < heads; ++head) {
      float* key = step_buffers_.data() + head * step_floats() + 2 * d;
      float* rotated = key + d;
      bf16* stored = step_keys_.bf16_data() + head * d;
      hash_row(q.bf16_data() + head * d, d, rotation_rows_.empty() ? nullptr : rotation_rows_.data(), cols, key, stored,
               rotated);
      flops += 3 * d + (half_ > 0 ? c_.n_rounds * (2 * d * half_ + c_.n_buckets) : 0);
      for (std::int64_t round = 0; round < c_.n_rounds; ++round) {
        const std::int32_t bucket = half_ > 0 ? lsh_bucket(rotated + round * half_, half_) : 0;
        step_buckets_.data()[head * c_.n_rounds + round] = bucket;
        append_member_bf16(head, round, bucket, i, stored, v.bf16_data() + head * d);
      }
    }
#pragma omp master
    stage_clock::lap("route");
#pragma omp for schedule(static)
    for (std::int64_t head = 0; head < heads; ++head)
      flops += decode_union_bf16(head, q.bf16_data() + head * d, out.bf16_data() + head * d, omp_get_thread_num());
#pragma omp master
    stage_clock::lap("attend");
  }
  FlopCounter::add(flops);
  ++length_;
}

// The newest token's union of visible keys (decode_union's rule, each key once) from the bf16 rings:
// scores in fp32 from the bf16 rows, one fp32 softmax, the weights rounded to bf16 as the forward
// rounds P, Σ p·v in fp32, the output rounded to bf16. FLOPs as the fp32 step's.
std::int64_t ReformerAttention::decode_union_bf16(std::int64_t head, const bf16* q, bf16* out, int thread) {
  const std::int64_t d = p_.head_dim, m = chunk_, ring = 2 * m;
  std::vector<std::int64_t>& pairs = union_pairs_[static_cast<std::size_t>(thread)];
  std::size_t count = 0;
  for (std::int64_t round = 0; round < c_.n_rounds; ++round) {
    const std::int32_t bucket = step_buckets_.data()[head * c_.n_rounds + round];
    const std::int64_t rank = member_counts_.data()[(head * c_.n_rounds + round) * c_.n_buckets + bucket] - 1;
    const std::int64_t first = rank == 0 ? 0 : std::max<std::int64_t>(0, (rank / m - 1) * m);
    const std::int64_t last = rank == 0 ? 0 : rank - 1;
    for (std::int64_t t = first; t <= last; ++t) {
      const std::int64_t row = ring_row(head, round, bucket) + t % ring;
      pairs[count++] = static_cast<std::int64_t>(ring_positions_.data()[row]) << 32 | row;
    }
  }
  std::sort(pairs.begin(), pairs.begin() + static_cast<std::ptrdiff_t>(count));
  std::int64_t unique = 0, previous = -1;
  for (std::size_t e = 0; e < count; ++e) {
    const std::int64_t position = pairs[e] >> 32;
    if (position == previous) continue;  // a key visible in several rounds
    previous = position;
    pairs[static_cast<std::size_t>(unique++)] = pairs[e] & 0xffffffff;  // its ring row
  }
  float* buffers = step_buffers_.data() + head * step_floats();
  float* query = buffers;
  float* acc = buffers + d;
  float* scores = buffers + 3 * d + c_.n_rounds * half_;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (std::int64_t c = 0; c < d; ++c) query[c] = to_float(q[c]) * scale;
  float peak = -std::numeric_limits<float>::infinity();
  for (std::int64_t u = 0; u < unique; ++u) {
    const bf16* key = ring_keys_.bf16_data() + pairs[static_cast<std::size_t>(u)] * d;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (std::int64_t c = 0; c < d; ++c) s += query[c] * to_float(key[c]);
    scores[u] = s;
    peak = std::max(peak, s);
  }
  float sum = 0.0f;
  std::fill(acc, acc + d, 0.0f);
  for (std::int64_t u = 0; u < unique; ++u) {
    const float p = std::exp(scores[u] - peak);
    sum += p;
    const float weight = round_to_bf16(p);
    const bf16* value = ring_values_.bf16_data() + pairs[static_cast<std::size_t>(u)] * d;
#pragma omp simd
    for (std::int64_t c = 0; c < d; ++c) acc[c] += weight * to_float(value[c]);
  }
  scale_row(acc, acc, 1.0f / sum, d);
  tiles::round_row(acc, d, out);
  return d + attend_rows_flops(unique, d) + d;
}

// ---- the registry's bf16 figures ------------------------------------------------------------------

std::int64_t reformer_bf16_workspace(const Problem& p, const ReformerConfig& c) {
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, m = reformer_chunk(p, c);
  const std::int64_t half = c.n_buckets / 2, threads = p.threads;
  const TileSizes t = tile_sizes(p, m);
  const std::int64_t floats = 2 * half * d * c.n_rounds + heads * n * (c.n_rounds * half + 2) +
                              threads * (m * t.ld + m * d + 2 * m + (c.n_rounds > 1 ? n * d : 0));
  const std::int64_t halves = heads * n * d + threads * t.forward();
  const std::int64_t ints = heads * n * c.n_rounds * (c.n_rounds > 1 ? 5 : 4) + threads * c.n_buckets;
  return 4 * (floats + ints) + 2 * halves;
}

std::int64_t reformer_bf16_backward_workspace(const Problem& p, const ReformerConfig& c) {
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, m = reformer_chunk(p, c);
  const TileSizes t = tile_sizes(p, m);
  return 4 * (heads * n + p.threads * ((m + 2 * t.kc) * d + m * t.ld + 3 * n * d)) + 2 * p.threads * t.backward();
}

std::int64_t reformer_bf16_decode_workspace(const Problem& p, const ReformerConfig& c) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, ring = 2 * reformer_chunk(p, c);
  const std::int64_t slots = heads * c.n_rounds * c.n_buckets * ring;
  const std::int64_t floats = heads * (3 * d + c.n_rounds * (c.n_buckets / 2) + c.n_rounds * ring);
  const std::int64_t ints = slots + heads * c.n_rounds * c.n_buckets + heads * c.n_rounds;
  return 2 * (2 * slots * d + heads * d) + 4 * (floats + ints);
}

}  // namespace xfb
