#include "taxonomy/fixed_patterns/poolingformer.hpp"

#include <omp.h>

#include <algorithm>
#include <string>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/gathered_attention_bf16.hpp"
#include "taxonomy/engines/gathered_tile_bf16.hpp"

namespace xfb {
namespace {

using fixed::ColumnRange;
using fixed::TileAttention;
using fixed::TilePattern;

// The sizes shared by the mechanism, flops() and workspace().
struct Layout {
  std::int64_t tokens = 0;          // N
  std::int64_t reach = 0;           // s₁ = ⌊w₁/2⌋
  std::int64_t pool_reach = 0;      // s₂ = ⌊w₂/2⌋
  std::int64_t kernel = 0;          // κ
  std::int64_t stride = 0;          // ξ
  std::int64_t pooled = 0;          // M = ⌈N/ξ⌉
  std::int64_t tile = 0;            // query rows per tile
  bool window = true, pool = true;  // which levels run
  bool stacked = false;             // level 2's query is level 1's output y (pooled_query=window_output)

  Layout(const Problem& p, const PoolingformerConfig& c)
      : tokens(p.seq_len),
        reach(c.window / 2),
        pool_reach(c.pool_window / 2),
        kernel(c.kernel),
        stride(c.stride),
        pooled((p.seq_len + c.stride - 1) / c.stride),
        tile(c.tile),
        window(c.levels != "pooled"),
        pool(c.levels != "window"),
        stacked(c.pooled_query == "window_output") {}

  bool both() const { return window && pool; }
  // c_m, the tokens averaged into pooled row m (≥ 1: m·ξ < N).
  std::int64_t members(std::int64_t m) const { return std::min(kernel, tokens - m * stride); }
  // Σ_m c_m, the token rows the pooling reads per head and tensor.
  std::int64_t pooled_members() const {
    std::int64_t total = 0;
    for (std::int64_t m = 0; m < pooled; ++m) total += members(m);
    return total;
  }
  // Query i's level-1 keys [i − s₁, i + s₁] ∩ [0, N).
  ColumnRange window_keys(std::int64_t i) const {
    return {std::max<std::int64_t>(i - reach, 0), std::min(i + reach + 1, tokens)};
  }
  // Query i's level-2 band: the pooled rows m with m·ξ ∈ [i − s₂, i + s₂], within [0, M).
  ColumnRange pooled_keys(std::int64_t i) const {
    const std::int64_t first = std::max<std::int64_t>(i - pool_reach, 0);
    return {(first + stride - 1) / stride, std::min((i + pool_reach) / stride + 1, pooled)};
  }
};

// One tile of query rows [start, start + rows) of one head (both levels).
struct Task {
  std::int64_t head = 0;
  std::int64_t start = 0, rows = 0;
};

std::vector<Task> tasks_of(const Layout& l, std::int64_t heads) {
  std::vector<Task> tasks;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < l.tokens; i += l.tile) tasks.push_back({h, i, std::min(l.tile, l.tokens - i)});
  return tasks;
}

// Level 1: one run over the head's N key rows. Level 2: one run over its M pooled rows.
void plan_window(const Layout& l, const Task& t, TilePattern& tile) {
  tile.reset(t.rows);
  const std::size_t run = tile.add_run({.first = 0, .step = 1, .count = l.tokens});
  for (std::int64_t r = 0; r < t.rows; ++r) tile.visible(r, run) = l.window_keys(t.start + r);
}

void plan_pooled(const Layout& l, const Task& t, TilePattern& tile) {
  tile.reset(t.rows);
  const std::size_t run = tile.add_run({.first = 0, .step = 1, .count = l.pooled});
  for (std::int64_t r = 0; r < t.rows; ++r) tile.visible(r, run) = l.pooled_keys(t.start + r);
}

// Calls level(plan) for each level that runs, with its planner.
template <class Level>
void for_each_level(const Layout& l, Level&& level) {
  if (l.window) level(plan_window);
  if (l.pool) level(plan_pooled);
}

std::int64_t score_capacity(const Layout& l, const std::vector<Task>& tasks) {
  std::int64_t most = 0;
  for_each_level(l, [&](auto plan) {
    most = std::max(most, fixed::most_score_floats(tasks, [&](const Task& t, TilePattern& tile) { plan(l, t, tile); }));
  });
  return most;
}

// The bf16 kernels' capacity over both levels' tiles.
fixed::TileCapacity tile_capacity(const Layout& l, const std::vector<Task>& tasks) {
  fixed::TileCapacity most;
  for_each_level(l, [&](auto plan) {
    const fixed::TileCapacity level =
        fixed::most_tile_capacity(tasks, [&](const Task& t, TilePattern& tile) { plan(l, t, tile); });
    most.rows = std::max(most.rows, level.rows);
    most.cols = std::max(most.cols, level.cols);
  });
  return most;
}

// K̄, V̄ of every head (T: the element type of k, v and the pooled rows): row m = (1/c_m)·Σ of the
// token rows [m·ξ, m·ξ + c_m), summed in fp32 in token order and stored once. 2·D·Σ c_m FLOPs per head.
template <class T>
void pool_rows(const Problem& p, const Layout& l, const Tensor& k, const Tensor& v, Tensor& pooled_k,
               Tensor& pooled_v) {
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, rows = l.pooled;
#pragma omp parallel for num_threads(p.threads) schedule(static) collapse(2)
  for (std::int64_t head = 0; head < heads; ++head)
    for (std::int64_t m = 0; m < rows; ++m)
      for (int which = 0; which < 2; ++which) {
        const T* x = elements<T>(which == 0 ? k : v) + (head * n + m * l.stride) * d;
        T* row = elements<T>(which == 0 ? pooled_k : pooled_v) + (head * rows + m) * d;
        const std::int64_t count = l.members(m);
        const float scale = 1.0f / static_cast<float>(count);
#pragma omp simd
        for (std::int64_t c = 0; c < d; ++c) {
          float sum = as_float(x[c]);
          for (std::int64_t t = 1; t < count; ++t) sum += as_float(x[t * d + c]);
          row[c] = stored<T>(sum * scale);
        }
      }
  FlopCounter::add(heads * 2 * d * l.pooled_members());
}

// dx_t += dX̄_m / c_m for every token t of every pooled row m of one head (fp32 gradients [N, D], or
// the bf16 form's fp32 accumulators). Returns 2·D·Σ c_m.
std::int64_t unpool(const Layout& l, std::int64_t d, const float* pooled_grads, float* grads) {
  for (std::int64_t m = 0; m < l.pooled; ++m) {
    const std::int64_t count = l.members(m);
    const float scale = 1.0f / static_cast<float>(count);
    for (std::int64_t t = 0; t < count; ++t) {
      float* row = grads + (m * l.stride + t) * d;
      const float* pooled = pooled_grads + m * d;
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) row[c] += scale * pooled[c];
    }
  }
  return 2 * d * l.pooled_members();
}

