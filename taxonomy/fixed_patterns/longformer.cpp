#include "taxonomy/fixed_patterns/longformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/gathered_attention_bf16.hpp"
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

// bf16 (besides projection_floats): per thread the rounded q̃ of a global tile (bf16 [tile, D]);
// training: per thread two fp32 [tile, D] rows widened from bf16 and the rounded dA (bf16 [tile, D]).
std::int64_t bf16_forward_halves(const Problem& p, const LongformerConfig& c) { return c.tile * p.head_dim; }
std::int64_t bf16_backward_floats(const Problem& p, const LongformerConfig& c) { return 2 * c.tile * p.head_dim; }

constexpr std::int64_t kFloatBytes = sizeof(float), kHalfBytes = sizeof(bf16);

// T: the element type of q, k, v, out, the gradients, the saved global projections and the
// decode caches (float, or bf16 on the bf16 kernel). Parameters and their gradients are fp32.
// bf16 rounding points of a global tile (the window tiles are the kernel's alone): P1 = q·Wq and
// q̃ = P1·Wkᵀ in fp32 from the bf16 q, q̃ rounded to bf16 for the kernel, A = the kernel's fp32
// A/Σ, out = bf16(A·Wv); training saves bf16(P1), bf16(q̃) and bf16(A). Backward: dA = dO·Wvᵀ
// rounded to bf16 (the kernel's dO; δ = bf16(dA)·bf16(A)), dWv += bf16(A)ᵀ·dO, the kernel's fp32
// dq̃, dP1 = dq̃·Wk, dWk += dq̃ᵀ·bf16(P1), dq = bf16(dP1·Wqᵀ), dWq += qᵀ·dP1 (all fp32 products of
// widened bf16 rows).
template <class T>
class Longformer final : public Mechanism {
  static constexpr bool kBf16 = std::is_same_v<T, bf16>;
  using Kernel = fixed::GatheredKernel<T>;

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
    kernels_.clear();
    for (std::int64_t t = 0; t < threads; ++t) {
      if constexpr (kBf16)
        kernels_.emplace_back(fixed::window_global_capacity(shape_, tasks_), d);
      else
        kernels_.emplace_back(fixed::window_global_score_floats(shape_, tasks_), 0, d);
    }
    projections_ = Tensor(Shape{threads, 3, tile_rows_, d});
    if constexpr (kBf16) global_queries_ = Tensor(Shape{threads, tile_rows_, d}, DType::BF16);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    fixed::run_tile_tasks(p_.batch, tasks_, kernels_,
                          [&](std::int64_t b, const WindowGlobalTask& task, Kernel&, TilePattern& tile) {
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
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim;
    globals_cache_ = KvCache(heads, shape_.globals, d, p_.dtype);
    window_cache_ = KvCache(heads, ring_, d, p_.dtype);
    step_buffers_ = Tensor(Shape{heads, 2, d});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, i = length_, g = shape_.globals;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      window_cache_.store(head, i % ring_, elements<T>(k) + head * d, elements<T>(v) + head * d, 1);
      std::int64_t flops = attend_rows(row, query, globals_cache_.keys<T>(head), globals_cache_.values<T>(head), g);
      const auto [first, window] = step_window(head);
      return flops + attend_ring(row, query, window_cache_.keys<T>(head), window_cache_.values<T>(head), ring_, first,
                                 window, dilations_[static_cast<std::size_t>(head % p_.heads)]);
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
    global_saved_ = Tensor(Shape{heads, 3, shape_.globals, d}, kBf16 ? DType::BF16 : DType::F32);
    heads_ = fixed::HeadBackward<T>(p_.threads, n, d);
    projection_grads_ = Tensor(Shape{p_.threads, 3, tile_rows_, d});
    if constexpr (kBf16) {
      widened_ = Tensor(Shape{p_.threads, 2, tile_rows_, d});
      rounded_grads_ = Tensor(Shape{p_.threads, tile_rows_, d}, DType::BF16);
    }
    for (Tensor* grad : {&dwq_, &dwk_, &dwv_}) *grad = Tensor(Shape{p_.heads, d, d});
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
  }

  // One task per head index h (its batch entries in turn): the projection gradients of head h sum
  // over the batch, and a head's tiles write overlapping dK, dV rows.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const block_sparse::BackwardTensors t{q, k, v, out, dout, dq, dk, dv};
    block_sparse::run_heads(p_.heads, p_.threads, [&](std::int64_t h, int thread) {
      for (Tensor* grad : {&dwq_, &dwk_, &dwv_}) std::fill_n(grad->data() + h * d * d, d * d, 0.0f);
      std::int64_t flops = 0;
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t head = b * p_.heads + h, offset = head * n * d;
        const fixed::HeadRowsOf<T> rows = heads_.begin(t, offset, lse_.data() + head * n, thread, flops);
        const T *keys = elements<T>(k) + offset, *values = elements<T>(v) + offset;
        TilePattern tile;
        for (std::size_t i = ranges_[static_cast<std::size_t>(h)]; i < ranges_[static_cast<std::size_t>(h + 1)]; ++i) {
          const WindowGlobalTask& task = tasks_[i];
          fixed::plan_window_global(shape_, task, tile);
          flops += task.global ? global_backward(task, tile, rows, keys, values, head, thread)
                               : kernels_[static_cast<std::size_t>(thread)].backward(
                                     tile, fixed::task_grads(task, rows, d), keys, values, false);
        }
        heads_.finish(t, offset, thread);
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
      const T *keys = elements<T>(k) + head * n * d, *values = elements<T>(v) + head * n * d;
      globals_cache_.store(head, 0, keys, values, shape_.globals);
      window_cache_.store(head, first % ring_, keys + first * d, values + first * d, kept);
    }
    length_ = n;
  }

  // Token i's window: tokens i − d_h·t ≥ g for t ≤ s, as (first token, count).
  std::pair<std::int64_t, std::int64_t> step_window(std::int64_t head) const {
    const std::int64_t i = length_, g = shape_.globals, s = shape_.before;
    const std::int64_t dilation = dilations_[static_cast<std::size_t>(head % p_.heads)];
    const std::int64_t window = std::min(s, (i - g) / dilation) + 1;
    return {i - dilation * (window - 1), window};
  }

  std::int64_t window_tile(const WindowGlobalTask& task, const TilePattern& tile, const Tensor& q, const Tensor& k,
                           const Tensor& v, Tensor& out, std::int64_t b, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, head = (b * p_.heads + task.head) * n * d;
    const std::int64_t offset = fixed::first_row(task) * d, ld = fixed::row_step(task) * d;
    return kernels_[static_cast<std::size_t>(thread)].run(
        tile, elements<T>(q) + head + offset, ld, elements<T>(k) + head, elements<T>(v) + head,
        elements<T>(out) + head + offset, ld, false, lse_at(b, task), fixed::row_step(task));
  }

  float* lse_at(std::int64_t b, const WindowGlobalTask& task) {
    return lse_.empty() ? nullptr : lse_.data() + (b * p_.heads + task.head) * p_.seq_len + fixed::first_row(task);
  }

  // fp32 rows of a bf16 buffer (widened into `scratch`) or the rows themselves.
  static const float* fp32_rows(const float* x, std::int64_t, float*) { return x; }
  static const float* fp32_rows(const bf16* x, std::int64_t count, float* scratch) {
    widen(x, scratch, count);
    return scratch;
  }

  // The backward of a global tile (saved: P1 = q·Wq, q̃ = P1·Wkᵀ, A = the attention's output):
  //   dA = dO·Wvᵀ, dWv += Aᵀ·dO; δ = dA·A; attention backward of q̃ → dq̃ (and dK, dV);
  //   dP1 = dq̃·Wk, dWk += dq̃ᵀ·P1; dq = dP1·Wqᵀ, dWq += qᵀ·dP1. Returns the elementwise FLOPs (bf16:
  //   the kernel's FLOPs too). bf16 roundings: the class comment.
  std::int64_t global_backward(const WindowGlobalTask& task, const TilePattern& tile, const fixed::HeadRowsOf<T>& rows,
                               const T* k, const T* v, std::int64_t head, int thread) {
    const std::int64_t d = p_.head_dim, r = task.rows, h = task.head, first = task.start * d, g = shape_.globals;
    const T* projected = elements<T>(global_saved_) + (head * 3 * g + task.start) * d;
    const T* query = projected + g * d;
    const T* attended = query + g * d;
    float* d_attended = projection_grads_.data() + thread * 3 * tile_rows_ * d;
    float* d_query = d_attended + tile_rows_ * d;
    float* d_projected = d_query + tile_rows_ * d;
    float* wide = kBf16 ? widened_.data() + thread * 2 * tile_rows_ * d : nullptr;  // two [tile, D] rows
    const float *wq = wq_.data() + h * d * d, *wk = wk_.data() + h * d * d, *wv = wv_.data() + h * d * d;
    const float* dout = fp32_rows(rows.dout + first, r * d, wide);
    const float* attended32 = fp32_rows(attended, r * d, wide + (kBf16 ? tile_rows_ * d : 0));
    ops::gemm(false, true, r, d, d, 1.0f, dout, d, wv, d, 0.0f, d_attended, d);
    ops::gemm(true, false, d, d, r, 1.0f, attended32, d, dout, d, 1.0f, dwv_.data() + h * d * d, d);
    const T* kernel_dout = nullptr;
    if constexpr (kBf16) {  // the kernel's dO: dA rounded, and δ of the rounded rows
      bf16* rounded = rounded_grads_.bf16_data() + thread * tile_rows_ * d;
      narrow(d_attended, rounded, r * d);
      widen(rounded, d_attended, r * d);
      kernel_dout = rounded;
    } else {
      kernel_dout = d_attended;
    }
    float* delta = rows.delta + task.start;
    block_sparse::row_dots(d_attended, attended32, r, d, delta);
    auto& kernel = kernels_[static_cast<std::size_t>(thread)];
    fixed::TileGradsOf<T> grads{.q = query,
                                .dout = kernel_dout,
                                .dq = nullptr,
                                .ld = d,
                                .lse = rows.lse + task.start,
                                .delta = delta,
                                .dk = rows.dk,
                                .dv = rows.dv};
    if constexpr (!kBf16) {
      std::fill_n(d_query, r * d, 0.0f);
      grads.dq = d_query;
    }
    const std::int64_t flops = kernel.backward(tile, grads, k, v, false);
    const float* dq_tilde = d_query;
    if constexpr (kBf16) dq_tilde = kernel.dq_tile();
    ops::gemm(false, false, r, d, d, 1.0f, dq_tilde, d, wk, d, 0.0f, d_projected, d);
    ops::gemm(true, false, d, d, r, 1.0f, dq_tilde, d, fp32_rows(projected, r * d, wide), d, 1.0f,
              dwk_.data() + h * d * d, d);
    if constexpr (kBf16) {
      ops::gemm(false, true, r, d, d, 1.0f, d_projected, d, wq, d, 0.0f, d_query, d);
      narrow(d_query, rows.dq + first, r * d);
    } else {
      ops::gemm(false, true, r, d, d, 1.0f, d_projected, d, wq, d, 0.0f, rows.dq + first, d);
    }
    ops::gemm(true, false, d, d, r, 1.0f, fp32_rows(rows.q + first, r * d, wide), d, d_projected, d, 1.0f,
              dwq_.data() + h * d * d, d);
    return flops + 2 * r * d;
  }

  // Global rows: q̃ = (q·Wq)·Wkᵀ attends the plain keys/values, then the result is multiplied by Wv.
  // A training forward keeps P1 = q·Wq, q̃ and the attention's output for the backward (bf16: the
  // class comment's roundings).
  std::int64_t global_tile(const WindowGlobalTask& task, const TilePattern& tile, const Tensor& q, const Tensor& k,
                           const Tensor& v, Tensor& out, std::int64_t b, int thread) {
    const std::int64_t d = p_.head_dim, rows = task.rows, h = task.head, head = b * p_.heads + h;
    const std::int64_t g = shape_.globals, n = p_.seq_len, first = head * n * d + task.start * d;
    const float* wq = wq_.data() + h * d * d;
    const float* wk = wk_.data() + h * d * d;
    const float* wv = wv_.data() + h * d * d;
    auto& kernel = kernels_[static_cast<std::size_t>(thread)];
    const T *keys = elements<T>(k) + head * n * d, *values = elements<T>(v) + head * n * d;
    if constexpr (kBf16) {
      float* projected = projections_.data() + thread * 3 * tile_rows_ * d;
      float *query = projected + tile_rows_ * d, *attended = query + tile_rows_ * d;
      bf16* rounded = global_queries_.bf16_data() + thread * tile_rows_ * d;
      widen(q.bf16_data() + first, attended, rows * d);
      ops::gemm(false, false, rows, d, d, 1.0f, attended, d, wq, d, 0.0f, projected, d);
      ops::gemm(false, true, rows, d, d, 1.0f, projected, d, wk, d, 0.0f, query, d);
      narrow(query, rounded, rows * d);
      const std::int64_t flops = kernel.attend(tile, rounded, d, keys, values, attended, d, lse_at(b, task));
      ops::gemm(false, false, rows, d, d, 1.0f, attended, d, wv, d, 0.0f, query, d);
      narrow(query, out.bf16_data() + first, rows * d);
      if (!global_saved_.empty()) {
        bf16* saved = global_saved_.bf16_data() + (head * 3 * g + task.start) * d;
        narrow(projected, saved, rows * d);
        std::copy_n(rounded, rows * d, saved + g * d);
        narrow(attended, saved + 2 * g * d, rows * d);
      }
      return flops;
    } else {
      const bool training = !global_saved_.empty();
      const std::int64_t slot = training ? g : tile_rows_;
      float* projected = training ? global_saved_.data() + (head * 3 * g + task.start) * d
                                  : projections_.data() + thread * 3 * tile_rows_ * d;
      float* query = projected + slot * d;
      float* attended = query + slot * d;
      ops::gemm(false, false, rows, d, d, 1.0f, q.data() + first, d, wq, d, 0.0f, projected, d);
      ops::gemm(false, true, rows, d, d, 1.0f, projected, d, wk, d, 0.0f, query, d);
      const std::int64_t flops = kernel.run(tile, query, d, keys, values, attended, d, false, lse_at(b, task));
      ops::gemm(false, false, rows, d, d, 1.0f, attended, d, wv, d, 0.0f, out.data() + first, d);
      return flops;
    }
  }

  Problem p_;
  WindowGlobalShape shape_;
  std::vector<WindowGlobalTask> tasks_;
  std::int64_t tile_rows_;
  std::uint64_t seed_;
  Tensor wq_, wk_, wv_, projections_;
  Tensor global_queries_;  // bf16: per thread the rounded q̃ of a global tile
  std::vector<Kernel> kernels_;
  // Training only (prepare_backward).
  Tensor lse_, global_saved_, projection_grads_, dwq_, dwk_, dwv_;
  Tensor widened_, rounded_grads_;  // bf16: widened rows and the rounded dA, per thread
  fixed::HeadBackward<T> heads_;
  std::vector<std::size_t> ranges_;
  // Decoding only (prepare_decode).
  std::vector<std::int64_t> dilations_;   // d_h per head index
  std::int64_t ring_;                     // window ring rows, window_ring()
  KvCache globals_cache_, window_cache_;  // of T
  Tensor step_buffers_;                   // per head: the fp32 scaled query and accumulator (both dtypes)
  std::int64_t length_ = 0;
};

}  // namespace

