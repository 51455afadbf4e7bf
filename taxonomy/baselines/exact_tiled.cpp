#include "taxonomy/baselines/exact_tiled.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/online_attention_bf16.hpp"

namespace xfb {
namespace {

// Head sizes that are multiples of the kernel panel run on the register-blocked tile kernels;
// others on oneDNN's sgemm. The kernels compute whole key panels (the last one zero-padded).
bool uses_tile_kernels(std::int64_t d) { return tiles::fits_head_dim(d); }

// On the tile kernels a query block's tile is done in strips of this many rows (scores, softmax,
// P·V per strip), so the strip's scores stay in cache between the three steps (AVX-512 class,
// N = 4096: 32 rows 3–4% faster than 24, 36, 48 or the whole block of 64 with key tiles of 512;
// with 1024, 24 rows 2% and 48 rows 4–5% slower than 32, at 4K and 16K).
constexpr std::int64_t kStripRows = 32;

// Rows of the forward's score tile: one strip on the tile kernels, the whole block on sgemm.
std::int64_t score_rows(const ExactTiledConfig& c, std::int64_t d) {
  return uses_tile_kernels(d) ? std::min(c.block_q, kStripRows) : c.block_q;
}

// Query rows per backward tile on the tile kernels: longer strips let dV and dK of the key block
// (read and written once per strip) take more products per pass (AVX-512 class, N = 4096: 128 rows
// 8% faster than 64 or 32; 192 and 256 no faster).
constexpr std::int64_t kBackwardStripRows = 128;

// Query rows per backward tile: kBackwardStripRows on the tile kernels, block_q on sgemm.
std::int64_t backward_rows(const ExactTiledConfig& c, std::int64_t d) {
  return uses_tile_kernels(d) ? kBackwardStripRows : c.block_q;
}

// Floats of one packed key (or value) block of the backward: backward_block_k keys in panels; 0
// on sgemm.
std::int64_t block_panel_floats(const ExactTiledConfig& c, std::int64_t d) {
  return uses_tile_kernels(d) ? tiles::panels_for(c.backward_block_k) * d * tiles::kPanel : 0;
}

}  // namespace

// On the tile kernels a key tile starts on a panel boundary: block_k and backward_block_k are
// rounded up to whole panels.
ExactTiledConfig resolve(const Problem& p, ExactTiledConfig c) {
  if (uses_tile_kernels(p.head_dim)) {
    c.block_k = tiles::panels_for(c.block_k) * tiles::kPanel;
    c.backward_block_k = tiles::panels_for(c.backward_block_k) * tiles::kPanel;
  }
  return c;
}

namespace {

// Floats of the packed copy of K (all heads) that the tile kernels read; 0 on the sgemm path.
std::int64_t packed_key_floats(const Problem& p) {
  if (!uses_tile_kernels(p.head_dim)) return 0;
  return p.batch * p.heads * tiles::panels_for(p.seq_len) * p.head_dim * tiles::kPanel;
}

std::int64_t score_columns(std::int64_t cols, std::int64_t d) {
  return uses_tile_kernels(d) ? tiles::panels_for(cols) * tiles::kPanel : cols;
}

// Row stride of the score tile: whole 16-float vectors for the row softmax (tiles::exp_interval).
std::int64_t score_stride(std::int64_t block_k) { return tiles::panels_for(block_k) * tiles::kPanel; }

// Key columns of the tile at (q0, k0) with `rows` query rows, forward and backward alike: the key
// block, cut at the query block's last row when causal.
std::int64_t tile_columns(const Problem& p, std::int64_t k0, std::int64_t q0, std::int64_t rows, std::int64_t bk) {
  const std::int64_t key_end = p.causal ? q0 + rows : p.seq_len;
  return std::min(bk, key_end - k0);
}

// Entries of a [rows, cols] tile at (q0, k0) that a causal mask keeps: row i keeps j <= i.
std::int64_t valid_in_row(bool causal, std::int64_t i, std::int64_t k0, std::int64_t cols) {
  return causal ? std::clamp<std::int64_t>(i - k0 + 1, 0, cols) : cols;
}

// Decode splits per head: enough tasks for every thread, but no split shorter than block_k keys
// at the full N + T (so a split's work outweighs its merge).
std::int64_t decode_splits(const Problem& p, const ExactTiledConfig& c, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, capacity = p.seq_len + tokens;
  const std::int64_t for_threads = (p.threads + heads - 1) / heads;
  return std::max<std::int64_t>(1, std::min(for_threads, capacity / c.block_k));
}

// The most keys one split of n ≤ capacity keys holds: ⌈n / splits⌉.
std::int64_t split_capacity(std::int64_t capacity, std::int64_t splits) { return (capacity + splits - 1) / splits; }

// Split-K decode's partial states, one per task = head·S + split: an fp32 accumulator [D] and the
// running (max, sum) of its keys. Both forms attend their splits into these, then merge per head.
class SplitRows {
 public:
  SplitRows() = default;
  SplitRows(std::int64_t tasks, std::int64_t d) : d_(d), accumulators_(Shape{tasks, d}), stats_(Shape{tasks, 2}) {}
  RowSoftmax begin(std::int64_t task) { return begin_row(accumulators_.data() + task * d_, d_); }
  void keep(std::int64_t task, const RowSoftmax& row) {
    stats_[2 * task] = row.max;
    stats_[2 * task + 1] = row.sum;
  }
  // The head's S states merged (into the last split's accumulator) in *total; returns the FLOPs.
  std::int64_t merge(std::int64_t head, std::int64_t splits, RowSoftmax* total) {
    *total = kept(head * splits + splits - 1);
    std::int64_t flops = 0;
    for (std::int64_t split = 0; split + 1 < splits; ++split) flops += merge_rows(*total, kept(head * splits + split));
    return flops;
  }

