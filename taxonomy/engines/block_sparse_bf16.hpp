#pragma once
// The bf16 form of the single-plan block-sparse path (engines/single_plan.hpp: `local`,
// `image-transformer`), on the bf16 tile kernels (lib/core/tile_kernels_bf16.hpp). q, k, v, out,
// dq, dk, dv and the decode ring are bf16; products accumulate in fp32; softmax statistics (row
// max, sum, the saved log-sum-exp, δ) stay fp32. Requires D % 16 == 0 (tiles::fits_head_dim; the
// models report other D as unsupported in bf16).
//
// Forward of one tile (rows m ≤ kTaskRows, hull [c0, c1) of width w, as block_sparse::attend):
//   K[hull] packed into key pair panels;  S = scale·Q·Kᵀ (scores_bf16, fp32)
//   per row: M = max over its interval, P_j = exp(S_j − M) on the interval (0 elsewhere), Σ = Σ_j P_j
//   P rounded to bf16 rows;  V[hull] in row pairs;  A = P·V (accumulate_pv_bf16, fp32 [m, D])
//   O = bf16(A / Σ);  L = M + log Σ saved (fp32) when training.
// Backward of one tile (FlashAttention-2 style, as block_sparse::attend_backward), δ_r = dO_r·O_r
// in fp32 from the bf16 rows:
//   S = scale·Q·Kᵀ, dP = dO·Vᵀ (scores_bf16 on K and V pair panels);  P = exp(S − L),
//   dS = P ⊙ (dP − δ) in fp32 (softmax_grad_interval); P and dS rounded to bf16;
//   dV += Pᵀ·dO, dK += scale·dSᵀ·Q (accumulate_transposed_bf16), dQ = scale·dS·K (accumulate_pv_bf16).
//   dQ: an fp32 tile [m, D], rounded to bf16 once (every query row is in exactly one task).
//   dK, dV: a key row may get several tiles' sums (image-transformer's flange, local's blocks of
//   more than 64 rows), so they accumulate in fp32 per thread (one head per task), in a sliding
//   window of key_window_rows(max_cols) rows: rows are zeroed as tiles first reach them and rounded
//   to bf16 once no later tile can reach them — the plan's key hulls start at non-decreasing rows
//   (checked) — so the live rows never span more than two hulls.
// FLOPs: exactly the fp32 path's (block_sparse::accumulate_flops + finish_flops per tile forward;
// 2·N·D + attend_backward_flops per tile backward); conversions and panel padding not counted.
#include <cstdint>
#include <vector>

#include "lib/core/bf16.hpp"
#include "lib/core/mechanism.hpp"
#include "lib/core/tensor.hpp"
#include "taxonomy/engines/block_sparse.hpp"

namespace xfb::block_sparse {

// Rows of the fp32 dK/dV window for hulls of ≤ max_cols keys.
inline std::int64_t key_window_rows(std::int64_t max_cols) { return 2 * max_cols; }

// One head's [N, D] bf16 matrices; lse as in HeadView.
struct HeadViewBf16 {
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  bf16* out = nullptr;
  std::int64_t d = 0;
  float* lse = nullptr;
};
HeadViewBf16 head_view_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t head);

// Per-thread forward buffers for tiles of ≤ kTaskRows rows and hulls of ≤ max_cols keys, with
// P = panels_for(max_cols) panels and ld = P·kPanel: the fp32 score tile [kTaskRows, ld], the bf16
// P rows [kTaskRows, ld], K pair panels and V row pairs (P·kPanel·D bf16 each), the fp32
// accumulator [kTaskRows, D], M and S, and the row intervals. Tracked: every buffer but lo/hi.
class ThreadScratchBf16 {
 public:
  ThreadScratchBf16() = default;
  ThreadScratchBf16(std::int64_t threads, std::int64_t max_cols, std::int64_t d);
  static std::int64_t tracked_bytes(std::int64_t threads, std::int64_t max_cols, std::int64_t d);
  int threads() const { return threads_; }
  std::int64_t ld() const { return ld_; }
  float* scores(int thread) { return floats_.data() + thread * float_stride_; }
  float* acc(int thread) { return scores(thread) + kTaskRows * ld_; }
  float* row_max(int thread) { return acc(thread) + kTaskRows * d_; }
  float* row_sum(int thread) { return row_max(thread) + kTaskRows; }
  bf16* probs(int thread) { return halves_.bf16_data() + thread * half_stride_; }
  bf16* key_panels(int thread) { return probs(thread) + kTaskRows * ld_; }
  bf16* value_pairs(int thread) { return key_panels(thread) + ld_ * d_; }
  std::int64_t* lo(int thread) { return bounds_.data() + thread * 2 * kTaskRows; }
  std::int64_t* hi(int thread) { return lo(thread) + kTaskRows; }

