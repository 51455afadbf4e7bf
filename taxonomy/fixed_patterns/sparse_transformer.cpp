#include "taxonomy/fixed_patterns/sparse_transformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"

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

class SparseTransformer final : public Mechanism {
 public:
  SparseTransformer(const Problem& problem, const SparseTransformerConfig& config)
      : p_(problem), layout_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratch(p_.threads, layout_.max_width(), p_.head_dim);
    const std::int64_t g = layout_.summary_count();
    if (g == 0) return;
    summary_index_.resize(static_cast<std::size_t>(g));
    for (std::int64_t s = 0; s < g; ++s) summary_index_[static_cast<std::size_t>(s)] = layout_.summaries.position(s);
    summary_keys_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim});
    summary_values_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    attend_context(q, k, v, out);
    if (!first_cache_.key_tensor().empty()) load_decode_context(k, v);
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
    const std::int64_t d = p_.head_dim;
    first_cache_ = KvCache(p_.batch * layout_.heads_a1, layout_.first_ring(), d);
    if (layout_.heads_a2 > 0)
      second_cache_ = KvCache(p_.batch * layout_.heads_a2, layout_.second_rows(p_.seq_len + tokens), d);
    step_buffers_ = Tensor(Shape{p_.batch * p_.heads, 2, d});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, token = length_;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      return attend_step(row, query, k.data() + head * d, v.data() + head * d, head / p_.heads, head % p_.heads, token);
    });
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    std::vector<NamedTensor> state = {{"a1_key_ring", &first_cache_.key_tensor()},
                                      {"a1_value_ring", &first_cache_.value_tensor()}};
    if (layout_.heads_a2 > 0) {
      state.push_back({"a2_keys", &second_cache_.key_tensor()});
      state.push_back({"a2_values", &second_cache_.value_tensor()});
    }
    return state;
  }

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

  // The prefill's part of a decode: the context's rows each cache keeps (after the forward).
  void load_decode_context(const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, a1 = layout_.heads_a1, a2 = layout_.heads_a2;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      const std::int64_t b = head / p_.heads, h = head % p_.heads;
      const float *keys = k.data() + head * n * d, *values = v.data() + head * n * d;
      if (h < a1) {
        const std::int64_t ring = layout_.first_ring(), kept = std::min(n, ring), first = n - kept;
        first_cache_.store(b * a1 + h, first % ring, keys + first * d, values + first * d, kept);
      } else if (layout_.fixed) {
        for (std::int64_t s = 0; s < layout_.summaries.up_to(n - 1); ++s) {
          const std::int64_t position = layout_.summaries.position(s);
          second_cache_.store(b * a2 + h - a1, s, keys + position * d, values + position * d, 1);
        }
      } else {
        second_cache_.store(b * a2 + h - a1, 0, keys, values, n);
      }
    }
    length_ = n;
  }

  // One head's step for token i: stores its key and value where its group keeps them, then attends
  // to the token's causal set (A1: the band or the block so far; A2: its residue class or the
  // summaries so far). Returns the FLOPs.
  std::int64_t attend_step(RowSoftmax& row, const float* query, const float* key, const float* value, std::int64_t b,
                           std::int64_t h, std::int64_t i) {
    const std::int64_t d = p_.head_dim, l = layout_.l, a1 = layout_.heads_a1, a2 = layout_.heads_a2;
    if (h < a1) {
      const std::int64_t index = b * a1 + h, ring = layout_.first_ring();
      first_cache_.store(index, i % ring, key, value, 1);
      const std::int64_t first = layout_.fixed ? i / l * l : std::max<std::int64_t>(0, i - l);
      return attend_ring(row, query, first_cache_.keys(index), first_cache_.values(index), ring, first, i - first + 1);
    }
    const std::int64_t index = b * a2 + h - a1;
    if (layout_.fixed) {
      const std::int64_t summaries = layout_.summaries.up_to(i);
      if (i % l >= l - layout_.c) second_cache_.store(index, summaries - 1, key, value, 1);
      return attend_rows(row, query, second_cache_.keys(index), second_cache_.values(index), summaries);
    }
    second_cache_.store(index, i, key, value, 1);
    const std::int64_t residue = i % l;
    return attend_rows(row, query, second_cache_.keys(index) + residue * d, second_cache_.values(index) + residue * d,
                       i / l + 1, l * d);
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
  Tensor summary_grads_;                // training, fixed pattern: per thread dK, dV of one head's gathered rows
  KvCache first_cache_, second_cache_;  // decoding: A1 rings, A2 rows (see Layout::first_ring)
  Tensor step_buffers_;                 // decoding: per head the scaled query and the accumulator
  std::int64_t length_ = 0;             // decoding: tokens seen
};

}  // namespace

void validate(const Problem&, const SparseTransformerConfig& c) {
  if (c.pattern == "fixed" && c.stride > 0 && c.summary > c.stride)
    throw ParamError("sparse-transformer: summary=" + std::to_string(c.summary) +
                     " exceeds stride=" + std::to_string(c.stride) + " (c must be at most l)");
}

std::unique_ptr<Mechanism> create(const Problem& problem, const SparseTransformerConfig& c, std::uint64_t) {
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
  const std::int64_t summary_grads = p.threads * 2 * layout.summary_count() * p.head_dim;
  return bs::TileTraining::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, layout.max_width(), p.head_dim) +
         summary_grads * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t workspace(const Problem& p, const SparseTransformerConfig& c) {
  const Layout layout(p, c);
  const std::int64_t gathered = 2 * p.batch * layout.heads_a2 * layout.summary_count() * p.head_dim;
  return bs::ThreadScratch::tracked_bytes(p.threads, layout.max_width(), p.head_dim) +
         gathered * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t decode_workspace(const Problem& p, const SparseTransformerConfig& c, std::int64_t tokens) {
  const Layout layout(p, c);
  const std::int64_t d = p.head_dim;
  std::int64_t bytes = KvCache::bytes(p.batch * layout.heads_a1, layout.first_ring(), d) +
                       p.batch * p.heads * 2 * d * static_cast<std::int64_t>(sizeof(float));
  if (layout.heads_a2 > 0)
    bytes += KvCache::bytes(p.batch * layout.heads_a2, layout.second_rows(p.seq_len + tokens), d);
  return bytes;
}

FieldTable<SparseTransformerConfig> config_fields(const SparseTransformerConfig*) {
  return {choice_field("pattern", &SparseTransformerConfig::pattern, {{"strided", "strided"}, {"fixed", "fixed"}},
                       "factorised pattern"),
          int_field("stride", &SparseTransformerConfig::stride, 0, 1000000, "l in tokens; 0 means ceil(sqrt(N))"),
          int_field("summary", &SparseTransformerConfig::summary, 1, 1000000,
                    "c: summary tokens per block of l (fixed pattern)")};
}

SparseTransformerConfig resolve(const Problem& p, SparseTransformerConfig c) {
  const Layout layout(p, c);
  c.stride = layout.l;
  c.summary = layout.c;
  return c;
}

template <>
Implementation implementation<SparseTransformerConfig>() {
  return implement<SparseTransformerConfig>();
}

}  // namespace xfb
