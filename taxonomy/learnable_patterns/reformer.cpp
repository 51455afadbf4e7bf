#include "taxonomy/learnable_patterns/reformer.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/tile_kernels.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {

std::int64_t reformer_chunk(const Problem& p, const ReformerConfig& c) {
  const std::int64_t wanted = c.chunk_len > 0 ? c.chunk_len : (p.seq_len + c.n_buckets - 1) / c.n_buckets;
  return std::clamp<std::int64_t>(wanted, 1, std::max<std::int64_t>(p.seq_len, 1));
}

namespace {

// Candidate keys per tile: own + previous chunk, or two previous chunks when causal.
std::int64_t max_key_cols(const Problem& p, std::int64_t chunk) {
  return std::min(p.seq_len, (p.causal ? 3 : 2) * chunk);
}

// merge: a round after the first (log-sum-exp merge); discount: several rounds (one subtraction
// of log(count) per candidate pair).
std::int64_t tile_flops(std::int64_t rows, std::int64_t cols, std::int64_t d, bool merge, bool discount) {
  return 2 * matmul_flops(rows, cols, d) + kOnlineSoftmaxFlopsPerElement * rows * cols + rows * d +
         (merge ? 3 * rows * d : 0) + (discount ? rows * cols : 0);
}

// Consecutive chunks a thread claims at a time in the forward: its tiles then share candidate
// rows (keep_held_rows).
constexpr int kChunksPerClaim = 8;

// log(c) for the number of rounds c ∈ [1, 8] in which a key is visible to a query.
constexpr std::array<float, 9> kLogCount = {0.0f,         0.0f,         0.693147181f, 1.098612289f, 1.386294361f,
                                            1.609437912f, 1.791759469f, 1.945910149f, 2.079441542f};

}  // namespace

ReformerAttention::ReformerAttention(const Problem& problem, const ReformerConfig& config, std::uint64_t seed)
    : p_(problem),
      c_(config),
      seed_(seed),
      chunk_(reformer_chunk(problem, config)),
      half_(config.n_buckets / 2),
      key_cols_(max_key_cols(problem, chunk_)),
      score_ld_(ops::padded_ld(key_cols_)),
      bf16_(problem.dtype == DType::BF16) {}

void ReformerAttention::prepare(const Tensor&, const Tensor&, const Tensor&) {
  if (bf16_) {
    prepare_bf16();
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  threads_ = p_.threads;
  if (half_ > 0) {
    rotations_ = Tensor(Shape{d, c_.n_rounds, half_});
    CounterRng(seed_, "reformer/rotations").fill_normal(rotations_);
    rotated_ = Tensor(Shape{heads * n, c_.n_rounds * half_});
  }
  keys_ = Tensor::bhnd(p_.batch, p_.heads, n, d);
  inverse_norms_ = Tensor(Shape{heads, n});
  running_lse_ = Tensor(Shape{heads, n});
  buckets_ = IndexBuffer(c_.n_rounds * heads * n);
  orders_ = IndexBuffer(c_.n_rounds * heads * n);
  sorted_buckets_ = IndexBuffer(c_.n_rounds * heads * n);
  ranks_ = IndexBuffer(c_.n_rounds * heads * n);
  if (c_.n_rounds > 1) positions_ = IndexBuffer(c_.n_rounds * heads * n);
  bucket_counts_ = IndexBuffer(threads_ * c_.n_buckets);
  gathered_ = Tensor(Shape{threads_, chunk_ + 2 * key_cols_, d});
  scores_ = Tensor(Shape{threads_, chunk_, score_ld_});
  tile_out_ = Tensor(Shape{threads_, chunk_, d});
  panels_ = Tensor(Shape{threads_, tile_panel_floats(key_cols_, d)});
  row_stats_ = Tensor(Shape{threads_, 2, chunk_});
  held_rows_.assign(static_cast<std::size_t>(threads_), HeldRows{});
}

void ReformerAttention::forget_held_rows() { std::fill(held_rows_.begin(), held_rows_.end(), HeldRows{}); }

std::vector<NamedTensor> ReformerAttention::parameters() const {
  if (half_ == 0) return {};
  return {{"rotations", &rotations_}};
}

std::vector<std::int32_t> ReformerAttention::buckets(std::int64_t round, std::int64_t b, std::int64_t h) const {
  const std::int32_t* first = buckets_.data() + (round * p_.batch * p_.heads + head_index(b, h)) * p_.seq_len;
  return {first, first + p_.seq_len};
}

std::vector<std::int32_t> ReformerAttention::sort_order(std::int64_t round, std::int64_t b, std::int64_t h) const {
  const std::int32_t* first = orders_.data() + (round * p_.batch * p_.heads + head_index(b, h)) * p_.seq_len;
  return {first, first + p_.seq_len};
}

std::int64_t ReformerAttention::key_start(std::int64_t q0) const {
  return std::max<std::int64_t>(0, q0 - (p_.causal ? 2 : 1) * chunk_);
}

void ReformerAttention::forward(const Tensor& q, const Tensor&, const Tensor& v, Tensor& out) {
  if (bf16_) {
    forward_bf16(q, v, out);
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len;
  std::int64_t flops = normalise_keys(q);
  if (half_ > 0) {
    ops::MatmulShape rotate{.m = heads * n, .n = c_.n_rounds * half_, .k = p_.head_dim};
    ops::matmul(rotate, keys_.data(), rotations_.data(), rotated_.data());
  }
  const std::int64_t chunks = (n + chunk_ - 1) / chunk_;
  forget_held_rows();
  // Every round is hashed before any attends: a round's discount reads the other rounds' patterns.
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < c_.n_rounds * heads; ++task) flops += hash_and_sort(task / heads, task % heads);
#pragma omp master
    stage_clock::lap("route");
    for (std::int64_t round = 0; round < c_.n_rounds; ++round) {
#pragma omp for schedule(dynamic, kChunksPerClaim)
      for (std::int64_t task = 0; task < heads * chunks; ++task)
        flops += attend_chunk(round, task / chunks, task % chunks, q, v, out, thread);
    }
#pragma omp master
    stage_clock::lap("attend");
  }
  FlopCounter::add(flops);
  if (!ring_keys_.empty()) load_decode_context(v);
}