// What a training forward keeps, in either form: each level's log-sum-exp, K̄ and V̄, and y (both levels).
std::vector<NamedTensor> kept_tensors(const Layout& l, const Tensor& lse_window, const Tensor& lse_pooled,
                                      const Tensor& pooled_k, const Tensor& pooled_v, const Tensor& window_output) {
  std::vector<NamedTensor> kept;
  if (l.window) kept.push_back({"window_log_sum_exp", &lse_window});
  if (l.pool) {
    kept.push_back({"pooled_log_sum_exp", &lse_pooled});
    kept.push_back({"pooled_keys", &pooled_k});
    kept.push_back({"pooled_values", &pooled_v});
  }
  if (l.both()) kept.push_back({"window_output", &window_output});
  return kept;
}

class Poolingformer final : public Mechanism {
 public:
  Poolingformer(const Problem& problem, const Layout& layout)
      : p_(problem), l_(layout), tasks_(tasks_of(layout, problem.heads)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t d = p_.head_dim;
    if (l_.pool) {
      pooled_k_ = Tensor::bhnd(p_.batch, p_.heads, l_.pooled, d);
      pooled_v_ = Tensor::bhnd(p_.batch, p_.heads, l_.pooled, d);
    }
    if (l_.both()) level_two_ = Tensor(Shape{p_.threads, l_.tile, d});
    const std::int64_t scores = score_capacity(l_, tasks_);
    kernels_.clear();
    for (std::int64_t t = 0; t < p_.threads; ++t) kernels_.emplace_back(scores, 0, d);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (l_.pool) pool_rows<float>(p_, l_, k, v, pooled_k_, pooled_v_);
    const std::int64_t d = p_.head_dim, n = p_.seq_len;
    fixed::run_tile_tasks(
        p_.batch, tasks_, kernels_, [&](std::int64_t b, const Task& task, TileAttention& kernel, TilePattern& tile) {
          const std::int64_t head = b * p_.heads + task.head, rows = task.start * d;
          const float* query = q.head(b, task.head) + rows;
          float* result = out.head(b, task.head) + rows;
          // levels=both: y to the saved copy (training) or to out, z to the thread's buffer.
          const bool training = !lse_window_.empty();
          float* y = l_.both() && training ? saved_y_.data() + head * n * d + rows : result;
          float* z = l_.both() ? level_two_.data() + omp_get_thread_num() * l_.tile * d : result;
          std::int64_t flops = 0;
          if (l_.window) {
            plan_window(l_, task, tile);
            flops += kernel.run(tile, query, d, k.head(b, task.head), v.head(b, task.head), y, d, false,
                                lse_at(lse_window_, head, task));
          }
          if (l_.pool) {
            plan_pooled(l_, task, tile);
            flops += kernel.run(tile, l_.stacked ? y : query, d, pooled_k_.head(b, task.head),
                                pooled_v_.head(b, task.head), z, d, false, lse_at(lse_pooled_, head, task));
          }
          if (l_.both()) {
            const std::int64_t count = task.rows * d;
#pragma omp simd
            for (std::int64_t e = 0; e < count; ++e) result[e] = y[e] + z[e];
            flops += count;
          }
          return flops;
        });
  }

