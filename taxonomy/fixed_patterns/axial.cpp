#include "taxonomy/fixed_patterns/axial.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/block_sparse.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;
using bs::kTaskRows;

std::int64_t ceil_sqrt(std::int64_t n) {
  auto root = static_cast<std::int64_t>(std::sqrt(static_cast<double>(n)));
  while (root * root < n) ++root;
  while (root > 1 && (root - 1) * (root - 1) >= n) --root;
  return std::max<std::int64_t>(root, 1);
}

struct Grid {
  std::int64_t cols;
  bs::BlockTiling rows;       // grid rows: blocks of C tokens
  bs::StridedTiling columns;  // grid columns: residue classes of stride C
  Grid(const Problem& p, const AxialConfig& c)
      : cols(std::min(c.cols > 0 ? c.cols : ceil_sqrt(p.seq_len), p.seq_len)),
        rows(p.seq_len, cols),
        columns(p.seq_len, cols) {}
  std::int64_t max_width() const { return std::max(rows.block, columns.longest); }
};

// Causal column keys: member m of a column sees members [0, m) — the rows strictly above.
bs::Tile column_above_tile(const bs::StridedTiling& t, std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
  const bs::Tile tile = bs::class_tile(t, task, true, lo, hi);
  bs::prefix_bounds(tile.rows, t.first_member(task) - 1, t.members(task), true, lo, hi);
  return tile;
}

// Folds one tile into the per-token online-softmax state (`out` and the token's max/sum) and
// optionally normalises. Returns the elementwise FLOPs.
std::int64_t fold(const bs::HeadView& head, const bs::Tile& tile, float* token_max, float* token_sum, bool fresh,
                  bool normalise, bs::ThreadScratch& scratch, int thread) {
  const std::int64_t d = head.d;
  const bs::QueryBlock queries{.queries = head.q + tile.q_first * d,
                               .ld_queries = tile.q_step * d,
                               .rows = tile.rows,
                               .acc = head.out + tile.q_first * d,
                               .ld_acc = tile.q_step * d,
                               .row_max = token_max + tile.q_first,
                               .row_sum = token_sum + tile.q_first,
                               .ld_stats = tile.q_step};
  const bs::KeyBlock keys{.keys = head.k + tile.k_first * d,
                          .ld_keys = tile.k_step * d,
                          .values = head.v + tile.k_first * d,
                          .ld_values = tile.k_step * d,
                          .lo = scratch.lo(thread),
                          .hi = scratch.hi(thread)};
  std::int64_t flops =
      bs::accumulate(queries, keys, d, 1.0f / std::sqrt(static_cast<float>(d)), fresh, scratch.scores(thread));
  if (normalise) flops += bs::finish(queries, d, queries.acc, queries.ld_acc);
  return flops;
}

class Axial final : public Mechanism {
 public:
  Axial(const Problem& problem, const AxialConfig& config) : p_(problem), grid_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratch(p_.threads, grid_.max_width());
    row_outputs_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
    if (p_.causal) token_stats_ = Tensor(Shape{p_.batch * p_.heads, 2, p_.seq_len});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads;
    // Row stage: U = row attention of V (unmasked in both modes).
    bs::run_tiles(
        heads, grid_.rows.tasks(), scratch_,
        [&](std::int64_t head) { return bs::head_view(q, k, v, row_outputs_, head); },
        [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
          return bs::block_tile(grid_.rows, task, false, lo, hi);
        });
    auto over_rows = [&](std::int64_t head) {
      bs::HeadView view = bs::head_view(q, k, v, out, head);
      view.v = row_outputs_.head(head / p_.heads, head % p_.heads);
      return view;
    };
    if (!p_.causal) {
      bs::run_tiles(heads, grid_.columns.tasks(), scratch_, over_rows,
                    [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
                      return bs::class_tile(grid_.columns, task, false, lo, hi);
                    });
      return;
    }
    causal_passes(q, k, v, out, over_rows);
  }

 private:
  template <class OverRows>
  void causal_passes(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, const OverRows& over_rows) {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len;
    const std::int64_t column_tasks = grid_.columns.tasks(), row_tasks = grid_.rows.tasks();
    std::int64_t flops = 0;
#pragma omp parallel num_threads(scratch_.threads()) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
      std::int64_t* lo = scratch_.lo(thread);
      std::int64_t* hi = scratch_.hi(thread);
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t index = 0; index < heads * column_tasks; ++index) {
        const std::int64_t head = index / column_tasks;
        const bs::Tile tile = column_above_tile(grid_.columns, index % column_tasks, lo, hi);
        float* stats = token_stats_.data() + head * 2 * n;
        if (tile.rows > 0) flops += fold(over_rows(head), tile, stats, stats + n, true, false, scratch_, thread);
      }
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t index = 0; index < heads * row_tasks; ++index) {
        const std::int64_t head = index / row_tasks;
        const bs::Tile tile = bs::block_tile(grid_.rows, index % row_tasks, true, lo, hi);
        float* stats = token_stats_.data() + head * 2 * n;
        if (tile.rows > 0)
          flops += fold(bs::head_view(q, k, v, out, head), tile, stats, stats + n, false, true, scratch_, thread);
      }
    }
    FlopCounter::add(flops);
  }

  Problem p_;
  Grid grid_;
  bs::ThreadScratch scratch_;
  Tensor row_outputs_, token_stats_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const AxialConfig& c, std::uint64_t) {
  return std::make_unique<Axial>(problem, c);
}

// Exact FLOPs of the causal column and row passes for one head.
std::int64_t causal_pass_flops(const Grid& grid, std::int64_t d) {
  std::vector<std::int64_t> lo(kTaskRows), hi(kTaskRows);
  std::int64_t flops = 0;
  for (std::int64_t task = 0; task < grid.columns.tasks(); ++task) {
    const bs::Tile tile = column_above_tile(grid.columns, task, lo.data(), hi.data());
    if (tile.rows > 0) flops += bs::accumulate_flops(tile.rows, lo.data(), hi.data(), d, true);
  }
  for (std::int64_t task = 0; task < grid.rows.tasks(); ++task) {
    const bs::Tile tile = bs::block_tile(grid.rows, task, true, lo.data(), hi.data());
    if (tile.rows > 0)
      flops += bs::accumulate_flops(tile.rows, lo.data(), hi.data(), d, false) + bs::finish_flops(tile.rows, d);
  }
  return flops;
}

std::int64_t flops(const Problem& p, const AxialConfig& c) {
  const Grid grid(p, c);
  const std::int64_t d = p.head_dim;
  std::int64_t per_head =
      bs::plan_flops(grid.rows.tasks(), d, [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
        return bs::block_tile(grid.rows, task, false, lo, hi);
      });
  if (p.causal)
    per_head += causal_pass_flops(grid, d);
  else
    per_head += bs::plan_flops(grid.columns.tasks(), d, [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
      return bs::class_tile(grid.columns, task, false, lo, hi);
    });
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const AxialConfig& c) {
  const Grid grid(p, c);
  const std::int64_t tokens = p.batch * p.heads * p.seq_len;
  const std::int64_t floats = tokens * p.head_dim + (p.causal ? 2 * tokens : 0);
  return bs::ThreadScratch::tracked_bytes(p.threads, grid.max_width()) +
         floats * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace

Implementation axial_implementation() {
  return implement(ModelSpec<AxialConfig>{
      .fields = {int_field("cols", &AxialConfig::cols, 0, 1000000, "grid width C in tokens; 0 means ceil(sqrt(N))")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, AxialConfig c) {
        c.cols = Grid(p, c).cols;
        return c;
      }});
}

}  // namespace xfb