void validate(const Problem&, const LongformerConfig& c) {
  if (c.window % 2 != 0)
    throw ParamError("longformer: window must be even (w/2 keys on each side), got " + std::to_string(c.window));
}

std::unique_ptr<Mechanism> create(const Problem& problem, const LongformerConfig& c, std::uint64_t seed) {
  if (problem.dtype == DType::BF16) return std::make_unique<Longformer<bf16>>(problem, c, seed);
  return std::make_unique<Longformer<float>>(problem, c, seed);
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
  if (p.dtype == DType::BF16) {
    const auto capacity = fixed::window_global_capacity(shape, fixed::window_global_tasks(shape, head_dilations(p, c)));
    return (3 * p.heads * p.head_dim * p.head_dim + threads * projection_floats(p, c)) * kFloatBytes +
           threads * bf16_forward_halves(p, c) * kHalfBytes +
           threads * fixed::TileAttentionBf16::bytes(capacity, p.head_dim);
  }
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
  if (p.dtype == DType::BF16) {
    const auto capacity = fixed::window_global_capacity(shape, fixed::window_global_tasks(shape, head_dilations(p, c)));
    const std::int64_t floats =
        heads * p.seq_len + threads * 3 * c.tile * d + threads * bf16_backward_floats(p, c) + 3 * p.heads * d * d;
    const std::int64_t halves = heads * 3 * shape.globals * d + threads * c.tile * d;
    return floats * kFloatBytes + halves * kHalfBytes + fixed::HeadBackward<bf16>::bytes(threads, p.seq_len, d) +
           threads * fixed::TileAttentionBf16::backward_bytes(capacity, d);
  }
  const std::int64_t scores =
      fixed::window_global_score_floats(shape, fixed::window_global_tasks(shape, head_dilations(p, c)));
  const std::int64_t floats = heads * p.seq_len + heads * 3 * shape.globals * d + threads * p.seq_len +
                              threads * 3 * c.tile * d + 3 * p.heads * d * d;
  return floats * static_cast<std::int64_t>(sizeof(float)) + threads * TileAttention::backward_bytes(scores, 0, d);
}

