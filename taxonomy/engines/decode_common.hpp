#pragma once
// Pieces of the incremental (decode) forms of the softmax models.
//
// KvCache: the keys and values a decoding model keeps, per head ([heads, capacity, D] each, heads =
// B·H, tracked). A model stores a token's row at a slot of its choosing: token i at slot i (a cache
// of the whole sequence, capacity N + T) or at i mod capacity (a window that overwrites the oldest).
//
// RowSoftmax: exact softmax attention of one query row over cached rows by online softmax, for
// rows that come in pieces (a ring buffer's two runs, a split of the keys per thread). The state is
// the running max m, the running sum l and the unnormalised accumulator acc [D]; the query is
// scaled by 1/√D first (D FLOPs, scale_query). Keys are taken in chunks of kDecodeChunk:
//   s_j = q·k_j;  m' = max(m, max_j s_j);  acc = acc·e^(m−m') + Σ_j e^(s_j−m')·v_j;  l likewise.
// FLOPs (attend_rows): per key 2·D (dot) + 4 (max, subtract+exp, sum) + 2·D (accumulate); per
// chunk D + 2 (rescale acc and l, and the factor). merge_rows (two partial states of one query):
// 3·D + 7. finish_row: D (out = acc / l).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/mechanism.hpp"
#include "lib/core/tensor.hpp"

namespace xfb {

inline constexpr std::int64_t kDecodeChunk = 128;  // keys per online-softmax chunk
// Cached floats a step reads (keys and values of every head) below which its heads run on the
// calling thread: an OpenMP fork and join (~1–2 µs on the 2-vCPU machines) costs more than the work.
inline constexpr std::int64_t kParallelStepFloats = std::int64_t{1} << 17;

// Rows of fp32 or bf16 (a bf16 model's cache, --dtype bf16: plain rows, half the bytes) elements;
// keys()/values() are the fp32 view, keys<bf16>()/values<bf16>() the bf16 one.
class KvCache {
 public:
  KvCache() = default;
  KvCache(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim, DType dtype = DType::F32);
  std::int64_t capacity() const { return keys_.empty() ? 0 : keys_.dim(1); }
  template <class T = float>
  T* keys(std::int64_t head) {
    return elements<T>(keys_) + head * keys_.dim(1) * keys_.dim(2);
  }
  template <class T = float>
  T* values(std::int64_t head) {
    return elements<T>(values_) + head * values_.dim(1) * values_.dim(2);
  }
  // Copies `rows` consecutive rows of k and v ([rows, D] each, the cache's element type) to slots
  // slot, slot + 1, … of head, wrapping at the capacity.
  template <class T>
  void store(std::int64_t head, std::int64_t slot, const T* k, const T* v, std::int64_t rows) {
    const std::int64_t d = keys_.dim(2), capacity = keys_.dim(1);
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t at = (slot + r) % capacity;
      std::copy_n(k + r * d, d, keys<T>(head) + at * d);
      std::copy_n(v + r * d, d, values<T>(head) + at * d);
    }
  }
  // The prefill: every head keeps the last min(N, capacity) tokens of its context (k, v:
  // [B, H, N, D] of the cache's element type), token t at slot t mod capacity — all of them in a
  // cache of the whole sequence.
  void load_context(const Tensor& k, const Tensor& v, int threads);
  const Tensor& key_tensor() const { return keys_; }
  const Tensor& value_tensor() const { return values_; }
  static std::int64_t bytes(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim,
                            DType dtype = DType::F32) {
    return 2 * heads * capacity * head_dim * element_bytes(dtype);
  }

 private:
  Tensor keys_, values_;
};

struct RowSoftmax {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.0f;
  float* acc = nullptr;  // [D], zeroed by begin_row
  std::int64_t head_dim = 0;
  // On bf16 rows: false rounds each exponential to bf16 before it weighs its value (a bf16 form's P),
  // true keeps it fp32 (a storage-only form's step, whose forward computes in fp32).
  bool fp32_probabilities = false;
};

// acc: D floats the row accumulates into (zeroed here).
RowSoftmax begin_row(float* acc, std::int64_t head_dim);
// q_scaled = q / √D (a bf16 query widened first, exactly). Returns its FLOPs (D).
std::int64_t scale_query(const float* q, std::int64_t head_dim, float* q_scaled);
std::int64_t scale_query(const bf16* q, std::int64_t head_dim, float* q_scaled);
// Attends q_scaled to `rows` cached rows, row r at keys + r·stride (and values likewise; stride 0
// means D: consecutive rows). Returns its FLOPs. On bf16 rows (a bf16 model's cache) the products
// are exact in fp32 and summed in fp32, and each exponential is rounded to bf16 before it weighs its
// value row (the bf16 forward's rounding of P; not with row.fp32_probabilities); the statistics stay
// fp32; the FLOPs are the same.
std::int64_t attend_rows(RowSoftmax& row, const float* q_scaled, const float* keys, const float* values,
                         std::int64_t rows, std::int64_t stride = 0);
