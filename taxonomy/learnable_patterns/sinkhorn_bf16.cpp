// The bf16 form of `sinkhorn` (sinkhorn.hpp, "bf16"). The sorting part stays the fp32 form's — E
// (fp32 sums of the bf16 keys; causal: each prefix rounded to bf16, as the decode state holds it),
// the network, the balance and P, their gradients — and the attention side is bf16:
//   mixing: K̃_i = bf16(Σ_j P_ij·K_j), Ṽ_i likewise (the fp32 form's sgemm on a head's widened rows,
//     each sum rounded once); K̃, Ṽ are stored bf16;
//   attention of query block i: its keys [own block; K̃_i] (or the SortCut rows) gathered bf16, S on
//     the bf16 tile kernels, the fp32 masked softmax (exp_rows_masked), O = bf16((bf16(P)·V)/Σ)
//     (gathered_tile_bf16.hpp); lse saved in fp32;
//   backward: per query block gathered_tile_backward_bf16 (dQ rounded once; the own block's dK, dV
//     rounded into dk, dv; dK̃_i, dṼ_i kept fp32); dP = dK̃·K_blocksᵀ + dṼ·V_blocksᵀ in fp32 from the
//     bf16 blocks; the balance and network backward (fp32, shared with the fp32 form); then per key
//     block j: dK_j = bf16(dK_j + Σ_i P_ij·dK̃_i + dE_j), dV_j = bf16(dV_j + Σ_i P_ij·dṼ_i), so the own
//     block's share is rounded twice;
//   decode: the block cache, the open block's E and its K̃, Ṽ in bf16; a step attends one query row
//     over [its block so far; K̃, Ṽ] as the forward's tile does.
// FLOPs: the fp32 form's counts (the products the fp32 form runs on sgemm are counted here, as the
// bf16 kernels count nothing).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/stage_clock.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/pattern_common.hpp"
#include "taxonomy/learnable_patterns/sinkhorn.hpp"

namespace xfb {

namespace {

// acc [len] = Σ_{j < count} w[j]·x_j over the blocks x_j = x + j·stride, block j's first min(stride,
// total − j·stride) entries (a short last block is zero-padded); zero weights are skipped (causal P).
void mix_rows_bf16(const float* w, std::int64_t count, const bf16* x, std::int64_t stride, std::int64_t total,
                   float* acc) {
  std::fill(acc, acc + stride, 0.0f);
  for (std::int64_t j = 0; j < count; ++j) {
    if (w[j] == 0.0f) continue;
    const float weight = w[j];
    const bf16* row = x + j * stride;
    const std::int64_t len = std::min(stride, total - j * stride);
#pragma omp simd
    for (std::int64_t e = 0; e < len; ++e) acc[e] += weight * to_float(row[e]);
  }
}

// Σ_e a[e]·x[e] over len entries, fp32 (a fp32, x bf16).
float dot_bf16(const float* a, const bf16* x, std::int64_t len) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t e = 0; e < len; ++e) sum += a[e] * to_float(x[e]);
  return sum;
}

void copy_rows(const bf16* src, std::int64_t rows, std::int64_t d, bf16* dst) {
  std::memcpy(dst, src, static_cast<std::size_t>(rows * d) * sizeof(bf16));
}

}  // namespace

void SinkhornAttention::prepare_bf16() {
  const std::int64_t d = p_.head_dim, b = block_;
  tiles16_ = GatheredScratchBf16(threads_, b, score_cols_, d, false);
  tile_acc_ = Tensor(Shape{threads_, b, d});
  mix_rows_ = Tensor(Shape{threads_, sinkhorn_bf16_mixing_floats(p_, c_)});
}

void SinkhornAttention::forward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads;
  std::int64_t flops = route(k);
  flops += mix_blocks_bf16(k, sorted_k_);
  flops += mix_blocks_bf16(v, sorted_v_);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t task = 0; task < heads * blocks_; ++task)
    flops += attend_block_bf16(q, k, v, task / blocks_, task % blocks_, out, omp_get_thread_num());
  stage_clock::lap("attend");
  FlopCounter::add(flops);
  if (!block_keys_.empty()) load_decode_context(k, v);
}

