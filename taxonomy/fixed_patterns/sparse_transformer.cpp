#include "taxonomy/fixed_patterns/sparse_transformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/block_sparse_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/single_plan.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;
using bs::kTaskRows;

// Strided A1: consecutive query tiles of min(64, l) rows over the band i − l ≤ j ≤ i (non-causal:
// |i − j| ≤ l); a tile's hull is its rows plus l (2l) columns, so the waste stays a fixed factor.
struct BandPlan {
  std::int64_t n, l;
  bool causal;
  std::int64_t tile() const { return std::min(kTaskRows, l); }
  std::int64_t tasks() const { return (n + tile() - 1) / tile(); }
  std::int64_t max_width() const { return std::min(n, tile() + (causal ? l : 2 * l)); }
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    const std::int64_t q0 = task * tile(), k0 = std::max<std::int64_t>(0, q0 - l);
    const bs::Tile tile_rows{.rows = std::min(tile(), n - q0), .q_first = q0, .k_first = k0};
    for (std::int64_t r = 0; r < tile_rows.rows; ++r) {
      const std::int64_t i = q0 + r;
      lo[r] = std::max<std::int64_t>(0, i - l) - k0;
      hi[r] = (causal ? i + 1 : std::min(n, i + l + 1)) - k0;
    }
    return tile_rows;
  }
};

// Fixed A2: the summary tokens j mod l ≥ l − c, gathered in order into a contiguous [G, D] buffer.
struct SummaryPlan {
  std::int64_t n, l, c;
  bool causal;
  // Summary tokens ≤ i.
  std::int64_t up_to(std::int64_t i) const { return i / l * c + std::clamp<std::int64_t>(i % l - (l - c) + 1, 0, c); }
  std::int64_t count() const { return up_to(n - 1); }
  std::int64_t position(std::int64_t s) const { return s / c * l + (l - c) + s % c; }
  std::int64_t tasks() const { return (n + kTaskRows - 1) / kTaskRows; }
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    const std::int64_t q0 = task * kTaskRows, all = count();
    const bs::Tile tile{.rows = std::min(kTaskRows, n - q0), .q_first = q0, .k_first = 0};
    for (std::int64_t r = 0; r < tile.rows; ++r) {
      lo[r] = 0;
      hi[r] = causal ? up_to(q0 + r) : all;
    }
    return tile;
  }
};

// Everything the mechanism, flops() and workspace() derive from the problem and parameters.
struct Layout {
  bool fixed;
  std::int64_t l, c, heads_a1, heads_a2;
  BandPlan band;
  bs::StridedTiling classes;
  bs::BlockTiling blocks;
  SummaryPlan summaries;

  Layout(const Problem& p, const SparseTransformerConfig& config)
      : fixed(config.pattern == "fixed"),
        l(config.stride > 0 ? config.stride : bs::ceil_sqrt(p.seq_len)),
        c(std::min(config.summary, l)),
        heads_a1((p.heads + 1) / 2),
        heads_a2(p.heads - heads_a1),
        band{p.seq_len, l, p.causal},
        classes(p.seq_len, l),
        blocks(p.seq_len, l),
        summaries{p.seq_len, l, c, p.causal} {}

  std::int64_t summary_count() const { return fixed && heads_a2 > 0 ? summaries.count() : 0; }
  std::vector<std::int64_t> summary_positions() const {
    std::vector<std::int64_t> positions(static_cast<std::size_t>(summary_count()));
    for (std::size_t s = 0; s < positions.size(); ++s) positions[s] = summaries.position(static_cast<std::int64_t>(s));
    return positions;
  }
  // Head (= b·H + h) of group member `index` (b·|group| + the head's rank in its group).
  std::int64_t group_head(bool first, std::int64_t index, std::int64_t heads) const {
    return first ? index / heads_a1 * heads + index % heads_a1 : index / heads_a2 * heads + heads_a1 + index % heads_a2;
  }
  bool first_group(std::int64_t head, std::int64_t heads) const { return head % heads < heads_a1; }

