#pragma once
// Shared kernel of the fixed-pattern models: softmax attention of a block of query rows over a
// block of key/value rows in which every query row sees one contiguous interval of the keys.
//
// Views. Matrices are fp32 rows of D features; row r of a view starts at data + r·ld (ld ≥ D, in
// floats). A view with ld = l·D addresses every l-th token of a head (a strided column) without a
// copy; `gather_rows` copies an arbitrary index list into a contiguous buffer when no stride fits.
//
// Online-softmax state of a query block of m rows: running max M_r, running sum S_r and the
// unnormalised output A_r ∈ R^D (r < m). `accumulate` folds one key block into it:
//   [c0, c1) = hull of the non-empty row intervals [lo_r, hi_r) (rows with hi_r ≤ lo_r see nothing)
//   X = scale · Q·K[c0:c1]ᵀ                                       gemm m×w×D, w = c1 − c0
//   per row with lo_r < hi_r:  M' = max(M_r, max_{lo_r ≤ j < hi_r} X_rj)
//     P_rj = exp(X_rj − M') for lo_r ≤ j < hi_r, else 0;  α = exp(M_r − M')
//     S_r = α·S_r + Σ_j P_rj;  A_r = α·A_r (skipped on a fresh state);  M_r = M'
//   A += P·V[c0:c1]                                               gemm m×D×w
// A fresh state (`fresh`) ignores the previous contents of A, M and S, so A may be the output
// itself. `finish` writes O_r = A_r / S_r, or 0 for a row that never saw a key.
// Only the interval hull is computed, so the wasted work of a call is the hull minus the rows'
// intervals: the padding of partial blocks and the triangle of causal diagonal blocks.
//
// FLOPs (flop_counter.hpp conventions), mirrored exactly by accumulate_flops / finish_flops:
//   accumulate: 4·m·w·D (two gemms) + 4 per valid entry (max, subtract+exp, sum)
//               + D per non-empty row when not fresh (the α rescale); 0 when every row is empty
//   finish:     D per row
#include <omp.h>

#include <cstdint>
#include <vector>

#include "lib/core/flop_counter.hpp"
#include "lib/core/mechanism.hpp"
#include "lib/core/tensor.hpp"
#include "lib/core/tile_kernels.hpp"