// sorted_i = bf16(Σ_j P_ij · block_j) for the first sorted_rows_ rows of every head's P (blocks of
// b·D entries of x, the short last one zero-padded), the sums in fp32, each rounded once. Non-causal:
// per head, x widened into the thread's fp32 rows and the fp32 form's products (mix_blocks) on sgemm
// (row by row over the bf16 blocks, the mixing ran at half sgemm's rate: 1.8× fp32's time at 16K).
// Causal: row by row (mix_rows_bf16), skipping the zero weights of the blocks after row i (half the
// products; sgemm would run them all). Returns the FLOPs not counted by sgemm: the fp32 form's count
// of the mixing, B·H·2·n_r·N·D, is the same either way.
std::int64_t SinkhornAttention::mix_blocks_bf16(const Tensor& x, Tensor& sorted) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_, nb = blocks_, nr = sorted_rows_;
  const std::int64_t heads = p_.batch * p_.heads, full = n / b, rem = n % b;
  if (p_.causal) {
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 4)
    for (std::int64_t task = 0; task < heads * nr; ++task) {
      const std::int64_t head = task / nr, i = task % nr;
      float* acc = mix_rows_.data() + omp_get_thread_num() * mix_rows_.dim(1);
      mix_rows_bf16(permutation_.data() + (head * nb + i) * nb, nb, x.bf16_data() + head * n * d, b * d, n * d, acc);
      tiles::round_row(acc, b * d, sorted.bf16_data() + (head * nr + i) * b * d);
    }
    return heads * matmul_flops(nr, n, d);
  }
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
  for (std::int64_t head = 0; head < heads; ++head) {
    float* rows = mix_rows_.data() + omp_get_thread_num() * mix_rows_.dim(1);  // x [N, D], then sums [n_r, b·D]
    float* sums = rows + n * d;
    const float* weights = permutation_.data() + head * nb * nb;
    widen(x.bf16_data() + head * n * d, rows, n * d);
    if (full > 0)
      ops::gemm(false, false, nr, b * d, full, 1.0f, weights, nb, rows, b * d, 0.0f, sums, b * d);
    else
      std::fill(sums, sums + nr * b * d, 0.0f);
    if (rem > 0)
      ops::gemm(false, false, nr, rem * d, 1, 1.0f, weights + full, nb, rows + full * b * d, rem * d, 1.0f, sums,
                b * d);
    tiles::round_row(sums, nr * b * d, sorted.bf16_data() + head * nr * b * d);
  }
  return 0;
}

// The bf16 keys and values query block `block` attends to ([own block; K̃_i] gathered into b.keys and
// b.values, or the SortCut rows in place). Returns their count.
std::int64_t SinkhornAttention::gather_block_bf16(const Tensor& k, const Tensor& v, std::int64_t head,
                                                  std::int64_t block, const GatheredBf16Buffers& b, const bf16** keys,
                                                  const bf16** values) const {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, bs = block_;
  const std::int64_t q0 = block * bs, rows = std::min(bs, n - q0), sorted_at = head * sorted_rows_ * bs * d;
  *keys = sorted_k_.bf16_data() + sorted_at;
  *values = sorted_v_.bf16_data() + sorted_at;
  if (sortcut_ > 0) return sortcut_ * bs;
  copy_rows(k.bf16_data() + (head * n + q0) * d, rows, d, b.keys);
  copy_rows(v.bf16_data() + (head * n + q0) * d, rows, d, b.values);
  copy_rows(*keys + block * bs * d, bs, d, b.keys + rows * d);
  copy_rows(*values + block * bs * d, bs, d, b.values + rows * d);
  *keys = b.keys;
  *values = b.values;
  return rows + bs;
}

