#include "taxonomy/fixed_patterns/longformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
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
  return {.tokens = p.seq_len,
          .globals = std::min(c.globals, p.seq_len),
          .before = half,
          .after = p.causal ? 0 : half,
          .tile = c.tile,
          .causal = p.causal};
}

std::vector<std::int64_t> head_dilations(const Problem& p, const LongformerConfig& c) {
  std::vector<std::int64_t> dilation(static_cast<std::size_t>(p.heads), 1);
  for (std::int64_t h = std::max<std::int64_t>(p.heads - c.dilated_heads, 0); h < p.heads; ++h)
    dilation[static_cast<std::size_t>(h)] = c.dilation;
  return dilation;
}

// Decode: the ring of the last s·d_max + 1 tokens, which holds every head's one-sided window.
std::int64_t window_ring(const LongformerConfig& c) {
  return c.window / 2 * (c.dilated_heads > 0 ? c.dilation : 1) + 1;
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
        seed_(seed),
        dilations_(head_dilations(problem, config)),
        ring_(window_ring(config)) {}

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
    if (window_cache_.capacity() > 0) load_decode_context(k, v);
  }

  std::vector<NamedTensor> parameters() const override {
    return {{"global_wq", &wq_}, {"global_wk", &wk_}, {"global_wv", &wv_}};
  }

  // Decode: the global tokens' keys and values and the window ring. A decoded token is never global
  // (g ≤ N), so it attends with its plain q to the g globals and to its window's non-global tokens.
  void prepare_decode(std::int64_t) override {
    globals_cache_ = KvCache(p_.batch * p_.heads, shape_.globals, p_.head_dim);
    window_cache_ = KvCache(p_.batch * p_.heads, ring_, p_.head_dim);
    step_buffers_ = Tensor(Shape{p_.batch * p_.heads, 2, p_.head_dim});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, i = length_, g = shape_.globals, s = shape_.before;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      window_cache_.store(head, i % ring_, k.data() + head * d, v.data() + head * d, 1);
      std::int64_t flops = attend_rows(row, query, globals_cache_.keys(head), globals_cache_.values(head), g);
      const std::int64_t dilation = dilations_[static_cast<std::size_t>(head % p_.heads)];
      const std::int64_t window = std::min(s, (i - g) / dilation) + 1;  // i − dilation·t ≥ g, t ≤ s
      return flops + attend_ring(row, query, window_cache_.keys(head), window_cache_.values(head), ring_,
                                 i - dilation * (window - 1), window, dilation);
    });
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"global_keys", &globals_cache_.key_tensor()},
            {"global_values", &globals_cache_.value_tensor()},
            {"window_keys", &window_cache_.key_tensor()},
            {"window_values", &window_cache_.value_tensor()}};
  }

  void prepare_backward() override {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    for (auto& kernel : kernels_) kernel.enable_backward();
    lse_ = Tensor(Shape{heads, n});
    global_saved_ = Tensor(Shape{heads, 3, shape_.globals, d});
    deltas_ = Tensor(Shape{p_.threads, n});
    projection_grads_ = Tensor(Shape{p_.threads, 3, tile_rows_, d});
    for (Tensor* grad : {&dwq_, &dwk_, &dwv_}) *grad = Tensor(Shape{p_.heads, d, d});
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
  }

  // One task per head index h (its batch entries in turn): the projection gradients of head h sum
  // over the batch, and a head's tiles write overlapping dK, dV rows.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    block_sparse::run_heads(p_.heads, p_.threads, [&](std::int64_t h, int thread) {
      for (Tensor* grad : {&dwq_, &dwk_, &dwv_}) std::fill_n(grad->data() + h * d * d, d * d, 0.0f);
      std::int64_t flops = 0;
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t head = b * p_.heads + h, offset = head * n * d;
        float* delta = deltas_.data() + thread * n;
        const fixed::HeadRows rows{
            q.data() + offset,  dout.data() + offset, dq.data() + offset, lse_.data() + head * n, delta,
            dk.data() + offset, dv.data() + offset};
        flops += block_sparse::begin_head({.out = out.data() + offset,
                                           .dout = rows.dout,
                                           .delta = delta,
                                           .dq = rows.dq,
                                           .dk = rows.dk,
                                           .dv = rows.dv,
                                           .d = d},
                                          n, n);
        TilePattern tile;
        for (std::size_t t = ranges_[static_cast<std::size_t>(h)]; t < ranges_[static_cast<std::size_t>(h + 1)]; ++t) {
          const WindowGlobalTask& task = tasks_[t];
          fixed::plan_window_global(shape_, task, tile);
          flops += task.global
                       ? global_backward(task, tile, rows, k.data() + offset, v.data() + offset, head, thread)
                       : kernels_[static_cast<std::size_t>(thread)].backward(
                             tile, fixed::task_grads(task, rows, d), k.data() + offset, v.data() + offset, false);
        }
      }
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override {
    return {{"log_sum_exp", &lse_}, {"global_projections", &global_saved_}};
  }
  std::vector<NamedTensor> parameter_gradients() const override {
    return {{"dglobal_wq", &dwq_}, {"dglobal_wk", &dwk_}, {"dglobal_wv", &dwv_}};
  }

 private:
  // The prefill's part of a decode: the globals and the last tokens of the context.
  void load_decode_context(const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, kept = std::min(n, ring_), first = n - kept;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      const float *keys = k.data() + head * n * d, *values = v.data() + head * n * d;
      globals_cache_.store(head, 0, keys, values, shape_.globals);
      window_cache_.store(head, first % ring_, keys + first * d, values + first * d, kept);
    }
    length_ = n;
  }

  std::int64_t window_tile(const WindowGlobalTask& task, const TilePattern& tile, const Tensor& q, const Tensor& k,
                           const Tensor& v, Tensor& out, std::int64_t b, int thread) {
    const std::int64_t d = p_.head_dim, offset = fixed::first_row(task) * d, ld = fixed::row_step(task) * d;
    return kernels_[static_cast<std::size_t>(thread)].run(tile, q.head(b, task.head) + offset, ld, k.head(b, task.head),
                                                          v.head(b, task.head), out.head(b, task.head) + offset, ld,
                                                          false, lse_at(b, task), fixed::row_step(task));
  }

  float* lse_at(std::int64_t b, const WindowGlobalTask& task) {
    return lse_.empty() ? nullptr : lse_.data() + (b * p_.heads + task.head) * p_.seq_len + fixed::first_row(task);
  }

  // The backward of a global tile (saved: P1 = q·Wq, q̃ = P1·Wkᵀ, A = the attention's output):
  //   dA = dO·Wvᵀ, dWv += Aᵀ·dO; δ = dA·A; attention backward of q̃ → dq̃ (and dK, dV);
  //   dP1 = dq̃·Wk, dWk += dq̃ᵀ·P1; dq = dP1·Wqᵀ, dWq += qᵀ·dP1. Returns the elementwise FLOPs.
  std::int64_t global_backward(const WindowGlobalTask& task, const TilePattern& tile, const fixed::HeadRows& rows,
                               const float* k, const float* v, std::int64_t head, int thread) {
    const std::int64_t d = p_.head_dim, r = task.rows, h = task.head, first = task.start * d;
    const std::int64_t g = shape_.globals;
    const float* projected = global_saved_.data() + (head * 3 * g + task.start) * d;
    const float* query = projected + g * d;
    const float* attended = query + g * d;
    float* d_attended = projection_grads_.data() + thread * 3 * tile_rows_ * d;
    float* d_query = d_attended + tile_rows_ * d;
    float* d_projected = d_query + tile_rows_ * d;
    const float *wq = wq_.data() + h * d * d, *wk = wk_.data() + h * d * d, *wv = wv_.data() + h * d * d;
    ops::gemm(false, true, r, d, d, 1.0f, rows.dout + first, d, wv, d, 0.0f, d_attended, d);
    ops::gemm(true, false, d, d, r, 1.0f, attended, d, rows.dout + first, d, 1.0f, dwv_.data() + h * d * d, d);
    float* delta = rows.delta + task.start;
    block_sparse::row_dots(d_attended, attended, r, d, delta);
    std::fill_n(d_query, r * d, 0.0f);
    const fixed::TileGrads grads{.q = query,
                                 .dout = d_attended,
                                 .dq = d_query,
                                 .ld = d,
                                 .lse = rows.lse + task.start,
                                 .delta = delta,
                                 .dk = rows.dk,
                                 .dv = rows.dv};
    const std::int64_t flops = kernels_[static_cast<std::size_t>(thread)].backward(tile, grads, k, v, false);
    ops::gemm(false, false, r, d, d, 1.0f, d_query, d, wk, d, 0.0f, d_projected, d);
    ops::gemm(true, false, d, d, r, 1.0f, d_query, d, projected, d, 1.0f, dwk_.data() + h * d * d, d);
    ops::gemm(false, true, r, d, d, 1.0f, d_projected, d, wq, d, 0.0f, rows.dq + first, d);
    ops::gemm(true, false, d, d, r, 1.0f, rows.q + first, d, d_projected, d, 1.0f, dwq_.data() + h * d * d, d);
    return flops + 2 * r * d;
  }

  // Global rows: q̃ = (q·Wq)·Wkᵀ attends the plain keys/values, then the result is multiplied by Wv.
  // A training forward keeps P1 = q·Wq, q̃ and the attention's output for the backward.
  std::int64_t global_tile(const WindowGlobalTask& task, const TilePattern& tile, const Tensor& q, const Tensor& k,
                           const Tensor& v, Tensor& out, std::int64_t b, int thread) {
    const std::int64_t d = p_.head_dim, rows = task.rows, h = task.head;
    const bool training = !global_saved_.empty();
    const std::int64_t g = shape_.globals, slot = training ? g : tile_rows_;
    float* projected = training ? global_saved_.data() + ((b * p_.heads + h) * 3 * g + task.start) * d
                                : projections_.data() + thread * 3 * tile_rows_ * d;
    float* query = projected + slot * d;
    float* attended = query + slot * d;
    const float* wq = wq_.data() + h * d * d;
    const float* wk = wk_.data() + h * d * d;
    const float* wv = wv_.data() + h * d * d;
    ops::gemm(false, false, rows, d, d, 1.0f, q.head(b, h) + task.start * d, d, wq, d, 0.0f, projected, d);
    ops::gemm(false, true, rows, d, d, 1.0f, projected, d, wk, d, 0.0f, query, d);
    const std::int64_t flops = kernels_[static_cast<std::size_t>(thread)].run(
        tile, query, d, k.head(b, h), v.head(b, h), attended, d, false, lse_at(b, task));
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
  // Training only (prepare_backward).
  Tensor lse_, global_saved_, deltas_, projection_grads_, dwq_, dwk_, dwv_;
  std::vector<std::size_t> ranges_;
  // Decoding only (prepare_decode).
  std::vector<std::int64_t> dilations_;  // d_h per head index
  std::int64_t ring_;                    // window ring rows, window_ring()
  KvCache globals_cache_, window_cache_;
  Tensor step_buffers_;  // per head the scaled query and the accumulator
  std::int64_t length_ = 0;
};

}  // namespace

