#include "taxonomy/fixed_patterns/etc.hpp"

#include <algorithm>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/window_global.hpp"

namespace xfb {
namespace {

using fixed::TileAttention;
using fixed::TilePattern;
using fixed::WindowGlobalShape;
using fixed::WindowGlobalTask;

WindowGlobalShape shape_of(const Problem& p, const EtcConfig& c) {
  return {.tokens = p.seq_len, .globals = std::min(c.globals, p.seq_len), .before = c.radius, .after = c.radius,
          .tile = c.tile, .causal = false};
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
                            return kernel.run(tile, q.head(b, task.head) + offset, d, k.head(b, task.head),
                                              v.head(b, task.head), out.head(b, task.head) + offset, d, false);
                          });
  }

 private:
  Problem p_;
  WindowGlobalShape shape_;
  std::vector<WindowGlobalTask> tasks_;
  std::vector<TileAttention> kernels_;
};

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

}  // namespace

Implementation etc_implementation() {
  return implement(ModelSpec<EtcConfig>{
      .fields = {int_field("globals", &EtcConfig::globals, 0, 1 << 20, "global tokens n_g: the first n_g positions"),
                 int_field("radius", &EtcConfig::radius, 0, 1 << 20, "long-to-long radius r, tokens on each side"),
                 int_field("tile", &EtcConfig::tile, 1, 1024, "query rows per computed tile (implementation)")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, EtcConfig c) {
        c.globals = std::min(c.globals, p.seq_len);
        return c;
      }});
}

}  // namespace xfb