std::int64_t SinkhornAttention::attend_block_bf16(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t head,
                                                  std::int64_t block, Tensor& out, int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_;
  const std::int64_t q0 = block * b, rows = std::min(b, n - q0), at = (head * n + q0) * d;
  const GatheredBf16Buffers buffers = tiles16_.buffers(thread);
  const bf16 *keys = nullptr, *values = nullptr;
  const std::int64_t cols = gather_block_bf16(k, v, head, block, buffers, &keys, &values);
  float* scores = scores_.data() + thread * b * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * b;
  float* inverse = lse + b;
  std::int64_t flops = gathered_scores_bf16(q.bf16_data() + at, rows, keys, cols, d,
                                            1.0f / std::sqrt(static_cast<float>(d)), buffers, scores, score_ld_);
  const bool causal = p_.causal, cut = sortcut_ > 0;
  auto visible = [&](std::int64_t r, std::int64_t t) {
    return cut || (t < rows ? !causal || t <= r : !causal || block > 0);
  };
  flops += exp_rows_masked(scores, rows, cols, score_ld_, visible, lse, inverse);
  flops += gathered_values_bf16(scores, score_ld_, rows, cols, values, d, inverse, buffers,
                                tile_acc_.data() + thread * b * d, out.bf16_data() + at, d);
  if (!lse_.empty()) std::copy(lse, lse + rows, lse_.data() + head * n + q0);
  return flops;
}

// ---- backward -----------------------------------------------------------------------------------

void SinkhornAttention::prepare_backward_bf16() {
  grads16_ = GatheredScratchBf16(threads_, block_, score_cols_, p_.head_dim, true);
}

void SinkhornAttention::backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
  std::int64_t flops = 0;
  if (sortcut_ > 0) {  // one task per head, as the fp32 form; dK, dV get the mixing's share alone
    sorted_k_grads_.fill(0.0f);
    sorted_v_grads_.fill(0.0f);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < heads; ++head)
      for (std::int64_t block = 0; block < blocks_; ++block)
        flops += attend_block_backward_bf16(q, k, v, out, dout, head, block, dq, dk, dv, omp_get_thread_num());
  } else {
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t task = 0; task < heads * blocks_; ++task)
      flops += attend_block_backward_bf16(q, k, v, out, dout, task / blocks_, task % blocks_, dq, dk, dv,
                                          omp_get_thread_num());
  }
  mix_blocks_backward_bf16(k, v);
  flops += 2 * heads * matmul_flops(sorted_rows_, n, d);
  stage_clock::lap("backward_attend");
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += balance_backward(head, omp_get_thread_num());
  flops += sorting_network_backward();
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += block_embedding_grads(head, omp_get_thread_num());
  stage_clock::lap("backward_route");
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 4) reduction(+ : flops)
  for (std::int64_t task = 0; task < heads * blocks_; ++task)
    flops += spread_grads_bf16(task / blocks_, task % blocks_, dk, dv, omp_get_thread_num());
  flops += 2 * heads * matmul_flops(sorted_rows_, n, d);
  stage_clock::lap("backward_attend");
  FlopCounter::add(flops);
}