  // Runs with_plan(tasks, plan) with the tile plan of the first (A1) or second (A2) head group.
  template <class WithPlan>
  auto with_group_plan(bool first, bool causal, const WithPlan& with_plan) const {
    if (first && fixed)
      return with_plan(blocks.tasks(), [this, causal](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
        return bs::block_tile(blocks, task, causal, lo, hi);
      });
    if (first) return with_plan(band.tasks(), band);
    if (fixed) return with_plan(summaries.tasks(), summaries);
    return with_plan(classes.tasks(), [this, causal](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
      return bs::class_tile(classes, task, causal, lo, hi);
    });
  }
  // Decode caches: A1 rings (strided: the last l + 1 tokens; fixed: l, the current block) and A2's
  // rows of `total` tokens (strided: every token; fixed: the summary tokens, at least one row).
  std::int64_t first_ring() const { return fixed ? l : l + 1; }
  std::int64_t second_rows(std::int64_t total) const {
    return fixed ? std::max<std::int64_t>(1, summaries.up_to(total - 1)) : total;
  }
  std::int64_t max_width() const {
    const std::int64_t a1 = fixed ? blocks.block : band.max_width();
    const std::int64_t a2 = heads_a2 == 0 ? 0 : (fixed ? summaries.count() : classes.longest);
    return std::max(a1, a2);
  }
};

// The decode state (header comment) on rows of T (fp32, or bf16 for --dtype bf16): A1 rings in
// `first`, A2 rows in `second` (KvCache of T each).
struct DecodeCaches {
  KvCache first, second;
  DecodeCaches() = default;
  DecodeCaches(const Problem& p, const Layout& layout, std::int64_t tokens) {
    first = KvCache(p.batch * layout.heads_a1, layout.first_ring(), p.head_dim, p.dtype);
    if (layout.heads_a2 > 0)
      second = KvCache(p.batch * layout.heads_a2, layout.second_rows(p.seq_len + tokens), p.head_dim, p.dtype);
  }
  static std::int64_t bytes(const Problem& p, const Layout& layout, std::int64_t tokens) {
    std::int64_t bytes = KvCache::bytes(p.batch * layout.heads_a1, layout.first_ring(), p.head_dim, p.dtype);
    if (layout.heads_a2 > 0)
      bytes += KvCache::bytes(p.batch * layout.heads_a2, layout.second_rows(p.seq_len + tokens), p.head_dim, p.dtype);
    return bytes;
  }
  bool empty() const { return first.key_tensor().empty(); }
  std::vector<NamedTensor> state(const Layout& layout) const {
    std::vector<NamedTensor> state = {{"a1_key_ring", &first.key_tensor()}, {"a1_value_ring", &first.value_tensor()}};
    if (layout.heads_a2 > 0) {
      state.push_back({"a2_keys", &second.key_tensor()});
      state.push_back({"a2_values", &second.value_tensor()});
    }
    return state;
  }

  // The prefill's part of a decode: the context's rows each cache keeps (k, v: [B, H, N, D] of T).
  template <class T>
  void load_context(const Problem& p, const Layout& layout, const T* k, const T* v) {
    const std::int64_t n = p.seq_len, d = p.head_dim, a1 = layout.heads_a1, a2 = layout.heads_a2;
#pragma omp parallel for num_threads(p.threads) schedule(static)
    for (std::int64_t head = 0; head < p.batch * p.heads; ++head) {
      const std::int64_t b = head / p.heads, h = head % p.heads;
      const T *keys = k + head * n * d, *values = v + head * n * d;
      if (h < a1) {
        const std::int64_t ring = layout.first_ring(), kept = std::min(n, ring), start = n - kept;
        first.store(b * a1 + h, start % ring, keys + start * d, values + start * d, kept);
      } else if (layout.fixed) {
        for (std::int64_t s = 0; s < layout.summaries.up_to(n - 1); ++s) {
          const std::int64_t position = layout.summaries.position(s);
          second.store(b * a2 + h - a1, s, keys + position * d, values + position * d, 1);
        }
      } else {
        second.store(b * a2 + h - a1, 0, keys, values, n);
      }
    }
  }