 private:
  int threads_ = 0;
  std::int64_t ld_ = 0, d_ = 0, float_stride_ = 0, half_stride_ = 0;
  Tensor floats_, halves_;
  std::vector<std::int64_t> bounds_;
};

// The online form (block_sparse::accumulate / finish in bf16), for query rows whose softmax spans
// several key blocks (axial's causal union): bf16 queries, keys and values; the state M, S and the
// unnormalised A stay fp32 (A: an fp32 buffer of the caller's, not the output), updated by the fp32
// engine's online_softmax_row. A call folds one key block in: S = scale·Q·K[hull]ᵀ (scores_bf16),
// the row update, P rounded to bf16 rows, A += P·V[hull] (accumulate_pv_bf16); fresh zeroes A first.
// finish_bf16 writes O = bf16(A / S) (0 for a row that saw nothing).
struct QueryBlockBf16 {
  const bf16* queries = nullptr;  // row r at queries + r·ld_queries
  std::int64_t ld_queries = 0;
  std::int64_t rows = 0;  // m ≤ kTaskRows
  float* acc = nullptr;   // A: row r at acc + r·ld_acc
  std::int64_t ld_acc = 0;
  float* row_max = nullptr;  // M_r at row_max[r·ld_stats]
  float* row_sum = nullptr;  // S_r at row_sum[r·ld_stats]
  std::int64_t ld_stats = 1;
};
struct KeyBlockBf16 {
  const bf16* keys = nullptr;  // key row j at keys + j·ld_keys
  std::int64_t ld_keys = 0;
  const bf16* values = nullptr;  // value row j at values + j·ld_values
  std::int64_t ld_values = 0;
  const std::int64_t* lo = nullptr;  // query row r sees key rows [lo[r], hi[r])
  const std::int64_t* hi = nullptr;
};
// Uses the thread's score tile, P rows and panels (not its acc, M, S unless the blocks point there).
// Returns the FLOPs of the fp32 accumulate with its gemms: accumulate_flops(rows, lo, hi, d, fresh).
std::int64_t accumulate_bf16(const QueryBlockBf16& queries, const KeyBlockBf16& keys, std::int64_t d, float scale,
                             bool fresh, ThreadScratchBf16& scratch, int thread);
// out row r at out + r·ld_out. Returns finish_flops(rows, d).
std::int64_t finish_bf16(const QueryBlockBf16& queries, std::int64_t d, bf16* out, std::int64_t ld_out);

// The complete bf16 attention of one tile (the thread's lo/hi; Tile addressing as in attend): a
// fresh accumulate_bf16 into the thread's acc, M and S, then finish_bf16 into its rows of head.out
// (and head.lse when set). Returns the FLOPs of the fp32 attend (gemms included).
std::int64_t attend_bf16(const HeadViewBf16& head, const Tile& tile, ThreadScratchBf16& scratch, int thread);

// run_tiles in bf16: every task of every head, FLOPs added to the counter.
template <class HeadOf, class Plan>
void run_tiles_bf16(std::int64_t heads, std::int64_t tasks, ThreadScratchBf16& scratch, const HeadOf& head_of,
                    const Plan& plan) {
  const std::int64_t total = heads * tasks;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(scratch.threads()) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, kTilesPerClaim)
    for (std::int64_t index = 0; index < total; ++index) {
      const Tile tile = plan(index % tasks, scratch.lo(thread), scratch.hi(thread));
      if (tile.rows > 0) flops += attend_bf16(head_of(index / tasks), tile, scratch, thread);
    }
  }
  FlopCounter::add(flops);
}

