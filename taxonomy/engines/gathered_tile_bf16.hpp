#pragma once
// The bf16 form of a gathered softmax tile (pattern_common.hpp's tile_scores, tile_values and
// gathered_tile_backward), shared by the learnable-pattern models whose tiles gather their rows by a
// learned pattern. Query rows Q [rows, D], key and value rows K, V [cols, D]: bf16, contiguous (row
// stride D); D % 16 == 0 (tiles::fits_head_dim). Products on the bf16 tile kernels
// (lib/core/tile_kernels_bf16.hpp): bf16 operands, fp32 accumulation.
//   gathered_scores_bf16: K packed into key pair panels, S = scale·Q·Kᵀ in fp32 (scores_bf16; the
//     last panel's padding columns are computed too, as 0 scores). The caller's softmax
//     (exp_rows_masked) then turns S into p = exp(S − M) in place and gives 1/Σ per row.
//   gathered_values_bf16: p rounded to bf16 rows, V in row pairs, O = bf16((P·V)·(1/Σ)), the sum in
//     fp32 (accumulate_pv_bf16).
//   gathered_tile_backward_bf16: on the recomputed S (−inf where a query does not see a key), with
//     the saved L and δ = dO·O (fp32): P = exp(S − L) in fp32, rounded to bf16 for the products;
//     dV = Pᵀ·dO; dP = dO·Vᵀ (fp32); dS = P ⊙ (dP − δ) in fp32 from the unrounded P, rounded to
//     bf16; dQ = scale·dS·K, dK = scale·dSᵀ·Q. dq, dk, dv are fp32 and overwritten.
// FLOPs: those of the fp32 tile (2·rows·cols·D per product; the softmax backward's
// kRecomputedSoftmaxBackwardFlopsPerElement per entry); the kernels count nothing themselves, so
// each function returns all of its own.
#include <cstdint>

#include "lib/core/bf16.hpp"
#include "lib/core/tensor.hpp"

namespace xfb {

// One thread's bf16 buffers for tiles of ≤ rows query rows and ≤ cols keys (ld = padded_ld(cols)):
// gathered keys and values [cols, D] each, key panels and value panels or pairs (panels_for(cols)·16·D
// each), P rows [rows, ld]; with the backward also P and dS in row pairs (⌈rows/2⌉·2·ld each), dS rows
// [rows, ld], dO and Q row pairs (⌈rows/2⌉·2·D each) and K row pairs (⌈cols/2⌉·2·D).
struct GatheredBf16Buffers {
  bf16 *keys = nullptr, *values = nullptr, *key_panels = nullptr, *value_panels = nullptr, *probs = nullptr;
  bf16 *prob_pairs = nullptr, *grads = nullptr, *grad_pairs = nullptr, *dout_pairs = nullptr, *query_pairs = nullptr,
       *key_pairs = nullptr;
};

class GatheredScratchBf16 {
 public:
  GatheredScratchBf16() = default;
  GatheredScratchBf16(std::int64_t threads, std::int64_t rows, std::int64_t cols, std::int64_t d, bool backward);
  static std::int64_t bytes(std::int64_t threads, std::int64_t rows, std::int64_t cols, std::int64_t d, bool backward);
  GatheredBf16Buffers buffers(int thread);
  bool empty() const { return halves_.empty(); }

 private:
  static std::int64_t elements(std::int64_t rows, std::int64_t cols, std::int64_t d, bool backward);
  std::int64_t rows_ = 0, cols_ = 0, d_ = 0;
  bool backward_ = false;
  Tensor halves_;
};

// S [rows, lds] = scale·Q·Kᵀ over the panels of `keys` (packed into b.key_panels); lds ≥
// panels_for(cols)·16. Returns 2·rows·cols·D.
std::int64_t gathered_scores_bf16(const bf16* q, std::int64_t rows, const bf16* keys, std::int64_t cols, std::int64_t d,
                                  float scale, const GatheredBf16Buffers& b, float* s, std::int64_t lds);

// Row r of out (stride ld_out) = bf16(inverse[r]·Σ_j bf16(p_rj)·v_j), p in s [rows, lds] (entry
// cols of an odd-width row is overwritten with 0); acc: fp32 [rows, D] scratch. Returns 2·rows·cols·D
// + rows·D.
std::int64_t gathered_values_bf16(float* s, std::int64_t lds, std::int64_t rows, std::int64_t cols, const bf16* values,
                                  std::int64_t d, const float* inverse, const GatheredBf16Buffers& b, float* acc,
                                  bf16* out, std::int64_t ld_out);

struct GatheredTileBf16 {
  std::int64_t rows = 0, cols = 0, d = 0, ld = 0;
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  const bf16* dout = nullptr;
  const float* lse = nullptr;
  const float* delta = nullptr;
};
// scores, grads: fp32 [rows, ld]. Returns 8·rows·cols·D + kRecomputedSoftmaxBackwardFlopsPerElement·rows·cols.
std::int64_t gathered_tile_backward_bf16(const GatheredTileBf16& t, float scale, float* scores, float* grads,
                                         const GatheredBf16Buffers& b, float* dq, float* dk, float* dv);

// δ_r = Σ_c dO_rc·O_rc in fp32 over `rows` bf16 rows of d. Returns 2·rows·D.
std::int64_t row_dots_bf16(const bf16* dout, const bf16* out, std::int64_t rows, std::int64_t d, float* delta);

}  // namespace xfb
