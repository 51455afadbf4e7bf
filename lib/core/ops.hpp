#pragma once
// Dense operations on fp32 row-major buffers. Each adds its executed FLOPs to FlopCounter
// (conventions in lib/core/flop_counter.hpp). Primitive-backed ops create their oneDNN primitive on the
// first call with a given shape; later calls reuse it.
#include <algorithm>
#include <cstdint>

#include "lib/core/bf16.hpp"
#include "lib/core/exp_polynomial.hpp"
#include "lib/core/tile_kernels.hpp"

namespace xfb::ops {

// C[b] = alpha · op(A[b]) · op(B[b]) (+ C[b] when accumulate), b < batch.
// op(X) is X or Xᵀ. Stored operand sizes: A is [m,k] (or [k,m] when trans_a), B is [k,n] (or [n,k]
// when trans_b), C is [m,n]; ld* are row strides of the stored matrices, stride_* batch strides
// in elements (0 broadcasts one matrix over the batch). oneDNN matmul primitive.
struct MatmulShape {
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  std::int64_t lda = 0, ldb = 0, ldc = 0;                    // 0: packed (the stored row length)
  std::int64_t stride_a = -1, stride_b = -1, stride_c = -1;  // -1: packed
  float alpha = 1.0f;
  bool accumulate = false;
};
void matmul(const MatmulShape& shape, const float* a, const float* b, float* c);
// The same product on bf16 operands, accumulated in fp32 and stored in fp32 or rounded to bf16
// (oneDNN picks AMX, AVX512_BF16 or AVX-512 conversions itself). Where oneDNN has no bf16 matmul
// (bf16_matmul_available() false: oneDNN 2.6 below AVX-512), blocks of the operands are widened to
// fp32 (exact) in the scratchpad and multiplied by sgemm: the same numerics, at about fp32's speed.
void matmul(const MatmulShape& shape, const bf16* a, const bf16* b, float* c);
void matmul(const MatmulShape& shape, const bf16* a, const bf16* b, bf16* c);
// Creates the primitive of that bf16 product (fp32 or bf16 output) without running it, or reserves
// the widening scratchpad: for a mechanism's untimed prepare, so the timed forward creates nothing.
void prepare_bf16_matmul(const MatmulShape& shape, bool bf16_output);
// That fallback itself, on every CPU (the bf16 matmul's path where oneDNN has none; tests run it
// everywhere).
void widened_bf16_matmul(const MatmulShape& shape, const bf16* a, const bf16* b, float* c);
void widened_bf16_matmul(const MatmulShape& shape, const bf16* a, const bf16* b, bf16* c);
// Whether oneDNN implements bf16 matmul on this CPU under its ISA cap (oneDNN 2.6: AVX-512 and up;
// not under ONEDNN_MAX_CPU_ISA=AVX2). Decided once per process.
bool bf16_matmul_available();

// Single-matrix product for use inside the project's own OpenMP loops (runs on the calling
// thread): C = alpha · op(A) · op(B) + beta · C. oneDNN's sgemm (the same JIT kernels as matmul).
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);

// In-place softmax over each of `rows` dense rows of length `cols` (oneDNN softmax primitive).
void softmax(float* data, std::int64_t rows, std::int64_t cols);

// In-place softmax over the rows of `batch` strided [rows, cols] matrices (row stride ld, matrix
// stride rows·ld). Row r uses its first valid(r) entries, where
// valid(r) = cols, or min(cols, r + 1 + causal_offset) when causal; the rest of the row is set
// to 0. Counts kSoftmaxFlopsPerElement per valid entry. Project kernel (OpenMP over rows).
void softmax_rows_masked(float* data, std::int64_t batch, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         bool causal, std::int64_t causal_offset = 0);

// Softmax backward over the same strided rows: grad holds dP on entry and dS on return, where
// dS[r, j] = P[r, j]·(dP[r, j] − Σ_valid P[r, ·]·dP[r, ·]) for the valid(r) entries (as above, with
// causal_offset 0) and 0 beyond them. p: the softmax output (row stride ld), unchanged. Counts
// kSoftmaxBackwardFlopsPerElement per valid entry. Project kernel (OpenMP over rows).
void softmax_backward_rows_masked(const float* p, float* grad, std::int64_t batch, std::int64_t rows, std::int64_t cols,
                                  std::int64_t ld, bool causal);