void ReformerAttention::prepare_decode(std::int64_t) {
  if (!p_.causal) throw std::logic_error("reformer: decoding needs a causal problem");
  if (bf16_) {
    prepare_decode_bf16();
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, ring = 2 * chunk_;
  const std::int64_t slots = heads * c_.n_rounds * c_.n_buckets * ring, gathered = c_.n_rounds * ring;
  ring_positions_ = IndexBuffer(slots);
  ring_keys_ = Tensor(Shape{slots, d});
  ring_values_ = Tensor(Shape{slots, d});
  member_counts_ = IndexBuffer(heads * c_.n_rounds * c_.n_buckets);
  step_buckets_ = IndexBuffer(heads * c_.n_rounds);
  union_keys_ = Tensor(Shape{heads, gathered, d});
  union_values_ = Tensor(Shape{heads, gathered, d});
  step_buffers_ = Tensor(Shape{heads, 3, d});
  union_pairs_.assign(static_cast<std::size_t>(p_.threads),
                      std::vector<std::int64_t>(static_cast<std::size_t>(gathered)));
}

// Round `round`'s bucket of a normalised key: argmax of [x ; −x], x = k̂·R_r (first maximum wins).
std::int32_t ReformerAttention::bucket_of(const float* key, std::int64_t round) const {
  if (half_ == 0) return 0;
  const std::int64_t d = p_.head_dim, ld = c_.n_rounds * half_;
  float best = 0.0f;
  std::int32_t arg = 0;
  for (std::int64_t side = 0; side < 2; ++side)
    for (std::int64_t j = 0; j < half_; ++j) {
      float x = 0.0f;
      for (std::int64_t c = 0; c < d; ++c) x += key[c] * rotations_[c * ld + round * half_ + j];
      if (side == 1) x = -x;
      if ((side == 0 && j == 0) || x > best) {
        best = x;
        arg = static_cast<std::int32_t>(side * half_ + j);
      }
    }
  return arg;
}

void ReformerAttention::append_member(std::int64_t head, std::int64_t round, std::int32_t bucket, std::int64_t position,
                                      const float* key, const float* value) {
  const std::int64_t d = p_.head_dim, ring = 2 * chunk_;
  std::int32_t& count = member_counts_.data()[(head * c_.n_rounds + round) * c_.n_buckets + bucket];
  const std::int64_t row = ring_row(head, round, bucket) + count % ring;
  ring_positions_.data()[row] = static_cast<std::int32_t>(position);
  std::copy_n(key, d, ring_keys_.data() + row * d);
  std::copy_n(value, d, ring_values_.data() + row * d);
  ++count;
}

// The keys the newest token sees, each once: per round its bucket's members of ranks
// max(0, ⌊rank/m⌋·m − m) … rank − 1, or itself when it is the first member; gathered in position
// order and attended with its query q (one softmax). Returns the FLOPs.
std::int64_t ReformerAttention::decode_union(std::int64_t head, const float* q, float* out, int thread) {
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
  float* keys = union_keys_.data() + head * union_keys_.dim(1) * d;
  float* values = union_values_.data() + head * union_values_.dim(1) * d;
  std::int64_t unique = 0;
  for (std::size_t e = 0; e < count; ++e) {
    if (e > 0 && pairs[e] >> 32 == pairs[e - 1] >> 32) continue;  // a key visible in several rounds
    const std::int64_t row = pairs[e] & 0xffffffff;
    std::copy_n(ring_keys_.data() + row * d, d, keys + unique * d);
    std::copy_n(ring_values_.data() + row * d, d, values + unique * d);
    ++unique;
  }
  float* query = step_buffers_.data() + head * 3 * d;
  RowSoftmax row = begin_row(query + d, d);
  std::int64_t flops = scale_query(q, d, query);
  flops += attend_rows(row, query, keys, values, unique);
  return flops + finish_row(row, out);
}

void ReformerAttention::decode_step(const Tensor& q, const Tensor&, const Tensor& v, Tensor& out) {
  if (bf16_) {
    decode_step_bf16(q, v, out);
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, i = length_;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(threads_) reduction(+ : flops)
  {
#pragma omp for schedule(static)
    for (std::int64_t head = 0; head < heads; ++head) {
      const float* x = q.data() + head * d;
      float* key = step_buffers_.data() + (head * 3 + 2) * d;
      float squares = 0.0f;
      for (std::int64_t c = 0; c < d; ++c) squares += x[c] * x[c];
      scale_row(key, x, squares > 0.0f ? 1.0f / std::sqrt(squares) : 0.0f, d);
      flops += 3 * d + (half_ > 0 ? c_.n_rounds * (2 * d * half_ + c_.n_buckets) : 0);
      for (std::int64_t round = 0; round < c_.n_rounds; ++round) {
        const std::int32_t bucket = bucket_of(key, round);
        step_buckets_.data()[head * c_.n_rounds + round] = bucket;
        append_member(head, round, bucket, i, key, v.data() + head * d);
      }
    }
#pragma omp master
    stage_clock::lap("route");
#pragma omp for schedule(static)
    for (std::int64_t head = 0; head < heads; ++head)
      flops += decode_union(head, q.data() + head * d, out.data() + head * d, omp_get_thread_num());
#pragma omp master
    stage_clock::lap("attend");
  }
  FlopCounter::add(flops);
  ++length_;
}

// After a prefill: every context token joins its buckets' rings in position order (the buckets
// are the forward's).
void ReformerAttention::load_decode_context(const Tensor& v) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  std::fill_n(member_counts_.data(), member_counts_.size(), 0);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head)
    for (std::int64_t round = 0; round < c_.n_rounds; ++round) {
      const std::int32_t* bucket = buckets_.data() + (round * heads + head) * n;
      for (std::int64_t i = 0; i < n; ++i)
        append_member(head, round, bucket[i], i, keys_.data() + (head * n + i) * d, v.data() + (head * n + i) * d);
    }
  length_ = n;
}

