#include "taxonomy/learnable_patterns/sinkhorn.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "lib/core/bf16.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {

std::int64_t sinkhorn_block(const Problem& p, const SinkhornConfig& c) {
  return std::clamp<std::int64_t>(c.block, 1, std::max<std::int64_t>(p.seq_len, 1));
}

std::int64_t sinkhorn_blocks(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t b = sinkhorn_block(p, c);
  return (p.seq_len + b - 1) / b;
}

namespace {

// The network's output weights w2 [D, n], entry (r, j) drawn by its coordinates
// (CounterRng::normal_at), N(0, 1/D): those of n blocks are the first columns of more blocks'.
void fill_output_weights(Tensor& w2, std::uint64_t seed) {
  const std::int64_t d = w2.dim(0), n = w2.dim(1);
  const CounterRng rng(seed, "sinkhorn/w2");
  const double spread = 1.0 / std::sqrt(static_cast<double>(d));
  for (std::int64_t r = 0; r < d; ++r)
    for (std::int64_t j = 0; j < n; ++j) w2[r * n + j] = static_cast<float>(spread * rng.normal_at(0, r, j));
}

std::int64_t sortcut(const Problem& p, const SinkhornConfig& c) {
  return std::min(c.sortcut_blocks, sinkhorn_blocks(p, c));
}

std::int64_t sorted_rows(const Problem& p, const SinkhornConfig& c) {
  return sortcut(p, c) > 0 ? sortcut(p, c) : sinkhorn_blocks(p, c);
}

// Keys per query: own block + sorted block, or the SortCut blocks.
std::int64_t score_cols(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t b = sinkhorn_block(p, c);
  return sortcut(p, c) > 0 ? sortcut(p, c) * b : 2 * b;
}

std::int64_t tile_flops(std::int64_t rows, std::int64_t cols, std::int64_t d) {
  return 2 * matmul_flops(rows, cols, d) + kOnlineSoftmaxFlopsPerElement * rows * cols + rows * d;
}

// Subtracts log Σ_j exp x_j from each of the n values of x: 5·n FLOPs (max, subtract+exp, sum,
// subtract).
void normalise_row(float* x, std::int64_t n) {
  if (n == 0) return;
  const float peak = ops::row_max(x, n, -std::numeric_limits<float>::infinity());
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t j = 0; j < n; ++j) sum += ops::fast_exp(x[j] - peak);
  const float total = peak + std::log(sum);
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) x[j] -= total;
}

// The same for every column of the [n, n] matrix l; peak and sum are [n] scratch. 5·n² FLOPs.
void normalise_columns(float* l, std::int64_t n, float* peak, float* sum) {
  std::fill(peak, peak + n, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + n, 0.0f);
  for (std::int64_t i = 0; i < n; ++i) {
    const float* row = l + i * n;
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) peak[j] = std::max(peak[j], row[j]);
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const float* row = l + i * n;
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) sum[j] += ops::fast_exp(row[j] - peak[j]);
  }
  for (std::int64_t j = 0; j < n; ++j) peak[j] += std::log(sum[j]);
  for (std::int64_t i = 0; i < n; ++i) {
    float* row = l + i * n;
#pragma omp simd
    for (std::int64_t j = 0; j < n; ++j) row[j] -= peak[j];
  }
}

inline float widened_value(float x) { return x; }
inline float widened_value(bf16 x) { return to_float(x); }

void exp_in_place(float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) x[j] = ops::fast_exp(x[j]);
}

}  // namespace

std::int64_t sinkhorn_bf16_mixing_floats(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t b = sinkhorn_block(p, c), d = p.head_dim;
  return p.causal ? b * d : (p.seq_len + sorted_rows(p, c) * b) * d;
}

SinkhornAttention::SinkhornAttention(const Problem& problem, const SinkhornConfig& config, std::uint64_t seed)
    : p_(problem),
      c_(config),
      seed_(seed),
      block_(sinkhorn_block(problem, config)),
      blocks_(sinkhorn_blocks(problem, config)),
      sortcut_(sortcut(problem, config)),
      sorted_rows_(sorted_rows(problem, config)),
      score_cols_(score_cols(problem, config)),
      score_ld_(ops::padded_ld(score_cols_)),
      bf16_(problem.dtype == DType::BF16) {}

void SinkhornAttention::prepare(const Tensor&, const Tensor&, const Tensor&) {
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, nb = blocks_;
  threads_ = p_.threads;
  const float spread = 1.0f / std::sqrt(static_cast<float>(d));
  w1_ = Tensor(Shape{d, d});
  b1_ = Tensor(Shape{d});
  w2_ = Tensor(Shape{d, nb});
  b2_ = Tensor(Shape{nb});
  CounterRng(seed_, "sinkhorn/w1").fill_normal(w1_, 0.0f, spread);
  CounterRng(seed_, "sinkhorn/b1").fill_normal(b1_, 0.0f, spread);
  fill_output_weights(w2_, seed_);  // by coordinates: the weights of n_B blocks are a prefix of more's
  CounterRng(seed_, "sinkhorn/b2").fill_normal(b2_, 0.0f, spread);
  embeddings_ = Tensor(Shape{heads * nb, d});
  hidden_ = Tensor(Shape{heads * nb, d});
  permutation_ = Tensor(Shape{p_.batch, p_.heads, nb, nb});
  const DType sorted = bf16_ ? DType::BF16 : DType::F32;
  sorted_k_ = Tensor(Shape{heads, sorted_rows_ * block_, d}, sorted);
  sorted_v_ = Tensor(Shape{heads, sorted_rows_ * block_, d}, sorted);
  running_ = Tensor(Shape{threads_, 2, d});
  scratch_ = Tensor(Shape{threads_, 2, nb});
  scores_ = Tensor(Shape{threads_, block_, score_ld_});
  row_stats_ = Tensor(Shape{threads_, 2, block_});
  if (bf16_) prepare_bf16();
}