  std::vector<NamedTensor> parameters() const override { return {}; }

  void prepare_backward() override {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    for (auto& kernel : kernels_) kernel.enable_backward();
    if (l_.window) lse_window_ = Tensor(Shape{heads, n});
    if (l_.pool) {
      lse_pooled_ = Tensor(Shape{heads, n});
      pooled_grads_ = Tensor(Shape{p_.threads, 2, l_.pooled, d});
    }
    if (l_.both()) saved_y_ = Tensor::bhnd(p_.batch, p_.heads, n, d);
    if (l_.stacked) window_grads_ = Tensor(Shape{p_.threads, l_.tile, d});
    deltas_ = Tensor(Shape{p_.threads, 2, n});
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
  }

  // One task per (batch, head): a head's tiles write overlapping dK, dV (and dK̄, dV̄) rows.
  // δ = dO·out; with both levels δ₁ = dO·y and δ₂ = δ − δ₁ (= dO·z).
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    block_sparse::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      const std::int64_t b = head / p_.heads, h = head % p_.heads, offset = head * n * d;
      float* delta = deltas_.data() + thread * 2 * n;
      float* delta_window = l_.both() ? delta + n : delta;
      const block_sparse::HeadGrads g{.out = out.data() + offset,
                                      .dout = dout.data() + offset,
                                      .delta = delta,
                                      .dq = dq.data() + offset,
                                      .dk = dk.data() + offset,
                                      .dv = dv.data() + offset,
                                      .d = d};
      std::int64_t flops = block_sparse::begin_head(g, n, n);
      if (l_.both()) {
        flops += block_sparse::row_dots(g.dout, saved_y_.data() + offset, n, d, delta_window) + n;
        for (std::int64_t i = 0; i < n; ++i) delta[i] -= delta_window[i];
      }
      TileAttention& kernel = kernels_[static_cast<std::size_t>(thread)];
      float* dk_pooled = l_.pool ? pooled_grads_.data() + thread * 2 * l_.pooled * d : nullptr;
      float* dv_pooled = l_.pool ? dk_pooled + l_.pooled * d : nullptr;
      if (l_.pool) std::fill_n(dk_pooled, 2 * l_.pooled * d, 0.0f);
      TilePattern tile;
      for (std::size_t t = ranges_[static_cast<std::size_t>(h)]; t < ranges_[static_cast<std::size_t>(h + 1)]; ++t) {
        const Task& task = tasks_[t];
        fixed::TileGrads grads{.q = q.data() + offset + task.start * d,
                               .dout = g.dout + task.start * d,
                               .dq = g.dq + task.start * d,
                               .ld = d};
        if (l_.pool) {
          plan_pooled(l_, task, tile);
          fixed::TileGrads pooled = grads;
          pooled.lse = lse_pooled_.data() + head * n + task.start;
          pooled.delta = delta + task.start;
          pooled.dk = dk_pooled;
          pooled.dv = dv_pooled;
          if (l_.stacked) {  // the query is y: its gradient joins dO as level 1's output gradient
            pooled.q = saved_y_.data() + offset + task.start * d;
            pooled.dq = window_grads_.data() + thread * l_.tile * d;
            std::fill_n(pooled.dq, task.rows * d, 0.0f);
          }
          flops += kernel.backward(tile, pooled, pooled_k_.head(b, h), pooled_v_.head(b, h), false);
          if (l_.stacked) flops += window_output_grads(task, pooled.dq, grads, delta_window, offset);
        }
        if (l_.window) {
          plan_window(l_, task, tile);
          grads.lse = lse_window_.data() + head * n + task.start;
          grads.delta = delta_window + task.start;
          grads.dk = g.dk;
          grads.dv = g.dv;
          flops += kernel.backward(tile, grads, k.data() + offset, v.data() + offset, false);
        }
      }
      if (l_.pool) flops += unpool(l_, d, dk_pooled, g.dk) + unpool(l_, d, dv_pooled, g.dv);
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override {
    return kept_tensors(l_, lse_window_, lse_pooled_, pooled_k_, pooled_v_, saved_y_);
  }
  std::vector<NamedTensor> parameter_gradients() const override { return {}; }