 private:
  RowSoftmax kept(std::int64_t task) {
    RowSoftmax row;
    row.acc = accumulators_.data() + task * d_;
    row.head_dim = d_;
    row.max = stats_[2 * task];
    row.sum = stats_[2 * task + 1];
    return row;
  }
  std::int64_t d_ = 0;
  Tensor accumulators_, stats_;
};

class ExactTiled final : public Mechanism {
 public:
  ExactTiled(const Problem& problem, const ExactTiledConfig& config) : p_(problem), c_(config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t threads = p_.threads;
    score_ld_ = score_stride(c_.block_k);
    scores_ = Tensor(Shape{threads, score_rows(c_, p_.head_dim), score_ld_});
    if (uses_tile_kernels(p_.head_dim)) packed_keys_ = Tensor(Shape{packed_key_floats(p_)});
    accumulators_ = Tensor(Shape{threads, c_.block_q, p_.head_dim});
    row_stats_ = Tensor(Shape{threads, 2, c_.block_q});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t n = p_.seq_len;
    const std::int64_t query_blocks = (n + c_.block_q - 1) / c_.block_q;
    const std::int64_t tasks = p_.batch * p_.heads * query_blocks;
    if (uses_tile_kernels(p_.head_dim)) pack_keys(k);
    std::int64_t kernel_flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : kernel_flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t head = task / query_blocks;
        // Causal tasks near the end of a head are the longest: start them first.
        const std::int64_t block = p_.causal ? query_blocks - 1 - task % query_blocks : task % query_blocks;
        kernel_flops += query_block(head, q.data() + head * n * p_.head_dim, k.data() + head * n * p_.head_dim,
                                    v.data() + head * n * p_.head_dim, out.data() + head * n * p_.head_dim,
                                    block * c_.block_q, thread);
      }
    }
    if (cache_.capacity() > 0) cache_.load_context(k, v, p_.threads);  // the prefill of a decode
    FlopCounter::add(kernel_flops);
    length_ = n;
  }

