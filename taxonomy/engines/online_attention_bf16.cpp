#include "taxonomy/engines/online_attention_bf16.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels_bf16.hpp"

namespace xfb {
void round_tile_rows(const float* tile, std::int64_t ld, std::int64_t rows, std::int64_t cols, bf16* out) {
  for (std::int64_t r = 0; r < rows; ++r) {
    tiles::round_row(tile + r * ld, cols, out + r * ld);
    if (cols % 2 == 1) out[r * ld + cols] = bf16{};
  }
}

namespace {
std::int64_t score_stride(std::int64_t block_k) { return tiles::panels_for(block_k) * tiles::kPanel; }

// The same tile rounded to bf16 row pairs with ld (the missing odd row 0).
void round_tile_pairs(const float* tile, std::int64_t ld, std::int64_t rows, std::int64_t cols, bf16* out) {
  for (std::int64_t r = 0; r < rows; r += 2)
    tiles::round_row_pair(tile + r * ld, r + 1 < rows ? tile + (r + 1) * ld : nullptr, cols, out + r * ld);
}
}  // namespace

OnlineBuffersBf16::OnlineBuffersBf16(std::int64_t threads, std::int64_t block_q, std::int64_t block_k, std::int64_t d)
    : block_q_(block_q),
      d_(d),
      lds_(score_stride(block_k)),
      scores_(Shape{threads, kOnlineStripRows, lds_}),
      probs_(Shape{threads, kOnlineStripRows, lds_}, DType::BF16),
      accumulators_(Shape{threads, block_q, d}),
      row_stats_(Shape{threads, 2, block_q}) {}

std::int64_t OnlineBuffersBf16::bytes(std::int64_t threads, std::int64_t block_q, std::int64_t block_k,
                                      std::int64_t d) {
  constexpr std::int64_t kF32 = sizeof(float), kBf16 = sizeof(bf16);
  return threads * (kOnlineStripRows * score_stride(block_k) * (kF32 + kBf16) + (block_q * d + 2 * block_q) * kF32);
}

OnlineScratchBf16 OnlineBuffersBf16::scratch(int thread) {
  float* row_max = row_stats_.data() + thread * 2 * block_q_;
  return {scores_.data() + thread * kOnlineStripRows * lds_,
          probs_.bf16_data() + thread * kOnlineStripRows * lds_,
          lds_,
          accumulators_.data() + thread * block_q_ * d_,
          row_max,
          row_max + block_q_};
}

void pack_heads_bf16(const Tensor& k, const Tensor& v, int threads, Tensor& packed_keys, Tensor& packed_values) {
  const std::int64_t heads = k.dim(0) * k.dim(1), n = k.dim(2), d = k.dim(3);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t head = 0; head < heads; ++head) {
    tiles::pack_key_pair_panels(k.bf16_data() + head * n * d, d, n, d,
                                packed_keys.bf16_data() + head * packed_keys.dim(1));
    tiles::pack_row_pairs(v.bf16_data() + head * n * d, d, n, d,
                          packed_values.bf16_data() + head * packed_values.dim(1));
  }
}