 private:
  float* lse_at(Tensor& lse, std::int64_t head, const Task& task) const {
    return lse.empty() ? nullptr : lse.data() + head * p_.seq_len + task.start;
  }

  // Stacked levels: level 1's output gradient for a tile's rows is dY = dO + dq₂ (written into dq2,
  // which `grads` then reads as its dout) and δ₁ = dY·y. Returns the FLOPs (3·rows·D).
  std::int64_t window_output_grads(const Task& task, float* dq2, fixed::TileGrads& grads, float* delta_window,
                                   std::int64_t offset) const {
    const std::int64_t d = p_.head_dim, count = task.rows * d;
    const float* dout = grads.dout;
#pragma omp simd
    for (std::int64_t e = 0; e < count; ++e) dq2[e] += dout[e];
    grads.dout = dq2;
    return count + block_sparse::row_dots(dq2, saved_y_.data() + offset + task.start * d, task.rows, d,
                                          delta_window + task.start);
  }

  Problem p_;
  Layout l_;
  std::vector<Task> tasks_;
  Tensor pooled_k_, pooled_v_, level_two_;  // K̄, V̄ [B, H, M, D]; z of a tile per thread [threads, tile, D]
  std::vector<TileAttention> kernels_;
  // Training only (prepare_backward).
  Tensor lse_window_, lse_pooled_, saved_y_, deltas_, pooled_grads_;
  Tensor window_grads_;  // stacked: dY of a tile per thread [threads, tile, D]
  std::vector<std::size_t> ranges_;
};

// The bf16 form (header): K̄, V̄ = bf16(fp32 means of the bf16 rows); each level on the bf16 gathered
// kernel (P rounded to bf16); one level alone rounds its output, both keep y and z in fp32 and round
// y + z once (stacked: level 2's query is bf16(y)). Training keeps each level's log-sum-exp and, with
// both levels, bf16(y); the backward is the fp32 form's on the bf16 kernel (below).
class PoolingformerBf16 final : public Mechanism {
 public:
  PoolingformerBf16(const Problem& problem, const Layout& layout)
      : p_(problem), l_(layout), tasks_(tasks_of(layout, problem.heads)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t d = p_.head_dim;
    if (l_.pool) {
      pooled_k_ = Tensor::bhnd(p_.batch, p_.heads, l_.pooled, d, DType::BF16);
      pooled_v_ = Tensor::bhnd(p_.batch, p_.heads, l_.pooled, d, DType::BF16);
    }
    if (l_.both()) levels_ = Tensor(Shape{p_.threads, 2, l_.tile, d});
    if (l_.stacked) stacked_rows_ = Tensor(Shape{p_.threads, l_.tile, d}, DType::BF16);
    kernels_.clear();
    for (std::int64_t t = 0; t < p_.threads; ++t) kernels_.emplace_back(tile_capacity(l_, tasks_), d);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (l_.pool) pool_rows<bf16>(p_, l_, k, v, pooled_k_, pooled_v_);
    const std::int64_t d = p_.head_dim, n = p_.seq_len;
    fixed::run_tile_tasks(
        p_.batch, tasks_, kernels_,
        [&](std::int64_t b, const Task& task, fixed::TileAttentionBf16& kernel, TilePattern& tile) {
          const std::int64_t head = b * p_.heads + task.head, rows = head * n * d + task.start * d;
          const Head h{.head = head,
                       .rows = rows,
                       .keys = k.bf16_data() + head * n * d,
                       .values = v.bf16_data() + head * n * d,
                       .pooled_keys = l_.pool ? pooled_k_.bf16_data() + head * l_.pooled * d : nullptr,
                       .pooled_values = l_.pool ? pooled_v_.bf16_data() + head * l_.pooled * d : nullptr};
          const bf16* query = q.bf16_data() + rows;
          bf16* result = out.bf16_data() + rows;
          if (!l_.both()) {
            if (l_.window) plan_window(l_, task, tile);
            if (l_.pool) plan_pooled(l_, task, tile);
            return l_.window ? kernel.attend(tile, query, d, h.keys, h.values, result, d, lse_at(lse_window_, h, task))
                             : kernel.attend(tile, query, d, h.pooled_keys, h.pooled_values, result, d,
                                             lse_at(lse_pooled_, h, task));
          }
          return both_levels(task, h, kernel, tile, query, result);
        });
  }