std::int64_t decode_workspace(const Problem& p, const LongformerConfig& c, std::int64_t) {
  const std::int64_t heads = p.batch * p.heads, d = p.head_dim;
  return KvCache::bytes(heads, c.globals, d, p.dtype) + KvCache::bytes(heads, window_ring(c), d, p.dtype) +
         heads * 2 * d * kFloatBytes;
}

FieldTable<LongformerConfig> config_fields(const LongformerConfig*) {
  return {
      int_field("window", &LongformerConfig::window, 0, 1 << 20, "sliding window w (even), tokens: w/2 on each side"),
      int_field("dilation", &LongformerConfig::dilation, 1, 1024, "gap between window keys on dilated heads, tokens"),
      int_field("dilated_heads", &LongformerConfig::dilated_heads, 0, 4096,
                "number of (last) heads using the dilation"),
      int_field("globals", &LongformerConfig::globals, 0, 1 << 20,
                "global tokens: the first g positions (clamped to N)"),
      int_field("tile", &LongformerConfig::tile, 1, 1024, "query rows per computed tile (implementation)")};
}

LongformerConfig resolve(const Problem& p, LongformerConfig c) {
  c.globals = std::min(c.globals, p.seq_len);
  return c;
}

std::string unsupported(const Problem& p, const LongformerConfig&) { return fixed::gathered_bf16_unsupported(p); }

template <>
Implementation implementation<LongformerConfig>() {
  Implementation impl = implement<LongformerConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