namespace xfb::block_sparse {

// Query rows per task in the models of this folder: a tile of at most kTaskRows rows shares one
// score tile of kTaskRows × (hull width) floats.
inline constexpr std::int64_t kTaskRows = 64;

// Query rows of one block and where their online-softmax state lives.
struct QueryBlock {
  const float* queries = nullptr;  // row r at queries + r·ld_queries
  std::int64_t ld_queries = 0;
  std::int64_t rows = 0;  // m
  float* acc = nullptr;   // A: row r at acc + r·ld_acc (may alias the output)
  std::int64_t ld_acc = 0;
  float* row_max = nullptr;  // M_r at row_max[r·ld_stats]
  float* row_sum = nullptr;  // S_r at row_sum[r·ld_stats]
  std::int64_t ld_stats = 1;
};

// Keys and values of one block and each query row's interval of them.
struct KeyBlock {
  const float* keys = nullptr;  // key row j at keys + j·ld_keys
  std::int64_t ld_keys = 0;
  const float* values = nullptr;  // value row j at values + j·ld_values
  std::int64_t ld_values = 0;
  const std::int64_t* lo = nullptr;  // query row r sees key rows [lo[r], hi[r])
  const std::int64_t* hi = nullptr;
};

// Per-call scratch: the m×w score tile, row stride ld (a multiple of 16, ≥ the largest w of the
// caller's calls: the row softmax works on whole vectors, tiles::exp_interval), and room for
// packed_key_floats(that width, D) floats of key panels (nullptr: the scores come from sgemm).
struct ScoreTile {
  float* data = nullptr;
  std::int64_t ld = 0;
  float* panels = nullptr;
};

// Hulls of at most kPackedKeys keys (block-local attention's 50) get their scores from the 512-bit
// tile kernels on keys packed into panels (tiles::scores) when D fits them; wider hulls, and every
// hull on the 256-bit kernels, from sgemm (measured at N = 8192: local's training step 6% faster
// on AVX-512, 12% more with the register-transposed packing; image-transformer's 13% slower when
// its wide hulls took the kernels too, local's 12–17% slower on the AVX2 kernels). Only scratch
// for hulls of at most kPackedKeys keys holds panels, so models whose hulls can be wider
// (image-transformer, axial, …) keep sgemm throughout and their workspace does not grow. The
// kernels also compute the panel's padding columns (50 → 64), which the FLOP count leaves out.
inline constexpr std::int64_t kPackedKeys = 64;
bool packs_keys(std::int64_t width, std::int64_t d);
// Floats of one packed panel buffer for hulls up to max_cols ≤ kPackedKeys keys (else 0).
std::int64_t packed_key_floats(std::int64_t max_cols, std::int64_t d);

// Folds `keys` into the state of `queries` (see the header comment); d = features per row,
// scale = the logit scale (1/√D). Returns the elementwise FLOPs it executed; its two gemms add
// their own FLOPs to the counter.
std::int64_t accumulate(const QueryBlock& queries, const KeyBlock& keys, std::int64_t d, float scale, bool fresh,
                        const ScoreTile& scores);

// The online-softmax update of one row, shared by the fp32 and bf16 engines (both keep M, S and A
// in fp32): row [0, width) holds the row's scores, its interval [lo, hi) (hi ≤ lo: empty). Writes
// P_j = exp(X_j − M') on the interval and 0 elsewhere in [0, width), and updates row_max, row_sum
// and (not fresh) rescales acc [d] by α. A fresh empty row gets M = −inf, S = 0; a stale empty row
// keeps its state. Returns the FLOPs it executed (4 per valid entry, + d when it rescaled).
std::int64_t online_softmax_row(float* row, std::int64_t width, std::int64_t lo, std::int64_t hi, float& row_max,
                                float& row_sum, float* acc, std::int64_t d, bool fresh);

// O_r = A_r / S_r (0 when S_r = 0); out row r at out + r·ld_out, may alias acc with the same
// stride. Returns the FLOPs it executed (D per row).
std::int64_t finish(const QueryBlock& queries, std::int64_t d, float* out, std::int64_t ld_out);

// L = M + log S, or −inf when S = 0 (a row that saw nothing).
float log_sum_exp(float row_max, float row_sum);

// The exact FLOPs of accumulate (gemms included) and finish for the same rows and intervals.
std::int64_t accumulate_flops(std::int64_t rows, const std::int64_t* lo, const std::int64_t* hi, std::int64_t d,
                              bool fresh);
inline std::int64_t finish_flops(std::int64_t rows, std::int64_t d) { return rows * d; }

// Width of the interval hull accumulate computes for these rows (0 when all are empty).
std::int64_t hull_width(std::int64_t rows, const std::int64_t* lo, const std::int64_t* hi);

// dst row r = src row index[r] (r < count); rows of d floats, row strides ld_src and ld_dst.
void gather_rows(const float* src, std::int64_t ld_src, const std::int64_t* index, std::int64_t count, std::int64_t d,
                 float* dst, std::int64_t ld_dst);

// Consecutive blocks of `block` tokens over n tokens (block clamped to [1, n], the last block
// partial), each split into tiles of ≤ kTaskRows query rows. Task t is tile t % tiles_per_block of
// block t / tiles_per_block; the missing tiles of a partial last block have 0 rows.
struct BlockTiling {
  std::int64_t n = 0, block = 1, tiles_per_block = 1, blocks = 0;
  BlockTiling() = default;
  BlockTiling(std::int64_t tokens, std::int64_t block_tokens);
  std::int64_t tasks() const { return blocks * tiles_per_block; }
  std::int64_t block_start(std::int64_t t) const { return t / tiles_per_block * block; }
  std::int64_t block_end(std::int64_t t) const { return block_start(t) + block < n ? block_start(t) + block : n; }
  std::int64_t first_row(std::int64_t t) const { return block_start(t) + t % tiles_per_block * kTaskRows; }
  std::int64_t rows(std::int64_t t) const;
};

// ⌈√n⌉, at least 1: the default stride and grid width of the factorised patterns.
std::int64_t ceil_sqrt(std::int64_t n);

// The residue classes of a stride: class r < min(stride, n) holds tokens r, r + stride, … < n;
// each class is split into tiles of ≤ kTaskRows consecutive members. Task t is tile
// t % tiles_per_class of class t / tiles_per_class; tiles past a short class have 0 rows.
struct StridedTiling {
  std::int64_t n = 0, stride = 1, classes = 0, longest = 0, tiles_per_class = 1;
  StridedTiling() = default;
  StridedTiling(std::int64_t tokens, std::int64_t stride_tokens);
  std::int64_t tasks() const { return classes * tiles_per_class; }
  std::int64_t residue(std::int64_t t) const { return t / tiles_per_class; }
  std::int64_t members(std::int64_t t) const { return (n - residue(t) + stride - 1) / stride; }
  std::int64_t first_member(std::int64_t t) const { return t % tiles_per_class * kTaskRows; }
  std::int64_t first_row(std::int64_t t) const { return residue(t) + first_member(t) * stride; }
  std::int64_t rows(std::int64_t t) const;
};

// Bounds of a tile whose query row r is key row first + r: every row sees keys [0, count), or
// [0, first + r + 1) when causal (clamped to [0, count]).
void prefix_bounds(std::int64_t rows, std::int64_t first, std::int64_t count, bool causal, std::int64_t* lo,
                   std::int64_t* hi);

// Per-thread buffers for tiles of up to kTaskRows query rows and hull width up to max_cols (rows
// of d features): the score tile and its key panels, M and S of the tile's rows, and the row
// intervals lo/hi. Tracked: the floats.
class ThreadScratch {
 public:
  ThreadScratch() = default;
  ThreadScratch(std::int64_t threads, std::int64_t max_cols, std::int64_t d);
  static std::int64_t tracked_bytes(std::int64_t threads, std::int64_t max_cols, std::int64_t d);