// The attention backward of one query block on its gathered bf16 rows (gather_block_bf16), scores
// recomputed and masked as attend_block_bf16 masks them: dQ rounded into dq; the own block's dK, dV
// rounded into dk, dv and dK̃_i, dṼ_i copied (SortCut: dK̃, dṼ added) in fp32.
std::int64_t SinkhornAttention::attend_block_backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v,
                                                           const Tensor& out, const Tensor& dout, std::int64_t head,
                                                           std::int64_t block, Tensor& dq, Tensor& dk, Tensor& dv,
                                                           int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_;
  const std::int64_t q0 = block * b, rows = std::min(b, n - q0), at = (head * n + q0) * d;
  const GatheredBf16Buffers buffers = grads16_.buffers(thread);
  const bf16 *keys = nullptr, *values = nullptr;
  const std::int64_t cols = gather_block_bf16(k, v, head, block, buffers, &keys, &values);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float* scores = scores_.data() + thread * b * score_ld_;
  std::int64_t flops = gathered_scores_bf16(q.bf16_data() + at, rows, keys, cols, d, scale, buffers, scores, score_ld_);
  if (sortcut_ == 0 && p_.causal) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    for (std::int64_t r = 0; r < rows; ++r) {
      std::fill(scores + r * score_ld_ + r + 1, scores + r * score_ld_ + rows, kNegInf);
      if (block == 0) std::fill(scores + r * score_ld_ + rows, scores + r * score_ld_ + cols, kNegInf);
    }
  }
  float* delta = row_stats_.data() + thread * 2 * b;
  flops += row_dots_bf16(dout.bf16_data() + at, out.bf16_data() + at, rows, d, delta);
  const GatheredTileBf16 tile{.rows = rows,
                              .cols = cols,
                              .d = d,
                              .ld = score_ld_,
                              .q = q.bf16_data() + at,
                              .k = keys,
                              .v = values,
                              .dout = dout.bf16_data() + at,
                              .lse = lse_.data() + head * n + q0,
                              .delta = delta};
  float* query_grads = tile_acc_.data() + thread * b * d;
  float* key_grads = key_rows_.data() + thread * 2 * score_cols_ * d;
  float* value_grads = key_grads + score_cols_ * d;
  flops += gathered_tile_backward_bf16(tile, scale, scores, score_grads_.data() + thread * b * score_ld_, buffers,
                                       query_grads, key_grads, value_grads);
  tiles::round_row(query_grads, rows * d, dq.bf16_data() + at);
  float* sorted_key_grads = sorted_k_grads_.data() + head * sorted_rows_ * b * d;
  float* sorted_value_grads = sorted_v_grads_.data() + head * sorted_rows_ * b * d;
  if (sortcut_ > 0) {
    add_row(sorted_key_grads, key_grads, cols * d);
    add_row(sorted_value_grads, value_grads, cols * d);
    return flops + 2 * cols * d;
  }
  tiles::round_row(key_grads, rows * d, dk.bf16_data() + at);
  tiles::round_row(value_grads, rows * d, dv.bf16_data() + at);
  std::copy(key_grads + rows * d, key_grads + cols * d, sorted_key_grads + block * b * d);
  std::copy(value_grads + rows * d, value_grads + cols * d, sorted_value_grads + block * b * d);
  return flops;
}

// dP[i, j] = dK̃_i·K_j + dṼ_i·V_j (fp32 sums over the bf16 blocks, the short last one through its
// rem·D entries) for i < n_r; rows beyond n_r: 0.
void SinkhornAttention::mix_blocks_backward_bf16(const Tensor& k, const Tensor& v) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_, nb = blocks_, nr = sorted_rows_;
  permutation_grads_.fill(0.0f);
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t task = 0; task < p_.batch * p_.heads * nr; ++task) {
    const std::int64_t head = task / nr, i = task % nr;
    const float* key_grads = sorted_k_grads_.data() + (head * nr + i) * b * d;
    const float* value_grads = sorted_v_grads_.data() + (head * nr + i) * b * d;
    float* row = permutation_grads_.data() + (head * nb + i) * nb;
    for (std::int64_t j = 0; j < nb; ++j) {
      const std::int64_t at = (head * n + j * b) * d, len = std::min(b, n - j * b) * d;
      row[j] = dot_bf16(key_grads, k.bf16_data() + at, len) + dot_bf16(value_grads, v.bf16_data() + at, len);
    }
  }
}