void validate(const Problem&, const LongformerConfig& c) {
  if (c.window % 2 != 0)
    throw ParamError("longformer: window must be even (w/2 keys on each side), got " + std::to_string(c.window));
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
  const std::int64_t scores =
      fixed::window_global_score_floats(shape, fixed::window_global_tasks(shape, head_dilations(p, c)));
  const std::int64_t floats = 3 * p.heads * p.head_dim * p.head_dim + threads * projection_floats(p, c);
  return floats * static_cast<std::int64_t>(sizeof(float)) + threads * TileAttention::bytes(scores, 0, p.head_dim);
}

std::int64_t backward_flops(const Problem& p, const LongformerConfig& c) {
  const auto shape = shape_of(p, c);
  const std::int64_t d = p.head_dim;
  TilePattern tile;
  std::int64_t total = 2 * p.heads * p.seq_len * d;  // δ of every row
  for (const auto& task : fixed::window_global_tasks(shape, head_dilations(p, c))) {
    fixed::plan_window_global(shape, task, tile);
    total += fixed::tile_backward_flops(tile, d, false);
    if (task.global) total += 6 * matmul_flops(task.rows, d, d) + 2 * task.rows * d;  // projections, global δ
  }
  return p.batch * total;
}

std::int64_t backward_workspace(const Problem& p, const LongformerConfig& c) {
  const auto shape = shape_of(p, c);
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim, threads = p.threads;
  const std::int64_t scores =
      fixed::window_global_score_floats(shape, fixed::window_global_tasks(shape, head_dilations(p, c)));
  const std::int64_t floats = heads * p.seq_len + heads * 3 * shape.globals * d + threads * p.seq_len +
                              threads * 3 * c.tile * d + 3 * p.heads * d * d;
  return floats * static_cast<std::int64_t>(sizeof(float)) + threads * TileAttention::backward_bytes(scores, 0, d);
}

std::int64_t decode_workspace(const Problem& p, const LongformerConfig& c, std::int64_t) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim;
  return KvCache::bytes(heads, c.globals, d) + KvCache::bytes(heads, window_ring(c), d) +
         heads * 2 * d * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<LongformerConfig> config_fields(const LongformerConfig*) {
  return {
      int_field("window", &LongformerConfig::window, 0, 1 << 20, "sliding window w (even), tokens: w/2 on each side"),
      int_field("dilation", &LongformerConfig::dilation, 1, 1024, "gap between window keys on dilated heads, tokens"),
      int_field("dilated_heads", &LongformerConfig::dilated_heads, 0, 4096,
                "number of (last) heads using the dilation"),
      int_field("globals", &LongformerConfig::globals, 0, 1 << 20, "global tokens: the first g positions"),
      int_field("tile", &LongformerConfig::tile, 1, 1024, "query rows per computed tile (implementation)")};
}

LongformerConfig resolve(const Problem& p, LongformerConfig c) {
  c.globals = std::min(c.globals, p.seq_len);
  return c;
}

template <>
Implementation implementation<LongformerConfig>() {
  return implement<LongformerConfig>();
}

}  // namespace xfb