  int threads() const { return threads_; }  // buffers exist for threads 0 … threads()−1
  ScoreTile scores(int thread);
  float* row_max(int thread) { return stats_.data() + thread * 2 * kTaskRows; }
  float* row_sum(int thread) { return row_max(thread) + kTaskRows; }
  std::int64_t* lo(int thread) { return bounds_.data() + thread * 2 * kTaskRows; }
  std::int64_t* hi(int thread) { return lo(thread) + kTaskRows; }

 private:
  int threads_ = 0;
  Tensor scores_, panels_, stats_;
  std::vector<std::int64_t> bounds_;
};

// One head's [N, D] matrices (any of them may be a same-layout buffer such as gathered keys).
struct HeadView {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  float* out = nullptr;
  std::int64_t d = 0;
  float* lse = nullptr;  // when set, attend() saves each query token's log-sum-exp L = M + log S here
                         // (indexed by token; −inf for a row that saw nothing): the backward's input
};

// One task of a single-source plan: query row r is head row q_first + r·q_step, key/value row j
// is head row k_first + j·k_step (strided views, no copies).
struct Tile {
  std::int64_t rows = 0;  // query rows, ≤ kTaskRows; 0: nothing to do
  std::int64_t q_first = 0, q_step = 1;
  std::int64_t k_first = 0, k_step = 1;
};

// The tile of task t of a BlockTiling attending to its own block (local attention), and of a
// StridedTiling attending to its own residue class; lo/hi by prefix_bounds.
Tile block_tile(const BlockTiling& tiling, std::int64_t t, bool causal, std::int64_t* lo, std::int64_t* hi);
Tile class_tile(const StridedTiling& tiling, std::int64_t t, bool causal, std::int64_t* lo, std::int64_t* hi);

// Views of head `head` (= b·H + h) of [B, H, N, D] tensors.
HeadView head_view(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t head);

// Complete attention of one tile whose rows see keys [lo[r], hi[r]) (the thread's lo/hi): fresh
// accumulate at scale 1/√D, then finish into the tile's query rows of head.out. Returns the
// elementwise FLOPs (the gemms count themselves).
std::int64_t attend(const HeadView& head, const Tile& tile, ThreadScratch& scratch, int thread);

// A plan is a callable plan(task, lo, hi) -> Tile that fills lo/hi of the tile's rows; tasks are
// independent. run_tiles runs tasks [0, tasks) of every head h < heads (views from head_of(h)) in
// one OpenMP loop of scratch.threads() threads and adds the FLOPs to the counter; plan_flops is the exact count for one
// head. Threads claim kTilesPerClaim consecutive tasks at a time, so each reads its q, k, v rows as runs the hardware
// prefetcher follows (one task at a time interleaved the threads' rows: local attention 6% slower, axial 9%); claims
// stay small enough to balance uneven (causal) tasks.
inline constexpr int kTilesPerClaim = 8;
template <class Plan>
std::int64_t plan_flops(std::int64_t tasks, std::int64_t d, const Plan& plan) {
  std::vector<std::int64_t> lo(kTaskRows), hi(kTaskRows);
  std::int64_t flops = 0;
  for (std::int64_t task = 0; task < tasks; ++task) {
    const Tile tile = plan(task, lo.data(), hi.data());
    if (tile.rows > 0) flops += accumulate_flops(tile.rows, lo.data(), hi.data(), d, true) + finish_flops(tile.rows, d);
  }
  return flops;
}

template <class HeadOf, class Plan>
void run_tiles(std::int64_t heads, std::int64_t tasks, ThreadScratch& scratch, const HeadOf& head_of,
               const Plan& plan) {
  const std::int64_t total = heads * tasks;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(scratch.threads()) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, kTilesPerClaim)
    for (std::int64_t index = 0; index < total; ++index) {
      const Tile tile = plan(index % tasks, scratch.lo(thread), scratch.hi(thread));
      if (tile.rows > 0) flops += attend(head_of(index / tasks), tile, scratch, thread);
    }
  }
  FlopCounter::add(flops);
}

