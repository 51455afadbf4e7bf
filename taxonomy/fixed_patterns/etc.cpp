#include "taxonomy/fixed_patterns/etc.hpp"

#include <algorithm>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/window_global.hpp"

namespace xfb {
namespace {

using fixed::TileAttention;
using fixed::TilePattern;
using fixed::WindowGlobalShape;
using fixed::WindowGlobalTask;

WindowGlobalShape shape_of(const Problem& p, const EtcConfig& c) {
  return {.tokens = p.seq_len,
          .globals = std::min(c.globals, p.seq_len),
          .before = c.radius,
          .after = c.radius,
          .tile = c.tile,
          .causal = false};
}

std::vector<WindowGlobalTask> tasks_of(const Problem& p, const EtcConfig& c) {
  return fixed::window_global_tasks(shape_of(p, c), std::vector<std::int64_t>(static_cast<std::size_t>(p.heads), 1));
}

class Etc final : public Mechanism {
 public:
  Etc(const Problem& problem, const EtcConfig& config)
      : p_(problem), shape_(shape_of(problem, config)), tasks_(tasks_of(problem, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t threads = p_.threads;
    const std::int64_t scores = fixed::window_global_score_floats(shape_, tasks_);
    kernels_.clear();
    for (std::int64_t t = 0; t < threads; ++t) kernels_.emplace_back(scores, 0, p_.head_dim);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim;
    fixed::run_tile_tasks(p_.batch, tasks_, kernels_,
                          [&](std::int64_t b, const WindowGlobalTask& task, TileAttention& kernel, TilePattern& tile) {
                            fixed::plan_window_global(shape_, task, tile);
                            const std::int64_t offset = fixed::first_row(task) * d;
                            float* lse = lse_.empty() ? nullptr
                                                      : lse_.data() + (b * p_.heads + task.head) * p_.seq_len +
                                                            fixed::first_row(task);
                            return kernel.run(tile, q.head(b, task.head) + offset, d, k.head(b, task.head),
                                              v.head(b, task.head), out.head(b, task.head) + offset, d, false, lse);
                          });
  }

  void prepare_backward() override {
    for (auto& kernel : kernels_) kernel.enable_backward();
    lse_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
    deltas_ = Tensor(Shape{p_.threads, p_.seq_len});
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
  }

  // One head per task: its tiles write overlapping dK, dV rows.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    block_sparse::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      const std::int64_t offset = head * n * d, h = head % p_.heads;
      const fixed::HeadRows rows{q.data() + offset,      dout.data() + offset,        dq.data() + offset,
                                 lse_.data() + head * n, deltas_.data() + thread * n, dk.data() + offset,
                                 dv.data() + offset};
      std::int64_t flops = block_sparse::begin_head({.out = out.data() + offset,
                                                     .dout = rows.dout,
                                                     .delta = deltas_.data() + thread * n,
                                                     .dq = rows.dq,
                                                     .dk = rows.dk,
                                                     .dv = rows.dv,
                                                     .d = d},
                                                    n, n);
      auto& kernel = kernels_[static_cast<std::size_t>(thread)];
      TilePattern tile;
      for (std::size_t t = ranges_[static_cast<std::size_t>(h)]; t < ranges_[static_cast<std::size_t>(h + 1)]; ++t) {
        fixed::plan_window_global(shape_, tasks_[t], tile);
        flops +=
            kernel.backward(tile, fixed::task_grads(tasks_[t], rows, d), k.data() + offset, v.data() + offset, false);
      }
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override { return {{"log_sum_exp", &lse_}}; }

 private:
  Problem p_;
  WindowGlobalShape shape_;
  std::vector<WindowGlobalTask> tasks_;
  std::vector<TileAttention> kernels_;
  Tensor lse_, deltas_;              // training only
  std::vector<std::size_t> ranges_;  // training: tasks of each head
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const EtcConfig& c, std::uint64_t) {
  return std::make_unique<Etc>(problem, c);
}

std::int64_t flops(const Problem& p, const EtcConfig& c) {
  const auto shape = shape_of(p, c);
  TilePattern tile;
  std::int64_t total = 0;
  for (const auto& task : tasks_of(p, c)) {
    fixed::plan_window_global(shape, task, tile);
    total += fixed::tile_flops(tile, p.head_dim);
  }
  return p.batch * total;
}

std::int64_t workspace(const Problem& p, const EtcConfig& c) {
  const std::int64_t scores = fixed::window_global_score_floats(shape_of(p, c), tasks_of(p, c));
  return p.threads * TileAttention::bytes(scores, 0, p.head_dim);
}

std::int64_t backward_flops(const Problem& p, const EtcConfig& c) {
  const auto shape = shape_of(p, c);
  TilePattern tile;
  std::int64_t total = 2 * p.heads * p.seq_len * p.head_dim;  // δ
  for (const auto& task : tasks_of(p, c)) {
    fixed::plan_window_global(shape, task, tile);
    total += fixed::tile_backward_flops(tile, p.head_dim, false);
  }
  return p.batch * total;
}

std::int64_t backward_workspace(const Problem& p, const EtcConfig& c) {
  const std::int64_t scores = fixed::window_global_score_floats(shape_of(p, c), tasks_of(p, c));
  const std::int64_t floats = p.batch * p.heads * p.seq_len + p.threads * p.seq_len;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         p.threads * TileAttention::backward_bytes(scores, 0, p.head_dim);
}

FieldTable<EtcConfig> config_fields(const EtcConfig*) {
  return {int_field("globals", &EtcConfig::globals, 0, 1 << 20, "global tokens n_g: the first n_g positions"),
          int_field("radius", &EtcConfig::radius, 0, 1 << 20, "long-to-long radius r, tokens on each side"),
          int_field("tile", &EtcConfig::tile, 1, 1024, "query rows per computed tile (implementation)")};
}

EtcConfig resolve(const Problem& p, EtcConfig c) {
  c.globals = std::min(c.globals, p.seq_len);
  return c;
}

template <>
Implementation implementation<EtcConfig>() {
  return implement<EtcConfig>();
}

}  // namespace xfb
