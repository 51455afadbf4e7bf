#include "taxonomy/fixed_patterns/axial.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/stage_clock.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/block_sparse_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/single_plan.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;
using bs::kTaskRows;

struct Grid {
  std::int64_t cols;
  bs::BlockTiling rows;       // grid rows: blocks of C tokens
  bs::StridedTiling columns;  // grid columns: residue classes of stride C
  Grid(const Problem& p, const AxialConfig& c)
      : cols(std::min(c.cols > 0 ? c.cols : bs::ceil_sqrt(p.seq_len), p.seq_len)),
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

// The tile plans of the stages: rows (unmasked), columns (unmasked, non-causal), and the causal
// union's column keys strictly above and masked row keys.
struct StagePlan {
  enum Kind { Rows, MaskedRows, Columns, ColumnsAbove };
  const Grid* grid;
  Kind kind;
  std::int64_t tasks() const { return kind == Rows || kind == MaskedRows ? grid->rows.tasks() : grid->columns.tasks(); }
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    switch (kind) {
      case Rows:
        return bs::block_tile(grid->rows, task, false, lo, hi);
      case MaskedRows:
        return bs::block_tile(grid->rows, task, true, lo, hi);
      case Columns:
        return bs::class_tile(grid->columns, task, false, lo, hi);
      case ColumnsAbove:
        return column_above_tile(grid->columns, task, lo, hi);
    }
    return {};
  }
};

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
    scratch_ = bs::ThreadScratch(p_.threads, grid_.max_width(), p_.head_dim);
    row_outputs_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim);
    if (p_.causal) token_stats_ = Tensor(Shape{p_.batch * p_.heads, 2, p_.seq_len});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads;
    // Row stage: U = row attention of V (unmasked in both modes).
    bs::run_tiles(
        heads, grid_.rows.tasks(), scratch_,
        [&](std::int64_t head) { return saving(bs::head_view(q, k, v, row_outputs_, head), row_lse_, head); },
        StagePlan{&grid_, StagePlan::Rows});
    auto over_rows = [&](std::int64_t head) {
      bs::HeadView view = saving(bs::head_view(q, k, v, out, head), column_lse_, head);
      view.v = row_outputs_.head(head / p_.heads, head % p_.heads);
      return view;
    };
    if (!p_.causal) {
      bs::run_tiles(heads, grid_.columns.tasks(), scratch_, over_rows, StagePlan{&grid_, StagePlan::Columns});
      return;
    }
    causal_passes(q, k, v, out, over_rows);
    if (!open_row_.empty()) load_decode_context(q, k, v);
  }

  // Decode: the keys and row-stage outputs U of the completed grid rows ([B·H, N + T, D] each, in
  // position order) and the open row's q, k, v ([3, B·H, C, D]). When a row is complete (at the
  // next step: stage `row_complete`) its U is computed over the whole row and appended. A token at
  // row ρ, column γ attends, in one softmax, to the column keys above it (strided rows of the
  // cache, values U) and to its row so far (values V): O(R + C) = O(√N) per token, plus O(C·D)
  // per token for the row completions.
  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, c = grid_.cols, total = p_.seq_len + tokens;
    column_keys_ = Tensor(Shape{heads, total, d});
    column_outputs_ = Tensor(Shape{heads, total, d});
    open_row_ = Tensor(Shape{3, heads, c, d});
    step_buffers_ = Tensor(Shape{heads, 2, d});
    row_scores_ = Tensor(Shape{p_.threads, c, ops::padded_ld(c) + 1});  // the last column: 1/sum
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, c = grid_.cols, p = length_;
    std::int64_t flops = 0;
    if (filled_ == c) {
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
      for (std::int64_t head = 0; head < heads; ++head) flops += complete_row(head, p - c, omp_get_thread_num());
      filled_ = 0;
      stage_clock::lap("row_complete");
    }
    FlopCounter::add(flops);
    const std::int64_t rows_above = p / c, column = p % c;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      for (std::int64_t t = 0; t < 3; ++t)
        std::copy_n((t == 0 ? q : t == 1 ? k : v).data() + head * d, d, open_row(t, head) + filled_ * d);
      const std::int64_t offset = (head * column_keys_.dim(1) + column) * d;
      return attend_rows(row, query, column_keys_.data() + offset, column_outputs_.data() + offset, rows_above, c * d) +
             attend_rows(row, query, open_row(1, head), open_row(2, head), filled_ + 1);
    });
    ++filled_;
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"column_keys", &column_keys_}, {"column_outputs", &column_outputs_}, {"open_row", &open_row_}};
  }

  void prepare_backward() override {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len;
    row_lse_ = Tensor(Shape{heads, n});
    if (!p_.causal) column_lse_ = Tensor(Shape{heads, n});
    backward_scratch_ = bs::BackwardScratch(p_.threads, grid_.max_width(), n, p_.head_dim);
    row_grads_ = Tensor(Shape{p_.threads, n, p_.head_dim});
    row_stats_ = Tensor(Shape{p_.threads, 2, n});
  }

  // Per head, the second stage first (its value gradient is dU, the row outputs' gradient), then
  // the row stage with dU as its output gradient; both add to dQ and dK.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    bs::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      const std::int64_t offset = head * n * d;
      float* stats = row_stats_.data() + thread * 2 * n;  // joint L (causal), then δ of the row stage
      float* row_grads = row_grads_.data() + thread * n * d;
      const float* row_outputs = row_outputs_.data() + offset;
      bs::HeadGrads second{.q = q.data() + offset,
                           .k = k.data() + offset,
                           .v = row_outputs,
                           .out = out.data() + offset,
                           .dout = dout.data() + offset,
                           .lse = p_.causal ? stats : column_lse_.data() + head * n,
                           .delta = backward_scratch_.delta(thread),
                           .dq = dq.data() + offset,
                           .dk = dk.data() + offset,
                           .dv = row_grads,
                           .d = d};
      std::int64_t flops = bs::begin_head(second, n, n);
      std::fill_n(dv.data() + offset, n * d, 0.0f);
      if (p_.causal) {
        const float* token_stats = token_stats_.data() + head * 2 * n;
        for (std::int64_t i = 0; i < n; ++i) stats[i] = bs::log_sum_exp(token_stats[i], token_stats[n + i]);
        flops += backward_stage(second, {&grid_, StagePlan::ColumnsAbove}, thread);
        bs::HeadGrads masked_row = second;
        masked_row.v = v.data() + offset;
        masked_row.dv = dv.data() + offset;
        flops += backward_stage(masked_row, {&grid_, StagePlan::MaskedRows}, thread);
      } else {
        flops += backward_stage(second, {&grid_, StagePlan::Columns}, thread);
      }
      bs::HeadGrads first = second;
      first.v = v.data() + offset;
      first.out = row_outputs;
      first.dout = row_grads;
      first.lse = row_lse_.data() + head * n;
      first.delta = stats + n;
      first.dv = dv.data() + offset;
      flops += bs::row_dots(row_grads, row_outputs, n, d, first.delta);
      return flops + backward_stage(first, {&grid_, StagePlan::Rows}, thread);
    });
  }

  std::vector<NamedTensor> saved() const override {
    std::vector<NamedTensor> list{{"row_outputs", &row_outputs_}, {"row_log_sum_exp", &row_lse_}};
    list.push_back(p_.causal ? NamedTensor{"token_stats", &token_stats_}
                             : NamedTensor{"column_log_sum_exp", &column_lse_});
    return list;
  }

 private:
  std::int64_t backward_stage(const bs::HeadGrads& g, const StagePlan& plan, int thread) {
    return bs::backward_tiles(g, plan.tasks(), plan, backward_scratch_, thread);
  }

  static bs::HeadView saving(bs::HeadView view, Tensor& lse, std::int64_t head) {
    if (!lse.empty()) view.lse = lse.data() + head * lse.dim(1);
    return view;
  }
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

  float* open_row(std::int64_t which, std::int64_t head) {  // which: 0 q, 1 k, 2 v
    return open_row_.data() + (which * p_.batch * p_.heads + head) * grid_.cols * p_.head_dim;
  }

  // The prefill's part of a decode: the completed rows' keys and U (the forward's row stage), and
  // the open row's q, k, v.
  void load_decode_context(const Tensor& q, const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, c = grid_.cols, completed = n / c * c;
    const std::int64_t total = column_keys_.dim(1);
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      std::copy_n(k.data() + head * n * d, completed * d, column_keys_.data() + head * total * d);
      std::copy_n(row_outputs_.data() + head * n * d, completed * d, column_outputs_.data() + head * total * d);
      for (std::int64_t t = 0; t < 3; ++t)
        std::copy_n((t == 0   ? q
                     : t == 1 ? k
                              : v)
                            .data() +
                        (head * n + completed) * d,
                    (n - completed) * d, open_row(t, head));
    }
    filled_ = n - completed;
    length_ = n;
  }

  // The row stage of the open row (tokens first … first + C − 1) of one head: U over the whole row,
  // appended with the row's keys to the column cache. Returns the FLOPs outside ops::gemm: per
  // row of scores 4·C (max, subtract + exp, sum) + D (U's 1/sum).
  std::int64_t complete_row(std::int64_t head, std::int64_t first, int thread) {
    const std::int64_t d = p_.head_dim, c = grid_.cols, total = column_keys_.dim(1), ld = row_scores_.dim(2);
    float* scores = row_scores_.data() + thread * c * ld;  // row r: C scores, then its 1/sum at ld − 1
    float* outputs = column_outputs_.data() + (head * total + first) * d;
    ops::gemm(false, true, c, c, d, 1.0f / std::sqrt(static_cast<float>(d)), open_row(0, head), d, open_row(1, head), d,
              0.0f, scores, ld);
    for (std::int64_t r = 0; r < c; ++r) {
      float* row = scores + r * ld;
      row[ld - 1] = 1.0f / ops::exp_and_sum(row, c, ops::row_max(row, c, row[0]));
    }
    ops::gemm(false, false, c, d, c, 1.0f, scores, ld, open_row(2, head), d, 0.0f, outputs, d);
    for (std::int64_t r = 0; r < c; ++r)
      for (std::int64_t j = 0; j < d; ++j) outputs[r * d + j] *= scores[r * ld + ld - 1];
    std::copy_n(open_row(1, head), c * d, column_keys_.data() + (head * total + first) * d);
    return 4 * c * c + c * d;
  }

  Problem p_;
  Grid grid_;
  bs::ThreadScratch scratch_;
  Tensor row_outputs_, token_stats_;
  // Training only (prepare_backward).
  Tensor row_lse_, column_lse_, row_grads_, row_stats_;
  bs::BackwardScratch backward_scratch_;
  // Decoding only (prepare_decode): the column cache, the open row, per head the scaled query and
  // accumulator, per thread a C × C score tile; tokens in the open row, tokens seen.
  Tensor column_keys_, column_outputs_, open_row_, step_buffers_, row_scores_;
  std::int64_t filled_ = 0, length_ = 0;
};