  std::vector<NamedTensor> parameters() const override { return {}; }

  void prepare_backward() override {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    for (auto& kernel : kernels_) kernel.enable_backward();
    if (l_.window) lse_window_ = Tensor(Shape{heads, n});
    if (l_.pool) {
      lse_pooled_ = Tensor(Shape{heads, n});
      pooled_grads_ = Tensor(Shape{p_.threads, 2, l_.pooled, d});
    }
    if (l_.both()) {
      saved_y_ = Tensor::bhnd(p_.batch, p_.heads, n, d, DType::BF16);
      window_deltas_ = Tensor(Shape{p_.threads, n});
    }
    heads_ = fixed::HeadBackward<bf16>(p_.threads, n, d);
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
  }

  // One task per (batch, head), as the fp32 form. δ = dO·out (fp32 from the bf16 rows); with both
  // levels δ₁ = dO·bf16(y) and δ₂ = δ − δ₁. dK, dV (and dK̄, dV̄) accumulate in fp32 and are rounded
  // once per head; a query row's dq₁ + dq₂ is summed in fp32 and rounded once. Stacked: dY = bf16(dO
  // + dq₂) is level 1's output gradient and δ₁ = dY·bf16(y).
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const block_sparse::BackwardTensors t{q, k, v, out, dout, dq, dk, dv};
    block_sparse::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      const std::int64_t h = head % p_.heads, offset = head * n * d;
      std::int64_t flops = 0;
      const fixed::HeadRowsOf<bf16> rows = heads_.begin(t, offset, nullptr, thread, flops);
      float* delta_window = rows.delta;
      if (l_.both()) {
        delta_window = window_deltas_.data() + thread * n;
        flops += row_dots_bf16(rows.dout, saved_y_.bf16_data() + offset, n, d, delta_window) + n;
        for (std::int64_t i = 0; i < n; ++i) rows.delta[i] -= delta_window[i];
      }
      float* dk_pooled = l_.pool ? pooled_grads_.data() + thread * 2 * l_.pooled * d : nullptr;
      if (l_.pool) std::fill_n(dk_pooled, 2 * l_.pooled * d, 0.0f);
      const HeadGrads g{.head = head,
                        .offset = offset,
                        .rows = rows,
                        .delta_window = delta_window,
                        .dk_pooled = dk_pooled,
                        .dv_pooled = dk_pooled + (l_.pool ? l_.pooled * d : 0)};
      fixed::TileAttentionBf16& kernel = kernels_[static_cast<std::size_t>(thread)];
      TilePattern tile;
      for (std::size_t i = ranges_[static_cast<std::size_t>(h)]; i < ranges_[static_cast<std::size_t>(h + 1)]; ++i)
        flops += task_backward(tasks_[i], g, k, v, kernel, tile, thread);
      if (l_.pool) flops += unpool(l_, d, g.dk_pooled, rows.dk) + unpool(l_, d, g.dv_pooled, rows.dv);
      heads_.finish(t, offset, thread);
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override {
    return kept_tensors(l_, lse_window_, lse_pooled_, pooled_k_, pooled_v_, saved_y_);
  }
  std::vector<NamedTensor> parameter_gradients() const override { return {}; }

