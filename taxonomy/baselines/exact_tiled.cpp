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
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {
namespace {

// Head sizes that are multiples of the kernel panel run on the register-blocked tile kernels;
// others on oneDNN's sgemm. The kernels compute whole key panels (the last one zero-padded).
bool uses_tile_kernels(std::int64_t d) { return d % tiles::kPanel == 0; }

// On the tile kernels a key tile starts on a panel boundary: block_k is rounded up to whole panels.
ExactTiledConfig resolve(const Problem& p, ExactTiledConfig c) {
  if (uses_tile_kernels(p.head_dim)) c.block_k = tiles::panels_for(c.block_k) * tiles::kPanel;
  return c;
}

// Floats of the packed copy of K (all heads) that the tile kernels read; 0 on the sgemm path.
std::int64_t packed_key_floats(const Problem& p) {
  if (!uses_tile_kernels(p.head_dim)) return 0;
  return p.batch * p.heads * tiles::panels_for(p.seq_len) * p.head_dim * tiles::kPanel;
}

std::int64_t score_columns(std::int64_t cols, std::int64_t d) {
  return uses_tile_kernels(d) ? tiles::panels_for(cols) * tiles::kPanel : cols;
}

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

class ExactTiled final : public Mechanism {
 public:
  ExactTiled(const Problem& problem, const ExactTiledConfig& config) : p_(problem), c_(config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t threads = p_.threads;
    score_ld_ = score_columns(c_.block_k, p_.head_dim);
    scores_ = Tensor(Shape{threads, c_.block_q, score_ld_});
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
    tile_grads_ = Tensor(Shape{p_.threads, 2, c_.block_q, c_.block_k});
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
        own_flops += head_backward(head, {q.data() + offset, k.data() + offset, v.data() + offset, out.data() + offset,
                                          dout.data() + offset, dq.data() + offset, dk.data() + offset,
                                          dv.data() + offset},
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
    split_accumulators_ = Tensor(Shape{heads * splits_, p_.head_dim});
    split_queries_ = Tensor(Shape{heads * splits_, p_.head_dim});
    split_stats_ = Tensor(Shape{heads * splits_, 2});
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
        RowSoftmax row = begin_row(split_accumulators_.data() + task * d, d);
        flops += attend_block(row, query, cache_.keys(head) + begin * d, cache_.values(head) + begin * d, end - begin,
                              split_scores_.data() + task * split_scores_.dim(1));
        split_stats_[2 * task] = row.max;
        split_stats_[2 * task + 1] = row.sum;
      }
#pragma omp for schedule(static)
      for (std::int64_t head = 0; head < heads; ++head) {
        RowSoftmax total = split_row(head * splits + splits - 1);
        for (std::int64_t split = 0; split + 1 < splits; ++split) flops += merge_rows(total, split_row(head * splits + split));
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

  // The whole backward of one head. Returns the FLOPs it executed outside oneDNN.
  std::int64_t head_backward(std::int64_t head, const HeadGrads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bq = c_.block_q, bk = c_.block_k;
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
      const std::int64_t first_block = p_.causal ? k0 / bq * bq : 0;
      for (std::int64_t q0 = first_block; q0 < n; q0 += bq) {
        const std::int64_t rows = std::min(bq, n - q0);
        flops += tile_backward(head, g, q0, rows, k0, tile_columns(p_, k0, q0, rows, bk), thread);
      }
    }
    return flops;
  }

  // The backward of the [rows, cols] tile at (q0, k0). Returns the FLOPs it executed outside oneDNN.
  std::int64_t tile_backward(std::int64_t head, const HeadGrads& g, std::int64_t q0, std::int64_t rows,
                             std::int64_t k0, std::int64_t cols, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, ld = c_.block_k;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* probs = tile_grads_.data() + thread * 2 * c_.block_q * ld;
    float* grads = probs + c_.block_q * ld;
    const float* lse = log_sum_exp_.data() + head * n + q0;
    const float* delta = deltas_.data() + head * n + q0;
    ops::gemm(false, true, rows, cols, d, scale, g.q + q0 * d, d, g.k + k0 * d, d, 0.0f, probs, ld);
    ops::gemm(false, true, rows, cols, d, 1.0f, g.dout + q0 * d, d, g.v + k0 * d, d, 0.0f, grads, ld);
    std::int64_t valid_entries = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      float* p_row = probs + r * ld;
      float* g_row = grads + r * ld;
      const std::int64_t valid = valid_in_row(p_.causal, q0 + r, k0, cols);
      const float shift = lse[r], dot = delta[r];
#pragma omp simd
      for (std::int64_t j = 0; j < valid; ++j) {
        p_row[j] = ops::fast_exp(p_row[j] - shift);
        g_row[j] = p_row[j] * (g_row[j] - dot);
      }
      std::fill(p_row + valid, p_row + cols, 0.0f);
      std::fill(g_row + valid, g_row + cols, 0.0f);
      valid_entries += valid;
    }
    ops::gemm(true, false, cols, d, rows, 1.0f, probs, ld, g.dout + q0 * d, d, 1.0f, g.dv + k0 * d, d);
    ops::gemm(true, false, cols, d, rows, scale, grads, ld, g.q + q0 * d, d, 1.0f, g.dk + k0 * d, d);
    ops::gemm(false, false, rows, d, cols, scale, grads, ld, g.k + k0 * d, d, 1.0f, g.dq + q0 * d, d);
    return kRecomputedSoftmaxBackwardFlopsPerElement * valid_entries;
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
  std::int64_t query_block(std::int64_t head, const float* q, const float* k, const float* v, float* out, std::int64_t q0,
                           int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bk = c_.block_k;
    const std::int64_t rows = std::min(c_.block_q, n - q0);
    const std::int64_t lds = score_ld_;
    float* scores = scores_.data() + thread * c_.block_q * lds;
    float* acc = accumulators_.data() + thread * c_.block_q * d;
    float* row_max = row_stats_.data() + thread * 2 * c_.block_q;
    float* row_sum = row_max + c_.block_q;
    std::fill(acc, acc + rows * d, 0.0f);
    std::fill(row_max, row_max + rows, -std::numeric_limits<float>::infinity());
    std::fill(row_sum, row_sum + rows, 0.0f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const std::int64_t key_end = p_.causal ? q0 + rows : n;
    std::int64_t flops = 0;
    for (std::int64_t k0 = 0; k0 < key_end; k0 += bk) {
      const std::int64_t cols = tile_columns(p_, k0, q0, rows, bk);
      flops += compute_scores(head, q + q0 * d, rows, k, k0, cols, scale, scores);
      for (std::int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * lds;
        const std::int64_t valid = valid_in_row(p_.causal, q0 + r, k0, cols);
        if (valid == 0) {
          std::fill(row, row + cols, 0.0f);
          continue;
        }
        const float peak = ops::row_max(row, valid, row_max[r]);
        const float sum = ops::exp_and_sum(row, valid, peak);
        std::fill(row + valid, row + cols, 0.0f);
        const float rescale = ops::fast_exp(row_max[r] - peak);
        row_sum[r] = row_sum[r] * rescale + sum;
        row_max[r] = peak;
        float* acc_row = acc + r * d;
#pragma omp simd
        for (std::int64_t j = 0; j < d; ++j) acc_row[j] *= rescale;
        flops += kOnlineSoftmaxFlopsPerElement * valid + d;
      }
      if (uses_tile_kernels(d)) {
        tiles::accumulate_pv(scores, lds, rows, cols, v + k0 * d, d, d, acc, d);
        flops += matmul_flops(rows, d, cols);
      } else {
        ops::gemm(false, false, rows, d, cols, 1.0f, scores, lds, v + k0 * d, d, 1.0f, acc, d);
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
    const float* packed = packed_keys_.data() + (head * tiles::panels_for(p_.seq_len) + k0 / tiles::kPanel) * d * tiles::kPanel;
    tiles::scores(q, d, rows, packed, tiles::panels_for(cols), d, scale, scores, score_ld_);
    return matmul_flops(rows, score_columns(cols, d), d);
  }

  // The partial state of split task `task` as its attend_rows left it.
  RowSoftmax split_row(std::int64_t task) {
    RowSoftmax row;
    row.acc = split_accumulators_.data() + task * p_.head_dim;
    row.head_dim = p_.head_dim;
    row.max = split_stats_[2 * task];
    row.sum = split_stats_[2 * task + 1];
    return row;
  }

  Problem p_;
  ExactTiledConfig c_;
  std::int64_t score_ld_ = 0;
  Tensor scores_, packed_keys_, accumulators_, row_stats_;
  Tensor log_sum_exp_, deltas_, tile_grads_;  // training only (prepare_backward)
  // Decode (prepare_decode): every token's keys and values, and per split task its accumulator
  // [D], scaled query [D], (max, sum) and score row (as long as the longest split).
  KvCache cache_;
  Tensor split_accumulators_, split_queries_, split_stats_, split_scores_;
  std::int64_t splits_ = 1, length_ = 0;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const ExactTiledConfig& c, std::uint64_t) {
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

std::int64_t workspace(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t threads = p.threads;
  const std::int64_t per_thread = c.block_q * score_columns(c.block_k, p.head_dim) + c.block_q * p.head_dim + 2 * c.block_q;
  return (threads * per_thread + packed_key_floats(p)) * static_cast<std::int64_t>(sizeof(float));
}

// Tiles the backward executes: those the forward did (see tile_backward).
std::int64_t backward_flops(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  std::int64_t per_head = 2 * n * d;  // δ
  for (std::int64_t k0 = 0; k0 < n; k0 += c.block_k) {
    for (std::int64_t q0 = p.causal ? k0 / c.block_q * c.block_q : 0; q0 < n; q0 += c.block_q) {
      const std::int64_t rows = std::min(c.block_q, n - q0);
      const std::int64_t cols = tile_columns(p, k0, q0, rows, c.block_k);
      per_head += 5 * matmul_flops(rows, cols, d);
      for (std::int64_t r = 0; r < rows; ++r)
        per_head += kRecomputedSoftmaxBackwardFlopsPerElement * valid_in_row(p.causal, q0 + r, k0, cols);
    }
  }
  return p.batch * p.heads * per_head;
}

std::int64_t decode_workspace(const Problem& p, const ExactTiledConfig& c, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, tasks = heads * decode_splits(p, c, tokens);
  const std::int64_t capacity = p.seq_len + tokens;
  return KvCache::bytes(heads, capacity, p.head_dim) +
         tasks * (2 * p.head_dim + 2 + split_capacity(capacity, tasks / heads)) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_workspace(const Problem& p, const ExactTiledConfig& c) {
  const std::int64_t floats = 2 * p.batch * p.heads * p.seq_len + p.threads * 2 * c.block_q * c.block_k;
  return floats * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace

Implementation exact_tiled_implementation() {
  return implement(ModelSpec<ExactTiledConfig>{
      .fields = {int_field("block_q", &ExactTiledConfig::block_q, 1, 4096, "query rows per task (tokens)"),
                 int_field("block_k", &ExactTiledConfig::block_k, 1, 8192,
                           "key columns per tile (tokens; rounded up to a multiple of 16 when head_dim is)")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = resolve,
      .backward_flops = backward_flops,
      .backward_workspace = backward_workspace,
      .decode_workspace = decode_workspace});
}

}  // namespace xfb