std::int64_t attend_online_bf16(const OnlineBlockBf16& block, const OnlineScratchBf16& scratch, bf16* out, float* lse) {
  const std::int64_t d = block.d, rows = block.rows, lds = scratch.lds, q0 = block.q0;
  float *acc = scratch.acc, *row_max = scratch.row_max, *row_sum = scratch.row_sum;
  std::fill(acc, acc + rows * d, 0.0f);
  std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(row_sum, row_sum + rows, 0.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int64_t key_end = block.causal ? std::min(block.keys, q0 + rows) : block.keys;
  std::int64_t flops = 0;
  for (std::int64_t k0 = 0; k0 < key_end; k0 += block.block_k) {
    const std::int64_t cols = std::min(block.block_k, key_end - k0);
    for (std::int64_t s0 = 0; s0 < rows; s0 += kOnlineStripRows) {
      const std::int64_t strip_rows = std::min(kOnlineStripRows, rows - s0);
      tiles::scores_bf16(block.q + s0 * d, d, strip_rows, block.key_panels + k0 * d, tiles::panels_for(cols), d, scale,
                         scratch.scores, lds);
      flops += matmul_flops(strip_rows, tiles::panels_for(cols) * tiles::kPanel, d);
      for (std::int64_t r = 0; r < strip_rows; ++r) {
        float* row = scratch.scores + r * lds;
        const std::int64_t i = s0 + r;
        const std::int64_t valid = block.causal ? std::clamp<std::int64_t>(q0 + i - k0 + 1, 0, cols) : cols;
        if (valid == 0) {
          std::fill(row, row + cols, 0.0f);
          continue;
        }
        ops::online_softmax_step(row, valid, cols, row_max[i], row_sum[i], acc + i * d, d);
        flops += kOnlineSoftmaxFlopsPerElement * valid + d;
      }
      round_tile_rows(scratch.scores, lds, strip_rows, cols, scratch.probs);
      tiles::accumulate_pv_bf16(scratch.probs, lds, strip_rows, cols, block.value_pairs + k0 * d, d, acc + s0 * d, d);
      flops += matmul_flops(strip_rows, d, cols);
    }
  }
  if (lse != nullptr)
    for (std::int64_t r = 0; r < rows; ++r) lse[r] = row_max[r] + std::log(row_sum[r]);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float inverse = 1.0f / row_sum[r];
    float* src = acc + r * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) src[j] *= inverse;
    tiles::round_row(src, d, out + r * d);
  }
  return flops + rows * d;
}

OnlineBackwardBf16::OnlineBackwardBf16(std::int64_t threads, std::int64_t rows, std::int64_t keys, std::int64_t block_k,
                                       std::int64_t d)
    : ld_(score_stride(block_k)),
      tile_grads_(Shape{threads, 2, kOnlineBackwardStripRows, ld_}),
      tile_bf16_(Shape{threads, 3, kOnlineBackwardStripRows, ld_}, DType::BF16),  // P pairs, dS rows, dS pairs
      query_pairs_(Shape{threads, 2, head_pair_elements(rows, d)}, DType::BF16),  // Q, dO
      key_pairs_(Shape{threads, head_pair_elements(keys, d)}, DType::BF16),
      panels_(Shape{threads, 2, head_panel_elements(keys, d)}, DType::BF16),  // K, V
      query_grads_(Shape{threads, rows, d}),
      block_grads_(Shape{threads, 2, block_k, d}) {}  // dK, dV of a key block

std::int64_t OnlineBackwardBf16::bytes(std::int64_t threads, std::int64_t rows, std::int64_t keys, std::int64_t block_k,
                                       std::int64_t d) {
  constexpr std::int64_t kF32 = sizeof(float), kBf16 = sizeof(bf16);
  const std::int64_t strip = kOnlineBackwardStripRows * score_stride(block_k);
  return threads * ((2 * strip + rows * d + 2 * block_k * d) * kF32 +
                    (3 * strip + 2 * head_pair_elements(rows, d) + head_pair_elements(keys, d) +
                     2 * head_panel_elements(keys, d)) *
                        kBf16);
}

OnlineBackwardBf16::Packs OnlineBackwardBf16::packs(int thread) {
  const std::int64_t query = query_pairs_.dim(2), key = key_pairs_.dim(1), panel = panels_.dim(2);
  bf16* queries = query_pairs_.bf16_data() + thread * 2 * query;
  bf16* panels = panels_.bf16_data() + thread * 2 * panel;
  return {queries, queries + query, key_pairs_.bf16_data() + thread * key, panels, panels + panel};
}