// Per-thread backward buffers (ld, P as in ThreadScratchBf16; N tokens): fp32 S and dP tiles
// [kTaskRows, ld] each, the fp32 dQ tile [kTaskRows, D], the fp32 dK and dV windows
// [key_window_rows(max_cols), D] each,
// δ [N]; bf16 P and dS in row pairs and dS rows ([kTaskRows, ld] each), K and V pair panels and
// K row pairs (P·kPanel·D each), Q and dO row pairs ([kTaskRows, D] each); the row intervals.
class BackwardScratchBf16 {
 public:
  BackwardScratchBf16() = default;
  BackwardScratchBf16(std::int64_t threads, std::int64_t max_cols, std::int64_t tokens, std::int64_t d);
  static std::int64_t tracked_bytes(std::int64_t threads, std::int64_t max_cols, std::int64_t tokens, std::int64_t d);
  int threads() const { return threads_; }
  std::int64_t ld() const { return ld_; }
  float* probs(int thread) { return floats_.data() + thread * float_stride_; }
  float* grads(int thread) { return probs(thread) + kTaskRows * ld_; }
  float* dq(int thread) { return grads(thread) + kTaskRows * ld_; }
  float* dk(int thread) { return dq(thread) + kTaskRows * d_; }
  float* dv(int thread) { return dk(thread) + window_ * d_; }
  float* delta(int thread) { return dv(thread) + window_ * d_; }
  std::int64_t key_window() const { return window_; }
  bf16* prob_pairs(int thread) { return halves_.bf16_data() + thread * half_stride_; }
  bf16* grad_pairs(int thread) { return prob_pairs(thread) + kTaskRows * ld_; }
  bf16* grad_rows(int thread) { return grad_pairs(thread) + kTaskRows * ld_; }
  bf16* key_panels(int thread) { return grad_rows(thread) + kTaskRows * ld_; }
  bf16* value_panels(int thread) { return key_panels(thread) + ld_ * d_; }
  bf16* key_pairs(int thread) { return value_panels(thread) + ld_ * d_; }
  bf16* query_pairs(int thread) { return key_pairs(thread) + ld_ * d_; }
  bf16* dout_pairs(int thread) { return query_pairs(thread) + kTaskRows * d_; }
  std::int64_t* lo(int thread) { return bounds_.data() + thread * 2 * kTaskRows; }
  std::int64_t* hi(int thread) { return lo(thread) + kTaskRows; }

 private:
  int threads_ = 0;
  std::int64_t ld_ = 0, d_ = 0, tokens_ = 0, window_ = 0, float_stride_ = 0, half_stride_ = 0;
  Tensor floats_, halves_;
  std::vector<std::int64_t> bounds_;
};

// One head's bf16 tensors for the backward, with its fp32 dK/dV window (key row r at row r − base
// of it, `window` rows) and the rows of it zeroed and already rounded into dk/dv (a key row
// r < flushed is final; rows [flushed, zeroed) hold sums; rows ≥ zeroed are untouched).
struct HeadGradsBf16 {
  const bf16 *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *dout = nullptr;
  const float* lse = nullptr;
  float* delta = nullptr;
  bf16 *dq = nullptr, *dk = nullptr, *dv = nullptr;
  float *dk_acc = nullptr, *dv_acc = nullptr;
  std::int64_t window = 0;
  std::int64_t d = 0, tokens = 0;
  std::int64_t zeroed = 0, flushed = 0, base = 0;
};

// The backward of one tile (key step 1; its hull must not start below g.flushed: std::logic_error
// otherwise). Returns the FLOPs of the fp32 attend_backward (gemms included).
std::int64_t attend_backward_bf16(HeadGradsBf16& g, const Tile& tile, const std::int64_t* lo, const std::int64_t* hi,
                                  BackwardScratchBf16& scratch, int thread);
// The backward of one tile with any addressing (Tile's q_step and k_step; tiles may share query and
// key rows — sparse-transformer's residue classes, axial's stages): its dQ, dK and dV added to fp32
// sums of the whole head, dq_sum row t for query token t, dk_sum and dv_sum row t for key row t (of
// the head's key rows, which may be a gathered buffer). The products and roundings are those of
// attend_backward_bf16 (P and dS rounded to bf16; fp32 sums); g's dq, dk, dv and window are unused.
// The caller zeroes the sums and rounds them once every tile of the head is in. Returns the FLOPs of
// the fp32 attend_backward (gemms included).
std::int64_t accumulate_backward_bf16(const HeadGradsBf16& g, const Tile& tile, const std::int64_t* lo,
                                      const std::int64_t* hi, float* dq_sum, float* dk_sum, float* dv_sum,
                                      BackwardScratchBf16& scratch, int thread);