// fold on the bf16 engine: the tile's rows of the fp32 accumulator `acc` ([N, D] of the head) and
// of the token statistics, normalised into head.out (bf16) when asked. Returns all its FLOPs.
std::int64_t fold_bf16(const bs::HeadViewBf16& head, const bs::Tile& tile, float* acc, float* token_max,
                       float* token_sum, bool fresh, bool normalise, bs::ThreadScratchBf16& scratch, int thread) {
  const std::int64_t d = head.d, ldq = tile.q_step * d;
  const bs::QueryBlockBf16 queries{.queries = head.q + tile.q_first * d,
                                   .ld_queries = ldq,
                                   .rows = tile.rows,
                                   .acc = acc + tile.q_first * d,
                                   .ld_acc = ldq,
                                   .row_max = token_max + tile.q_first,
                                   .row_sum = token_sum + tile.q_first,
                                   .ld_stats = tile.q_step};
  const bs::KeyBlockBf16 keys{.keys = head.k + tile.k_first * d,
                              .ld_keys = tile.k_step * d,
                              .values = head.v + tile.k_first * d,
                              .ld_values = tile.k_step * d,
                              .lo = scratch.lo(thread),
                              .hi = scratch.hi(thread)};
  std::int64_t flops =
      bs::accumulate_bf16(queries, keys, d, 1.0f / std::sqrt(static_cast<float>(d)), fresh, scratch, thread);
  if (normalise) flops += bs::finish_bf16(queries, d, head.out + tile.q_first * d, ldq);
  return flops;
}