  void prepare_backward() override {
    const std::int64_t rows = p_.batch * p_.heads * p_.seq_len;
    log_sum_exp_ = Tensor(Shape{rows});
    deltas_ = Tensor(Shape{rows});
    tile_grads_ = Tensor(Shape{p_.threads, 2, backward_rows(c_, p_.head_dim), score_stride(c_.backward_block_k)});
    if (uses_tile_kernels(p_.head_dim))
      block_panels_ = Tensor(Shape{p_.threads, 2, block_panel_floats(c_, p_.head_dim)});
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads;
    std::int64_t own_flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : own_flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t head = 0; head < heads; ++head) {
        const std::int64_t offset = head * n * d;
        own_flops += head_backward(head,
                                   {q.data() + offset, k.data() + offset, v.data() + offset, out.data() + offset,
                                    dout.data() + offset, dq.data() + offset, dk.data() + offset, dv.data() + offset},
                                   thread);
      }
    }
    FlopCounter::add(own_flops);
  }

  std::vector<NamedTensor> saved() const override { return {{"log_sum_exp", &log_sum_exp_}}; }

  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t heads = p_.batch * p_.heads, capacity = p_.seq_len + tokens;
    splits_ = decode_splits(p_, c_, tokens);
    cache_ = KvCache(heads, capacity, p_.head_dim);
    split_rows_ = SplitRows(heads * splits_, p_.head_dim);
    split_queries_ = Tensor(Shape{heads * splits_, p_.head_dim});
    split_scores_ = Tensor(Shape{heads * splits_, split_capacity(capacity, splits_)});
  }

  // Split-K: split s of a head attends to keys [s·n/S, (s+1)·n/S) (the last split also stores the
  // new key first: it is the only one that reads it); then each head merges its S partial states.
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (length_ >= cache_.capacity()) throw std::logic_error("exact-tiled: decode step past the prepared capacity");
    const std::int64_t d = p_.head_dim, heads = p_.batch * p_.heads, keys = length_ + 1, splits = splits_;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
#pragma omp for schedule(static)
      for (std::int64_t task = 0; task < heads * splits; ++task) {
        const std::int64_t head = task / splits, split = task % splits;
        const std::int64_t begin = split * keys / splits, end = (split + 1) * keys / splits;
        if (split == splits - 1) cache_.store(head, length_, k.data() + head * d, v.data() + head * d, 1);
        float* query = split_queries_.data() + task * d;
        flops += scale_query(q.data() + head * d, d, query);
        RowSoftmax row = split_rows_.begin(task);
        flops += attend_block(row, query, cache_.keys(head) + begin * d, cache_.values(head) + begin * d, end - begin,
                              split_scores_.data() + task * split_scores_.dim(1));
        split_rows_.keep(task, row);
      }