std::int64_t ReformerAttention::normalise_keys(const Tensor& q) {
  const std::int64_t rows = q.size() / p_.head_dim, d = p_.head_dim;
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t row = 0; row < rows; ++row) {
    const float* x = q.data() + row * d;
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (std::int64_t j = 0; j < d; ++j) squares += x[j] * x[j];
    const float inverse = squares > 0.0f ? 1.0f / std::sqrt(squares) : 0.0f;
    inverse_norms_.data()[row] = inverse;
    scale_row(keys_.data() + row * d, x, inverse, d);
  }
  return 3 * rows * d;
}

// Buckets of round `round` in one head, then the stable counting sort by (bucket, position).
std::int64_t ReformerAttention::hash_and_sort(std::int64_t round, std::int64_t head) {
  const std::int64_t n = p_.seq_len, heads = p_.batch * p_.heads, nb = c_.n_buckets;
  std::int32_t* bucket = buckets_.data() + (round * heads + head) * n;
  std::int32_t* order = orders_.data() + (round * heads + head) * n;
  std::int32_t* sorted = sorted_buckets_.data() + (round * heads + head) * n;
  std::int32_t* rank = ranks_.data() + (round * heads + head) * n;
  std::int32_t* next = bucket_counts_.data() + omp_get_thread_num() * nb;
  std::int64_t flops = 0;
  if (half_ > 0) {
    const std::int64_t ld = c_.n_rounds * half_;
    const float* rotated = rotated_.data() + head * n * ld + round * half_;
    for (std::int64_t i = 0; i < n; ++i) {
      const float* x = rotated + i * ld;
      float best = x[0];
      std::int32_t arg = 0;
      for (std::int64_t j = 0; j < half_; ++j)
        if (x[j] > best) {
          best = x[j];
          arg = static_cast<std::int32_t>(j);
        }
      for (std::int64_t j = 0; j < half_; ++j)
        if (-x[j] > best) {
          best = -x[j];
          arg = static_cast<std::int32_t>(half_ + j);
        }
      bucket[i] = arg;
    }
    flops = n * nb;
  } else {
    std::fill(bucket, bucket + n, 0);
  }
  std::fill(next, next + nb, 0);
  for (std::int64_t i = 0; i < n; ++i) ++next[bucket[i]];
  std::int32_t start = 0;
  for (std::int64_t b = 0; b < nb; ++b) start += std::exchange(next[b], start);
  for (std::int64_t i = 0; i < n; ++i) order[next[bucket[i]]++] = static_cast<std::int32_t>(i);
  for (std::int64_t s = 0; s < n; ++s) {
    sorted[s] = bucket[order[s]];
    rank[s] = s > 0 && sorted[s - 1] == sorted[s] ? rank[s - 1] + 1 : 0;
  }
  if (c_.n_rounds > 1) {
    std::int32_t* position = positions_.data() + (round * heads + head) * n;
    for (std::int64_t s = 0; s < n; ++s) position[order[s]] = static_cast<std::int32_t>(s);
  }
  return flops;
}