// The bf16 form (header comment): q, k, v, U, out, the gradients and the decode state in bf16; the
// stages on block_sparse's bf16 engine (the causal union through its online form, its unnormalised
// output in an fp32 [N, D] buffer per thread, one head per task); the backward's dQ, dK, dV and dU
// summed in fp32 per head, dU rounded to bf16 once as the row stage's output gradient.
class AxialBf16 final : public Mechanism {
 public:
  AxialBf16(const Problem& problem, const AxialConfig& config) : p_(problem), grid_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratchBf16(p_.threads, grid_.max_width(), p_.head_dim);
    row_outputs_ = Tensor::bhnd(p_.batch, p_.heads, p_.seq_len, p_.head_dim, DType::BF16);
    if (!p_.causal) return;
    token_stats_ = Tensor(Shape{p_.batch * p_.heads, 2, p_.seq_len});
    union_acc_ = Tensor(Shape{p_.threads, p_.seq_len, p_.head_dim});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads;
    bs::run_tiles_bf16(
        heads, grid_.rows.tasks(), scratch_,
        [&](std::int64_t head) { return saving(bs::head_view_bf16(q, k, v, row_outputs_, head), row_lse_, head); },
        StagePlan{&grid_, StagePlan::Rows});
    auto over_rows = [&](std::int64_t head) {
      bs::HeadViewBf16 view = saving(bs::head_view_bf16(q, k, v, out, head), column_lse_, head);
      view.v = row_outputs_.bf16_data() + head * p_.seq_len * p_.head_dim;
      return view;
    };
    if (!p_.causal) {
      bs::run_tiles_bf16(heads, grid_.columns.tasks(), scratch_, over_rows, StagePlan{&grid_, StagePlan::Columns});
      return;
    }
    bs::run_heads(heads, p_.threads, [&](std::int64_t head, int thread) {
      return causal_union(over_rows(head), bs::head_view_bf16(q, k, v, out, head), head, thread);
    });
    if (!open_row_.empty()) load_decode_context(q, k, v);
  }

  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, c = grid_.cols, total = p_.seq_len + tokens;
    column_keys_ = Tensor(Shape{heads, total, d}, DType::BF16);
    column_outputs_ = Tensor(Shape{heads, total, d}, DType::BF16);
    open_row_ = Tensor(Shape{3, heads, c, d}, DType::BF16);
    step_buffers_ = Tensor(Shape{heads, 2, d});
    row_scratch_ = bs::ThreadScratchBf16(p_.threads, c, d);
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, c = grid_.cols, p = length_;
    std::int64_t flops = 0;
    if (filled_ == c) {
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
      for (std::int64_t head = 0; head < heads; ++head) flops += complete_row(head, p - c, omp_get_thread_num());
      filled_ = 0;
      stage_clock::lap("row_complete");
    }
    FlopCounter::add(flops);
    const std::int64_t rows_above = p / c, column = p % c;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      for (std::int64_t t = 0; t < 3; ++t)
        std::copy_n((t == 0 ? q : t == 1 ? k : v).bf16_data() + head * d, d, open_row(t, head) + filled_ * d);
      const std::int64_t offset = (head * column_keys_.dim(1) + column) * d;
      return attend_rows(row, query, column_keys_.bf16_data() + offset, column_outputs_.bf16_data() + offset,
                         rows_above, c * d) +
             attend_rows(row, query, open_row(1, head), open_row(2, head), filled_ + 1);
    });
    ++filled_;
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"column_keys", &column_keys_}, {"column_outputs", &column_outputs_}, {"open_row", &open_row_}};
  }

  void prepare_backward() override {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    row_lse_ = Tensor(Shape{heads, n});
    if (!p_.causal) column_lse_ = Tensor(Shape{heads, n});
    backward_scratch_ = bs::BackwardScratchBf16(p_.threads, grid_.max_width(), n, d);
    sums_ = Tensor(Shape{p_.threads, 4, n, d});
    row_grads_ = Tensor(Shape{p_.threads, n, d}, DType::BF16);
    row_stats_ = Tensor(Shape{p_.threads, 2, n});
  }

  // As the fp32 backward: the second stage into dQ, dK and dU (and the causal row keys' dV), dU
  // rounded to bf16, then the row stage with it as the output gradient; all sums fp32, rounded once.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    bs::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      const std::int64_t offset = head * n * d;
      float* stats = row_stats_.data() + thread * 2 * n;  // joint L (causal), then δ of the row stage
      float* dq_sum = sums_.data() + thread * 4 * n * d;
      float *dk_sum = dq_sum + n * d, *dv_sum = dk_sum + n * d, *du_sum = dv_sum + n * d;
      std::fill_n(dq_sum, 4 * n * d, 0.0f);
      bf16* row_grads = row_grads_.bf16_data() + thread * n * d;
      const bf16* row_outputs = row_outputs_.bf16_data() + offset;
      bs::HeadGradsBf16 second{.q = q.bf16_data() + offset,
                               .k = k.bf16_data() + offset,
                               .v = row_outputs,
                               .out = out.bf16_data() + offset,
                               .dout = dout.bf16_data() + offset,
                               .lse = p_.causal ? stats : column_lse_.data() + head * n,
                               .delta = backward_scratch_.delta(thread),
                               .d = d,
                               .tokens = n};
      std::int64_t flops = bs::row_dots_bf16(second.dout, second.out, n, d, second.delta);
      auto stage = [&](const bs::HeadGradsBf16& g, StagePlan::Kind kind, float* value_sums) {
        const StagePlan plan{&grid_, kind};
        return bs::backward_sums_bf16(g, plan.tasks(), plan, dq_sum, dk_sum, value_sums, backward_scratch_, thread);
      };
      if (p_.causal) {
        const float* token_stats = token_stats_.data() + head * 2 * n;
        for (std::int64_t i = 0; i < n; ++i) stats[i] = bs::log_sum_exp(token_stats[i], token_stats[n + i]);
        flops += stage(second, StagePlan::ColumnsAbove, du_sum);
        bs::HeadGradsBf16 masked_row = second;
        masked_row.v = v.bf16_data() + offset;
        flops += stage(masked_row, StagePlan::MaskedRows, dv_sum);
      } else {
        flops += stage(second, StagePlan::Columns, du_sum);
      }
      narrow(du_sum, row_grads, n * d);
      bs::HeadGradsBf16 first = second;
      first.v = v.bf16_data() + offset;
      first.out = row_outputs;
      first.dout = row_grads;
      first.lse = row_lse_.data() + head * n;
      first.delta = stats + n;
      flops += bs::row_dots_bf16(row_grads, row_outputs, n, d, first.delta);
      flops += stage(first, StagePlan::Rows, dv_sum);
      narrow(dq_sum, dq.bf16_data() + offset, n * d);
      narrow(dk_sum, dk.bf16_data() + offset, n * d);
      narrow(dv_sum, dv.bf16_data() + offset, n * d);
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override {
    std::vector<NamedTensor> list{{"row_outputs", &row_outputs_}, {"row_log_sum_exp", &row_lse_}};
    list.push_back(p_.causal ? NamedTensor{"token_stats", &token_stats_}
                             : NamedTensor{"column_log_sum_exp", &column_lse_});
    return list;
  }

 private:
  static bs::HeadViewBf16 saving(bs::HeadViewBf16 view, Tensor& lse, std::int64_t head) {
    if (!lse.empty()) view.lse = lse.data() + head * lse.dim(1);
    return view;
  }

  // The causal union of one head: the column keys above (values U) start every token's state, the
  // masked row keys (values V) continue it and normalise into out. Returns the FLOPs.
  std::int64_t causal_union(const bs::HeadViewBf16& over_rows, const bs::HeadViewBf16& own_row, std::int64_t head,
                            int thread) {
    const std::int64_t n = p_.seq_len;
    float* acc = union_acc_.data() + thread * n * p_.head_dim;
    float* stats = token_stats_.data() + head * 2 * n;
    std::int64_t *lo = scratch_.lo(thread), *hi = scratch_.hi(thread), flops = 0;
    for (std::int64_t task = 0; task < grid_.columns.tasks(); ++task) {
      const bs::Tile tile = column_above_tile(grid_.columns, task, lo, hi);
      if (tile.rows > 0) flops += fold_bf16(over_rows, tile, acc, stats, stats + n, true, false, scratch_, thread);
    }
    for (std::int64_t task = 0; task < grid_.rows.tasks(); ++task) {
      const bs::Tile tile = bs::block_tile(grid_.rows, task, true, lo, hi);
      if (tile.rows > 0) flops += fold_bf16(own_row, tile, acc, stats, stats + n, false, true, scratch_, thread);
    }
    return flops;
  }

  bf16* open_row(std::int64_t which, std::int64_t head) {  // which: 0 q, 1 k, 2 v
    return open_row_.bf16_data() + (which * p_.batch * p_.heads + head) * grid_.cols * p_.head_dim;
  }

  // The prefill's part of a decode: the completed rows' keys and U, and the open row's q, k, v.
  void load_decode_context(const Tensor& q, const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, c = grid_.cols, completed = n / c * c;
    const std::int64_t total = column_keys_.dim(1);
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      std::copy_n(k.bf16_data() + head * n * d, completed * d, column_keys_.bf16_data() + head * total * d);
      std::copy_n(row_outputs_.bf16_data() + head * n * d, completed * d,
                  column_outputs_.bf16_data() + head * total * d);
      for (std::int64_t t = 0; t < 3; ++t)
        std::copy_n((t == 0   ? q
                     : t == 1 ? k
                              : v)
                            .bf16_data() +
                        (head * n + completed) * d,
                    (n - completed) * d, open_row(t, head));
    }
    filled_ = n - completed;
    length_ = n;
  }

  // The row stage of the open row (tokens first … first + C − 1) of one head, as the forward's row
  // tiles compute it (attend_bf16 over the row, tiles of ≤ kTaskRows rows): U appended with the
  // row's keys to the column cache. Returns its FLOPs (4·C²·D + 4·C² + C·D, as fp32's).
  std::int64_t complete_row(std::int64_t head, std::int64_t first, int thread) {
    const std::int64_t d = p_.head_dim, c = grid_.cols, total = column_keys_.dim(1);
    const bs::HeadViewBf16 row{.q = open_row(0, head),
                               .k = open_row(1, head),
                               .v = open_row(2, head),
                               .out = column_outputs_.bf16_data() + (head * total + first) * d,
                               .d = d};
    const bs::BlockTiling tiling(c, c);
    std::int64_t flops = 0;
    for (std::int64_t task = 0; task < tiling.tasks(); ++task) {
      const bs::Tile tile = bs::block_tile(tiling, task, false, row_scratch_.lo(thread), row_scratch_.hi(thread));
      if (tile.rows > 0) flops += bs::attend_bf16(row, tile, row_scratch_, thread);
    }
    std::copy_n(open_row(1, head), c * d, column_keys_.bf16_data() + (head * total + first) * d);
    return flops;
  }

  Problem p_;
  Grid grid_;
  bs::ThreadScratchBf16 scratch_;
  Tensor row_outputs_, token_stats_, union_acc_;  // U (bf16); causal: the union's fp32 M, S and A
  // Training only (prepare_backward): the saved L, per thread the fp32 sums, dU in bf16, L and δ.
  Tensor row_lse_, column_lse_, sums_, row_grads_, row_stats_;
  bs::BackwardScratchBf16 backward_scratch_;
  // Decoding only (prepare_decode): as the fp32 form's, bf16; the row completion's tile scratch.
  Tensor column_keys_, column_outputs_, open_row_, step_buffers_;
  bs::ThreadScratchBf16 row_scratch_;
  std::int64_t filled_ = 0, length_ = 0;
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const AxialConfig& c, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<AxialBf16>(problem, c);
  return std::make_unique<Axial>(problem, c);
}