 private:
  // A task's head: its index in [0, B·H), `rows` the element offset of the task's first query row, and
  // the head's bf16 keys, values and pooled rows.
  struct Head {
    std::int64_t head = 0, rows = 0;
    const bf16 *keys = nullptr, *values = nullptr, *pooled_keys = nullptr, *pooled_values = nullptr;
  };
  // One head's backward state: its query-side rows and fp32 key-side accumulators, δ₁'s rows and the
  // thread's dK̄, dV̄ [M, D] each.
  struct HeadGrads {
    std::int64_t head = 0, offset = 0;
    fixed::HeadRowsOf<bf16> rows;
    float* delta_window = nullptr;
    float *dk_pooled = nullptr, *dv_pooled = nullptr;
  };

  float* lse_at(Tensor& lse, const Head& h, const Task& task) const {
    return lse.empty() ? nullptr : lse.data() + h.head * p_.seq_len + task.start;
  }

  // levels=both for one task: y, z [rows, D] fp32 in the thread's levels_, out = bf16(y + z).
  // Training also keeps bf16(y) (the stacked query, which otherwise goes to the thread's rows).
  std::int64_t both_levels(const Task& task, const Head& h, fixed::TileAttentionBf16& kernel, TilePattern& tile,
                           const bf16* query, bf16* result) {
    const std::int64_t d = p_.head_dim, count = task.rows * d;
    const int thread = omp_get_thread_num();
    float* y = levels_.data() + thread * 2 * l_.tile * d;
    float* z = y + l_.tile * d;
    plan_window(l_, task, tile);
    std::int64_t flops = kernel.attend(tile, query, d, h.keys, h.values, y, d, lse_at(lse_window_, h, task));
    bf16* rounded = !saved_y_.empty() ? saved_y_.bf16_data() + h.rows
                                      : (l_.stacked ? stacked_rows_.bf16_data() + thread * l_.tile * d : nullptr);
    if (rounded != nullptr) narrow(y, rounded, count);
    plan_pooled(l_, task, tile);
    flops += kernel.attend(tile, l_.stacked ? rounded : query, d, h.pooled_keys, h.pooled_values, z, d,
                           lse_at(lse_pooled_, h, task));
#pragma omp simd
    for (std::int64_t e = 0; e < count; ++e) result[e] = to_bf16(y[e] + z[e]);
    return flops + count;
  }

  // Both levels' backward of one task (level 2 first, as the fp32 form). A level whose dQ is not the
  // row's whole gradient leaves it in the kernel's fp32 tile: both levels in parallel hold dq₂ in the
  // thread's levels_ and round dq₁ + dq₂; stacked turns dq₂ into dY (the thread's stacked_rows_).
  std::int64_t task_backward(const Task& task, const HeadGrads& g, const Tensor& k, const Tensor& v,
                             fixed::TileAttentionBf16& kernel, TilePattern& tile, int thread) {
    const std::int64_t d = p_.head_dim, n = p_.seq_len, count = task.rows * d, first = task.start * d;
    const fixed::TileGradsOf<bf16> grads{.q = g.rows.q + first,
                                         .dout = g.rows.dout + first,
                                         .dq = l_.both() ? nullptr : g.rows.dq + first,
                                         .ld = d,
                                         .lse = nullptr,
                                         .delta = nullptr,
                                         .stats_step = 1,
                                         .dk = g.rows.dk,
                                         .dv = g.rows.dv};
    float* held = l_.both() ? levels_.data() + thread * 2 * l_.tile * d : nullptr;
    std::int64_t flops = 0;
    if (l_.pool) {
      plan_pooled(l_, task, tile);
      fixed::TileGradsOf<bf16> pooled = grads;
      pooled.lse = lse_pooled_.data() + g.head * n + task.start;
      pooled.delta = g.rows.delta + task.start;
      pooled.dk = g.dk_pooled;
      pooled.dv = g.dv_pooled;
      if (l_.stacked) pooled.q = saved_y_.bf16_data() + g.offset + first;
      flops += kernel.backward(tile, pooled, pooled_k_.bf16_data() + g.head * l_.pooled * d,
                               pooled_v_.bf16_data() + g.head * l_.pooled * d, false);
      if (l_.both()) std::copy_n(kernel.dq_tile(), count, held);
    }
    fixed::TileGradsOf<bf16> window = grads;
    if (l_.stacked) {
      bf16* dy = stacked_rows_.bf16_data() + thread * l_.tile * d;
#pragma omp simd
      for (std::int64_t e = 0; e < count; ++e) dy[e] = to_bf16(held[e] + to_float(grads.dout[e]));
      flops +=
          count + row_dots_bf16(dy, saved_y_.bf16_data() + g.offset + first, task.rows, d, g.delta_window + task.start);
      window.dout = dy;
      window.dq = g.rows.dq + first;
    }
    if (l_.window) {
      plan_window(l_, task, tile);
      window.lse = lse_window_.data() + g.head * n + task.start;
      window.delta = g.delta_window + task.start;
      flops += kernel.backward(tile, window, k.bf16_data() + g.offset, v.bf16_data() + g.offset, false);
    }
    if (l_.both() && !l_.stacked) {
      const float* dq1 = kernel.dq_tile();
      bf16* dq = g.rows.dq + first;
#pragma omp simd
      for (std::int64_t e = 0; e < count; ++e) dq[e] = to_bf16(held[e] + dq1[e]);
    }
    return flops;
  }