// The query at sorted position s sees no other key: causal, it is first in its bucket; non-causal,
// no other key of its bucket lies in its window (sorted chunks c−1 and c).
bool ReformerAttention::alone(const std::int32_t* sorted, const std::int32_t* rank, std::int64_t s) const {
  if (p_.causal) return rank[s] == 0;
  const std::int64_t q0 = s / chunk_ * chunk_, k0 = key_start(q0), end = std::min(q0 + chunk_, p_.seq_len);
  return !((s > k0 && sorted[s - 1] == sorted[s]) || (s + 1 < end && sorted[s + 1] == sorted[s]));
}

// The rule of reformer.hpp for one round, from token positions i (query) and j (key); chunk_scores'
// mask is the same rule for the keys of one tile, in sorted positions.
bool ReformerAttention::sees(std::int64_t round, std::int64_t head, std::int64_t i, std::int64_t j) const {
  const std::int64_t n = p_.seq_len, m = chunk_, at = (round * p_.batch * p_.heads + head) * n;
  const std::int32_t* bucket = buckets_.data() + at;
  if (bucket[i] != bucket[j]) return false;
  const std::int32_t* sorted = sorted_buckets_.data() + at;
  const std::int32_t* rank = ranks_.data() + at;
  const std::int64_t s = positions_.data()[at + i], t = positions_.data()[at + j];
  if (p_.causal && (t > s || rank[t] / m + 1 < rank[s] / m)) return false;
  if (!p_.causal && t / m != s / m && t / m + 1 != s / m) return false;
  return t != s || alone(sorted, rank, s);
}

// Several rounds: score(i, j) −= log(number of rounds in which j is visible to i), so the merged
// softmax counts each key of the union once. Every pair of the tile is adjusted (by 0 when no
// round shows it; pairs the current round masks are masked after this anyway).
std::int64_t ReformerAttention::discount_repeats(std::int64_t head, const std::int32_t* order, std::int64_t q0,
                                                 std::int64_t rows, std::int64_t k0, std::int64_t cols,
                                                 float* scores) const {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t t = 0; t < cols; ++t) {
      std::size_t count = 0;
      for (std::int64_t round = 0; round < c_.n_rounds; ++round)
        count += sees(round, head, order[q0 + r], order[k0 + t]);
      scores[r * score_ld_ + t] -= kLogCount[count];
    }
  return rows * cols;
}

