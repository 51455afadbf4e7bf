#include "taxonomy/fixed_patterns/longformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/window_global.hpp"

namespace xfb {
namespace {

using fixed::TileAttention;
using fixed::TilePattern;
using fixed::WindowGlobalShape;
using fixed::WindowGlobalTask;

WindowGlobalShape shape_of(const Problem& p, const LongformerConfig& c) {
  const std::int64_t half = c.window / 2;
  return {.tokens = p.seq_len, .globals = std::min(c.globals, p.seq_len), .before = half,
          .after = p.causal ? 0 : half, .tile = c.tile, .causal = p.causal};
}

std::vector<std::int64_t> head_dilations(const Problem& p, const LongformerConfig& c) {
  std::vector<std::int64_t> dilation(static_cast<std::size_t>(p.heads), 1);
  for (std::int64_t h = std::max<std::int64_t>(p.heads - c.dilated_heads, 0); h < p.heads; ++h)
    dilation[static_cast<std::size_t>(h)] = c.dilation;
  return dilation;
}

// Per-thread floats besides the kernel: projected queries, q̃ and the pre-projection output.
std::int64_t projection_floats(const Problem& p, const LongformerConfig& c) { return 3 * c.tile * p.head_dim; }

class Longformer final : public Mechanism {
 public:
  Longformer(const Problem& problem, const LongformerConfig& config, std::uint64_t seed)
      : p_(problem),
        shape_(shape_of(problem, config)),
        tasks_(fixed::window_global_tasks(shape_, head_dilations(problem, config))),
        tile_rows_(config.tile),
        seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t d = p_.head_dim;
    const auto std_dev = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
    for (auto [tensor, name] : {std::pair{&wq_, "longformer/global_wq"}, std::pair{&wk_, "longformer/global_wk"},
                                std::pair{&wv_, "longformer/global_wv"}}) {
      *tensor = Tensor(Shape{p_.heads, d, d});
      CounterRng(seed_, name).fill_normal(*tensor, 0.0f, std_dev);
    }
    const std::int64_t threads = p_.threads;
    const std::int64_t scores = fixed::window_global_score_floats(shape_, tasks_);
    kernels_.clear();
    for (std::int64_t t = 0; t < threads; ++t) kernels_.emplace_back(scores, 0, d);
    projections_ = Tensor(Shape{threads, 3, tile_rows_, d});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    fixed::run_tile_tasks(p_.batch, tasks_, kernels_,
                          [&](std::int64_t b, const WindowGlobalTask& task, TileAttention&, TilePattern& tile) {
                            fixed::plan_window_global(shape_, task, tile);
                            const int thread = omp_get_thread_num();  // also picks the projection buffers
                            return task.global ? global_tile(task, tile, q, k, v, out, b, thread)
                                               : window_tile(task, tile, q, k, v, out, b, thread);
                          });
  }

  std::vector<NamedTensor> parameters() const override {
    return {{"global_wq", &wq_}, {"global_wk", &wk_}, {"global_wv", &wv_}};
  }

 private:
  std::int64_t window_tile(const WindowGlobalTask& task, const TilePattern& tile, const Tensor& q, const Tensor& k,
                           const Tensor& v, Tensor& out, std::int64_t b, int thread) {
    const std::int64_t d = p_.head_dim, offset = fixed::first_row(task) * d, ld = fixed::row_step(task) * d;
    return kernels_[static_cast<std::size_t>(thread)].run(tile, q.head(b, task.head) + offset, ld, k.head(b, task.head),
                                                          v.head(b, task.head), out.head(b, task.head) + offset, ld,
                                                          false);
  }

  // Global rows: q̃ = (q·Wq)·Wkᵀ attends the plain keys/values, then the result is multiplied by Wv.
  std::int64_t global_tile(const WindowGlobalTask& task, const TilePattern& tile, const Tensor& q, const Tensor& k,
                           const Tensor& v, Tensor& out, std::int64_t b, int thread) {
    const std::int64_t d = p_.head_dim, rows = task.rows, h = task.head;
    float* projected = projections_.data() + thread * 3 * tile_rows_ * d;
    float* query = projected + tile_rows_ * d;
    float* attended = query + tile_rows_ * d;
    const float* wq = wq_.data() + h * d * d;
    const float* wk = wk_.data() + h * d * d;
    const float* wv = wv_.data() + h * d * d;
    ops::gemm(false, false, rows, d, d, 1.0f, q.head(b, h) + task.start * d, d, wq, d, 0.0f, projected, d);
    ops::gemm(false, true, rows, d, d, 1.0f, projected, d, wk, d, 0.0f, query, d);
    const std::int64_t flops = kernels_[static_cast<std::size_t>(thread)].run(tile, query, d, k.head(b, h), v.head(b, h),
                                                                              attended, d, false);
    ops::gemm(false, false, rows, d, d, 1.0f, attended, d, wv, d, 0.0f, out.head(b, h) + task.start * d, d);
    return flops;
  }

  Problem p_;
  WindowGlobalShape shape_;
  std::vector<WindowGlobalTask> tasks_;
  std::int64_t tile_rows_;
  std::uint64_t seed_;
  Tensor wq_, wk_, wv_, projections_;
  std::vector<TileAttention> kernels_;
};

void validate(const Problem&, const LongformerConfig& c) {
  if (c.window % 2 != 0) throw ParamError("longformer: window must be even (w/2 keys on each side), got " +
                                          std::to_string(c.window));
}

std::unique_ptr<Mechanism> create(const Problem& problem, const LongformerConfig& c, std::uint64_t seed) {
  return std::make_unique<Longformer>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const LongformerConfig& c) {
  const auto shape = shape_of(p, c);
  TilePattern tile;
  std::int64_t total = 0;
  for (const auto& task : fixed::window_global_tasks(shape, head_dilations(p, c))) {
    fixed::plan_window_global(shape, task, tile);
    total += fixed::tile_flops(tile, p.head_dim);
    if (task.global) total += 3 * matmul_flops(task.rows, p.head_dim, p.head_dim);
  }
  return p.batch * total;
}

std::int64_t workspace(const Problem& p, const LongformerConfig& c) {
  const auto shape = shape_of(p, c);
  const std::int64_t threads = p.threads;
  const std::int64_t scores = fixed::window_global_score_floats(shape, fixed::window_global_tasks(shape, head_dilations(p, c)));
  const std::int64_t floats = 3 * p.heads * p.head_dim * p.head_dim + threads * projection_floats(p, c);
  return floats * static_cast<std::int64_t>(sizeof(float)) + threads * TileAttention::bytes(scores, 0, p.head_dim);
}

}  // namespace

Implementation longformer_implementation() {
  return implement(ModelSpec<LongformerConfig>{
      .fields = {int_field("window", &LongformerConfig::window, 0, 1 << 20,
                           "sliding window w (even), tokens: w/2 on each side"),
                 int_field("dilation", &LongformerConfig::dilation, 1, 1024, "gap between window keys on dilated heads, tokens"),
                 int_field("dilated_heads", &LongformerConfig::dilated_heads, 0, 4096,
                           "number of (last) heads using the dilation"),
                 int_field("globals", &LongformerConfig::globals, 0, 1 << 20, "global tokens: the first g positions"),
                 int_field("tile", &LongformerConfig::tile, 1, 1024, "query rows per computed tile (implementation)")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, LongformerConfig c) {
        c.globals = std::min(c.globals, p.seq_len);
        return c;
      },
      .validate = validate});
}

}  // namespace xfb