// y = (x - mean) / sqrt(var + eps) · gamma + beta over each row of [rows, cols] (oneDNN).
void layer_norm(const float* x, float* y, std::int64_t rows, std::int64_t cols, const float* gamma, const float* beta,
                float eps = 1e-5f);

// In-place GELU (erf form) over n values (oneDNN eltwise).
void gelu(float* data, std::int64_t n);

// GELU's backward: grad holds dL/dGELU(z) on entry and dL/dz = grad·GELU'(z) on return, over n
// values; z: the pre-activation. oneDNN eltwise backward; counts kGeluBackwardFlopsPerElement.
void gelu_backward(const float* z, float* grad, std::int64_t n);

// The backward of layer_norm over [rows, cols] for y = x̂·gamma + beta, x̂ = (x − mean)/sqrt(var + eps):
// dx += rstd·(dx̂ − mean(dx̂) − x̂·mean(dx̂·x̂)) with dx̂ = dy·gamma (added to dx: a residual
// branch's gradient may already be there); dgamma = Σ_rows dy·x̂, dbeta = Σ_rows dy (overwritten).
// x̂ is recomputed from x into `normalised` ([rows, cols] scratch). Project kernel (OpenMP over
// rows, then over columns); counts kLayerNormBackwardFlopsPerElement per element.
void layer_norm_backward(const float* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                         float* dx, float* dgamma, float* dbeta, float* normalised, float eps = 1e-5f);

// The same LayerNorm on bf16 rows (the encoder layer's bf16 form): statistics and the normalised value in
// fp32 from the widened row, each output rounded once. Project kernel (OpenMP over rows); the same FLOPs.
void layer_norm(const bf16* x, bf16* y, std::int64_t rows, std::int64_t cols, const float* gamma, const float* beta,
                float eps = 1e-5f);
// Its backward on bf16 x: as above, into fp32 dx, or into bf16 dx as dx := round(dx + the row's gradient)
// (one rounding per element; dx holds the residual branch's bf16 gradient, or zeros, on entry).
void layer_norm_backward(const bf16* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                         float* dx, float* dgamma, float* dbeta, float* normalised, float eps = 1e-5f);
void layer_norm_backward(const bf16* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                         bf16* dx, float* dgamma, float* dbeta, float* normalised, float eps = 1e-5f);

// GELU on bf16 values: out = round(GELU(z)) (out may alias z), and its backward grad := round(grad·GELU'(z)),
// both in fp32 on oneDNN's eltwise (erf form) over chunks of up to kBf16EltwiseChunk widened values in
// scratch [bf16_eltwise_scratch_floats(n') floats for some n' ≥ n]. The same FLOPs as the fp32 forms.
inline constexpr std::int64_t kBf16EltwiseChunk = 16384;
inline std::int64_t bf16_eltwise_scratch_floats(std::int64_t n) { return 2 * std::min(n, kBf16EltwiseChunk); }
void gelu(const bf16* z, bf16* out, std::int64_t n, float* scratch);
void gelu_backward(const bf16* z, bf16* grad, std::int64_t n, float* scratch);
// The fp32 forms with the same signature (no scratch used), for code written once over both types.
void gelu(const float* z, float* out, std::int64_t n, float* scratch);
void gelu_backward(const float* z, float* grad, std::int64_t n, float* scratch);

// c = a + b over n values (oneDNN binary); c may alias a or b.
void add(const float* a, const float* b, float* c, std::int64_t n);

// exp(x) to a few ulp for x in [-87, 88]; 0 below. Branch-free so loops vectorise. The reduction
// and polynomial of lib/core/exp_polynomial.hpp, which the tile kernels' exp_lanes shares.
inline float fast_exp(float x) {
  using namespace exp_polynomial;
  const float clamped = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);
  const float t = clamped * kLog2e;
  const float rounded = __builtin_floorf(t + 0.5f);
  const float f = clamped - rounded * kLn2High + rounded * kLn2Low;  // |f| <= ln2/2
  float p = kCoefficients[0];