std::vector<NamedTensor> SinkhornAttention::parameters() const {
  return {{"w1", &w1_}, {"b1", &b1_}, {"w2", &w2_}, {"b2", &b2_}, {"permutation", &permutation_}};
}

std::vector<float> SinkhornAttention::permutation(std::int64_t b, std::int64_t h) const {
  const float* first = permutation_.data() + (b * p_.heads + h) * blocks_ * blocks_;
  return {first, first + blocks_ * blocks_};
}

void SinkhornAttention::prepare_decode(std::int64_t tokens) {
  if (!p_.causal || sortcut_ > 0) throw std::logic_error("sinkhorn: decoding needs the causal mode");
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, b = block_;
  const std::int64_t blocks = (p_.seq_len + tokens + b - 1) / b;
  const float spread = 1.0f / std::sqrt(static_cast<float>(d));
  decode_w2_ = Tensor(Shape{d, blocks});
  fill_output_weights(decode_w2_, seed_);
  decode_b2_ = Tensor(Shape{blocks});
  CounterRng(seed_, "sinkhorn/b2")
      .fill_normal(decode_b2_, 0.0f, spread);  // entry j is draw j: a prefix of more blocks'
  if (bf16_) {
    prepare_decode_bf16(blocks);
    return;
  }
  block_keys_ = Tensor(Shape{heads, blocks * b, d});
  block_values_ = Tensor(Shape{heads, blocks * b, d});
  decode_sorted_ = Tensor(Shape{heads, 2, b, d});
  decode_embeddings_ = Tensor(Shape{heads, d});
  decode_buffers_ = Tensor(Shape{heads, 2, d});
  decode_scratch_ = Tensor(Shape{heads, d + blocks});
}

// The open block `block` of one head: from E (the keys of the blocks before it) the network's row
// R_block,j = ReLU(E·w1 + b1)·w2[:, j] + b2[j], j < block; P = softmax(R/τ); K̃ = P·K_blocks,
// Ṽ = P·V_blocks. Nothing for block 0. Returns the FLOPs outside ops::gemm: 2·D (bias, ReLU) +
// block (bias) + 6·block (÷τ, max, subtract + exp, sum, 1/Σ). The bf16 form reads E widened (in
// the scratch after the R row), and mixes K̃, Ṽ on mix_rows_bf16 (bf16 blocks, fp32 sums rounded to
// bf16 rows), whose 2·2·block·b·D FLOPs it adds to the count (the fp32 gemms count their own).
std::int64_t SinkhornAttention::start_block(std::int64_t head, std::int64_t block) {
  if (block == 0) return 0;
  const std::int64_t d = p_.head_dim, b = block_, blocks = decode_b2_.size();
  float* hidden = decode_scratch_.data() + head * decode_scratch_.dim(1);
  float* scores = hidden + d;
  const float* embedding = scores + blocks;  // bf16: E widened
  if (bf16_)
    widen(decode_embeddings_.bf16_data() + head * d, scores + blocks, d);
  else
    embedding = decode_embeddings_.data() + head * d;
  ops::gemm(false, false, 1, d, d, 1.0f, embedding, d, w1_.data(), d, 0.0f, hidden, d);
  for (std::int64_t c = 0; c < d; ++c) hidden[c] = std::max(hidden[c] + b1_[c], 0.0f);
  ops::gemm(false, false, 1, block, d, 1.0f, hidden, d, decode_w2_.data(), blocks, 0.0f, scores, block);
  const float inverse_temperature = static_cast<float>(1.0 / c_.temperature);
  for (std::int64_t j = 0; j < block; ++j) scores[j] = (scores[j] + decode_b2_[j]) * inverse_temperature;
  const float total = ops::exp_and_sum(scores, block, ops::row_max(scores, block, scores[0]));
  for (std::int64_t j = 0; j < block; ++j) scores[j] /= total;
  if (bf16_) return 2 * d + 7 * block + mix_open_block_bf16(head, block, scores);
  float* sorted = decode_sorted_.data() + head * 2 * b * d;
  ops::gemm(false, false, 1, b * d, block, 1.0f, scores, block, block_keys_.data() + head * block_keys_.dim(1) * d,
            b * d, 0.0f, sorted, b * d);
  ops::gemm(false, false, 1, b * d, block, 1.0f, scores, block, block_values_.data() + head * block_values_.dim(1) * d,
            b * d, 0.0f, sorted + b * d, b * d);
  return 2 * d + 7 * block;
}