// ---- Backward (FlashAttention-2 style recomputation) -------------------------------------------
// The forward saved L_r per query token (HeadView::lse). With δ_r = dO_r·O_r, the backward of one
// tile recomputes the scores of its hull and accumulates
//   P = exp(X − L) on each row's interval, 0 elsewhere;  dV[hull] += Pᵀ·dO;  dP = dO·V[hull]ᵀ;
//   dS = P ⊙ (dP − δ);  dK[hull] += scale·dSᵀ·Q;  dQ += scale·dS·K[hull].
// When a row's softmax spans several tiles (axial's union of column and row keys), P from the
// joint L is each tile's share of the one softmax, so the tiles together give the exact gradient.
// Tiles that write the same dK/dV rows must not run concurrently: the models run one head per task.
// FLOPs of a tile (attend_backward_flops): 5 gemms of rows × hull width × D, plus
// kRecomputedSoftmaxBackwardFlopsPerElement per valid entry; begin_head: 2·D per query row (δ).

// The tensors a backward reads and writes, [B, H, N, D] each.
struct BackwardTensors {
  const Tensor &q, &k, &v, &out, &dout;
  Tensor &dq, &dk, &dv;
};

// One head's tensors for the backward. Query-side rows (q, out, dout, dq, lse, delta) are indexed
// by query token, key-side rows (k, v, dk, dv) by key row; any may be a same-layout buffer.
struct HeadGrads {
  const float *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr, *dout = nullptr;
  const float* lse = nullptr;  // [query tokens]
  float* delta = nullptr;      // [query tokens]: δ, written by begin_head
  float *dq = nullptr, *dk = nullptr, *dv = nullptr;
  std::int64_t d = 0;
};