  // One head's step for token i: stores its key and value where its group keeps them, then attends
  // to the token's causal set (A1: the band or the block so far; A2: its residue class or the
  // summaries so far). Returns the FLOPs.
  template <class T>
  std::int64_t attend_step(const Layout& layout, RowSoftmax& row, const float* query, const T* key, const T* value,
                           std::int64_t b, std::int64_t h, std::int64_t i) {
    const std::int64_t d = row.head_dim, l = layout.l, a1 = layout.heads_a1, a2 = layout.heads_a2;
    if (h < a1) {
      const std::int64_t index = b * a1 + h, ring = layout.first_ring();
      first.store(index, i % ring, key, value, 1);
      const std::int64_t start = layout.fixed ? i / l * l : std::max<std::int64_t>(0, i - l);
      return attend_ring(row, query, first.keys<T>(index), first.values<T>(index), ring, start, i - start + 1);
    }
    const std::int64_t index = b * a2 + h - a1;
    if (layout.fixed) {
      const std::int64_t summaries = layout.summaries.up_to(i);
      if (i % l >= l - layout.c) second.store(index, summaries - 1, key, value, 1);
      return attend_rows(row, query, second.keys<T>(index), second.values<T>(index), summaries);
    }
    second.store(index, i, key, value, 1);
    const std::int64_t residue = i % l;
    return attend_rows(row, query, second.keys<T>(index) + residue * d, second.values<T>(index) + residue * d,
                       i / l + 1, l * d);
  }
};

class SparseTransformer final : public Mechanism {
 public:
  SparseTransformer(const Problem& problem, const SparseTransformerConfig& config)
      : p_(problem), layout_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratch(p_.threads, layout_.max_width(), p_.head_dim);
    const std::int64_t g = layout_.summary_count();
    if (g == 0) return;
    summary_index_ = layout_.summary_positions();
    summary_keys_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim});
    summary_values_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    attend_context(q, k, v, out);
    if (!caches_.empty()) {
      caches_.load_context(p_, layout_, k.data(), v.data());
      length_ = p_.seq_len;
    }
  }

  void attend_context(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t a1 = layout_.heads_a1, a2 = layout_.heads_a2;
    auto first_group = [&](std::int64_t index) {
      const std::int64_t head = index / a1 * p_.heads + index % a1;
      return training_.saving(bs::head_view(q, k, v, out, head), head);
    };
    auto second_group = [&](std::int64_t index) {
      const std::int64_t head = index / a2 * p_.heads + a1 + index % a2;
      return training_.saving(bs::head_view(q, k, v, out, head), head);
    };
    const bool causal = p_.causal;
    if (!layout_.fixed) {
      bs::run_tiles(p_.batch * a1, layout_.band.tasks(), scratch_, first_group, layout_.band);
      bs::run_tiles(p_.batch * a2, layout_.classes.tasks(), scratch_, second_group,
                    [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
                      return bs::class_tile(layout_.classes, task, causal, lo, hi);
                    });
      return;
    }
    bs::run_tiles(p_.batch * a1, layout_.blocks.tasks(), scratch_, first_group,
                  [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
                    return bs::block_tile(layout_.blocks, task, causal, lo, hi);
                  });
    if (a2 == 0) return;
    gather_summaries(k, v);
    const std::int64_t g = layout_.summary_count(), d = p_.head_dim;
    auto gathered = [&](std::int64_t index) {
      bs::HeadView view = second_group(index);
      view.k = summary_keys_.data() + index * g * d;
      view.v = summary_values_.data() + index * g * d;
      return view;
    };
    bs::run_tiles(p_.batch * a2, layout_.summaries.tasks(), scratch_, gathered, layout_.summaries);
  }

  void prepare_backward() override {
    training_.prepare(p_.batch * p_.heads, p_.seq_len, p_.threads, layout_.max_width(), p_.head_dim);
    const std::int64_t g = layout_.summary_count();
    if (g > 0) summary_grads_ = Tensor(Shape{p_.threads, 2, g, p_.head_dim});
  }

  void prepare_decode(std::int64_t tokens) override {
    caches_ = DecodeCaches(p_, layout_, tokens);
    step_buffers_ = Tensor(Shape{p_.batch * p_.heads, 2, p_.head_dim});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, token = length_;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      return caches_.attend_step(layout_, row, query, k.data() + head * d, v.data() + head * d, head / p_.heads,
                                 head % p_.heads, token);
    });
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override { return caches_.state(layout_); }

  // Per head: its group's tiles; the fixed pattern's A2 heads accumulate dK, dV of the gathered
  // summary rows and scatter them back (every other key row of such a head gets no gradient).
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const bs::BackwardTensors t{q, k, v, out, dout, dq, dk, dv};
    const std::int64_t n = p_.seq_len, d = p_.head_dim, g_rows = layout_.summary_count();
    bs::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      bs::HeadGrads g = training_.grads(t, head, thread);
      const bool first = layout_.first_group(head, p_.heads);
      const bool gathered = !first && layout_.fixed;
      if (gathered) {
        const std::int64_t index = head / p_.heads * layout_.heads_a2 + head % p_.heads - layout_.heads_a1;
        g.k = summary_keys_.data() + index * g_rows * d;
        g.v = summary_values_.data() + index * g_rows * d;
        g.dk = summary_grads_.data() + thread * 2 * g_rows * d;
        g.dv = g.dk + g_rows * d;
      }
      const std::int64_t flops = bs::begin_head(g, n, gathered ? g_rows : n) +
                                 layout_.with_group_plan(first, p_.causal, [&](std::int64_t tasks, const auto& plan) {
                                   return bs::backward_tiles(g, tasks, plan, training_.scratch(), thread);
                                 });
      if (gathered) scatter_summary_grads(g, dk.data() + head * n * d, dv.data() + head * n * d);
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override {
    auto saved = training_.saved();
    if (!summary_keys_.empty())
      saved.insert(saved.end(), {{"summary_keys", &summary_keys_}, {"summary_values", &summary_values_}});
    return saved;
  }

 private:
  void scatter_summary_grads(const bs::HeadGrads& g, float* dk, float* dv) const {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    std::fill(dk, dk + n * d, 0.0f);
    std::fill(dv, dv + n * d, 0.0f);
    for (std::size_t s = 0; s < summary_index_.size(); ++s) {
      const std::int64_t row = summary_index_[s];
      std::copy(g.dk + static_cast<std::int64_t>(s) * d, g.dk + static_cast<std::int64_t>(s + 1) * d, dk + row * d);
      std::copy(g.dv + static_cast<std::int64_t>(s) * d, g.dv + static_cast<std::int64_t>(s + 1) * d, dv + row * d);
    }
  }

  void gather_summaries(const Tensor& k, const Tensor& v) {
    const std::int64_t a2 = layout_.heads_a2, g = layout_.summary_count(), d = p_.head_dim, n = p_.seq_len;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t index = 0; index < p_.batch * a2; ++index) {
      const std::int64_t head = index / a2 * p_.heads + layout_.heads_a1 + index % a2;
      bs::gather_rows(k.data() + head * n * d, d, summary_index_.data(), g, d, summary_keys_.data() + index * g * d, d);
      bs::gather_rows(v.data() + head * n * d, d, summary_index_.data(), g, d, summary_values_.data() + index * g * d,
                      d);
    }
  }

  Problem p_;
  Layout layout_;
  bs::ThreadScratch scratch_;
  std::vector<std::int64_t> summary_index_;
  Tensor summary_keys_, summary_values_;
  bs::TileTraining training_;
  Tensor summary_grads_;     // training, fixed pattern: per thread dK, dV of one head's gathered rows
  DecodeCaches caches_;      // decoding: A1 rings, A2 rows (see Layout::first_ring)
  Tensor step_buffers_;      // decoding: per head the scaled query and the accumulator
  std::int64_t length_ = 0;  // decoding: tokens seen
};