// After a prefill: the context's keys and values in the block cache, E of the open block, its
// sorted block.
void SinkhornAttention::load_decode_context(const Tensor& k, const Tensor& v) {
  if (bf16_) {
    load_decode_context_bf16(k, v);
    return;
  }
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_, complete = n / b;
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
    const std::int64_t rows = block_keys_.dim(1);
    std::copy_n(k.data() + head * n * d, n * d, block_keys_.data() + head * rows * d);
    std::copy_n(v.data() + head * n * d, n * d, block_values_.data() + head * rows * d);
    float* e = decode_embeddings_.data() + head * d;
    std::fill_n(e, d, 0.0f);
    for (std::int64_t t = 0; t < complete * b; ++t)
      for (std::int64_t c = 0; c < d; ++c) e[c] += k[(head * n + t) * d + c];
    start_block(head, complete);
  }
  open_block_ = complete;
  filled_ = n - complete * b;
}

void SinkhornAttention::decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (bf16_) {
    decode_step_bf16(q, k, v, out);
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, b = block_;
  std::int64_t flops = 0;
  if (filled_ == b) {  // the previous token completed its block: E grows by its keys, the next one opens
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
    for (std::int64_t head = 0; head < heads; ++head) {
      const float* keys = block_keys_.data() + (head * block_keys_.dim(1) + open_block_ * b) * d;
      float* e = decode_embeddings_.data() + head * d;
      for (std::int64_t t = 0; t < b; ++t)
        for (std::int64_t c = 0; c < d; ++c) e[c] += keys[t * d + c];
      flops += b * d + start_block(head, open_block_ + 1);
    }
    ++open_block_;
    filled_ = 0;
    stage_clock::lap("route");
  }
  FlopCounter::add(flops);
  const std::int64_t first = open_block_ * b;
  attend_every_head(q, out, decode_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
    const std::int64_t row0 = head * block_keys_.dim(1) + first;
    std::copy_n(k.data() + head * d, d, block_keys_.data() + (row0 + filled_) * d);
    std::copy_n(v.data() + head * d, d, block_values_.data() + (row0 + filled_) * d);
    std::int64_t attended =
        attend_rows(row, query, block_keys_.data() + row0 * d, block_values_.data() + row0 * d, filled_ + 1);
    if (open_block_ > 0) {
      const float* sorted = decode_sorted_.data() + head * 2 * b * d;
      attended += attend_rows(row, query, sorted, sorted + b * d, b);
    }
    return attended;
  });
  ++filled_;
  stage_clock::lap("attend");
}

// The soft permutation of every head from its keys (E, the network, the balance), R saved when
// training. Returns its FLOPs outside ops::matmul.
std::int64_t SinkhornAttention::route(const Tensor& k) {
  const std::int64_t heads = p_.batch * p_.heads;
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += embed_blocks(k, head, omp_get_thread_num());
  flops += sorting_network();
  if (!sort_scores_.empty())
    std::copy(permutation_.data(), permutation_.data() + permutation_.size(), sort_scores_.data());
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += balance(head, omp_get_thread_num());
  stage_clock::lap("route");
  return flops;
}

void SinkhornAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  if (bf16_) {
    forward_bf16(q, k, v, out);
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads;
  std::int64_t flops = route(k);
  mix_blocks(k, sorted_k_);
  mix_blocks(v, sorted_v_);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t task = 0; task < heads * blocks_; ++task)
    flops += attend_block(q, k, v, task / blocks_, task % blocks_, out, omp_get_thread_num());
  stage_clock::lap("attend");
  FlopCounter::add(flops);
  if (!block_keys_.empty()) load_decode_context(k, v);
}

std::int64_t SinkhornAttention::embed_blocks(const Tensor& k, std::int64_t head, int thread) {
  const std::int64_t at = head * p_.seq_len * p_.head_dim;
  return bf16_ ? embed_blocks_as(k.bf16_data() + at, head, thread) : embed_blocks_as(k.data() + at, head, thread);
}

// E_i = Σ keys of block i (fp32 sums, of the widened keys in bf16); causal: E_i = Σ keys of blocks
// before i. The causal bf16 form rounds each prefix to bf16, E_{i+1} = bf16(E_i + Σ block i), as its
// decode state holds E in bf16: the same recurrence there gives the same bits.
template <class T>
std::int64_t SinkhornAttention::embed_blocks_as(const T* keys, std::int64_t head, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, nb = blocks_;
  float* e = embeddings_.data() + head * nb * d;
  std::fill(e, e + nb * d, 0.0f);
  for (std::int64_t t = 0; t < n; ++t) {
    float* sum = e + (t / block_) * d;
    const T* key = keys + t * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) sum[j] += static_cast<float>(widened_value(key[j]));
  }
  if (!p_.causal) return n * d;
  float* prefix = running_.data() + thread * 2 * d;
  float* own = prefix + d;
  std::fill(prefix, prefix + d, 0.0f);
  for (std::int64_t i = 0; i < nb; ++i) {
    std::copy(e + i * d, e + (i + 1) * d, own);
    std::copy(prefix, prefix + d, e + i * d);
    if (i + 1 == nb) break;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) prefix[j] += own[j];
    if constexpr (std::is_same_v<T, bf16>)
      for (std::int64_t j = 0; j < d; ++j) prefix[j] = round_to_bf16(prefix[j]);
  }
  return n * d + (nb - 1) * d;
}