#pragma omp for schedule(static)
      for (std::int64_t head = 0; head < heads; ++head) {
        RowSoftmax total;
        flops += split_rows_.merge(head, splits, &total);
        flops += finish_row(total, out.data() + head * d);
      }
    }
    FlopCounter::add(flops);
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"key_cache", &cache_.key_tensor()}, {"value_cache", &cache_.value_tensor()}};
  }

 private:
  // One head's tensors for the backward, each [N, D].
  struct HeadGrads {
    const float *q, *k, *v, *out, *dout;
    float *dq, *dk, *dv;
  };

  bool saves_log_sum_exp() const { return !log_sum_exp_.empty(); }

  // The whole backward of one head: per key block (packed into panels on the tile kernels), every
  // strip of backward_rows query rows that sees it. Returns the FLOPs it executed outside oneDNN.
  std::int64_t head_backward(std::int64_t head, const HeadGrads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bk = c_.backward_block_k, strip = backward_rows(c_, d);
    float* delta = deltas_.data() + head * n;
    for (std::int64_t i = 0; i < n; ++i) {
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (std::int64_t c = 0; c < d; ++c) dot += g.dout[i * d + c] * g.out[i * d + c];
      delta[i] = dot;
    }
    std::fill(g.dq, g.dq + n * d, 0.0f);
    std::fill(g.dk, g.dk + n * d, 0.0f);
    std::fill(g.dv, g.dv + n * d, 0.0f);
    std::int64_t flops = 2 * n * d;
    for (std::int64_t k0 = 0; k0 < n; k0 += bk) {
      if (uses_tile_kernels(d)) {
        const std::int64_t cols = std::min(bk, n - k0);
        tiles::pack_key_panels(g.k + k0 * d, d, cols, d, key_panels(thread));
        tiles::pack_key_panels(g.v + k0 * d, d, cols, d, value_panels(thread));
      }
      for (std::int64_t q0 = p_.causal ? k0 / strip * strip : 0; q0 < n; q0 += strip) {
        const std::int64_t rows = std::min(strip, n - q0);
        flops += tile_backward(head, g, q0, rows, k0, tile_columns(p_, k0, q0, rows, bk), thread);
      }
    }
    return flops;
  }

  float* key_panels(int thread) { return block_panels_.data() + thread * 2 * block_panel_floats(c_, p_.head_dim); }
  float* value_panels(int thread) { return key_panels(thread) + block_panel_floats(c_, p_.head_dim); }

  // The backward of the [rows, cols] tile at (q0, k0): P and dS recomputed from the saved
  // log-sum-exp, then dV += Pᵀ·dO, dK += scale·dSᵀ·Q, dQ += scale·dS·K. Returns the FLOPs it
  // executed outside oneDNN.
  std::int64_t tile_backward(std::int64_t head, const HeadGrads& g, std::int64_t q0, std::int64_t rows, std::int64_t k0,
                             std::int64_t cols, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, ld = score_stride(c_.backward_block_k);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* probs = tile_grads_.data() + thread * 2 * backward_rows(c_, d) * ld;
    float* grads = probs + backward_rows(c_, d) * ld;
    const float* lse = log_sum_exp_.data() + head * n + q0;
    const float* delta = deltas_.data() + head * n + q0;
    const bool tiled = uses_tile_kernels(d);
    std::int64_t flops = 0;
    if (tiled) {
      const std::int64_t panels = tiles::panels_for(cols);
      tiles::scores(g.q + q0 * d, d, rows, key_panels(thread), panels, d, scale, probs, ld);
      tiles::scores(g.dout + q0 * d, d, rows, value_panels(thread), panels, d, 1.0f, grads, ld);
      flops += 2 * matmul_flops(rows, score_columns(cols, d), d);
    } else {
      ops::gemm(false, true, rows, cols, d, scale, g.q + q0 * d, d, g.k + k0 * d, d, 0.0f, probs, ld);
      ops::gemm(false, true, rows, cols, d, 1.0f, g.dout + q0 * d, d, g.v + k0 * d, d, 0.0f, grads, ld);
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t valid = valid_in_row(p_.causal, q0 + r, k0, cols);
      tiles::softmax_grad_interval(probs + r * ld, grads + r * ld, 0, valid, cols, lse[r], delta[r]);
      flops += kRecomputedSoftmaxBackwardFlopsPerElement * valid;
    }
    if (tiled) {
      tiles::accumulate_transposed(probs, ld, rows, cols, g.dout + q0 * d, d, d, 1.0f, g.dv + k0 * d, d);
      tiles::accumulate_transposed(grads, ld, rows, cols, g.q + q0 * d, d, d, scale, g.dk + k0 * d, d);
      tiles::accumulate_pv(grads, ld, rows, cols, g.k + k0 * d, d, d, g.dq + q0 * d, d, scale);
      flops += 3 * matmul_flops(rows, cols, d);
    } else {
      ops::gemm(true, false, cols, d, rows, 1.0f, probs, ld, g.dout + q0 * d, d, 1.0f, g.dv + k0 * d, d);
      ops::gemm(true, false, cols, d, rows, scale, grads, ld, g.q + q0 * d, d, 1.0f, g.dk + k0 * d, d);
      ops::gemm(false, false, rows, d, cols, scale, grads, ld, g.k + k0 * d, d, 1.0f, g.dq + q0 * d, d);
    }
    return flops;
  }

  // Packs every head's keys once per call, so query blocks share the panels.
  void pack_keys(const Tensor& k) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, panels = tiles::panels_for(n);
    const std::int64_t heads = p_.batch * p_.heads;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t task = 0; task < heads * panels; ++task) {
      const std::int64_t head = task / panels, panel = task % panels;
      const std::int64_t first = panel * tiles::kPanel;
      tiles::pack_key_panels(k.data() + (head * n + first) * d, d, std::min(tiles::kPanel, n - first), d,
                             packed_keys_.data() + (head * panels + panel) * d * tiles::kPanel);
    }
  }

  // Computes rows [q0, q0 + bq) of one head. Returns the FLOPs it executed outside oneDNN.
  std::int64_t query_block(std::int64_t head, const float* q, const float* k, const float* v, float* out,
                           std::int64_t q0, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bk = c_.block_k;
    const std::int64_t rows = std::min(c_.block_q, n - q0);
    const std::int64_t lds = score_ld_;
    float* scores = scores_.data() + thread * score_rows(c_, d) * lds;
    float* acc = accumulators_.data() + thread * c_.block_q * d;
    float* row_max = row_stats_.data() + thread * 2 * c_.block_q;
    float* row_sum = row_max + c_.block_q;
    std::fill(acc, acc + rows * d, 0.0f);
    std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
    std::fill(row_sum, row_sum + rows, 0.0f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const std::int64_t key_end = p_.causal ? q0 + rows : n;
    std::int64_t flops = 0;
    const std::int64_t strip = score_rows(c_, d);
    for (std::int64_t k0 = 0; k0 < key_end; k0 += bk) {
      const std::int64_t cols = tile_columns(p_, k0, q0, rows, bk);
      for (std::int64_t s0 = 0; s0 < rows; s0 += strip) {
        const std::int64_t strip_rows = std::min(strip, rows - s0);
        flops += compute_scores(head, q + (q0 + s0) * d, strip_rows, k, k0, cols, scale, scores);
        for (std::int64_t r = 0; r < strip_rows; ++r) {
          float* row = scores + r * lds;
          const std::int64_t i = s0 + r;
          const std::int64_t valid = valid_in_row(p_.causal, q0 + i, k0, cols);
          if (valid == 0) {
            std::fill(row, row + cols, 0.0f);
            continue;
          }
          ops::online_softmax_step(row, valid, cols, row_max[i], row_sum[i], acc + i * d, d);
          flops += kOnlineSoftmaxFlopsPerElement * valid + d;
        }
        if (uses_tile_kernels(d)) {
          tiles::accumulate_pv(scores, lds, strip_rows, cols, v + k0 * d, d, d, acc + s0 * d, d);
          flops += matmul_flops(strip_rows, d, cols);
        } else {
          ops::gemm(false, false, strip_rows, d, cols, 1.0f, scores, lds, v + k0 * d, d, 1.0f, acc + s0 * d, d);
        }
      }
    }
    if (saves_log_sum_exp()) {
      float* lse = log_sum_exp_.data() + head * n + q0;
      for (std::int64_t r = 0; r < rows; ++r) lse[r] = row_max[r] + std::log(row_sum[r]);
    }
    for (std::int64_t r = 0; r < rows; ++r) {
      const float inverse = 1.0f / row_sum[r];
      float* dst = out + (q0 + r) * d;
      const float* src = acc + r * d;
#pragma omp simd
      for (std::int64_t j = 0; j < d; ++j) dst[j] = src[j] * inverse;
    }
    return flops + rows * d;
  }

  // scores[r, j] = scale · q[r]·k[j] for a [rows, cols] tile. Returns the FLOPs it executed that
  // the oneDNN path does not count itself.
  // Keys k0 .. k0 + cols of the head; k0 is a multiple of block_k.
  std::int64_t compute_scores(std::int64_t head, const float* q, std::int64_t rows, const float* k, std::int64_t k0,
                              std::int64_t cols, float scale, float* scores) {
    const std::int64_t d = p_.head_dim;
    if (!uses_tile_kernels(d)) {
      ops::gemm(false, true, rows, cols, d, scale, q, d, k + k0 * d, d, 0.0f, scores, score_ld_);
      return 0;
    }
    const float* packed =
        packed_keys_.data() + (head * tiles::panels_for(p_.seq_len) + k0 / tiles::kPanel) * d * tiles::kPanel;
    tiles::scores(q, d, rows, packed, tiles::panels_for(cols), d, scale, scores, score_ld_);
    return matmul_flops(rows, score_columns(cols, d), d);
  }

  Problem p_;
  ExactTiledConfig c_;
  std::int64_t score_ld_ = 0;
  Tensor scores_, packed_keys_, accumulators_, row_stats_;
  Tensor log_sum_exp_, deltas_, tile_grads_;  // training only (prepare_backward)
  Tensor block_panels_;  // backward on the tile kernels: per thread, one key and one value block packed
  // Decode (prepare_decode): every token's keys and values, and per split task its accumulator
  // [D], scaled query [D], (max, sum) and score row (as long as the longest split).
  KvCache cache_;
  SplitRows split_rows_;
  Tensor split_queries_, split_scores_;
  std::int64_t splits_ = 1, length_ = 0;
};

