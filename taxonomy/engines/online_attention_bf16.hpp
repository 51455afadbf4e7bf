#pragma once
// One block of query rows of a head against the head's keys on the bf16 tile kernels, with the
// online softmax of exact-tiled (issue 31), and the backward of one head from its saved log-sum-exp:
// exact-tiled's bf16 forward and backward and funnel's pooled queries run on them.
//
// Operands: q [rows, D] bf16 (row stride D); the head's `keys` keys in pair panels
// (tiles::pack_key_pair_panels) and its values in row pairs (tiles::pack_row_pairs); D % 16 == 0.
// Per key tile of ≤ block_k keys (block_k a multiple of the 16-key panel) and strip of
// kOnlineStripRows query rows: S = Q·Kᵀ/√D in fp32 over whole panels, the running row max and sum in
// fp32, the tile's exponentials rounded to bf16, P·V accumulated in fp32; at the end each row's
// accumulator divided by its sum and rounded to bf16. Causal: the block's row r (position q0 + r)
// sees keys j ≤ q0 + r, and key tiles end at the block's last row.
// FLOPs (returned, not added to FlopCounter): per strip and key tile of c keys
// 2·rows·16⌈c/16⌉·D (scores) + 2·rows·c·D (P·V) + per row kOnlineSoftmaxFlopsPerElement·valid + D
// (rescale); + rows·D (1/l) — the fp32 walk's count.
#include <cstdint>

#include "lib/core/bf16.hpp"
#include "lib/core/tensor.hpp"
#include "lib/core/tile_kernels.hpp"

namespace xfb {

// Query rows per strip, as the fp32 walk's (exact_tiled.cpp's kStripRows, measured there): the
// strip's scores stay in cache between scores, softmax and P·V.
inline constexpr std::int64_t kOnlineStripRows = 32;

// One thread's buffers for blocks of ≤ block_q rows: scores [kOnlineStripRows, lds] fp32 and probs
// [kOnlineStripRows, lds] bf16 (lds ≥ block_k, whole panels), acc [block_q, D] fp32, the row max
// and sum [block_q] fp32 each.
struct OnlineScratchBf16 {
  float* scores;
  bf16* probs;
  std::int64_t lds;
  float* acc;
  float* row_max;
  float* row_sum;
};

// The per-thread buffers of OnlineScratchBf16 for blocks of ≤ block_q rows and key tiles of ≤ block_k
// keys (lds = block_k rounded up to whole panels).
class OnlineBuffersBf16 {
 public:
  OnlineBuffersBf16() = default;
  OnlineBuffersBf16(std::int64_t threads, std::int64_t block_q, std::int64_t block_k, std::int64_t d);
  static std::int64_t bytes(std::int64_t threads, std::int64_t block_q, std::int64_t block_k, std::int64_t d);
  OnlineScratchBf16 scratch(int thread);

 private:
  std::int64_t block_q_ = 0, d_ = 0, lds_ = 0;
  Tensor scores_, probs_, accumulators_, row_stats_;
};

// A block: `rows` query rows from q (the first at position q0) against `keys` keys.
struct OnlineBlockBf16 {
  const bf16* q;
  std::int64_t q0, rows;
  const bf16* key_panels;
  const bf16* value_pairs;
  std::int64_t keys, block_k, d;
  bool causal;
};

// Writes the block's output rows to out [rows, D] bf16 and, when lse is not null, each row's
// log-sum-exp (fp32) to lse[r]. Returns the FLOPs (header).
std::int64_t attend_online_bf16(const OnlineBlockBf16& block, const OnlineScratchBf16& scratch, bf16* out, float* lse);

// Every head's keys of k ([B, H, N, D] bf16) into pair panels (packed_keys [B·H, head_panel_elements])
// and values of v into row pairs (packed_values [B·H, head_pair_elements]), the operands of
// attend_online_bf16.
void pack_heads_bf16(const Tensor& k, const Tensor& v, int threads, Tensor& packed_keys, Tensor& packed_values);

// The backward of one head: `rows` query rows (q, out, dout [rows, D] bf16; their saved log-sum-exp
// lse [rows]) against `keys` keys (k, v [keys, D] bf16), D % 16 == 0; causal: row i sees keys j ≤ i.
// δ_i = Σ dO_i·O_i (fp32, written to delta [rows]); per key block of block_k keys (whole panels) and
// strip of kOnlineBackwardStripRows rows that sees it: S = Q·Kᵀ/√D and dP = dO·Vᵀ on the bf16 kernels,
// P = exp(S − lse) and dS = P·(dP − δ) in fp32, rounded to bf16 for the products dV += Pᵀ·dO,
// dK += dSᵀ·Q/√D (fp32 per key block, rounded once into dk, dv [keys, D]) and dQ += dS·K/√D (fp32 over
// the whole head, in query_grads(thread) [rows, D]: the caller rounds it or maps it).
// FLOPs (returned, not added to FlopCounter): 2·rows·D + per tile of r rows and c keys
// 2·2·r·16⌈c/16⌉·D + 3·2·r·c·D + kRecomputedSoftmaxBackwardFlopsPerElement·(entries kept).
inline constexpr std::int64_t kOnlineBackwardStripRows = 128;  // exact-tiled's measured strip (exact_tiled.cpp)

struct OnlineBackwardHeadBf16 {
  const bf16 *q, *k, *v, *out, *dout;
  bf16 *dk, *dv;
  const float* lse;
  float* delta;
  std::int64_t rows, keys, d, block_k;
  bool causal;
};

// One thread's buffers of the backward for heads of ≤ rows query rows and ≤ keys keys: P and dP
// tiles in fp32 and their bf16 roundings, Q, dO and K in row pairs, K and V in pair panels, dQ of the
// head and dK, dV of a key block in fp32.
class OnlineBackwardBf16 {
 public:
  OnlineBackwardBf16() = default;
  OnlineBackwardBf16(std::int64_t threads, std::int64_t rows, std::int64_t keys, std::int64_t block_k, std::int64_t d);
  static std::int64_t bytes(std::int64_t threads, std::int64_t rows, std::int64_t keys, std::int64_t block_k,
                            std::int64_t d);
  std::int64_t head_backward(const OnlineBackwardHeadBf16& head, int thread);
  float* query_grads(int thread) { return query_grads_.data() + thread * query_grads_.dim(1) * query_grads_.dim(2); }

 private:
  struct Packs {
    bf16 *query_pairs, *dout_pairs, *key_pairs, *key_panels, *value_panels;
  };
  Packs packs(int thread);
  std::int64_t tile_backward(const OnlineBackwardHeadBf16& g, const Packs& packs, std::int64_t q0, std::int64_t rows,
                             std::int64_t k0, std::int64_t cols, float* dk, float* dv, int thread);

  std::int64_t ld_ = 0;
  Tensor tile_grads_, tile_bf16_, query_pairs_, key_pairs_, panels_, query_grads_, block_grads_;
};

// fp32 rows (stride ld) of a [rows, cols] tile rounded to bf16 plain rows (stride ld; the entry
// after an odd last column zeroed: the P·V kernel reads column pairs).
void round_tile_rows(const float* tile, std::int64_t ld, std::int64_t rows, std::int64_t cols, bf16* out);

// Elements of one head's K pair panels and V row pairs for n keys (D features).
inline std::int64_t head_panel_elements(std::int64_t n, std::int64_t d) {
  return tiles::panels_for(n) * tiles::kPanel * d;
}
inline std::int64_t head_pair_elements(std::int64_t n, std::int64_t d) { return (n + 1) / 2 * 2 * d; }

}  // namespace xfb