std::int64_t attend_rows(RowSoftmax& row, const float* q_scaled, const bf16* keys, const bf16* values,
                         std::int64_t rows, std::int64_t stride = 0);
// Attends to tokens first, first + step, … (count of them) of a ring of `capacity` rows (token t at
// row t mod capacity; the tokens span less than the capacity, so they are one or two strided runs
// of rows). Returns its FLOPs (attend_rows'). fp32 or bf16 rows, as attend_rows.
std::int64_t attend_ring(RowSoftmax& row, const float* q_scaled, const float* keys, const float* values,
                         std::int64_t capacity, std::int64_t first, std::int64_t count, std::int64_t step = 1);
std::int64_t attend_ring(RowSoftmax& row, const float* q_scaled, const bf16* keys, const bf16* values,
                         std::int64_t capacity, std::int64_t first, std::int64_t count, std::int64_t step = 1);
// into := the state over both sets of keys. Returns its FLOPs (3·D + 7; 0 when `from` saw no keys).
// `into` must have seen at least one key.
std::int64_t merge_rows(RowSoftmax& into, const RowSoftmax& from);
// out = acc / l (zeros when the row saw no key, as softmax attention over no keys). Returns its
// FLOPs (D; 0 for no key).
std::int64_t finish_row(const RowSoftmax& row, float* out);
// The same, rounded to bf16: out = bf16(acc·(1/l)), the bf16 forward's rounding of O.
std::int64_t finish_row(const RowSoftmax& row, bf16* out);
// One step's attention for every head of q, out ([B, H, 1, D], fp32 or bf16 — both of one type; a
// bf16 query is widened, the output rounded by finish_row): per head, q scaled into the head's
// row of `buffers` ([heads, 2, D]: query, accumulator), `attend(head, row, query)` — the model's
// keys for that head, returning its FLOPs — and the output row. Adds all FLOPs to FlopCounter.
// parallel = false runs the heads on the calling thread (a step too small for a fork and join).
template <class Attend>
void attend_every_head(const Tensor& q, Tensor& out, Tensor& buffers, int threads, const Attend& attend,
                       bool parallel = true) {
  const std::int64_t heads = q.dim(0) * q.dim(1), d = q.dim(3);
  std::int64_t flops = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : flops) if (parallel)
  for (std::int64_t head = 0; head < heads; ++head) {
    float* query = buffers.data() + head * 2 * d;
    RowSoftmax row = begin_row(query + d, d);
    const bool bf16_step = q.dtype() == DType::BF16;
    flops += bf16_step ? scale_query(q.bf16_data() + head * d, d, query) : scale_query(q.data() + head * d, d, query);
    flops += attend(head, row, static_cast<const float*>(query));
    flops += bf16_step ? finish_row(row, out.bf16_data() + head * d) : finish_row(row, out.data() + head * d);
  }
  FlopCounter::add(flops);
}

// The FLOPs of attend_rows over `rows` keys.
std::int64_t attend_rows_flops(std::int64_t rows, std::int64_t head_dim);

// One query row against `count` cached rows [count, D] of fp32 or bf16 (a bf16 model's state)
// without a softmax, for steps that need the scores themselves (relative terms, entmax, synthetic
// logits). row_scores: scores[x] = scale·q·row_x; weigh_rows: out = Σ_x p[x]·row_x (rows whose weight
// is exactly 0 are skipped: they add nothing). fp32 rows go through ops::gemm, which counts its
// FLOPs (these return 0); bf16 rows are widened in fp32 dot products and sums (exact products, fp32
// accumulation; these return their 2·count·D FLOPs).
std::int64_t row_scores(const float* q, const float* rows, std::int64_t count, std::int64_t d, float scale,
                        float* scores);
std::int64_t row_scores(const float* q, const bf16* rows, std::int64_t count, std::int64_t d, float scale,
                        float* scores);