ReformerAttention::ChunkRange ReformerAttention::chunk_range(std::int64_t chunk) const {
  const std::int64_t q0 = chunk * chunk_, rows = std::min(chunk_, p_.seq_len - q0), k0 = key_start(q0);
  return {q0, rows, k0, q0 + rows - k0};
}

// When the thread's tile holds key and value rows of the same round and head that this chunk's
// candidates start with (its previous tile was the chunk before), moves them to the front of the
// tile and returns their count; the tile then holds the chunk's candidates once the caller gathers
// the rest. Consecutive chunks share all candidates but the new chunk's own rows.
std::int64_t ReformerAttention::keep_held_rows(std::int64_t round, std::int64_t head, const ChunkRange& c, void* k_rows,
                                               void* v_rows, std::size_t row_bytes, int thread) {
  HeldRows& held = held_rows_[static_cast<std::size_t>(thread)];
  std::int64_t kept = 0;
  if (held.round == round && held.head == head && held.begin <= c.k0 && c.k0 < held.end) {
    const std::size_t from = static_cast<std::size_t>(c.k0 - held.begin) * row_bytes;
    kept = std::min(held.end, c.k0 + c.cols) - c.k0;
    const std::size_t bytes = static_cast<std::size_t>(kept) * row_bytes;
    std::memmove(k_rows, static_cast<char*>(k_rows) + from, bytes);
    std::memmove(v_rows, static_cast<char*>(v_rows) + from, bytes);
  }
  held = {.round = round, .head = head, .begin = c.k0, .end = c.k0 + c.cols};
  return kept;
}

// Gathers the chunk's query rows and candidate key and value rows into the thread's tile, computes
// the scores (discounted with several rounds) and sets pairs the round does not show to −inf.
// Returns the elementwise FLOPs (the own keys' scaling, the discount); tile_scores counts the product.
std::int64_t ReformerAttention::chunk_scores(std::int64_t round, std::int64_t head, const ChunkRange& c,
                                             const Tensor& q, const Tensor& v, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, m = chunk_;
  const std::int64_t at = (round * p_.batch * p_.heads + head) * n;
  const std::int32_t* order = orders_.data() + at;
  const float* q_head = q.data() + head * n * d;
  const float* k_head = keys_.data() + head * n * d;
  const float* v_head = v.data() + head * n * d;
  float* q_rows = gathered_.data() + thread * (m + 2 * key_cols_) * d;
  float* k_rows = q_rows + m * d;
  float* v_rows = k_rows + key_cols_ * d;
  gather_token_rows(q_head, order + c.q0, c.rows, d, q_rows);
  const std::int64_t kept = keep_held_rows(round, head, c, k_rows, v_rows, d * sizeof(float), thread);
  // The last c.rows candidates are the chunk's own tokens, whose keys k̂ = q·(1/‖q‖) come from the
  // gathered query rows (the same products normalise_keys wrote); only earlier ones are gathered.
  const std::int64_t own_rows = c.q0 - c.k0;  // candidates before the chunk's own
  if (kept < own_rows) gather_token_rows(k_head, order + c.k0 + kept, own_rows - kept, d, k_rows + kept * d);
  gather_token_rows(v_head, order + c.k0 + kept, c.cols - kept, d, v_rows + kept * d);
  const float* inverse_norms = inverse_norms_.data() + head * n;
  for (std::int64_t r = 0; r < c.rows; ++r)
    scale_row(k_rows + (own_rows + r) * d, q_rows + r * d, inverse_norms[order[c.q0 + r]], d);
  float* scores = scores_.data() + thread * m * score_ld_;
  tile_scores(q_rows, c.rows, k_rows, c.cols, d, 1.0f / std::sqrt(static_cast<float>(d)),
              panels_.data() + thread * tile_panel_floats(key_cols_, d), scores, score_ld_);
  return c.rows * d + mask_scores(round, head, c, scores);
}