// Per-thread buffers of the backward: the P and dS tiles (kTaskRows × ld, ld ≥ max_cols), K and V
// panels of packed hulls (packed_key_floats each), the row intervals, and δ of one head (`tokens`
// floats).
class BackwardScratch {
 public:
  BackwardScratch() = default;
  BackwardScratch(std::int64_t threads, std::int64_t max_cols, std::int64_t tokens, std::int64_t d);
  static std::int64_t tracked_bytes(std::int64_t threads, std::int64_t max_cols, std::int64_t tokens, std::int64_t d);
  int threads() const { return threads_; }
  float* probs(int thread) { return tiles_.data() + thread * 2 * kTaskRows * ld_; }
  float* grads(int thread) { return probs(thread) + kTaskRows * ld_; }
  std::int64_t ld() const { return ld_; }
  float* delta(int thread) { return deltas_.data() + thread * tokens_; }
  std::int64_t* lo(int thread) { return bounds_.data() + thread * 2 * kTaskRows; }
  std::int64_t* hi(int thread) { return lo(thread) + kTaskRows; }
  bool has_panels() const { return panel_floats_ > 0; }
  float* key_panels(int thread) { return panels_.data() + thread * 2 * panel_floats_; }
  float* value_panels(int thread) { return key_panels(thread) + panel_floats_; }

 private:
  int threads_ = 0;
  std::int64_t ld_ = 0, tokens_ = 0, panel_floats_ = 0;
  Tensor tiles_, panels_, deltas_;
  std::vector<std::int64_t> bounds_;
};

// dots[i] = Σ_c a[i, c]·b[i, c] for i < rows (rows of d floats). Returns its FLOPs (2·rows·d).
std::int64_t row_dots(const float* a, const float* b, std::int64_t rows, std::int64_t d, float* dots);

// δ of query rows [0, q_rows) into g.delta; zeroes dq (q_rows rows) and dk, dv (k_rows rows).
// Returns its FLOPs (2·q_rows·D).
std::int64_t begin_head(const HeadGrads& g, std::int64_t q_rows, std::int64_t k_rows);

// Lazily zeroed gradient rows of one head: dq rows [0, queries) and dk, dv rows [0, keys) hold
// sums; later rows are untouched until a tile reaches them. Zeroing rows just before a tile first
// accumulates into them keeps them in cache (a whole-head fill up front went out to memory and was
// read back: ~6% of a block-local training step).
struct ZeroedRows {
  std::int64_t queries = 0, keys = 0;
};

// The backward of one tile whose rows see key rows [lo[r], hi[r]) (Tile addressing as in attend).
// With `zeroed`, first zeroes the untouched rows up to the last dq and dk/dv rows the tile writes;
// without, the rows must be zero already (begin_head). Returns the elementwise FLOPs (the gemms
// count themselves).
std::int64_t attend_backward(const HeadGrads& g, const Tile& tile, const std::int64_t* lo, const std::int64_t* hi,
                             BackwardScratch& scratch, int thread, ZeroedRows* zeroed = nullptr);

// Zeroes the rows no tile reached: dq rows [zeroed.queries, q_rows), dk and dv [zeroed.keys, k_rows).
void zero_rest(const HeadGrads& g, const ZeroedRows& zeroed, std::int64_t q_rows, std::int64_t k_rows);
std::int64_t attend_backward_flops(std::int64_t rows, const std::int64_t* lo, const std::int64_t* hi, std::int64_t d);