// --- bf16 (issue 31; contracts in exact_tiled.hpp) ------------------------------------------------

// Split s of a bf16 decode step over `keys` keys starts at a panel boundary (the cache's key
// panels): [split_begin(s), split_begin(s + 1)), the last split ending at keys.
std::int64_t bf16_split_begin(std::int64_t split, std::int64_t splits, std::int64_t keys) {
  if (split >= splits) return keys;
  return split * keys / splits / tiles::kPanel * tiles::kPanel;
}
// The most keys one bf16 split of at most `capacity` keys holds.
std::int64_t bf16_split_capacity(std::int64_t capacity, std::int64_t splits) {
  return split_capacity(capacity, splits) + tiles::kPanel;
}

class ExactTiledBf16 final : public Mechanism {
 public:
  ExactTiledBf16(const Problem& problem, const ExactTiledConfig& config) : p_(problem), c_(config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t threads = p_.threads, heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    walk_ = OnlineBuffersBf16(threads, c_.block_q, c_.block_k, d);
    packed_keys_ = Tensor(Shape{heads, head_panel_elements(n, d)}, DType::BF16);
    packed_values_ = Tensor(Shape{heads, head_pair_elements(n, d)}, DType::BF16);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads;
    const std::int64_t query_blocks = (n + c_.block_q - 1) / c_.block_q, tasks = heads * query_blocks;
    pack_heads_bf16(k, v, p_.threads, packed_keys_, packed_values_);
    std::int64_t kernel_flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : kernel_flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t task = 0; task < tasks; ++task) {
        const std::int64_t head = task / query_blocks;
        const std::int64_t block = p_.causal ? query_blocks - 1 - task % query_blocks : task % query_blocks;
        kernel_flops +=
            query_block(head, q.bf16_data() + head * n * d, out.bf16_data() + head * n * d, block * c_.block_q, thread);
      }
    }
    if (cache_.capacity() > 0) cache_.load_context(k, v, p_.threads);
    FlopCounter::add(kernel_flops);
    length_ = n;
  }

  void prepare_backward() override {
    const std::int64_t n = p_.seq_len, rows = p_.batch * p_.heads * n;
    log_sum_exp_ = Tensor(Shape{rows});
    deltas_ = Tensor(Shape{rows});
    backward_ = OnlineBackwardBf16(p_.threads, n, n, c_.backward_block_k, p_.head_dim);
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads;
    std::int64_t own_flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : own_flops)
    {
      const int thread = omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t head = 0; head < heads; ++head) {
        const std::int64_t at = head * n * d;
        own_flops += backward_.head_backward(
            {q.bf16_data() + at, k.bf16_data() + at, v.bf16_data() + at, out.bf16_data() + at, dout.bf16_data() + at,
             dk.bf16_data() + at, dv.bf16_data() + at, log_sum_exp_.data() + head * n, deltas_.data() + head * n, n, n,
             d, c_.backward_block_k, p_.causal},
            thread);
        tiles::round_row(backward_.query_grads(thread), n * d, dq.bf16_data() + at);
      }
    }
    FlopCounter::add(own_flops);
  }

  std::vector<NamedTensor> saved() const override { return {{"log_sum_exp", &log_sum_exp_}}; }

  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t heads = p_.batch * p_.heads, capacity = p_.seq_len + tokens, d = p_.head_dim;
    splits_ = decode_splits(p_, c_, tokens);
    cache_ = Bf16KvCache(heads, capacity, d);
    const std::int64_t longest = bf16_split_capacity(capacity, splits_);
    split_rows_ = SplitRows(heads * splits_, d);
    split_scores_ = Tensor(Shape{heads * splits_, tiles::panels_for(longest) * tiles::kPanel});
    split_probs_ = Tensor(Shape{heads * splits_, longest / 2 * 2 + 2}, DType::BF16);
  }

  // Split-K as the fp32 form, on the bf16 cache: split s of a head attends to its keys
  // [bf16_split_begin(s), bf16_split_begin(s + 1)) (the last split also stores the new token first).
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (length_ >= cache_.capacity()) throw std::logic_error("exact-tiled: decode step past the prepared capacity");
    const std::int64_t d = p_.head_dim, heads = p_.batch * p_.heads, keys = length_ + 1, splits = splits_;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