// R = ReLU(E·w1 + b1)·w2 + b2 for every head at once, into permutation_.
std::int64_t SinkhornAttention::sorting_network() {
  const std::int64_t rows = p_.batch * p_.heads * blocks_, d = p_.head_dim, nb = blocks_;
  ops::matmul({.m = rows, .n = d, .k = d}, embeddings_.data(), w1_.data(), hidden_.data());
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* h = hidden_.data() + r * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) h[j] = std::max(h[j] + b1_[j], 0.0f);
  }
  ops::matmul({.m = rows, .n = nb, .k = d}, hidden_.data(), w2_.data(), permutation_.data());
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    float* s = permutation_.data() + r * nb;
#pragma omp simd
    for (std::int64_t j = 0; j < nb; ++j) s[j] += b2_[j];
  }
  return 2 * rows * d + rows * nb;
}

// Turns the scores of one head into its soft permutation, in place.
std::int64_t SinkhornAttention::balance(std::int64_t head, int thread) {
  const std::int64_t nb = blocks_;
  const float inverse_tau = static_cast<float>(1.0 / c_.temperature);
  float* l = permutation_.data() + head * nb * nb;
  if (p_.causal) {
    for (std::int64_t i = 0; i < nb; ++i) {
      float* row = l + i * nb;
      scale_row(row, row, inverse_tau, i);
      normalise_row(row, i);
      exp_in_place(row, i);
      std::fill(row + i, row + nb, 0.0f);
    }
    return 7 * nb * (nb - 1) / 2;
  }
  float* peak = scratch_.data() + thread * 2 * nb;
  scale_row(l, l, inverse_tau, nb * nb);
  for (std::int64_t iteration = 0; iteration < c_.sinkhorn_iters; ++iteration) {
    for (std::int64_t i = 0; i < nb; ++i) normalise_row(l + i * nb, nb);
    normalise_columns(l, nb, peak, peak + nb);
  }
  exp_in_place(l, nb * nb);
  return nb * nb * (2 + 10 * c_.sinkhorn_iters);
}

// sorted_i = Σ_j P_ij · block_j for the first sorted_rows_ rows of every head's P. Blocks are
// [b·D] rows of x; a short last block contributes only its rem·D leading entries (zero padding).
void SinkhornAttention::mix_blocks(const Tensor& x, Tensor& sorted) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, b = block_, nb = blocks_;
  const std::int64_t full = n / b, rem = n % b, nr = sorted_rows_;
  ops::MatmulShape mix{.batch = heads,
                       .m = nr,
                       .n = b * d,
                       .k = full,
                       .lda = nb,
                       .ldb = b * d,
                       .ldc = b * d,
                       .stride_a = nb * nb,
                       .stride_b = n * d,
                       .stride_c = nr * b * d};
  ops::matmul(mix, permutation_.data(), x.data(), sorted.data());
  if (rem == 0) return;
  ops::MatmulShape tail{.batch = heads,
                        .m = nr,
                        .n = rem * d,
                        .k = 1,
                        .lda = nb,
                        .ldb = rem * d,
                        .ldc = b * d,
                        .stride_a = nb * nb,
                        .stride_b = n * d,
                        .stride_c = nr * b * d,
                        .accumulate = true};
  ops::matmul(tail, permutation_.data() + full, x.data() + full * b * d, sorted.data());
}

std::int64_t SinkhornAttention::attend_block(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                                             std::int64_t block, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_;
  const std::int64_t q0 = block * b, rows = std::min(b, n - q0);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* queries = q.data() + (head * n + q0) * d;
  const float* sorted_keys = sorted_k_.data() + head * sorted_rows_ * b * d;
  const float* sorted_values = sorted_v_.data() + head * sorted_rows_ * b * d;
  float* scores = scores_.data() + thread * b * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * b;
  float* inverse = lse + b;
  float* dst = out.data() + (head * n + q0) * d;
  std::int64_t flops = 0;
  if (sortcut_ > 0) {
    const std::int64_t cols = sortcut_ * b;
    ops::gemm(false, true, rows, cols, d, scale, queries, d, sorted_keys, d, 0.0f, scores, score_ld_);
    flops = exp_rows_masked(
        scores, rows, cols, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, inverse);
    ops::gemm(false, false, rows, d, cols, 1.0f, scores, score_ld_, sorted_values, d, 0.0f, dst, d);
  } else {
    const std::int64_t own = rows;
    ops::gemm(false, true, rows, own, d, scale, queries, d, k.data() + (head * n + q0) * d, d, 0.0f, scores, score_ld_);
    ops::gemm(false, true, rows, b, d, scale, queries, d, sorted_keys + block * b * d, d, 0.0f, scores + own,
              score_ld_);
    const bool causal = p_.causal;
    auto visible = [&](std::int64_t r, std::int64_t t) { return t < own ? !causal || t <= r : !causal || block > 0; };
    flops = exp_rows_masked(scores, rows, own + b, score_ld_, visible, lse, inverse);
    ops::gemm(false, false, rows, d, own, 1.0f, scores, score_ld_, v.data() + (head * n + q0) * d, d, 0.0f, dst, d);
    ops::gemm(false, false, rows, d, b, 1.0f, scores + own, score_ld_, sorted_values + block * b * d, d, 1.0f, dst, d);
  }
  for (std::int64_t r = 0; r < rows; ++r) scale_row(dst + r * d, dst + r * d, inverse[r], d);
  if (!lse_.empty()) std::copy(lse, lse + rows, lse_.data() + head * n + q0);
  return flops + rows * d;
}