// accumulate_backward_bf16 over every task's tile of one head (the thread's lo/hi). Returns the FLOPs.
template <class Plan>
std::int64_t backward_sums_bf16(const HeadGradsBf16& g, std::int64_t tasks, const Plan& plan, float* dq_sum,
                                float* dk_sum, float* dv_sum, BackwardScratchBf16& scratch, int thread) {
  std::int64_t *lo = scratch.lo(thread), *hi = scratch.hi(thread), flops = 0;
  for (std::int64_t task = 0; task < tasks; ++task) {
    const Tile tile = plan(task, lo, hi);
    if (tile.rows > 0) flops += accumulate_backward_bf16(g, tile, lo, hi, dq_sum, dk_sum, dv_sum, scratch, thread);
  }
  return flops;
}
// dots[i] = Σ_c a[i, c]·b[i, c] in fp32 for i < rows (bf16 rows of d). Returns its FLOPs (2·rows·d).
std::int64_t row_dots_bf16(const bf16* a, const bf16* b, std::int64_t rows, std::int64_t d, float* dots);
// δ of the head's N rows (2·N·D FLOPs, returned).
std::int64_t begin_head_bf16(HeadGradsBf16& g);
// Rounds the remaining dK/dV sums and zeroes the rows no tile reached.
void finish_head_bf16(HeadGradsBf16& g);

// The bf16 training state: the saved log-sum-exp ([heads, N] fp32) and the backward scratch.
class TileTrainingBf16 {
 public:
  void prepare(std::int64_t heads, std::int64_t tokens, std::int64_t threads, std::int64_t max_cols, std::int64_t d);
  static std::int64_t tracked_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t threads,
                                    std::int64_t max_cols, std::int64_t d);
  HeadViewBf16 saving(HeadViewBf16 view, std::int64_t head) {
    if (!lse_.empty()) view.lse = lse_.data() + head * tokens_;
    return view;
  }
  std::vector<NamedTensor> saved() const { return {{"log_sum_exp", &lse_}}; }
  // Head `head`'s HeadGradsBf16 of t with the saved log-sum-exp, δ and the dK/dV window in the
  // thread's scratch.
  HeadGradsBf16 grads(const BackwardTensors& t, std::int64_t head, int thread);
  BackwardScratchBf16& scratch() { return scratch_; }

  // The backward of a single-plan model over heads [0, heads) of t, one head per task.
  template <class Plan>
  void run(const BackwardTensors& t, std::int64_t heads, std::int64_t tasks, const Plan& plan) {
    run_heads(heads, scratch_.threads(), [&](std::int64_t head, int thread) {
      HeadGradsBf16 g = grads(t, head, thread);
      std::int64_t flops = begin_head_bf16(g);
      std::int64_t *lo = scratch_.lo(thread), *hi = scratch_.hi(thread);
      for (std::int64_t task = 0; task < tasks; ++task) {
        const Tile tile = plan(task, lo, hi);
        if (tile.rows > 0) flops += attend_backward_bf16(g, tile, lo, hi, scratch_, thread);
      }
      finish_head_bf16(g);
      return flops;
    });
  }

 private:
  std::int64_t tokens_ = 0;
  Tensor lse_;
  BackwardScratchBf16 scratch_;
};

// The decoding state of a window pattern in bf16 (WindowCache's contract): the last `capacity`
// tokens' keys and values of every head in bf16 rings ([heads, capacity, D] each, token t at slot
// t mod capacity), and per head an fp32 step buffer of capacity scores and the D accumulator. A
// step: s_j = scale·q·k_j (fp32 sums of exact products), M = max_j s_j, p_j = exp(s_j − M),
// Σ = Σ_j p_j, O = bf16((Σ_j bf16(p_j)·v_j)·(1/Σ)) — the forward's rounding of P and O. Its FLOPs
// are WindowCache's (D + attend_rows_flops per ring run + D).
class WindowCacheBf16 {
 public:
  WindowCacheBf16() = default;
  WindowCacheBf16(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim);
  void load_context(const Tensor& k, const Tensor& v, int threads);
  void step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t first, int threads);
  std::int64_t length() const { return length_; }
  bool empty() const { return capacity_ == 0; }
  std::vector<NamedTensor> state() const { return {{"key_window", &keys_}, {"value_window", &values_}}; }
  static std::int64_t bytes(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim) {
    return 2 * heads * capacity * head_dim * static_cast<std::int64_t>(sizeof(bf16)) +
           heads * (capacity + head_dim) * static_cast<std::int64_t>(sizeof(float));
  }

 private:
  std::int64_t capacity_ = 0, d_ = 0;
  Tensor keys_, values_, buffers_;  // bf16 rings [heads, capacity, D]; fp32 [heads, capacity + D]
  std::int64_t length_ = 0;
};

}  // namespace xfb::block_sparse