// The bf16 form (header comment): the same tiles on block_sparse's bf16 engine, the gathered summary
// rows in bf16, the backward's dQ, dK, dV summed in fp32 per head and rounded once, the decode state
// in bf16 rows.
class SparseTransformerBf16 final : public Mechanism {
 public:
  SparseTransformerBf16(const Problem& problem, const SparseTransformerConfig& config)
      : p_(problem), layout_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratchBf16(p_.threads, layout_.max_width(), p_.head_dim);
    const std::int64_t g = layout_.summary_count();
    if (g == 0) return;
    summary_index_ = layout_.summary_positions();
    summary_keys_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim}, DType::BF16);
    summary_values_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim}, DType::BF16);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (layout_.summary_count() > 0) gather_summaries(k, v);
    for (bool first : {true, false}) {
      const std::int64_t members = p_.batch * (first ? layout_.heads_a1 : layout_.heads_a2);
      if (members == 0) continue;
      auto head_of = [&](std::int64_t index) {
        const std::int64_t head = layout_.group_head(first, index, p_.heads);
        bs::HeadViewBf16 view = training_.saving(bs::head_view_bf16(q, k, v, out, head), head);
        if (!first && layout_.fixed) {
          view.k = summary_rows(summary_keys_, index);
          view.v = summary_rows(summary_values_, index);
        }
        return view;
      };
      layout_.with_group_plan(first, p_.causal, [&](std::int64_t tasks, const auto& plan) {
        bs::run_tiles_bf16(members, tasks, scratch_, head_of, plan);
        return 0;
      });
    }
    if (!caches_.empty()) {
      caches_.load_context(p_, layout_, k.bf16_data(), v.bf16_data());
      length_ = p_.seq_len;
    }
  }

  void prepare_backward() override {
    training_.prepare(p_.batch * p_.heads, p_.seq_len, p_.threads, layout_.max_width(), p_.head_dim);
    sums_ = Tensor(Shape{p_.threads, 3, p_.seq_len, p_.head_dim});
  }

  // Per head: δ, its group's tiles into the thread's fp32 sums, then dQ, dK, dV rounded once (the
  // fixed pattern's A2 heads scatter their gathered rows' sums; their other key rows get 0).
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const bs::BackwardTensors t{q, k, v, out, dout, dq, dk, dv};
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    bs::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      bs::HeadGradsBf16 g = training_.grads(t, head, thread);
      const bool first = layout_.first_group(head, p_.heads), gathered = !first && layout_.fixed;
      if (gathered) {
        const std::int64_t index = head / p_.heads * layout_.heads_a2 + head % p_.heads - layout_.heads_a1;
        g.k = summary_rows(summary_keys_, index);
        g.v = summary_rows(summary_values_, index);
      }
      float* dq_sum = sums_.data() + thread * 3 * n * d;
      float *dk_sum = dq_sum + n * d, *dv_sum = dk_sum + n * d;
      std::fill_n(dq_sum, 3 * n * d, 0.0f);
      const std::int64_t flops =
          bs::row_dots_bf16(g.dout, g.out, n, d, g.delta) +
          layout_.with_group_plan(first, p_.causal, [&](std::int64_t tasks, const auto& plan) {
            return bs::backward_sums_bf16(g, tasks, plan, dq_sum, dk_sum, dv_sum, training_.scratch(), thread);
          });
      narrow(dq_sum, g.dq, n * d);
      if (!gathered) {
        narrow(dk_sum, g.dk, n * d);
        narrow(dv_sum, g.dv, n * d);
        return flops;
      }
      std::fill_n(g.dk, n * d, bf16{});
      std::fill_n(g.dv, n * d, bf16{});
      for (std::size_t s = 0; s < summary_index_.size(); ++s) {
        const std::int64_t row = summary_index_[s], from = static_cast<std::int64_t>(s) * d;
        narrow(dk_sum + from, g.dk + row * d, d);
        narrow(dv_sum + from, g.dv + row * d, d);
      }
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override {
    auto saved = training_.saved();
    if (!summary_keys_.empty())
      saved.insert(saved.end(), {{"summary_keys", &summary_keys_}, {"summary_values", &summary_values_}});
    return saved;
  }

  void prepare_decode(std::int64_t tokens) override {
    caches_ = DecodeCaches(p_, layout_, tokens);
    step_buffers_ = Tensor(Shape{p_.batch * p_.heads, 2, p_.head_dim});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, token = length_;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      return caches_.attend_step(layout_, row, query, k.bf16_data() + head * d, v.bf16_data() + head * d,
                                 head / p_.heads, head % p_.heads, token);
    });
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override { return caches_.state(layout_); }

 private:
  // Member `index` of the A2 group's gathered rows (none when the pattern has no summary yet).
  const bf16* summary_rows(const Tensor& rows, std::int64_t index) const {
    return rows.empty() ? nullptr : rows.bf16_data() + index * rows.dim(2) * rows.dim(3);
  }

  void gather_summaries(const Tensor& k, const Tensor& v) {
    const std::int64_t a2 = layout_.heads_a2, g = layout_.summary_count(), d = p_.head_dim, n = p_.seq_len;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t index = 0; index < p_.batch * a2; ++index) {
      const std::int64_t head = layout_.group_head(false, index, p_.heads);
      for (std::int64_t s = 0; s < g; ++s) {
        const std::int64_t from = (head * n + summary_index_[static_cast<std::size_t>(s)]) * d,
                           to = (index * g + s) * d;
        std::copy_n(k.bf16_data() + from, d, summary_keys_.bf16_data() + to);
        std::copy_n(v.bf16_data() + from, d, summary_values_.bf16_data() + to);
      }
    }
  }

  Problem p_;
  Layout layout_;
  bs::ThreadScratchBf16 scratch_;
  std::vector<std::int64_t> summary_index_;
  Tensor summary_keys_, summary_values_;  // bf16 [B, A2 heads, G, D]
  bs::TileTrainingBf16 training_;
  Tensor sums_;  // training: per thread fp32 dQ, dK, dV sums of one head, [threads, 3, N, D]
  DecodeCaches caches_;
  Tensor step_buffers_;
  std::int64_t length_ = 0;
};

}  // namespace