std::int64_t weigh_rows(const float* p, const float* rows, std::int64_t count, std::int64_t d, float* out);
std::int64_t weigh_rows(const float* p, const bf16* rows, std::int64_t count, std::int64_t d, float* out);
// The same update for a long run of rows as one block through two sgemm calls (scores = q·Kᵀ into
// `scores` [rows], then acc += p·V), where the calls' overhead is amortised (a split of a KV
// cache). Returns the FLOPs outside the sgemm calls, which count themselves (2·rows·D each):
// 4·rows + D + 2.
std::int64_t attend_block(RowSoftmax& row, const float* q_scaled, const float* keys, const float* values,
                          std::int64_t rows, float* scores);

// The bf16 KV cache of a decoding model (issue 31) in the bf16 tile kernels' layouts
// (lib/core/tile_kernels_bf16.hpp), so a step's products run on them with no repacking: per head,
// keys in key pair panels (panels_for(capacity) panels of 16 tokens) and values in row pairs
// (⌈capacity/2⌉ pairs of tokens), token t at slot t; slots not yet written hold 0. Half the bytes of
// the fp32 KvCache (to the panel padding). D must be a multiple of 16.
class Bf16KvCache {
 public:
  Bf16KvCache() = default;
  Bf16KvCache(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim);
  std::int64_t capacity() const { return capacity_; }
  const bf16* key_panels(std::int64_t head) const { return keys_.bf16_data() + head * keys_.dim(1); }
  const bf16* value_pairs(std::int64_t head) const { return values_.bf16_data() + head * values_.dim(1); }
  // Token `slot` of head: its key and value rows (D bf16 each).
  void store(std::int64_t head, std::int64_t slot, const bf16* k, const bf16* v);
  // The prefill: tokens 0 … N − 1 of every head of k, v ([B, H, N, D] bf16), N ≤ capacity.
  void load_context(const Tensor& k, const Tensor& v, int threads);
  const Tensor& key_tensor() const { return keys_; }
  const Tensor& value_tensor() const { return values_; }
  static std::int64_t bytes(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim);

 private:
  std::int64_t capacity_ = 0, head_dim_ = 0;
  Tensor keys_, values_;  // bf16 [heads, panel elements] and [heads, pair elements]
};

// attend_block's update on the bf16 cache: the row's scores over tokens [begin, begin + rows) of
// `head` (begin a multiple of 16) as scale·q·kᵀ on tiles::scores_bf16 into `scores` (fp32, ≥
// panels_for(rows)·16 floats), fp32 online softmax, the exponentials rounded to bf16 into `probs`
// (≥ rows + 1 elements) and acc += p·V on tiles::accumulate_pv_bf16. q: D bf16 values, unscaled.
// Returns the FLOPs of attend_block's contract (4·rows·D + 4·rows + D + 2; the products' padding
// columns are not counted, and the scale rides on the scores as the query scaling does in fp32).
std::int64_t attend_block_bf16(RowSoftmax& row, const bf16* q, const Bf16KvCache& cache, std::int64_t head,
                               std::int64_t begin, std::int64_t rows, float* scores, bf16* probs);

// The decoding state of a pattern whose token i sees one run of keys [first(i), i] with
// i − first(i) < capacity (a local block, a query block and its memory flange, a sliding window):
// the last `capacity` tokens of every head in a ring (KvCache slot = token mod capacity), and the
// per-head query and accumulator of a step. A step's FLOPs per head: D (scale) + attend_rows over
// the run (one or two pieces, as the ring wraps) + D (finish): O(capacity), independent of N.
class WindowCache {
 public:
  WindowCache() = default;
  WindowCache(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim);
  // The prefill: keeps the last min(N, capacity) tokens of every head's context (k, v: [B, H, N, D]).
  void load_context(const Tensor& k, const Tensor& v, int threads);
  // One token per head (q, k, v, out: [B, H, 1, D]): stores its key and value as token length(),
  // then attends its query to tokens [first, length()] (first > length() − capacity). Adds its
  // FLOPs to FlopCounter.
  void step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t first, int threads);
  std::int64_t length() const { return length_; }  // tokens seen (context and steps)
  bool empty() const { return cache_.capacity() == 0; }
  std::vector<NamedTensor> state() const {
    return {{"key_window", &cache_.key_tensor()}, {"value_window", &cache_.value_tensor()}};
  }
  // The bytes the constructor allocates: the ring and the per-head step buffers.
  static std::int64_t bytes(std::int64_t heads, std::int64_t capacity, std::int64_t head_dim) {
    return KvCache::bytes(heads, capacity, head_dim) + 2 * heads * head_dim * static_cast<std::int64_t>(sizeof(float));
  }

 private:
  KvCache cache_;
  Tensor buffers_;  // per head the scaled query and the accumulator, [heads, 2, D]
  std::int64_t length_ = 0;
};

}  // namespace xfb