#pragma omp for schedule(static)
      for (std::int64_t task = 0; task < heads * splits; ++task) {
        const std::int64_t head = task / splits, split = task % splits;
        const std::int64_t begin = bf16_split_begin(split, splits, keys);
        const std::int64_t end = bf16_split_begin(split + 1, splits, keys);
        if (split == splits - 1) cache_.store(head, length_, k.bf16_data() + head * d, v.bf16_data() + head * d);
        RowSoftmax row = split_rows_.begin(task);
        flops += d;  // the fp32 form's query scaling; here the scale rides on the scores
        flops += attend_block_bf16(row, q.bf16_data() + head * d, cache_, head, begin, end - begin,
                                   split_scores_.data() + task * split_scores_.dim(1),
                                   split_probs_.bf16_data() + task * split_probs_.dim(1));
        split_rows_.keep(task, row);
      }
#pragma omp for schedule(static)
      for (std::int64_t head = 0; head < heads; ++head) {
        RowSoftmax total;
        flops += split_rows_.merge(head, splits, &total);
        float* acc = total.acc;
        flops += finish_row(total, acc);
        tiles::round_row(acc, d, out.bf16_data() + head * d);
      }
    }
    FlopCounter::add(flops);
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"key_cache", &cache_.key_tensor()}, {"value_cache", &cache_.value_tensor()}};
  }

 private:
  bool saves_log_sum_exp() const { return !log_sum_exp_.empty(); }

  // Rows [q0, q0 + bq) of one head: the fp32 form's walk on the bf16 kernels
  // (attend_online_bf16). Returns its FLOPs.
  std::int64_t query_block(std::int64_t head, const bf16* q, bf16* out, std::int64_t q0, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const OnlineBlockBf16 block{q + q0 * d,
                                q0,
                                std::min(c_.block_q, n - q0),
                                packed_keys_.bf16_data() + head * packed_keys_.dim(1),
                                packed_values_.bf16_data() + head * packed_values_.dim(1),
                                n,
                                c_.block_k,
                                d,
                                p_.causal};
    float* lse = saves_log_sum_exp() ? log_sum_exp_.data() + head * n + q0 : nullptr;
    return attend_online_bf16(block, walk_.scratch(thread), out + q0 * d, lse);
  }

  Problem p_;
  ExactTiledConfig c_;
  OnlineBuffersBf16 walk_;  // per thread: a strip's scores and probabilities, the block's accumulator and statistics
  Tensor packed_keys_, packed_values_;
  // Training (prepare_backward): L and δ (fp32) and the backward's per-thread buffers.
  Tensor log_sum_exp_, deltas_;
  OnlineBackwardBf16 backward_;
  Bf16KvCache cache_;  // decode
  SplitRows split_rows_;
  Tensor split_scores_, split_probs_;
  std::int64_t splits_ = 1, length_ = 0;
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const ExactTiledConfig& c, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<ExactTiledBf16>(problem, c);
  return std::make_unique<ExactTiled>(problem, c);
}