void validate(const Problem&, const SparseTransformerConfig& c) {
  if (c.pattern == "fixed" && c.stride > 0 && c.summary > c.stride)
    throw ParamError("sparse-transformer: summary=" + std::to_string(c.summary) +
                     " exceeds stride=" + std::to_string(c.stride) + " (c must be at most l)");
}

std::unique_ptr<Mechanism> create(const Problem& problem, const SparseTransformerConfig& c, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<SparseTransformerBf16>(problem, c);
  return std::make_unique<SparseTransformer>(problem, c);
}

std::int64_t flops(const Problem& p, const SparseTransformerConfig& c) {
  const Layout layout(p, c);
  auto group = [&](bool first) {
    return layout.with_group_plan(
        first, p.causal, [&](std::int64_t tasks, const auto& plan) { return bs::plan_flops(tasks, p.head_dim, plan); });
  };
  return p.batch * (layout.heads_a1 * group(true) + (layout.heads_a2 > 0 ? layout.heads_a2 * group(false) : 0));
}

std::int64_t backward_flops(const Problem& p, const SparseTransformerConfig& c) {
  const Layout layout(p, c);
  auto group = [&](bool first) {
    return layout.with_group_plan(first, p.causal, [&](std::int64_t tasks, const auto& plan) {
      return bs::plan_backward_flops(p.seq_len, tasks, p.head_dim, plan);
    });
  };
  return p.batch * (layout.heads_a1 * group(true) + (layout.heads_a2 > 0 ? layout.heads_a2 * group(false) : 0));
}