std::int64_t OnlineBackwardBf16::head_backward(const OnlineBackwardHeadBf16& g, int thread) {
  const std::int64_t rows = g.rows, keys = g.keys, d = g.d, bk = g.block_k, strip = kOnlineBackwardStripRows;
  for (std::int64_t i = 0; i < rows; ++i) {
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t c = 0; c < d; ++c) dot += to_float(g.dout[i * d + c]) * to_float(g.out[i * d + c]);
    g.delta[i] = dot;
  }
  const Packs p = packs(thread);
  tiles::pack_row_pairs(g.q, d, rows, d, p.query_pairs);
  tiles::pack_row_pairs(g.dout, d, rows, d, p.dout_pairs);
  tiles::pack_row_pairs(g.k, d, keys, d, p.key_pairs);
  tiles::pack_key_pair_panels(g.k, d, keys, d, p.key_panels);
  tiles::pack_key_pair_panels(g.v, d, keys, d, p.value_panels);
  float* dq = query_grads(thread);
  float* dk = block_grads_.data() + thread * 2 * block_grads_.dim(2) * d;
  float* dv = dk + block_grads_.dim(2) * d;
  std::fill(dq, dq + rows * d, 0.0f);
  std::int64_t flops = 2 * rows * d;
  for (std::int64_t k0 = 0; k0 < keys; k0 += bk) {
    const std::int64_t block_keys = std::min(bk, keys - k0);
    std::fill(dk, dk + block_keys * d, 0.0f);
    std::fill(dv, dv + block_keys * d, 0.0f);
    for (std::int64_t q0 = g.causal ? k0 / strip * strip : 0; q0 < rows; q0 += strip) {
      const std::int64_t strip_rows = std::min(strip, rows - q0);
      const std::int64_t key_end = g.causal ? q0 + strip_rows : keys;
      flops += tile_backward(g, p, q0, strip_rows, k0, std::min(bk, key_end - k0), dk, dv, thread);
    }
    tiles::round_row(dk, block_keys * d, g.dk + k0 * d);
    tiles::round_row(dv, block_keys * d, g.dv + k0 * d);
  }
  return flops;
}

// The [rows, cols] tile at (q0, k0): S and dP on the bf16 kernels, P and dS in fp32 from the saved
// log-sum-exp, rounded to bf16 (P in row pairs; dS in rows and row pairs), then dV += Pᵀ·dO,
// dK += scale·dSᵀ·Q, dQ += scale·dS·K. Returns its FLOPs.
std::int64_t OnlineBackwardBf16::tile_backward(const OnlineBackwardHeadBf16& g, const Packs& packs, std::int64_t q0,
                                               std::int64_t rows, std::int64_t k0, std::int64_t cols, float* dk,
                                               float* dv, int thread) {
  const std::int64_t d = g.d, ld = ld_, strip = kOnlineBackwardStripRows, panels = tiles::panels_for(cols);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  float* probs = tile_grads_.data() + thread * 2 * strip * ld;
  float* grads = probs + strip * ld;
  bf16* prob_pairs = tile_bf16_.bf16_data() + thread * 3 * strip * ld;
  bf16* grad_rows = prob_pairs + strip * ld;
  bf16* grad_pairs = grad_rows + strip * ld;
  const float* lse = g.lse + q0;
  const float* delta = g.delta + q0;
  tiles::scores_bf16(g.q + q0 * d, d, rows, packs.key_panels + k0 * d, panels, d, scale, probs, ld);
  tiles::scores_bf16(g.dout + q0 * d, d, rows, packs.value_panels + k0 * d, panels, d, 1.0f, grads, ld);
  std::int64_t flops = 2 * matmul_flops(rows, panels * tiles::kPanel, d);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t valid = g.causal ? std::clamp<std::int64_t>(q0 + r - k0 + 1, 0, cols) : cols;
    tiles::softmax_grad_interval(probs + r * ld, grads + r * ld, 0, valid, cols, lse[r], delta[r]);
    flops += kRecomputedSoftmaxBackwardFlopsPerElement * valid;
  }
  round_tile_pairs(probs, ld, rows, cols, prob_pairs);
  round_tile_rows(grads, ld, rows, cols, grad_rows);
  round_tile_pairs(grads, ld, rows, cols, grad_pairs);
  tiles::accumulate_transposed_bf16(prob_pairs, ld, rows, cols, packs.dout_pairs + q0 * d, d, 1.0f, dv, d);
  tiles::accumulate_transposed_bf16(grad_pairs, ld, rows, cols, packs.query_pairs + q0 * d, d, scale, dk, d);
  tiles::accumulate_pv_bf16(grad_rows, ld, rows, cols, packs.key_pairs + k0 * d, d, query_grads(thread) + q0 * d, d,
                            scale);
  return flops + 3 * matmul_flops(rows, cols, d);
}

}  // namespace xfb
