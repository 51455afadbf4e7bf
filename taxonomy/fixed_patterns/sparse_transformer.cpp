#include "taxonomy/fixed_patterns/sparse_transformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/core/config_table.hpp"
#include "taxonomy/engines/block_sparse.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;
using bs::kTaskRows;

// ⌈√n⌉, at least 1.
std::int64_t ceil_sqrt(std::int64_t n) {
  auto root = static_cast<std::int64_t>(std::sqrt(static_cast<double>(n)));
  while (root * root < n) ++root;
  while (root > 1 && (root - 1) * (root - 1) >= n) --root;
  return std::max<std::int64_t>(root, 1);
}

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
        l(config.stride > 0 ? config.stride : ceil_sqrt(p.seq_len)),
        c(std::min(config.summary, l)),
        heads_a1((p.heads + 1) / 2),
        heads_a2(p.heads - heads_a1),
        band{p.seq_len, l, p.causal},
        classes(p.seq_len, l),
        blocks(p.seq_len, l),
        summaries{p.seq_len, l, c, p.causal} {}

  std::int64_t summary_count() const { return fixed && heads_a2 > 0 ? summaries.count() : 0; }
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
    scratch_ = bs::ThreadScratch(p_.threads, layout_.max_width());
    const std::int64_t g = layout_.summary_count();
    if (g == 0) return;
    summary_index_.resize(static_cast<std::size_t>(g));
    for (std::int64_t s = 0; s < g; ++s) summary_index_[static_cast<std::size_t>(s)] = layout_.summaries.position(s);
    summary_keys_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim});
    summary_values_ = Tensor(Shape{p_.batch, layout_.heads_a2, g, p_.head_dim});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t a1 = layout_.heads_a1, a2 = layout_.heads_a2;
    auto first_group = [&](std::int64_t index) {
      return bs::head_view(q, k, v, out, index / a1 * p_.heads + index % a1);
    };
    auto second_group = [&](std::int64_t index) {
      return bs::head_view(q, k, v, out, index / a2 * p_.heads + a1 + index % a2);
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

 private:
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
};

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
  const std::int64_t d = p.head_dim;
  std::int64_t first = 0, second = 0;
  if (layout.fixed) {
    first = bs::plan_flops(layout.blocks.tasks(), d, [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
      return bs::block_tile(layout.blocks, task, p.causal, lo, hi);
    });
    if (layout.heads_a2 > 0) second = bs::plan_flops(layout.summaries.tasks(), d, layout.summaries);
  } else {
    first = bs::plan_flops(layout.band.tasks(), d, layout.band);
    if (layout.heads_a2 > 0)
      second = bs::plan_flops(layout.classes.tasks(), d, [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
        return bs::class_tile(layout.classes, task, p.causal, lo, hi);
      });
  }
  return p.batch * (layout.heads_a1 * first + layout.heads_a2 * second);
}

std::int64_t workspace(const Problem& p, const SparseTransformerConfig& c) {
  const Layout layout(p, c);
  const std::int64_t gathered = 2 * p.batch * layout.heads_a2 * layout.summary_count() * p.head_dim;
  return bs::ThreadScratch::tracked_bytes(p.threads, layout.max_width()) +
         gathered * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace

Implementation sparse_transformer_implementation() {
  return implement(ModelSpec<SparseTransformerConfig>{
      .fields = {choice_field("pattern", &SparseTransformerConfig::pattern,
                              {{"strided", "strided"}, {"fixed", "fixed"}}, "factorised pattern"),
                 int_field("stride", &SparseTransformerConfig::stride, 0, 1000000, "l in tokens; 0 means ceil(sqrt(N))"),
                 int_field("summary", &SparseTransformerConfig::summary, 1, 1000000,
                           "c: summary tokens per block of l (fixed pattern)")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, SparseTransformerConfig c) {
        const Layout layout(p, c);
        c.stride = layout.l;
        c.summary = layout.c;
        return c;
      },
      .validate = validate});
}

}  // namespace xfb