std::int64_t flops(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  std::int64_t per_head = n * d;  // final 1/l scaling
  for (std::int64_t q0 = 0; q0 < n; q0 += c.block_q) {
    const std::int64_t rows = std::min(c.block_q, n - q0);
    const std::int64_t key_end = p.causal ? q0 + rows : n;
    for (std::int64_t k0 = 0; k0 < key_end; k0 += c.block_k) {
      const std::int64_t cols = tile_columns(p, k0, q0, rows, c.block_k);
      per_head += matmul_flops(rows, score_columns(cols, d), d) + matmul_flops(rows, d, cols);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t valid = valid_in_row(p.causal, q0 + r, k0, cols);
        if (valid > 0) per_head += kOnlineSoftmaxFlopsPerElement * valid + d;
      }
    }
  }
  return p.batch * p.heads * per_head;
}

namespace {

constexpr std::int64_t kF32 = sizeof(float), kBf16 = 2;

std::int64_t bf16_workspace(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t d = p.head_dim;
  const std::int64_t packed =
      p.batch * p.heads * (head_panel_elements(p.seq_len, d) + head_pair_elements(p.seq_len, d));
  return OnlineBuffersBf16::bytes(p.threads, c.block_q, c.block_k, d) + packed * kBf16;
}

std::int64_t bf16_backward_workspace(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t n = p.seq_len;
  return 2 * p.batch * p.heads * n * kF32 + OnlineBackwardBf16::bytes(p.threads, n, n, c.backward_block_k, p.head_dim);
}

std::int64_t bf16_decode_workspace(const Problem& p, const ExactTiledConfig& c, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, splits = decode_splits(p, c, tokens), tasks = heads * splits;
  const std::int64_t capacity = p.seq_len + tokens, longest = bf16_split_capacity(capacity, splits);
  return Bf16KvCache::bytes(heads, capacity, p.head_dim) +
         tasks * (p.head_dim + 2 + tiles::panels_for(longest) * tiles::kPanel) * kF32 +
         tasks * (longest / 2 * 2 + 2) * kBf16;
}

}  // namespace