void SinkhornAttention::prepare_backward() {
  if (bf16_) prepare_backward_bf16();
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, nb = blocks_, b = block_;
  lse_ = Tensor(Shape{heads, n});
  sort_scores_ = Tensor(Shape{heads, nb, nb});
  permutation_grads_ = Tensor(Shape{heads, nb, nb});
  sorted_k_grads_ = Tensor(Shape{heads, sorted_rows_ * b, d});
  sorted_v_grads_ = Tensor(Shape{heads, sorted_rows_ * b, d});
  dw1_ = Tensor(Shape{d, d});
  db1_ = Tensor(Shape{d});
  dw2_ = Tensor(Shape{d, nb});
  db2_ = Tensor(Shape{nb});
  hidden_grads_ = Tensor(Shape{heads * nb, d});
  embedding_grads_ = Tensor(Shape{heads * nb, d});
  key_rows_ = Tensor(Shape{threads_, bf16_ ? 2 : 4, score_cols_, d});  // bf16: the fp32 dK, dV rows alone
  score_grads_ = Tensor(Shape{threads_, b, score_ld_});
  if (!p_.causal) steps_ = Tensor(Shape{threads_, 2 * c_.sinkhorn_iters, nb, nb});
}

std::vector<NamedTensor> SinkhornAttention::saved() const {
  return {{"lse", &lse_},          {"sort_scores", &sort_scores_}, {"embeddings", &embeddings_},
          {"hidden", &hidden_},    {"permutation", &permutation_}, {"sorted_k", &sorted_k_},
          {"sorted_v", &sorted_v_}};
}

void SinkhornAttention::backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (bf16_) {
    backward_bf16(q, k, v, out, dout, dq, dk, dv);
    return;
  }
  const std::int64_t heads = p_.batch * p_.heads;
  std::int64_t flops = 0;
  if (sortcut_ > 0) {
    // Every query block adds into the same SortCut rows of dK̃, dṼ: one task per head. The queries
    // see no key of their own block, so dK, dV start from the mixing's share alone.
    dk.fill(0.0f);
    dv.fill(0.0f);
    sorted_k_grads_.fill(0.0f);
    sorted_v_grads_.fill(0.0f);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < heads; ++head)
      for (std::int64_t block = 0; block < blocks_; ++block)
        flops += attend_block_backward(q, k, v, out, dout, head, block, dq, dk, dv, omp_get_thread_num());
  } else {
    // Block i writes the rows of its own block and of K̃_i, Ṽ_i only: one task per block.
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t task = 0; task < heads * blocks_; ++task)
      flops +=
          attend_block_backward(q, k, v, out, dout, task / blocks_, task % blocks_, dq, dk, dv, omp_get_thread_num());
  }
  mix_blocks_backward(k, v, dk, dv);
  stage_clock::lap("backward_attend");
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += balance_backward(head, omp_get_thread_num());
  flops += sorting_network_backward();
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += embed_blocks_backward(head, dk, omp_get_thread_num());
  stage_clock::lap("backward_route");
  FlopCounter::add(flops);
}

// The attention backward of one query block: its keys gathered ([own block; K̃_i], or the SortCut
// rows in place), scores recomputed and masked as attend_block masks them, gathered_tile_backward;
// dQ written in place, dK, dV of the own block and dK̃_i, dṼ_i copied (SortCut: dK̃, dṼ added).
std::int64_t SinkhornAttention::attend_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& dout, std::int64_t head,
                                                      std::int64_t block, Tensor& dq, Tensor& dk, Tensor& dv,
                                                      int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_;
  const std::int64_t q0 = block * b, rows = std::min(b, n - q0), cols = sortcut_ > 0 ? sortcut_ * b : rows + b;
  const std::int64_t at = (head * n + q0) * d, sorted_at = head * sorted_rows_ * b * d;
  float* key_rows = key_rows_.data() + thread * 4 * score_cols_ * d;
  float* value_rows = key_rows + score_cols_ * d;
  float* key_grads = value_rows + score_cols_ * d;
  float* value_grads = key_grads + score_cols_ * d;
  const float* keys = sorted_k_.data() + sorted_at;
  const float* values = sorted_v_.data() + sorted_at;
  if (sortcut_ == 0) {
    std::copy(k.data() + at, k.data() + at + rows * d, key_rows);
    std::copy(v.data() + at, v.data() + at + rows * d, value_rows);
    std::copy(keys + block * b * d, keys + (block + 1) * b * d, key_rows + rows * d);
    std::copy(values + block * b * d, values + (block + 1) * b * d, value_rows + rows * d);
    keys = key_rows;
    values = value_rows;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float* scores = scores_.data() + thread * b * score_ld_;
  ops::gemm(false, true, rows, cols, d, scale, q.data() + at, d, keys, d, 0.0f, scores, score_ld_);
  if (sortcut_ == 0 && p_.causal) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (std::int64_t r = 0; r < rows; ++r) {
      std::fill(scores + r * score_ld_ + r + 1, scores + r * score_ld_ + rows, kNegInf);
      if (block == 0) std::fill(scores + r * score_ld_ + rows, scores + r * score_ld_ + cols, kNegInf);
    }
  }
  float* delta = row_stats_.data() + thread * 2 * b;
  const std::int64_t delta_flops = block_sparse::row_dots(out.data() + at, dout.data() + at, rows, d, delta);
  const GatheredTile tile{.rows = rows,
                          .cols = cols,
                          .d = d,
                          .ld = score_ld_,
                          .q = q.data() + at,
                          .k = keys,
                          .v = values,
                          .dout = dout.data() + at,
                          .lse = lse_.data() + head * n + q0,
                          .delta = delta};
  std::int64_t flops =
      delta_flops + gathered_tile_backward(tile, scale, scores, score_grads_.data() + thread * b * score_ld_,
                                           dq.data() + at, key_grads, value_grads);
  float* sorted_key_grads = sorted_k_grads_.data() + sorted_at;
  float* sorted_value_grads = sorted_v_grads_.data() + sorted_at;
  if (sortcut_ > 0) {
    add_row(sorted_key_grads, key_grads, cols * d);
    add_row(sorted_value_grads, value_grads, cols * d);
    return flops + 2 * cols * d;
  }
  std::copy(key_grads, key_grads + rows * d, dk.data() + at);
  std::copy(value_grads, value_grads + rows * d, dv.data() + at);
  std::copy(key_grads + rows * d, key_grads + cols * d, sorted_key_grads + block * b * d);
  std::copy(value_grads + rows * d, value_grads + cols * d, sorted_value_grads + block * b * d);
  return flops;
}