  Problem p_;
  Layout l_;
  std::vector<Task> tasks_;
  // K̄, V̄ [B, H, M, D] bf16; both levels: y, z of a tile per thread [threads, 2, tile, D] fp32 (the
  // backward: dq₂ of a tile); stacked: bf16(y) per thread [threads, tile, D] (the backward: dY).
  Tensor pooled_k_, pooled_v_, levels_, stacked_rows_;
  std::vector<fixed::TileAttentionBf16> kernels_;
  // Training only (prepare_backward): each level's log-sum-exp [B·H, N], bf16(y) [B, H, N, D] (both
  // levels), δ₁ per thread [threads, N], dK̄ and dV̄ per thread [threads, 2, M, D].
  Tensor lse_window_, lse_pooled_, saved_y_, window_deltas_, pooled_grads_;
  fixed::HeadBackward<bf16> heads_;
  std::vector<std::size_t> ranges_;
};

}  // namespace

void validate(const Problem&, const PoolingformerConfig& c) {
  if (c.pooled_query == "window_output" && c.levels != "both")
    throw ParamError("poolingformer: pooled_query=window_output needs levels=both (level 2 reads level 1's output)");
  if (c.levels != "window" && c.pool_window / 2 + 1 < c.stride)
    throw ParamError(
        "poolingformer: pool_window/2 + 1 must be at least the stride (" + std::to_string(c.stride) +
        ") so every query's level-2 window holds a pooled row, got pool_window=" + std::to_string(c.pool_window));
}

std::string unsupported(const Problem& p, const PoolingformerConfig&) {
  if (const std::string why = fixed::gathered_bf16_unsupported(p); !why.empty()) return why;
  if (p.causal)
    return "Poolingformer has no causal form (its paper is an encoder for long-document QA and summarisation; the "
           "survey marks it as not decoding): both windows are two-sided and a pooled row averages later tokens";
  return "";
}

std::unique_ptr<Mechanism> create(const Problem& problem, const PoolingformerConfig& c, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<PoolingformerBf16>(problem, Layout(problem, c));
  return std::make_unique<Poolingformer>(problem, Layout(problem, c));
}

std::int64_t flops(const Problem& p, const PoolingformerConfig& c) {
  const Layout l(p, c);
  const std::int64_t d = p.head_dim;
  std::int64_t total = 0;
  TilePattern tile;
  const auto tasks = tasks_of(l, p.heads);
  for_each_level(l, [&](auto plan) {
    for (const auto& task : tasks) {
      plan(l, task, tile);
      total += fixed::tile_flops(tile, d);
    }
  });
  if (l.pool) total += p.heads * 2 * d * l.pooled_members();
  if (l.both()) total += p.heads * p.seq_len * d;
  return p.batch * total;
}

