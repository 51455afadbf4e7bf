#include "taxonomy/fixed_patterns/etc.hpp"

#include <algorithm>
#include <string>
#include <type_traits>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/gathered_attention_bf16.hpp"
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

// T: the element type of q, k, v, out and the gradients (float, or bf16 on the bf16 kernel).
template <class T>
class Etc final : public Mechanism {
 public:
  Etc(const Problem& problem, const EtcConfig& config)
      : p_(problem), shape_(shape_of(problem, config)), tasks_(tasks_of(problem, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    kernels_.clear();
    for (std::int64_t t = 0; t < p_.threads; ++t) {
      if constexpr (std::is_same_v<T, bf16>)
        kernels_.emplace_back(fixed::window_global_capacity(shape_, tasks_), p_.head_dim);
      else
        kernels_.emplace_back(fixed::window_global_score_floats(shape_, tasks_), 0, p_.head_dim);
    }
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    fixed::run_tile_tasks(p_.batch, tasks_, kernels_,
                          [&](std::int64_t b, const WindowGlobalTask& task, Kernel& kernel, TilePattern& tile) {
                            fixed::plan_window_global(shape_, task, tile);
                            const std::int64_t head = b * p_.heads + task.head;
                            const std::int64_t offset = head * n * d, first = fixed::first_row(task) * d;
                            float* lse = lse_.empty() ? nullptr : lse_.data() + head * n + fixed::first_row(task);
                            return kernel.run(tile, elements<T>(q) + offset + first, d, elements<T>(k) + offset,
                                              elements<T>(v) + offset, elements<T>(out) + offset + first, d, false,
                                              lse);
                          });
  }

  void prepare_backward() override {
    for (auto& kernel : kernels_) kernel.enable_backward();
    lse_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
    heads_ = fixed::HeadBackward<T>(p_.threads, p_.seq_len, p_.head_dim);
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
  }

  // One head per task: its tiles write overlapping dK, dV rows.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const block_sparse::BackwardTensors t{q, k, v, out, dout, dq, dk, dv};
    block_sparse::run_heads(p_.batch * p_.heads, p_.threads, [&](std::int64_t head, int thread) {
      const std::int64_t offset = head * n * d, h = head % p_.heads;
      std::int64_t flops = 0;
      const fixed::HeadRowsOf<T> rows = heads_.begin(t, offset, lse_.data() + head * n, thread, flops);
      auto& kernel = kernels_[static_cast<std::size_t>(thread)];
      TilePattern tile;
      for (std::size_t i = ranges_[static_cast<std::size_t>(h)]; i < ranges_[static_cast<std::size_t>(h + 1)]; ++i) {
        fixed::plan_window_global(shape_, tasks_[i], tile);
        flops += kernel.backward(tile, fixed::task_grads(tasks_[i], rows, d), elements<T>(k) + offset,
                                 elements<T>(v) + offset, false);
      }
      heads_.finish(t, offset, thread);
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override { return {{"log_sum_exp", &lse_}}; }

 private:
  using Kernel = fixed::GatheredKernel<T>;
  Problem p_;
  WindowGlobalShape shape_;
  std::vector<WindowGlobalTask> tasks_;
  std::vector<Kernel> kernels_;
  Tensor lse_;                       // training only
  fixed::HeadBackward<T> heads_;     // training only
  std::vector<std::size_t> ranges_;  // training: tasks of each head
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const EtcConfig& c, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<Etc<bf16>>(problem, c);
  return std::make_unique<Etc<float>>(problem, c);
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
  if (p.dtype == DType::BF16)
    return p.threads *
           fixed::TileAttentionBf16::bytes(fixed::window_global_capacity(shape_of(p, c), tasks_of(p, c)), p.head_dim);
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
  const std::int64_t lse = p.batch * p.heads * p.seq_len * static_cast<std::int64_t>(sizeof(float));
  if (p.dtype == DType::BF16)
    return lse + fixed::HeadBackward<bf16>::bytes(p.threads, p.seq_len, p.head_dim) +
           p.threads * fixed::TileAttentionBf16::backward_bytes(
                           fixed::window_global_capacity(shape_of(p, c), tasks_of(p, c)), p.head_dim);
  const std::int64_t scores = fixed::window_global_score_floats(shape_of(p, c), tasks_of(p, c));
  const std::int64_t floats = p.batch * p.heads * p.seq_len + p.threads * p.seq_len;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         p.threads * TileAttention::backward_bytes(scores, 0, p.head_dim);
}

FieldTable<EtcConfig> config_fields(const EtcConfig*) {
  return {int_field("globals", &EtcConfig::globals, 0, 1 << 20,
                    "global tokens n_g: the first n_g positions (clamped to N)"),
          int_field("radius", &EtcConfig::radius, 0, 1 << 20, "long-to-long radius r, tokens on each side"),
          int_field("tile", &EtcConfig::tile, 1, 1024, "query rows per computed tile (implementation)")};
}

EtcConfig resolve(const Problem& p, EtcConfig c) {
  c.globals = std::min(c.globals, p.seq_len);
  return c;
}

std::string unsupported(const Problem& p, const EtcConfig&) { return fixed::gathered_bf16_unsupported(p); }

template <>
Implementation implementation<EtcConfig>() {
  Implementation impl = implement<EtcConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