// Exact FLOPs of the causal column and row passes for one head.
std::int64_t causal_pass_flops(const Grid& grid, std::int64_t d) {
  std::vector<std::int64_t> lo(kTaskRows), hi(kTaskRows);
  std::int64_t flops = 0;
  const StagePlan above{&grid, StagePlan::ColumnsAbove}, masked_rows{&grid, StagePlan::MaskedRows};
  for (std::int64_t task = 0; task < above.tasks(); ++task) {
    const bs::Tile tile = above(task, lo.data(), hi.data());
    if (tile.rows > 0) flops += bs::accumulate_flops(tile.rows, lo.data(), hi.data(), d, true);
  }
  for (std::int64_t task = 0; task < masked_rows.tasks(); ++task) {
    const bs::Tile tile = masked_rows(task, lo.data(), hi.data());
    if (tile.rows > 0)
      flops += bs::accumulate_flops(tile.rows, lo.data(), hi.data(), d, false) + bs::finish_flops(tile.rows, d);
  }
  return flops;
}

std::int64_t flops(const Problem& p, const AxialConfig& c) {
  const Grid grid(p, c);
  const std::int64_t d = p.head_dim;
  const StagePlan rows{&grid, StagePlan::Rows}, columns{&grid, StagePlan::Columns};
  std::int64_t per_head = bs::plan_flops(rows.tasks(), d, rows);
  per_head += p.causal ? causal_pass_flops(grid, d) : bs::plan_flops(columns.tasks(), d, columns);
  return p.batch * p.heads * per_head;
}