// The discount (several rounds) and the round's mask on a chunk's scores [rows, score_ld_]; returns
// the discount's FLOPs.
std::int64_t ReformerAttention::mask_scores(std::int64_t round, std::int64_t head, const ChunkRange& c,
                                            float* scores) const {
  const std::int64_t n = p_.seq_len, m = chunk_;
  const std::int64_t at = (round * p_.batch * p_.heads + head) * n;
  const std::int32_t* order = orders_.data() + at;
  const std::int32_t* sorted = sorted_buckets_.data() + at;
  const std::int32_t* rank = ranks_.data() + at;
  const std::int64_t flops = c_.n_rounds > 1 ? discount_repeats(head, order, c.q0, c.rows, c.k0, c.cols, scores) : 0;

  // The sorted order groups a bucket's keys by position, so the keys query s sees form one run of
  // columns [first, end): its bucket's keys in the tile (causal: up to s, and from the first rank
  // of the previous chunk of its bucket's grid on); its own column only when nothing else is.
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (std::int64_t r = 0; r < c.rows; ++r) {
    const std::int64_t s = c.q0 + r, own = s - c.k0, bucket_start = s - rank[s];
    const std::int64_t first_rank = p_.causal ? std::max<std::int64_t>(0, (rank[s] / m - 1) * m) : 0;
    const std::int64_t first = std::max<std::int64_t>(0, bucket_start + first_rank - c.k0);
    std::int64_t end = own + 1;
    if (!p_.causal)
      while (end < c.cols && sorted[c.k0 + end] == sorted[s]) ++end;
    const bool self_visible = alone(sorted, rank, s);
    float* row = scores + r * score_ld_;
#pragma omp simd
    for (std::int64_t t = 0; t < c.cols; ++t) {
      const bool visible = t >= first && t < end && (t != own || self_visible);
      row[t] = visible ? row[t] : kNegInf;
    }
  }
  return flops;
}