std::int64_t backward_workspace(const Problem& p, const SparseTransformerConfig& c) {
  const Layout layout(p, c);
  if (p.dtype == DType::BF16)
    return bs::TileTrainingBf16::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, layout.max_width(),
                                               p.head_dim) +
           p.threads * 3 * p.seq_len * p.head_dim * static_cast<std::int64_t>(sizeof(float));
  const std::int64_t summary_grads = p.threads * 2 * layout.summary_count() * p.head_dim;
  return bs::TileTraining::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, layout.max_width(), p.head_dim) +
         summary_grads * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t workspace(const Problem& p, const SparseTransformerConfig& c) {
  const Layout layout(p, c);
  const std::int64_t gathered = 2 * p.batch * layout.heads_a2 * layout.summary_count() * p.head_dim;
  if (p.dtype == DType::BF16)
    return bs::ThreadScratchBf16::tracked_bytes(p.threads, layout.max_width(), p.head_dim) +
           gathered * element_bytes(DType::BF16);
  return bs::ThreadScratch::tracked_bytes(p.threads, layout.max_width(), p.head_dim) +
         gathered * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t decode_workspace(const Problem& p, const SparseTransformerConfig& c, std::int64_t tokens) {
  return DecodeCaches::bytes(p, Layout(p, c), tokens) +
         p.batch * p.heads * 2 * p.head_dim * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<SparseTransformerConfig> config_fields(const SparseTransformerConfig*) {
  return {choice_field("pattern", &SparseTransformerConfig::pattern, {{"strided", "strided"}, {"fixed", "fixed"}},
                       "factorised pattern"),
          int_field("stride", &SparseTransformerConfig::stride, 0, 1000000, "l in tokens; 0 means ceil(sqrt(N))"),
          int_field("summary", &SparseTransformerConfig::summary, 1, 1000000,
                    "c: summary tokens per block of l (fixed pattern; clamped to l)")};
}

SparseTransformerConfig resolve(const Problem& p, SparseTransformerConfig c) {
  const Layout layout(p, c);
  c.stride = layout.l;
  c.summary = layout.c;
  return c;
}

std::string unsupported(const Problem& p, const SparseTransformerConfig&) {
  if (p.heads < 2)  // the mechanism would run A1 alone: not the factorised pattern the row names
    return "the factorised pattern puts A1 and A2 on different heads: with --heads 1 only A1 would run; give "
           "--heads 2 or more";
  return bs::single_plan_bf16_unsupported(p);
}

template <>
Implementation implementation<SparseTransformerConfig>() {
  Implementation impl = implement<SparseTransformerConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