// δ of each stage plus every stage's tiles (plan_backward_flops counts one δ per plan).
std::int64_t backward_flops(const Problem& p, const AxialConfig& c) {
  const Grid grid(p, c);
  const std::int64_t n = p.seq_len, d = p.head_dim;
  auto stage = [&](StagePlan::Kind kind, std::int64_t deltas) {
    const StagePlan plan{&grid, kind};
    return bs::plan_backward_flops(n, plan.tasks(), d, plan) - (1 - deltas) * 2 * n * d;
  };
  std::int64_t per_head = stage(StagePlan::Rows, 1);
  per_head +=
      p.causal ? stage(StagePlan::ColumnsAbove, 1) + stage(StagePlan::MaskedRows, 0) : stage(StagePlan::Columns, 1);
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const AxialConfig& c) {
  const Grid grid(p, c);
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len;
  if (p.dtype == DType::BF16) {
    const std::int64_t floats = (p.causal ? 1 : 2) * heads * n + p.threads * 4 * n * p.head_dim + p.threads * 2 * n;
    return floats * static_cast<std::int64_t>(sizeof(float)) + p.threads * n * p.head_dim * element_bytes(p.dtype) +
           bs::BackwardScratchBf16::tracked_bytes(p.threads, grid.max_width(), n, p.head_dim);
  }
  const std::int64_t floats = (p.causal ? 1 : 2) * heads * n + p.threads * n * p.head_dim + p.threads * 2 * n;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         bs::BackwardScratch::tracked_bytes(p.threads, grid.max_width(), n, p.head_dim);
}

