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

}  // namespace xfb
