#pragma once
// Register-blocked fp32 kernels for attention tiles, run on the calling thread (for use inside
// the project's OpenMP loops). They keep a 6×16 block of results in registers (12 8-wide
// accumulators) and stream the shared operand from L1/L2, avoiding the per-call packing and
// dispatch of a general GEMM on small tiles.
//
// Layouts (row-major, leading dimensions in floats):
//   keys K [cols, d] are packed into panels of kPanel keys: packed[(p·d + c)·kPanel + t] =
//   K[p·kPanel + t][c], zero for t beyond `cols`. A tile then covers panels·kPanel columns.
#include <cstdint>

namespace xfb::tiles {

inline constexpr std::int64_t kPanel = 16;  // key columns per packed panel
inline constexpr std::int64_t kRows = 6;    // query rows per register block

inline std::int64_t panels_for(std::int64_t cols) { return (cols + kPanel - 1) / kPanel; }

// Head sizes the products below run on (their vectors tile D exactly): multiples of kPanel.
inline bool fits_head_dim(std::int64_t d) { return d % kPanel == 0; }

// Packs keys [cols, d] (row stride ldk) into panels_for(cols) panels; `packed` holds
// panels_for(cols)·d·kPanel floats. When D fits the kernels, by register transposes of 16 × 16
// blocks (8 × 8 on AVX2) — a panel in whole-vector loads and stores; else element by element.
void pack_key_panels(const float* keys, std::int64_t ldk, std::int64_t cols, std::int64_t d, float* packed);

// S[r, j] = alpha · Σ_c Q[r, c]·K[j, c] for r < rows, j < panels·kPanel (columns past the packed
// keys are 0). Q: [rows, d] stride ldq; S stride lds ≥ panels·kPanel.
// Executes 2·rows·panels·kPanel·d FLOPs (not counted here).
void scores(const float* q, std::int64_t ldq, std::int64_t rows, const float* packed, std::int64_t panels,
            std::int64_t d, float alpha, float* s, std::int64_t lds);

// O[r, :] += alpha·Σ_{j < cols} P[r, j]·V[j, :] for r < rows. P stride ldp, V [cols, d] stride ldv,
// O stride ldo. Requires d % kPanel == 0. Executes 2·rows·cols·d FLOPs (not counted here).
void accumulate_pv(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v,
                   std::int64_t ldv, std::int64_t d, float* out, std::int64_t ldo, float alpha = 1.0f);

// The transposed product: O[c, :] += alpha·Σ_{r < rows} P[r, c]·X[r, :] for c < cols (Pᵀ·X, as
// dV = Pᵀ·dO and dK = dSᵀ·Q in an attention backward). P stride ldp, X [rows, d] stride ldx,
// O [cols, d] stride ldo. Requires d % kPanel == 0. Executes 2·rows·cols·d FLOPs (not counted here).
void accumulate_transposed(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* x,
                           std::int64_t ldx, std::int64_t d, float alpha, float* out, std::int64_t ldo);

// The accumulating head-dimension products of an attention backward tile, whatever D: on the
// kernels above when D % kPanel == 0 (their output columns are D, so no panel padding is computed),
// else on oneDNN's sgemm. Both count 2·rows·cols·d FLOPs into the FlopCounter, as ops::gemm does.
//   pv_product:         O += alpha·P·V    (P [rows, cols] stride ldp, V [cols, d], O [rows, d])
//   transposed_product: O += alpha·Pᵀ·X   (P [rows, cols] stride ldp, X [rows, d], O [cols, d])
void pv_product(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* v,
                std::int64_t ldv, std::int64_t d, float alpha, float* out, std::int64_t ldo);
void transposed_product(const float* p, std::int64_t ldp, std::int64_t rows, std::int64_t cols, const float* x,
                        std::int64_t ldx, std::int64_t d, float alpha, float* out, std::int64_t ldo);

// S = alpha·X·Yᵀ, [rows, cols] with row stride lds ≥ panels_for(cols)·kPanel, on `scores`: Y's cols
// rows (stride ldy) packed into `panels` (panels_for(cols)·kPanel·d floats) first; X [rows, d]
// stride ldx. Requires d % kPanel == 0. Counts 2·rows·cols·d FLOPs into the FlopCounter (the last
// panel's padding columns are computed too, not counted).
void packed_score_product(const float* x, std::int64_t ldx, std::int64_t rows, const float* y, std::int64_t ldy,
                          std::int64_t cols, std::int64_t d, float alpha, float* panels, float* s, std::int64_t lds);

// Softmax pieces of one score row on the same vector width. The row is padded: it holds at least
// width rounded up to 16 floats, and the padding past `width` (like the entries outside [lo, hi))
// is read as scratch and may be overwritten with 0. lo <= hi <= width.
//   interval_max:          max(start, x[lo..hi)).
//   exp_interval:          x[j] := exp(x[j] − shift) (ops::fast_exp's polynomial) for j in [lo, hi),
//                          0 elsewhere in [0, width); returns Σ x[lo..hi).
//   softmax_grad_interval: p[j] := exp(p[j] − shift), g[j] := p[j]·(g[j] − dot) for j in [lo, hi),
//                          both 0 elsewhere in [0, width) (the recomputed probabilities and dS of a
//                          softmax backward row).
// Vectors and horizontal reductions over whole lanes (masked at the interval's ends): no scalar
// tails, so short rows (block-local attention's 50) cost about as much per entry as long ones.
float interval_max(const float* x, std::int64_t lo, std::int64_t hi, float start);
float exp_interval(float* x, std::int64_t lo, std::int64_t hi, std::int64_t width, float shift);
void softmax_grad_interval(float* p, float* g, std::int64_t lo, std::int64_t hi, std::int64_t width, float shift,
                           float dot);

// The same pieces on rows without padding (any n, any alignment; nothing past x[n − 1] is read or
// written: masked loads and stores for the last part-vector). ops::row_max and ops::exp_and_sum,
// the softmax rows of every engine, run on these.
//   row_max:      max(start, x[0..n)).
//   exp_and_sum:  x[j] := exp(x[j] − shift) for j < n; returns Σ x[0..n).
float row_max(const float* x, std::int64_t n, float start);
float exp_and_sum(float* x, std::int64_t n, float shift);

// Selection filter (routing's balanced top-w): the positions i < n with values[i] >= threshold,
// ascending, into `positions` and their values into `kept` (n entries each: the vectors of kept
// lanes are stored whole, never past entry n); returns how many. Vector compares and lane packing
// (vpcompressd; a table-driven vpermd on AVX2) instead of a step per position.
std::int64_t positions_at_least(const float* values, std::int64_t n, float threshold, std::int32_t* positions,
                                float* kept);

}  // namespace xfb::tiles