// Key block j of one head: dK_j = bf16(dK_j + Σ_{i<n_r} P_ij·dK̃_i + dE_j) and dV_j = bf16(dV_j +
// Σ_i P_ij·dṼ_i), dK_j, dV_j the attention's share in dk, dv (SortCut: none). Returns the FLOPs of
// the dE adds (rows·D; the mixing products are counted by the caller).
std::int64_t SinkhornAttention::spread_grads_bf16(std::int64_t head, std::int64_t block, Tensor& dk, Tensor& dv,
                                                  int thread) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_, nb = blocks_, nr = sorted_rows_;
  const std::int64_t rows = std::min(b, n - block * b), len = rows * d, at = (head * n + block * b) * d;
  float* acc = mix_rows_.data() + thread * b * d;
  const float* weights = permutation_.data() + head * nb * nb + block;  // column `block` of P, stride n_B
  const std::pair<Tensor*, const Tensor*> pairs[] = {{&dk, &sorted_k_grads_}, {&dv, &sorted_v_grads_}};
  for (const auto& [grads, sorted_grads] : pairs) {
    bf16* dst = grads->bf16_data() + at;
    if (sortcut_ > 0)
      std::fill(acc, acc + len, 0.0f);
    else
      widen(dst, acc, len);
    for (std::int64_t i = 0; i < nr; ++i) {
      const float w = weights[i * nb];
      if (w == 0.0f) continue;
      const float* src = sorted_grads->data() + (head * nr + i) * b * d;
#pragma omp simd
      for (std::int64_t e = 0; e < len; ++e) acc[e] += w * src[e];
    }
    if (grads == &dk) {
      const float* embedding = embedding_grads_.data() + (head * nb + block) * d;
      for (std::int64_t t = 0; t < rows; ++t) add_row(acc + t * d, embedding, d);
    }
    tiles::round_row(acc, len, dst);
  }
  return len;
}

// ---- decode -------------------------------------------------------------------------------------

// The bf16 state (block cache, E, the open block's K̃ and Ṽ) and the fp32 network scratch [hidden,
// R row, widened E]; a step's tile buffers are the forward's.
void SinkhornAttention::prepare_decode_bf16(std::int64_t blocks) {
  const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, b = block_;
  block_keys_ = Tensor(Shape{heads, blocks * b, d}, DType::BF16);
  block_values_ = Tensor(Shape{heads, blocks * b, d}, DType::BF16);
  decode_sorted_ = Tensor(Shape{heads, 2, b, d}, DType::BF16);
  decode_embeddings_ = Tensor(Shape{heads, d}, DType::BF16);
  decode_scratch_ = Tensor(Shape{heads, 2 * d + blocks});
}

// K̃, Ṽ of the open block `block` of one head from its P row (weights) over the cached blocks before
// it. Returns 2·2·block·b·D.
std::int64_t SinkhornAttention::mix_open_block_bf16(std::int64_t head, std::int64_t block, const float* weights) {
  const std::int64_t d = p_.head_dim, b = block_, rows = block_keys_.dim(1);
  float* acc = mix_rows_.data() + omp_get_thread_num() * b * d;
  bf16* sorted = decode_sorted_.bf16_data() + head * 2 * b * d;
  const Tensor* caches[] = {&block_keys_, &block_values_};
  for (int x = 0; x < 2; ++x) {
    mix_rows_bf16(weights, block, caches[x]->bf16_data() + head * rows * d, b * d, block * b * d, acc);
    tiles::round_row(acc, b * d, sorted + x * b * d);
  }
  return 2 * matmul_flops(1, b * d, block);
}

// E ← bf16(E + Σ of block `block`'s keys) (embed_blocks_as' recurrence, the same bits). Returns b·D.
std::int64_t SinkhornAttention::close_block_bf16(std::int64_t head, std::int64_t block) {
  const std::int64_t d = p_.head_dim, b = block_;
  float* sum = decode_scratch_.data() + head * decode_scratch_.dim(1);
  float* embedding = sum + d;
  const bf16* keys = block_keys_.bf16_data() + (head * block_keys_.dim(1) + block * b) * d;
  std::fill(sum, sum + d, 0.0f);
  for (std::int64_t t = 0; t < b; ++t)
    for (std::int64_t c = 0; c < d; ++c) sum[c] += to_float(keys[t * d + c]);
  bf16* e = decode_embeddings_.bf16_data() + head * d;
  widen(e, embedding, d);
  for (std::int64_t c = 0; c < d; ++c) e[c] = to_bf16(embedding[c] + sum[c]);
  return b * d;
}