std::int64_t workspace(const Problem& p, const PoolingformerConfig& c) {
  const Layout l(p, c);
  const std::int64_t d = p.head_dim;
  if (p.dtype == DType::BF16) {
    const std::int64_t halves =
        (l.pool ? 2 * p.batch * p.heads * l.pooled * d : 0) + (l.stacked ? p.threads * l.tile * d : 0);
    const std::int64_t floats = l.both() ? p.threads * 2 * l.tile * d : 0;
    return halves * static_cast<std::int64_t>(sizeof(bf16)) + floats * static_cast<std::int64_t>(sizeof(float)) +
           p.threads * fixed::TileAttentionBf16::bytes(tile_capacity(l, tasks_of(l, p.heads)), d);
  }
  const std::int64_t floats =
      (l.pool ? 2 * p.batch * p.heads * l.pooled * d : 0) + (l.both() ? p.threads * l.tile * d : 0);
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         p.threads * TileAttention::bytes(score_capacity(l, tasks_of(l, p.heads)), 0, d);
}

std::int64_t backward_flops(const Problem& p, const PoolingformerConfig& c) {
  const Layout l(p, c);
  const std::int64_t d = p.head_dim, n = p.seq_len;
  std::int64_t total = p.heads * 2 * n * d;                       // δ = dO·out
  if (l.both()) total += p.heads * (2 * n * d + n);               // δ₁ = dO·y, δ₂ = δ − δ₁
  if (l.pool) total += p.heads * 2 * 2 * d * l.pooled_members();  // spreading dK̄, dV̄ back
  if (l.stacked) total += p.heads * 3 * n * d;                    // dY = dO + dq₂, δ₁ = dY·y
  TilePattern tile;
  const auto tasks = tasks_of(l, p.heads);
  for_each_level(l, [&](auto plan) {
    for (const auto& task : tasks) {
      plan(l, task, tile);
      total += fixed::tile_backward_flops(tile, d, false);
    }
  });
  return p.batch * total;
}

std::int64_t backward_workspace(const Problem& p, const PoolingformerConfig& c) {
  const Layout l(p, c);
  const std::int64_t heads = p.batch * p.heads, n = p.seq_len, d = p.head_dim, threads = p.threads;
  if (p.dtype == DType::BF16) {
    const std::int64_t floats = (l.window ? heads * n : 0) + (l.pool ? heads * n + threads * 2 * l.pooled * d : 0) +
                                (l.both() ? threads * n : 0);
    const std::int64_t halves = l.both() ? heads * n * d : 0;
    return floats * static_cast<std::int64_t>(sizeof(float)) + halves * static_cast<std::int64_t>(sizeof(bf16)) +
           fixed::HeadBackward<bf16>::bytes(threads, n, d) +
           threads * fixed::TileAttentionBf16::backward_bytes(tile_capacity(l, tasks_of(l, p.heads)), d);
  }
  std::int64_t floats = threads * 2 * n;
  if (l.window) floats += heads * n;
  if (l.pool) floats += heads * n + threads * 2 * l.pooled * d;
  if (l.both()) floats += heads * n * d;
  if (l.stacked) floats += threads * l.tile * d;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         threads * TileAttention::backward_bytes(score_capacity(l, tasks_of(l, p.heads)), 0, d);
}

FieldTable<PoolingformerConfig> config_fields(const PoolingformerConfig*) {
  return {int_field("window", &PoolingformerConfig::window, 0, 1 << 20,
                    "level-1 sliding window w1, tokens: w1/2 keys on each side"),
          int_field("pool_window", &PoolingformerConfig::pool_window, 0, 1 << 20,
                    "level-2 window w2, tokens: pooled rows starting within w2/2 on each side"),
          int_field("kernel", &PoolingformerConfig::kernel, 1, 1 << 16, "pooling kernel, tokens averaged per row"),
          int_field("stride", &PoolingformerConfig::stride, 1, 1 << 16, "pooling stride, tokens between rows"),
          choice_field("levels", &PoolingformerConfig::levels,
                       {{"both", "both"}, {"window", "window"}, {"pooled", "pooled"}},
                       "levels summed: both, the window alone or the pooled level alone"),
          choice_field("pooled_query", &PoolingformerConfig::pooled_query,
                       {{"input", "input"}, {"window_output", "window_output"}},
                       "level-2 query: the input q (levels in parallel) or level 1's output y (stacked)"),
          int_field("tile", &PoolingformerConfig::tile, 1, 1024, "query rows per computed tile (implementation)")};
}

template <>
Implementation implementation<PoolingformerConfig>() {
  Implementation impl = implement<PoolingformerConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