std::string unsupported(const Problem& p, const ExactTiledConfig&) {
  return tiles::bf16_head_dim_unsupported("exact-tiled's bf16 form", p.dtype, p.head_dim);
}

std::int64_t workspace(const Problem& p, const ExactTiledConfig& c) {
  if (p.dtype == DType::BF16) return bf16_workspace(p, c);
  const std::int64_t threads = p.threads;
  const std::int64_t per_thread =
      score_rows(c, p.head_dim) * score_stride(c.block_k) + c.block_q * p.head_dim + 2 * c.block_q;
  return (threads * per_thread + packed_key_floats(p)) * static_cast<std::int64_t>(sizeof(float));
}

// The tiles head_backward executes: per key block, strips of backward_rows query rows (causal: from
// the strip holding the block's first key); S and dP over whole panels on the tile kernels.
std::int64_t backward_flops(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, strip = backward_rows(c, d);
  std::int64_t per_head = 2 * n * d;  // δ
  for (std::int64_t k0 = 0; k0 < n; k0 += c.backward_block_k) {
    for (std::int64_t q0 = p.causal ? k0 / strip * strip : 0; q0 < n; q0 += strip) {
      const std::int64_t rows = std::min(strip, n - q0);
      const std::int64_t cols = tile_columns(p, k0, q0, rows, c.backward_block_k);
      per_head += 2 * matmul_flops(rows, score_columns(cols, d), d) + 3 * matmul_flops(rows, cols, d);
      for (std::int64_t r = 0; r < rows; ++r)
        per_head += kRecomputedSoftmaxBackwardFlopsPerElement * valid_in_row(p.causal, q0 + r, k0, cols);
    }
  }
  return p.batch * p.heads * per_head;
}

std::int64_t decode_workspace(const Problem& p, const ExactTiledConfig& c, std::int64_t tokens) {
  if (p.dtype == DType::BF16) return bf16_decode_workspace(p, c, tokens);
  const std::int64_t heads = p.batch * p.heads, tasks = heads * decode_splits(p, c, tokens);
  const std::int64_t capacity = p.seq_len + tokens;
  return KvCache::bytes(heads, capacity, p.head_dim) +
         tasks * (2 * p.head_dim + 2 + split_capacity(capacity, tasks / heads)) *
             static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_workspace(const Problem& p, const ExactTiledConfig& c) {
  if (p.dtype == DType::BF16) return bf16_backward_workspace(p, c);
  const std::int64_t per_thread =
      2 * backward_rows(c, p.head_dim) * score_stride(c.backward_block_k) + 2 * block_panel_floats(c, p.head_dim);
  const std::int64_t floats = 2 * p.batch * p.heads * p.seq_len + p.threads * per_thread;
  return floats * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<ExactTiledConfig> config_fields(const ExactTiledConfig*) {
  return {int_field("block_q", &ExactTiledConfig::block_q, 1, 4096, "query rows per task (tokens)"),
          int_field("block_k", &ExactTiledConfig::block_k, 1, 8192,
                    "key columns per forward tile (tokens; rounded up to a multiple of 16 when head_dim is)"),
          int_field("backward_block_k", &ExactTiledConfig::backward_block_k, 1, 8192,
                    "key columns per backward block (tokens; rounded up like block_k)")};
}

template <>
Implementation implementation<ExactTiledConfig>() {
  Implementation impl = implement<ExactTiledConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
