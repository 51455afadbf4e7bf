#pragma once
// bf16 forms of the tile kernels (lib/core/tile_kernels.hpp): bf16 operands, fp32 accumulation,
// fp32 results. Run on the calling thread. Two paths, chosen at run time (bf16_dot_product() in
// lib/core/cpu_isa.hpp): `vdpbf16ps` (AVX512_BF16: one instruction multiplies 16 lanes of bf16
// pairs and adds both products into fp32) and convert-and-FMA (AVX-512 or AVX2: a pair widened
// to two fp32 values, exact, then two FMAs). Both compute every product exactly in fp32 and sum
// in fp32; they differ from each other and from fp32 kernels only in summation order.
//
// Pair layouts (bf16 elements; a "pair" is two adjacent bf16 values read as one 32-bit word):
//   key pair panels of K [cols, d] (pack_key_pair_panels): panel p of kPanel keys holds, for each
//     feature pair c2 < d/2, the 16 keys' pairs side by side:
//       packed[p·d·kPanel + (c2·kPanel + t)·2 + e] = K[p·kPanel + t][2·c2 + e], 0 for keys past cols.
//     (The element count of an fp32 panel: panels_for(cols)·d·kPanel.)
//   row pairs of X [rows, ld] (pack_row_pairs, round_row_pair): rows 2·r2 and 2·r2 + 1 interleaved,
//       pairs[(r2·ld + f)·2 + e] = X[2·r2 + e][f], the missing odd row 0;  ⌈rows/2⌉·2·ld elements.
// A [rows, cols] matrix used as the left operand of a product over its columns (P·V) is plain
// bf16 rows (stride ldp even, cols rounded up to even with a 0 entry); used over its rows (Pᵀ·X)
// it is in row pairs with ld = ldp.
//
// Every product below requires d % kPanel == 0 (tiles::fits_head_dim) and executes the FLOPs of
// its fp32 counterpart (not counted here).
#include <cstdint>
#include <string>

#include "lib/core/bf16.hpp"
#include "lib/core/tensor.hpp"
#include "lib/core/tile_kernels.hpp"

namespace xfb::tiles {

// packed ← the key pair panels of keys [cols, d] (row stride ldk), panels_for(cols) panels.
void pack_key_pair_panels(const bf16* keys, std::int64_t ldk, std::int64_t cols, std::int64_t d, bf16* packed);

// pairs ← the row pairs of x [rows, d] (row stride ldx): ⌈rows/2⌉·2·d elements, pair stride 2·d.
void pack_row_pairs(const bf16* x, std::int64_t ldx, std::int64_t rows, std::int64_t d, bf16* pairs);

// S[r, j] = alpha·Σ_c Q[r, c]·K[j, c] for r < rows, j < panels·kPanel (0 past the packed keys).
// Q bf16 [rows, d] stride ldq (even); S fp32 stride lds ≥ panels·kPanel. 2·rows·panels·kPanel·d FLOPs.
void scores_bf16(const bf16* q, std::int64_t ldq, std::int64_t rows, const bf16* packed, std::int64_t panels,
                 std::int64_t d, float alpha, float* s, std::int64_t lds);

// O[r, :] += alpha·Σ_{j < cols} P[r, j]·V[j, :] for r < rows. P bf16 rows, stride ldp (even), with
// P[r, cols] = 0 when cols is odd; V in row pairs of [cols, d] (pack_row_pairs); O fp32 stride ldo.
// 2·rows·cols·d FLOPs.
void accumulate_pv_bf16(const bf16* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const bf16* v_pairs,
                        std::int64_t d, float* out, std::int64_t ldo, float alpha = 1.0f);

// O[c, :] += alpha·Σ_{r < rows} P[r, c]·X[r, :] for c < cols (Pᵀ·X). P in row pairs with ld ldp ≥
// cols (the missing odd row 0); X in row pairs of [rows, d]; O fp32 stride ldo. 2·rows·cols·d FLOPs.
void accumulate_transposed_bf16(const bf16* p_pairs, std::int64_t ldp, std::int64_t rows, std::int64_t cols,
                                const bf16* x_pairs, std::int64_t d, float alpha, float* out, std::int64_t ldo);

// dst[j] = to_bf16(src[j]) for j < n (round to nearest even), vectorised: vcvtneps2bf16 on the
// vdpbf16ps path (which reads fp32 denormals as 0: their bf16 is then 0, |error| < 2⁻¹²⁶), the
// bit-exact rounding of lib/core/bf16.hpp elsewhere.
void round_row(const float* src, std::int64_t n, bf16* dst);

// One row pair: dst[2·j + e] = to_bf16(row_e[j]) for j < n, e ∈ {0, 1}; row1 == nullptr gives 0s
// (the missing odd row).
void round_row_pair(const float* row0, const float* row1, std::int64_t n, bf16* dst);

// Why `form` (a model's bf16 form on these kernels) cannot run a problem of this element type and
// head dimension: "" when it can (f32, or D a multiple of kPanel), else the reason of its
// `unsupported` row.
inline std::string bf16_head_dim_unsupported(const std::string& form, DType dtype, std::int64_t head_dim) {
  if (dtype != DType::BF16 || fits_head_dim(head_dim)) return "";
  return form + " runs on the bf16 tile kernels, which need a head dimension that is a multiple of " +
         std::to_string(kPanel) + " (D = " + std::to_string(head_dim) + ")";
}

}  // namespace xfb::tiles