std::int64_t decode_workspace(const Problem& p, const AxialConfig& config, std::int64_t tokens) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, c = Grid(p, config).cols, total = p.seq_len + tokens;
  if (p.dtype == DType::BF16)
    return (2 * heads * total * d + 3 * heads * c * d) * element_bytes(p.dtype) +
           heads * 2 * d * static_cast<std::int64_t>(sizeof(float)) +
           bs::ThreadScratchBf16::tracked_bytes(p.threads, c, d);
  const std::int64_t floats =
      2 * heads * total * d + 3 * heads * c * d + heads * 2 * d + p.threads * c * (ops::padded_ld(c) + 1);
  return floats * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t workspace(const Problem& p, const AxialConfig& c) {
  const Grid grid(p, c);
  const std::int64_t tokens = p.batch * p.heads * p.seq_len;
  if (p.dtype == DType::BF16) {
    const std::int64_t floats = p.causal ? 2 * tokens + p.threads * p.seq_len * p.head_dim : 0;
    return bs::ThreadScratchBf16::tracked_bytes(p.threads, grid.max_width(), p.head_dim) +
           tokens * p.head_dim * element_bytes(p.dtype) + floats * static_cast<std::int64_t>(sizeof(float));
  }
  const std::int64_t floats = tokens * p.head_dim + (p.causal ? 2 * tokens : 0);
  return bs::ThreadScratch::tracked_bytes(p.threads, grid.max_width(), p.head_dim) +
         floats * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<AxialConfig> config_fields(const AxialConfig*) {
  return {
      int_field("cols", &AxialConfig::cols, 0, 1000000, "grid width C in tokens; 0 means ceil(sqrt(N)); clamped to N")};
}

AxialConfig resolve(const Problem& p, AxialConfig c) {
  c.cols = Grid(p, c).cols;
  return c;
}

std::string unsupported(const Problem& p, const AxialConfig&) { return bs::single_plan_bf16_unsupported(p); }

template <>
Implementation implementation<AxialConfig>() {
  Implementation impl = implement<AxialConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