// dP[:n_r] = dK̃·K_blocksᵀ + dṼ·V_blocksᵀ (rows beyond n_r: 0), dK += Pᵀ·dK̃, dV += Pᵀ·dṼ — the
// transposes of mix_blocks' products, a short last block again through its rem·D leading entries.
void SinkhornAttention::mix_blocks_backward(const Tensor& k, const Tensor& v, Tensor& dk, Tensor& dv) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, b = block_, nb = blocks_;
  const std::int64_t full = n / b, rem = n % b, nr = sorted_rows_;
  permutation_grads_.fill(0.0f);
  const std::pair<const Tensor*, const Tensor*> pairs[] = {{&k, &sorted_k_grads_}, {&v, &sorted_v_grads_}};
  for (const auto& [x, sorted_grads] : pairs) {
    ops::MatmulShape grad{.batch = heads,
                          .m = nr,
                          .n = full,
                          .k = b * d,
                          .trans_b = true,
                          .lda = b * d,
                          .ldb = b * d,
                          .ldc = nb,
                          .stride_a = nr * b * d,
                          .stride_b = n * d,
                          .stride_c = nb * nb,
                          .accumulate = true};
    ops::matmul(grad, sorted_grads->data(), x->data(), permutation_grads_.data());
    if (rem == 0) continue;
    ops::MatmulShape tail{.batch = heads,
                          .m = nr,
                          .n = 1,
                          .k = rem * d,
                          .trans_b = true,
                          .lda = b * d,
                          .ldb = rem * d,
                          .ldc = nb,
                          .stride_a = nr * b * d,
                          .stride_b = n * d,
                          .stride_c = nb * nb,
                          .accumulate = true};
    ops::matmul(tail, sorted_grads->data(), x->data() + full * b * d, permutation_grads_.data() + full);
  }
  const std::pair<Tensor*, const Tensor*> grads[] = {{&dk, &sorted_k_grads_}, {&dv, &sorted_v_grads_}};
  for (const auto& [dx, sorted_grads] : grads) {
    ops::MatmulShape spread{.batch = heads,
                            .m = full,
                            .n = b * d,
                            .k = nr,
                            .trans_a = true,
                            .lda = nb,
                            .ldb = b * d,
                            .ldc = b * d,
                            .stride_a = nb * nb,
                            .stride_b = nr * b * d,
                            .stride_c = n * d,
                            .accumulate = true};
    ops::matmul(spread, permutation_.data(), sorted_grads->data(), dx->data());
    if (rem == 0) continue;
    ops::MatmulShape tail{.batch = heads,
                          .m = 1,
                          .n = rem * d,
                          .k = nr,
                          .trans_a = true,
                          .lda = nb,
                          .ldb = b * d,
                          .ldc = rem * d,
                          .stride_a = nb * nb,
                          .stride_b = nr * b * d,
                          .stride_c = n * d,
                          .accumulate = true};
    ops::matmul(tail, permutation_.data() + full, sorted_grads->data(), dx->data() + full * b * d);
  }
}