// Runs head_task(head, thread) for every head h < heads on `threads` OpenMP threads, one
// head per task (dynamically scheduled), and adds the returned FLOPs to the counter.
template <class HeadTask>
void run_heads(std::int64_t heads, int threads, const HeadTask& head_task) {
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(+ : flops)
  for (std::int64_t head = 0; head < heads; ++head) flops += head_task(head, omp_get_thread_num());
  FlopCounter::add(flops);
}

// The backward of every task's tile of one head (after begin_head, or zeroing lazily through
// `zeroed`). Returns the elementwise FLOPs.
template <class Plan>
std::int64_t backward_tiles(const HeadGrads& g, std::int64_t tasks, const Plan& plan, BackwardScratch& scratch,
                            int thread, ZeroedRows* zeroed = nullptr) {
  std::int64_t *lo = scratch.lo(thread), *hi = scratch.hi(thread), flops = 0;
  for (std::int64_t task = 0; task < tasks; ++task) {
    const Tile tile = plan(task, lo, hi);
    if (tile.rows > 0) flops += attend_backward(g, tile, lo, hi, scratch, thread, zeroed);
  }
  return flops;
}

// The training state of a model on these tiles: the log-sum-exp its forward saves ([heads, N]) and
// the backward's per-thread scratch. Allocated by prepare (prepare_backward); until then
// saving() leaves views unchanged and the forward saves nothing.
class TileTraining {
 public:
  void prepare(std::int64_t heads, std::int64_t tokens, std::int64_t threads, std::int64_t max_cols, std::int64_t d);
  static std::int64_t tracked_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t threads,
                                    std::int64_t max_cols, std::int64_t d);
  // The view with lse at head `head`'s entries of the saved log-sum-exp (when prepared).
  HeadView saving(HeadView view, std::int64_t head) {
    if (!lse_.empty()) view.lse = lse_.data() + head * tokens_;
    return view;
  }
  // Head `head`'s HeadGrads of t with the saved log-sum-exp, δ in the thread's scratch.
  HeadGrads grads(const BackwardTensors& t, std::int64_t head, int thread);
  BackwardScratch& scratch() { return scratch_; }
  std::vector<NamedTensor> saved() const { return {{"log_sum_exp", &lse_}}; }

  // The backward of a single-plan model (run_tiles' forward over heads [0, heads) of t): per head,
  // δ of its N query rows, then every task's tile, zeroing the gradient rows as tiles reach them.
  template <class Plan>
  void run(const BackwardTensors& t, std::int64_t heads, std::int64_t tasks, const Plan& plan) {
    run_heads(heads, scratch_.threads(), [&](std::int64_t head, int thread) {
      const HeadGrads g = grads(t, head, thread);
      ZeroedRows zeroed;
      const std::int64_t flops =
          row_dots(g.dout, g.out, tokens_, g.d, g.delta) + backward_tiles(g, tasks, plan, scratch_, thread, &zeroed);
      zero_rest(g, zeroed, tokens_, tokens_);
      return flops;
    });
  }

 private:
  std::int64_t tokens_ = 0;
  Tensor lse_;
  BackwardScratch scratch_;
};

// The exact FLOPs of TileTraining::run for one head.
template <class Plan>
std::int64_t plan_backward_flops(std::int64_t tokens, std::int64_t tasks, std::int64_t d, const Plan& plan) {
  std::vector<std::int64_t> lo(kTaskRows), hi(kTaskRows);
  std::int64_t flops = 2 * tokens * d;
  for (std::int64_t task = 0; task < tasks; ++task) {
    const Tile tile = plan(task, lo.data(), hi.data());
    if (tile.rows > 0) flops += attend_backward_flops(tile.rows, lo.data(), hi.data(), d);
  }
  return flops;
}

}  // namespace xfb::block_sparse
