#include "taxonomy/learnable_patterns/sinkhorn.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "lib/core/stage_clock.hpp"
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

void exp_in_place(float* x, std::int64_t n) {
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) x[j] = ops::fast_exp(x[j]);
}

}  // namespace

SinkhornAttention::SinkhornAttention(const Problem& problem, const SinkhornConfig& config, std::uint64_t seed)
    : p_(problem),
      c_(config),
      seed_(seed),
      block_(sinkhorn_block(problem, config)),
      blocks_(sinkhorn_blocks(problem, config)),
      sortcut_(sortcut(problem, config)),
      sorted_rows_(sorted_rows(problem, config)),
      score_cols_(score_cols(problem, config)),
      score_ld_(ops::padded_ld(score_cols_)) {}

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
  CounterRng(seed_, "sinkhorn/w2").fill_normal(w2_, 0.0f, spread);
  CounterRng(seed_, "sinkhorn/b2").fill_normal(b2_, 0.0f, spread);
  embeddings_ = Tensor(Shape{heads * nb, d});
  hidden_ = Tensor(Shape{heads * nb, d});
  permutation_ = Tensor(Shape{p_.batch, p_.heads, nb, nb});
  sorted_k_ = Tensor(Shape{heads, sorted_rows_ * block_, d});
  sorted_v_ = Tensor(Shape{heads, sorted_rows_ * block_, d});
  running_ = Tensor(Shape{threads_, 2, d});
  scratch_ = Tensor(Shape{threads_, 2, nb});
  scores_ = Tensor(Shape{threads_, block_, score_ld_});
  row_stats_ = Tensor(Shape{threads_, 2, block_});
}

std::vector<NamedTensor> SinkhornAttention::parameters() const {
  return {{"w1", &w1_}, {"b1", &b1_}, {"w2", &w2_}, {"b2", &b2_}, {"permutation", &permutation_}};
}

std::vector<float> SinkhornAttention::permutation(std::int64_t b, std::int64_t h) const {
  const float* first = permutation_.data() + (b * p_.heads + h) * blocks_ * blocks_;
  return {first, first + blocks_ * blocks_};
}

void SinkhornAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads;
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += embed_blocks(k, head, omp_get_thread_num());
  flops += sorting_network();
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += balance(head, omp_get_thread_num());
  stage_clock::lap("route");
  mix_blocks(k, sorted_k_);
  mix_blocks(v, sorted_v_);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t task = 0; task < heads * blocks_; ++task)
    flops += attend_block(q, k, v, task / blocks_, task % blocks_, out, omp_get_thread_num());
  stage_clock::lap("attend");
  FlopCounter::add(flops);
}

// E_i = Σ keys of block i; causal: E_i = Σ keys of blocks before i.
std::int64_t SinkhornAttention::embed_blocks(const Tensor& k, std::int64_t head, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, nb = blocks_;
  const float* keys = k.data() + head * n * d;
  float* e = embeddings_.data() + head * nb * d;
  std::fill(e, e + nb * d, 0.0f);
  for (std::int64_t t = 0; t < n; ++t) {
    float* sum = e + (t / block_) * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) sum[j] += keys[t * d + j];
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
  ops::MatmulShape mix{.batch = heads, .m = nr, .n = b * d, .k = full, .lda = nb, .ldb = b * d, .ldc = b * d,
                       .stride_a = nb * nb, .stride_b = n * d, .stride_c = nr * b * d};
  ops::matmul(mix, permutation_.data(), x.data(), sorted.data());
  if (rem == 0) return;
  ops::MatmulShape tail{.batch = heads, .m = nr, .n = rem * d, .k = 1, .lda = nb, .ldb = rem * d, .ldc = b * d,
                        .stride_a = nb * nb, .stride_b = n * d, .stride_c = nr * b * d, .accumulate = true};
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
    flops = exp_rows_masked(scores, rows, cols, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse,
                            inverse);
    ops::gemm(false, false, rows, d, cols, 1.0f, scores, score_ld_, sorted_values, d, 0.0f, dst, d);
  } else {
    const std::int64_t own = rows;
    ops::gemm(false, true, rows, own, d, scale, queries, d, k.data() + (head * n + q0) * d, d, 0.0f, scores,
              score_ld_);
    ops::gemm(false, true, rows, b, d, scale, queries, d, sorted_keys + block * b * d, d, 0.0f, scores + own,
              score_ld_);
    const bool causal = p_.causal;
    auto visible = [&](std::int64_t r, std::int64_t t) {
      return t < own ? !causal || t <= r : !causal || block > 0;
    };
    flops = exp_rows_masked(scores, rows, own + b, score_ld_, visible, lse, inverse);
    ops::gemm(false, false, rows, d, own, 1.0f, scores, score_ld_, v.data() + (head * n + q0) * d, d, 0.0f, dst, d);
    ops::gemm(false, false, rows, d, b, 1.0f, scores + own, score_ld_, sorted_values + block * b * d, d, 1.0f, dst,
              d);
  }
  for (std::int64_t r = 0; r < rows; ++r) scale_row(dst + r * d, dst + r * d, inverse[r], d);
  return flops + rows * d;
}

namespace {

std::string unsupported(const Problem& p, const SinkhornConfig& c) {
  if (p.causal && c.sortcut_blocks > 0)
    return "SortCut (sortcut_blocks > 0) is encoder only: it has no causal mode";
  return "";
}

std::unique_ptr<Mechanism> create(const Problem& problem, const SinkhornConfig& c, std::uint64_t seed) {
  return std::make_unique<SinkhornAttention>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const SinkhornConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, b = sinkhorn_block(p, c), nb = sinkhorn_blocks(p, c);
  const std::int64_t cut = sortcut(p, c);
  std::int64_t per_head = n * d + (p.causal ? (nb - 1) * d : 0) + matmul_flops(nb, d, d) + 2 * nb * d +
                          matmul_flops(nb, nb, d) + nb * nb;
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
                              2 * heads * sorted_rows(p, c) * b * d +
                              threads * (2 * d + 2 * nb + b * ops::padded_ld(score_cols(p, c)) + 2 * b);
  return 4 * floats;
}

}  // namespace

Implementation sinkhorn_implementation() {
  return implement(ModelSpec<SinkhornConfig>{
      .fields = {int_field("block", &SinkhornConfig::block, 1, 65536, "tokens per block b (LRA: 50)"),
                 int_field("sinkhorn_iters", &SinkhornConfig::sinkhorn_iters, 1, 100,
                           "log-domain row+column normalisation rounds (non-causal; unconfirmed default)"),
                 real_field("temperature", &SinkhornConfig::temperature, 0.01, 100,
                            "temperature tau dividing the sorting scores (unconfirmed default)"),
                 int_field("sortcut_blocks", &SinkhornConfig::sortcut_blocks, 0, 65536,
                           "SortCut: attend only to the first n_k sorted blocks (encoder only); 0 = off")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, SinkhornConfig c) {
        c.block = sinkhorn_block(p, c);
        c.sortcut_blocks = sortcut(p, c);
        return c;
      },
      .unsupported = unsupported});
}

}  // namespace xfb