// dP of one head → dR, in place in permutation_grads_.
std::int64_t SinkhornAttention::balance_backward(std::int64_t head, int thread) {
  const std::int64_t nb = blocks_, iters = c_.sinkhorn_iters;
  const float inverse_tau = static_cast<float>(1.0 / c_.temperature);
  const float* p = permutation_.data() + head * nb * nb;
  float* g = permutation_grads_.data() + head * nb * nb;
  if (p_.causal) {
    for (std::int64_t i = 0; i < nb; ++i) {
      float* row = g + i * nb;
      softmax_backward_rows(p + i * nb, row, 1, i, nb);
      scale_row(row, row, inverse_tau, i);
      std::fill(row + i, row + nb, 0.0f);
    }
    return 5 * nb * (nb - 1) / 2;
  }
  // Replay: step s's output at steps + s·n_B² (even s: a row step, odd s: a column step).
  float* steps = steps_.data() + thread * 2 * iters * nb * nb;
  float* column_stats = scratch_.data() + thread * 2 * nb;
  scale_row(steps, sort_scores_.data() + head * nb * nb, inverse_tau, nb * nb);
  for (std::int64_t iteration = 0; iteration < iters; ++iteration) {
    float* rows_done = steps + 2 * iteration * nb * nb;
    if (iteration > 0) std::copy(rows_done - nb * nb, rows_done, rows_done);
    for (std::int64_t i = 0; i < nb; ++i) normalise_row(rows_done + i * nb, nb);
    std::copy(rows_done, rows_done + nb * nb, rows_done + nb * nb);
    normalise_columns(rows_done + nb * nb, nb, column_stats, column_stats + nb);
  }
  for (std::int64_t e = 0; e < nb * nb; ++e) g[e] *= p[e];
  float* sums = column_stats;
  for (std::int64_t step = 2 * iters - 1; step >= 0; --step) {
    const float* y = steps + step * nb * nb;
    if (step % 2 == 1) {
      std::fill(sums, sums + nb, 0.0f);
      for (std::int64_t i = 0; i < nb; ++i) add_row(sums, g + i * nb, nb);
      for (std::int64_t i = 0; i < nb; ++i) {
        float* row = g + i * nb;
        const float* out_row = y + i * nb;
#pragma omp simd
        for (std::int64_t j = 0; j < nb; ++j) row[j] -= ops::fast_exp(out_row[j]) * sums[j];
      }
      continue;
    }
    for (std::int64_t i = 0; i < nb; ++i) {
      float* row = g + i * nb;
      const float* out_row = y + i * nb;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t j = 0; j < nb; ++j) sum += row[j];
#pragma omp simd
      for (std::int64_t j = 0; j < nb; ++j) row[j] -= ops::fast_exp(out_row[j]) * sum;
    }
  }
  scale_row(g, g, inverse_tau, nb * nb);
  return nb * nb * (3 + 18 * iters);
}

// The network's backward over every head's rows at once (the weights are shared: their gradients
// sum over the heads); dE into embedding_grads_.
std::int64_t SinkhornAttention::sorting_network_backward() {
  const std::int64_t rows = p_.batch * p_.heads * blocks_, d = p_.head_dim, nb = blocks_;
  const float* dr = permutation_grads_.data();
  ops::matmul({.m = d, .n = nb, .k = rows, .trans_a = true}, hidden_.data(), dr, dw2_.data());
  db2_.fill(0.0f);
  for (std::int64_t r = 0; r < rows; ++r) add_row(db2_.data(), dr + r * nb, nb);
  float* dz = hidden_grads_.data();
  ops::matmul({.m = rows, .n = d, .k = nb, .trans_b = true}, dr, w2_.data(), dz);
  db1_.fill(0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* h = hidden_.data() + r * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) dz[r * d + j] = h[j] > 0.0f ? dz[r * d + j] : 0.0f;
    add_row(db1_.data(), dz + r * d, d);
  }
  ops::matmul({.m = d, .n = d, .k = rows, .trans_a = true}, embeddings_.data(), dz, dw1_.data());
  ops::matmul({.m = rows, .n = d, .k = d, .trans_b = true}, dz, w1_.data(), embedding_grads_.data());
  return rows * nb + 2 * rows * d;
}

// dK_t += dE of t's block; causal: E_i summed the blocks before i, so block j receives Σ_{i>j} dE_i.
std::int64_t SinkhornAttention::embed_blocks_backward(std::int64_t head, Tensor& dk, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  const std::int64_t flops = n * d + block_embedding_grads(head, thread);
  const float* g = embedding_grads_.data() + head * blocks_ * d;
  float* grads = dk.data() + head * n * d;
  for (std::int64_t t = 0; t < n; ++t) add_row(grads + t * d, g + (t / block_) * d, d);
  return flops;
}

// The dE each block's keys receive, in place in embedding_grads_: causal, block j's is Σ_{i>j} dE_i.
// Returns its FLOPs ((n_B − 1)·D causal).
std::int64_t SinkhornAttention::block_embedding_grads(std::int64_t head, int thread) {
  const std::int64_t d = p_.head_dim, nb = blocks_;
  float* g = embedding_grads_.data() + head * nb * d;
  std::int64_t flops = 0;
  if (p_.causal) {
    float* suffix = running_.data() + thread * 2 * d;
    float* own = suffix + d;
    std::fill(suffix, suffix + d, 0.0f);
    for (std::int64_t i = nb - 1; i >= 0; --i) {
      std::copy(g + i * d, g + (i + 1) * d, own);
      std::copy(suffix, suffix + d, g + i * d);
      if (i == 0) break;
      add_row(suffix, own, d);
    }
    flops += (nb - 1) * d;
  }
  return flops;
}

std::string unsupported(const Problem& p, const SinkhornConfig& c) {
  if (p.causal && c.sortcut_blocks > 0) return "SortCut (sortcut_blocks > 0) is encoder only: it has no causal mode";
  return tiles::bf16_head_dim_unsupported("sinkhorn's bf16 form", p.dtype, p.head_dim);
}