#pragma GCC unroll 6
  for (int i = 1; i <= kDegree; ++i) p = p * f + kCoefficients[i];
  const int exponent = static_cast<int>(rounded) + 127;
  const float scale = __builtin_bit_cast(float, exponent << 23);
  return x < kLowest ? 0.0f : p * scale;
}

}  // namespace xfb::ops

namespace xfb::ops {
// max(start, x[0..n)), on the row kernels of the run-time kernel ISA (tiles::row_max).
inline float row_max(const float* x, std::int64_t n, float start) { return tiles::row_max(x, n, start); }

// One score row's step of the online (tiled) softmax: with the running max M and sum l of the row so
// far, its first `valid` (≥ 1) of `cols` scores become exp(s − M') in place (the rest 0,
// tiles::exp_interval), M' = max(M, the row's max); l ← l·exp(M − M') + Σ exp(s − M'), and the
// row's accumulator acc [d] is rescaled by exp(M − M'). kOnlineSoftmaxFlopsPerElement·valid + d FLOPs
// (the caller counts them).
inline void online_softmax_step(float* row, std::int64_t valid, std::int64_t cols, float& running_max,
                                float& running_sum, float* acc, std::int64_t d) {
  const float peak = tiles::interval_max(row, 0, valid, running_max);
  const float sum = tiles::exp_interval(row, 0, valid, cols, peak);
  const float rescale = fast_exp(running_max - peak);
  running_sum = running_sum * rescale + sum;
  running_max = peak;
#pragma omp simd
  for (std::int64_t j = 0; j < d; ++j) acc[j] *= rescale;
}

// A LayerNorm row's statistics over n values: the mean and 1/sqrt(variance + eps) (population
// variance, two passes). Shared by the LayerNorm backward and the Set Transformer's own LayerNorms.
struct RowMoments {
  float mean, inverse_std;
};
// x: fp32 or bf16 values (widened exactly as read).
template <class T>
inline RowMoments row_moments(const T* x, std::int64_t n, float eps) {
  const float inverse_n = 1.0f / static_cast<float>(n);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t j = 0; j < n; ++j) sum += as_float(x[j]);
  const float mean = sum * inverse_n;
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (std::int64_t j = 0; j < n; ++j) squares += (as_float(x[j]) - mean) * (as_float(x[j]) - mean);
  return {mean, 1.0f / __builtin_sqrtf(squares * inverse_n + eps)};
}

// x[j] := exp(x[j] − shift) for j < n (fast_exp's polynomial); returns Σ x[j]. The exponent-and-sum
// step of every softmax row in the project, on the row kernels of the run-time kernel ISA
// (tiles::exp_and_sum: 512-bit on AVX-512 even in a portable build).
inline float exp_and_sum(float* x, std::int64_t n, float shift) { return tiles::exp_and_sum(x, n, shift); }

// dst = LN(x) over each of `rows` rows of d features with per-feature gain and shift (dst may alias x):
// (x − mean)/√(var + eps)·gain + shift, on row_moments.
inline void layer_norm_rows(const float* x, float* dst, std::int64_t rows, std::int64_t d, const float* gain,
                            const float* shift, float eps) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * d;
    float* y = dst + r * d;
    const auto [mean, inverse_std] = row_moments(in, d, eps);
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) y[j] = (in[j] - mean) * inverse_std * gain[j] + shift[j];
  }
}

// x[0..n) := softmax(x[0..n)) in place (n ≥ 1): kSoftmaxFlopsPerElement·n FLOPs, which the caller counts.
inline void softmax_in_place(float* x, std::int64_t n) {
  const float inverse = 1.0f / exp_and_sum(x, n, row_max(x, n, x[0]));
#pragma omp simd
  for (std::int64_t j = 0; j < n; ++j) x[j] *= inverse;
}

// A row stride of at least n floats that is a multiple of 16 and avoids multiples of 256 floats
// (power-of-two strides make oneDNN's gemm ~45% slower on this machine class through cache
// conflicts).
inline std::int64_t padded_ld(std::int64_t n) {
  std::int64_t ld = (n + 15) / 16 * 16;
  if (ld % 256 == 0) ld += 16;
  return ld;
}
}  // namespace xfb::ops