// Queries of sorted chunk `chunk` against their candidate keys; merges into out and running_lse.
std::int64_t ReformerAttention::attend_chunk(std::int64_t round, std::int64_t head, std::int64_t chunk, const Tensor& q,
                                             const Tensor& v, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, m = chunk_;
  const ChunkRange c = chunk_range(chunk);
  std::int64_t flops = chunk_scores(round, head, c, q, v, thread);
  const std::int32_t* order = orders_.data() + (round * p_.batch * p_.heads + head) * n;
  float* scores = scores_.data() + thread * m * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * m;
  float* inverse = lse + m;
  flops += exp_rows_masked(
      scores, c.rows, c.cols, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, inverse);
  const float* v_rows = gathered_.data() + thread * (m + 2 * key_cols_) * d + (m + key_cols_) * d;
  float* o = tile_out_.data() + thread * m * d;
  tile_values(scores, score_ld_, c.rows, c.cols, v_rows, d, o);

  float* out_head = out.data() + head * n * d;
  float* running = running_lse_.data() + head * n;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    const std::int64_t token = order[c.q0 + r];
    float* dst = out_head + token * d;
    const float* src = o + r * d;
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

void ReformerAttention::prepare_backward() {
  if (bf16_) {
    prepare_backward_bf16();
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  key_grads_ = Tensor(Shape{heads * n, d});
  deltas_ = Tensor(Shape{heads, n});
  grad_rows_ = Tensor(Shape{threads_, 2 * chunk_ + 2 * key_cols_, d});
  score_grads_ = Tensor(Shape{threads_, chunk_, score_ld_});
}

std::int64_t ReformerAttention::saved_bytes() const {
  return keys_.bytes() + inverse_norms_.bytes() + running_lse_.bytes() + buckets_.bytes() + orders_.bytes() +
         sorted_buckets_.bytes() + ranks_.bytes() + positions_.bytes();
}

void ReformerAttention::backward(const Tensor& q, const Tensor&, const Tensor& v, const Tensor& out, const Tensor& dout,
                                 Tensor& dq, Tensor& dk, Tensor& dv) {
  if (bf16_) {
    backward_bf16(q, v, out, dout, dq, dk, dv);
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads;
  dk.fill(0.0f);  // shared QK: the keys are made from q, the k input is not read
  forget_held_rows();
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head)
    flops += backward_head(head, q, v, out, dout, dq, dv, omp_get_thread_num());
  FlopCounter::add(flops);
}

// One head: δ, every round's chunks (dQ, dK̂, dV scattered back to their tokens), then the
// normalisation's backward dQ += (dK̂ − k̂·(k̂·dK̂)) / ‖q‖.
std::int64_t ReformerAttention::backward_head(std::int64_t head, const Tensor& q, const Tensor& v, const Tensor& out,
                                              const Tensor& dout, Tensor& dq, Tensor& dv, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, at = head * n * d;
  std::int64_t flops = block_sparse::row_dots(out.data() + at, dout.data() + at, n, d, deltas_.data() + head * n);
  std::fill(dq.data() + at, dq.data() + at + n * d, 0.0f);
  std::fill(dv.data() + at, dv.data() + at + n * d, 0.0f);
  std::fill(key_grads_.data() + at, key_grads_.data() + at + n * d, 0.0f);
  const std::int64_t chunks = (n + chunk_ - 1) / chunk_;
  for (std::int64_t round = 0; round < c_.n_rounds; ++round)
    for (std::int64_t chunk = 0; chunk < chunks; ++chunk)
      flops += chunk_backward(round, head, chunk_range(chunk), q, v, dout, dq, dv, thread);

  const float* x = q.data() + at;
  const float* keys = keys_.data() + at;
  const float* key_grads = key_grads_.data() + at;
  float* grad = dq.data() + at;
  for (std::int64_t i = 0; i < n; ++i) {
    float squares = 0.0f, dot = 0.0f;
#pragma omp simd reduction(+ : squares, dot)
    for (std::int64_t j = 0; j < d; ++j) {
      squares += x[i * d + j] * x[i * d + j];
      dot += keys[i * d + j] * key_grads[i * d + j];
    }
    const float inverse_norm = squares > 0.0f ? 1.0f / std::sqrt(squares) : 0.0f;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j)
      grad[i * d + j] += (key_grads[i * d + j] - keys[i * d + j] * dot) * inverse_norm;
  }
  return flops + 8 * n * d;
}

// The backward of one chunk of one round: recomputed scores, P = exp(S − L) with the merged L of
// all rounds (so each round contributes its share of the union's softmax), gathered_tile_backward,
// and the rows' gradients added back to their tokens.
std::int64_t ReformerAttention::chunk_backward(std::int64_t round, std::int64_t head, const ChunkRange& c,
                                               const Tensor& q, const Tensor& v, const Tensor& dout, Tensor& dq,
                                               Tensor& dv, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, m = chunk_;
  std::int64_t flops = chunk_scores(round, head, c, q, v, thread);
  const std::int32_t* order = orders_.data() + (round * p_.batch * p_.heads + head) * n;
  const float* q_rows = gathered_.data() + thread * (m + 2 * key_cols_) * d;
  float* dout_rows = grad_rows_.data() + thread * (2 * m + 2 * key_cols_) * d;
  float* dq_rows = dout_rows + m * d;
  float* dk_rows = dq_rows + m * d;
  float* dv_rows = dk_rows + key_cols_ * d;
  float* lse = row_stats_.data() + thread * 2 * m;
  float* delta = lse + m;
  const float* dout_head = dout.data() + head * n * d;
  for (std::int64_t r = 0; r < c.rows; ++r) {
    const std::int64_t token = order[c.q0 + r];
    std::memcpy(dout_rows + r * d, dout_head + token * d, d * sizeof(float));
    lse[r] = running_lse_.data()[head * n + token];
    delta[r] = deltas_.data()[head * n + token];
  }
  const GatheredTile tile{.rows = c.rows,
                          .cols = c.cols,
                          .d = d,
                          .ld = score_ld_,
                          .q = q_rows,
                          .k = q_rows + m * d,
                          .v = q_rows + (m + key_cols_) * d,
                          .dout = dout_rows,
                          .lse = lse,
                          .delta = delta};
  flops +=
      gathered_tile_backward(tile, 1.0f / std::sqrt(static_cast<float>(d)), scores_.data() + thread * m * score_ld_,
                             score_grads_.data() + thread * m * score_ld_, dq_rows, dk_rows, dv_rows);
  float* dq_head = dq.data() + head * n * d;
  float* dk_head = key_grads_.data() + head * n * d;
  float* dv_head = dv.data() + head * n * d;
  for (std::int64_t r = 0; r < c.rows; ++r) add_row(dq_head + order[c.q0 + r] * d, dq_rows + r * d, d);
  for (std::int64_t t = 0; t < c.cols; ++t) {
    add_row(dk_head + order[c.k0 + t] * d, dk_rows + t * d, d);
    add_row(dv_head + order[c.k0 + t] * d, dv_rows + t * d, d);
  }
  return flops + (c.rows + 2 * c.cols) * d;
}

void validate(const Problem&, const ReformerConfig& c) {
  if (c.n_buckets != 1 && c.n_buckets % 2 != 0)
    throw ParamError("reformer: n_buckets must be 1 or even (buckets are argmax over [xR; -xR]), got " +
                     std::to_string(c.n_buckets));
}

std::unique_ptr<Mechanism> create(const Problem& problem, const ReformerConfig& c, std::uint64_t seed) {
  return std::make_unique<ReformerAttention>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const ReformerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = reformer_chunk(p, c), half = c.n_buckets / 2;
  std::int64_t per_head = 3 * n * d;
  if (half > 0) per_head += matmul_flops(n, c.n_rounds * half, d) + c.n_rounds * n * c.n_buckets;
  for (std::int64_t round = 0; round < c.n_rounds; ++round)
    for (std::int64_t q0 = 0; q0 < n; q0 += m) {
      const std::int64_t rows = std::min(m, n - q0);
      const std::int64_t k0 = std::max<std::int64_t>(0, q0 - (p.causal ? 2 : 1) * m);
      per_head += tile_flops(rows, q0 + rows - k0, d, round > 0, c.n_rounds > 1) + rows * d;
    }
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const ReformerConfig& c) {
  if (p.dtype == DType::BF16) return reformer_bf16_workspace(p, c);
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, m = reformer_chunk(p, c);
  const std::int64_t half = c.n_buckets / 2, threads = p.threads, kc = max_key_cols(p, m);
  const std::int64_t floats =
      half * d * c.n_rounds + heads * n * (d + c.n_rounds * half + 2) +
      threads * ((m + 2 * kc) * d + m * ops::padded_ld(kc) + m * d + 2 * m + tile_panel_floats(kc, d));
  // buckets, orders, sorted buckets, ranks (and token positions with several rounds) per round.
  const std::int64_t ints = heads * n * c.n_rounds * (c.n_rounds > 1 ? 5 : 4) + threads * c.n_buckets;
  return 4 * (floats + ints);
}

std::int64_t decode_workspace(const Problem& p, const ReformerConfig& c, std::int64_t) {
  if (p.dtype == DType::BF16) return reformer_bf16_decode_workspace(p, c);
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, ring = 2 * reformer_chunk(p, c);
  const std::int64_t slots = heads * c.n_rounds * c.n_buckets * ring;
  const std::int64_t floats = 2 * slots * d + 2 * heads * c.n_rounds * ring * d + heads * 3 * d;
  const std::int64_t ints = slots + heads * c.n_rounds * c.n_buckets + heads * c.n_rounds;
  return 4 * (floats + ints);
}

std::int64_t backward_flops(const Problem& p, const ReformerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = reformer_chunk(p, c);
  std::int64_t per_head = 2 * n * d + 8 * n * d;
  for (std::int64_t q0 = 0; q0 < n; q0 += m) {
    const std::int64_t rows = std::min(m, n - q0);
    const std::int64_t cols = q0 + rows - std::max<std::int64_t>(0, q0 - (p.causal ? 2 : 1) * m);
    per_head += c.n_rounds * ((c.n_rounds > 1 ? rows * cols : 0) + 5 * matmul_flops(rows, cols, d) +
                              kRecomputedSoftmaxBackwardFlopsPerElement * rows * cols + (2 * rows + 2 * cols) * d);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const ReformerConfig& c) {
  if (p.dtype == DType::BF16) return reformer_bf16_backward_workspace(p, c);
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, m = reformer_chunk(p, c);
  const std::int64_t kc = max_key_cols(p, m);
  return 4 * (heads * n * (d + 1) + p.threads * ((2 * m + 2 * kc) * d + m * ops::padded_ld(kc)));
}

FieldTable<ReformerConfig> config_fields(const ReformerConfig*) {
  return {int_field("n_buckets", &ReformerConfig::n_buckets, 1, 4096, "hash buckets per round (1, or even); LRA: 10"),
          choice_field("n_rounds", &ReformerConfig::n_rounds,
                       {{"1", std::int64_t{1}}, {"2", std::int64_t{2}}, {"4", std::int64_t{4}}, {"8", std::int64_t{8}}},
                       "independent hash rounds; LRA: 1"),
          int_field("chunk_len", &ReformerConfig::chunk_len, 0, 65536,
                    "tokens per chunk of the sorted order (paper 64-128); 0 = ceil(N / n_buckets) as in LRA's code; "
                    "clamped to N")};
}

ReformerConfig resolve(const Problem& p, ReformerConfig c) {
  c.chunk_len = reformer_chunk(p, c);
  return c;
}

// The bf16 form runs on the bf16 tile kernels, which need D % 16 == 0.
std::string unsupported(const Problem& p, const ReformerConfig&) {
  return tiles::bf16_head_dim_unsupported("reformer's bf16 form", p.dtype, p.head_dim);
}

template <>
Implementation implementation<ReformerConfig>() {
  Implementation impl = implement<ReformerConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