void SinkhornAttention::load_decode_context_bf16(const Tensor& k, const Tensor& v) {
  const std::int64_t n = p_.seq_len, d = p_.head_dim, b = block_, complete = n / b;
#pragma omp parallel for num_threads(threads_) schedule(static)
  for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
    const std::int64_t rows = block_keys_.dim(1);
    copy_rows(k.bf16_data() + head * n * d, n, d, block_keys_.bf16_data() + head * rows * d);
    copy_rows(v.bf16_data() + head * n * d, n, d, block_values_.bf16_data() + head * rows * d);
    std::fill_n(decode_embeddings_.bf16_data() + head * d, d, bf16{});
    for (std::int64_t block = 0; block < complete; ++block) close_block_bf16(head, block);
    start_block(head, complete);
  }
  open_block_ = complete;
  filled_ = n - complete * b;
}

void SinkhornAttention::decode_step_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
  const std::int64_t heads = p_.batch * p_.heads;
  std::int64_t flops = 0;
  if (filled_ == block_) {  // the previous token completed its block: E grows by its keys, the next one opens
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
    for (std::int64_t head = 0; head < heads; ++head)
      flops += close_block_bf16(head, open_block_) + start_block(head, open_block_ + 1);
    ++open_block_;
    filled_ = 0;
    stage_clock::lap("route");
  }
#pragma omp parallel for num_threads(threads_) schedule(static) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += attend_step_bf16(q, k, v, out, head, omp_get_thread_num());
  FlopCounter::add(flops);
  ++filled_;
  stage_clock::lap("attend");
}

// One head's step: the token's key and value cached, its query over [its block so far; K̃, Ṽ of the
// block] as one row of the forward's tile (the same roundings). Returns the fp32 step's FLOPs:
// D (scale) + attend_rows over each run + D (finish).
std::int64_t SinkhornAttention::attend_step_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                                 std::int64_t head, int thread) {
  const std::int64_t d = p_.head_dim, b = block_, own = filled_ + 1;
  const std::int64_t row0 = head * block_keys_.dim(1) + open_block_ * b;
  copy_rows(k.bf16_data() + head * d, 1, d, block_keys_.bf16_data() + (row0 + filled_) * d);
  copy_rows(v.bf16_data() + head * d, 1, d, block_values_.bf16_data() + (row0 + filled_) * d);
  const GatheredBf16Buffers buffers = tiles16_.buffers(thread);
  copy_rows(block_keys_.bf16_data() + row0 * d, own, d, buffers.keys);
  copy_rows(block_values_.bf16_data() + row0 * d, own, d, buffers.values);
  const std::int64_t sorted = open_block_ > 0 ? b : 0;
  if (sorted > 0) {
    const bf16* block = decode_sorted_.bf16_data() + head * 2 * b * d;
    copy_rows(block, b, d, buffers.keys + own * d);
    copy_rows(block + b * d, b, d, buffers.values + own * d);
  }
  float* scores = scores_.data() + thread * b * score_ld_;
  float* lse = row_stats_.data() + thread * 2 * b;
  gathered_scores_bf16(q.bf16_data() + head * d, 1, buffers.keys, own + sorted, d,
                       1.0f / std::sqrt(static_cast<float>(d)), buffers, scores, score_ld_);
  exp_rows_masked(
      scores, 1, own + sorted, score_ld_, [](std::int64_t, std::int64_t) { return true; }, lse, lse + b);
  gathered_values_bf16(scores, score_ld_, 1, own + sorted, buffers.values, d, lse + b, buffers,
                       tile_acc_.data() + thread * b * d, out.bf16_data() + head * d, d);
  return 2 * d + attend_rows_flops(own, d) + (sorted > 0 ? attend_rows_flops(sorted, d) : 0);
}

}  // namespace xfb