std::unique_ptr<Mechanism> create(const Problem& problem, const SinkhornConfig& c, std::uint64_t seed) {
  return std::make_unique<SinkhornAttention>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, b = sinkhorn_block(p, c), nb = sinkhorn_blocks(p, c);
  const std::int64_t cut = sortcut(p, c);
  std::int64_t per_head =
      n * d + (p.causal ? (nb - 1) * d : 0) + matmul_flops(nb, d, d) + 2 * nb * d + matmul_flops(nb, nb, d) + nb * nb;
  per_head += p.causal ? 7 * nb * (nb - 1) / 2 : nb * nb * (2 + 10 * c.sinkhorn_iters);
  per_head += 2 * matmul_flops(sorted_rows(p, c), n, d);
  for (std::int64_t q0 = 0; q0 < n; q0 += b) {
    const std::int64_t rows = std::min(b, n - q0);
    per_head += tile_flops(rows, cut > 0 ? cut * b : rows + b, d);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, b = sinkhorn_block(p, c), nb = sinkhorn_blocks(p, c);
  const std::int64_t threads = p.threads;
  const std::int64_t floats = d * d + d + d * nb + nb + 2 * heads * nb * d + heads * nb * nb +
                              threads * (2 * d + 2 * nb + b * ops::padded_ld(score_cols(p, c)) + 2 * b);
  const std::int64_t sorted = 2 * heads * sorted_rows(p, c) * b * d;
  if (p.dtype != DType::BF16) return 4 * (floats + sorted);
  // bf16: K̃, Ṽ in bf16; per thread the tile's fp32 accumulator, the mixing's widened head and sums,
  // and its bf16 buffers.
  return 4 * (floats + threads * (b * d + sinkhorn_bf16_mixing_floats(p, c))) + 2 * sorted +
         GatheredScratchBf16::bytes(threads, b, score_cols(p, c), d, false);
}

std::int64_t backward_flops(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, b = sinkhorn_block(p, c), nb = sinkhorn_blocks(p, c);
  const std::int64_t cut = sortcut(p, c);
  std::int64_t per_head = 4 * matmul_flops(sorted_rows(p, c), n, d);
  for (std::int64_t q0 = 0; q0 < n; q0 += b) {
    const std::int64_t rows = std::min(b, n - q0), cols = cut > 0 ? cut * b : rows + b;
    per_head += 5 * matmul_flops(rows, cols, d) + kRecomputedSoftmaxBackwardFlopsPerElement * rows * cols +
                2 * rows * d + (cut > 0 ? 2 * cols * d : 0);
  }
  per_head += p.causal ? 5 * nb * (nb - 1) / 2 : nb * nb * (3 + 18 * c.sinkhorn_iters);
  per_head += matmul_flops(nb, d, nb) * 2 + matmul_flops(nb, d, d) * 2 + nb * nb + 2 * nb * d;
  per_head += n * d + (p.causal ? (nb - 1) * d : 0);
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, b = sinkhorn_block(p, c);
  const std::int64_t nb = sinkhorn_blocks(p, c), cols = score_cols(p, c), threads = p.threads;
  const bool bf16 = p.dtype == DType::BF16;
  const std::int64_t floats = heads * n + 2 * heads * nb * nb + 2 * heads * sorted_rows(p, c) * b * d + d * d + d +
                              d * nb + nb + 2 * heads * nb * d +
                              threads * ((bf16 ? 2 : 4) * cols * d + b * ops::padded_ld(cols)) +
                              (p.causal ? 0 : threads * 2 * c.sinkhorn_iters * nb * nb);
  return 4 * floats + (bf16 ? GatheredScratchBf16::bytes(threads, b, cols, d, true) : 0);
}

std::int64_t decode_workspace(const Problem& p, const SinkhornConfig& c, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, b = sinkhorn_block(p, c);
  const std::int64_t blocks = (p.seq_len + tokens + b - 1) / b;
  const std::int64_t state = 2 * heads * blocks * b * d + heads * 2 * b * d + heads * d;  // cache, K̃ and Ṽ, E
  if (p.dtype == DType::BF16)  // bf16 state; the network scratch [hidden, R row, widened E]
    return 4 * (d * blocks + blocks + heads * (2 * d + blocks)) + 2 * state;
  const std::int64_t floats = d * blocks + blocks + state + heads * 2 * d + heads * (d + blocks);  // step, network
  return 4 * floats;
}

FieldTable<SinkhornConfig> config_fields(const SinkhornConfig*) {
  return {
      int_field("block", &SinkhornConfig::block, 1, 65536, "tokens per block b (LRA: 50; clamped to N)"),
      int_field("sinkhorn_iters", &SinkhornConfig::sinkhorn_iters, 1, 100,
                "log-domain row+column normalisation rounds (non-causal; unconfirmed default)"),
      real_field("temperature", &SinkhornConfig::temperature, 0.01, 100,
                 "temperature tau dividing the sorting scores (unconfirmed default)"),
      int_field("sortcut_blocks", &SinkhornConfig::sortcut_blocks, 0, 65536,
                "SortCut: attend only to the first n_k sorted blocks (encoder only); 0 = off; clamped to the blocks")};
}

SinkhornConfig resolve(const Problem& p, SinkhornConfig c) {
  c.block = sinkhorn_block(p, c);
  c.sortcut_blocks = sortcut(p, c);
  return c;
}

template <>
Implementation implementation<SinkhornConfig>() {
  Implementation impl = implement<SinkhornConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
