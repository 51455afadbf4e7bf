#include "taxonomy/fixed_patterns/memory_compressed.hpp"

#include <algorithm>
#include <cmath>

#include "lib/core/bf16.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/gathered_attention_bf16.hpp"

namespace xfb {
namespace {

using fixed::TileAttention;
using fixed::TilePattern;

// Head split and sizes shared by the mechanism, flops() and workspace().
struct Layout {
  std::int64_t tokens = 0, block = 0, compression = 0, tile = 0;
  std::int64_t local_heads = 0, compressed_heads = 0;
  std::int64_t slots = 0;  // N_c
  bool causal = false;

  Layout(const Problem& p, const MemoryCompressedConfig& c)
      : tokens(p.seq_len),
        block(std::min(c.block, p.seq_len)),
        compression(c.compression),
        tile(c.tile),
        slots((p.seq_len + c.compression - 1) / c.compression),
        causal(p.causal) {
    local_heads = c.mode == "local" ? p.heads : c.mode == "compressed" ? 0 : (p.heads + 1) / 2;
    compressed_heads = p.heads - local_heads;
  }
};

// One tile of query rows of one head.
struct Task {
  std::int64_t head = 0;
  std::int64_t start = 0, rows = 0;             // query rows [start, start + rows)
  std::int64_t block_begin = 0, block_end = 0;  // local heads: the enclosing block
};

std::vector<Task> tasks_of(const Layout& l, std::int64_t heads) {
  std::vector<Task> tasks;
  for (std::int64_t h = 0; h < heads; ++h) {
    const bool local = h < l.local_heads;
    const std::int64_t span = local ? l.block : l.tokens;
    for (std::int64_t begin = 0; begin < l.tokens; begin += span) {
      const std::int64_t end = std::min(begin + span, l.tokens);
      for (std::int64_t i = begin; i < end; i += l.tile)
        tasks.push_back(
            {.head = h, .start = i, .rows = std::min(l.tile, end - i), .block_begin = begin, .block_end = end});
    }
  }
  return tasks;
}

void plan(const Layout& l, const Task& t, TilePattern& tile) {
  tile.reset(t.rows);
  if (t.head < l.local_heads) {
    const std::size_t run = tile.add_run({.first = t.block_begin, .step = 1, .count = t.block_end - t.block_begin});
    if (l.causal)
      for (std::int64_t r = 0; r < t.rows; ++r) tile.visible(r, run) = {0, t.start + r - t.block_begin + 1};
  } else {
    const std::size_t run = tile.add_run({.first = 0, .step = 1, .count = l.slots});
    if (l.causal)
      for (std::int64_t r = 0; r < t.rows; ++r)
        tile.visible(r, run) = {0, std::min(l.slots, (t.start + r + 1) / l.compression)};
  }
}

std::int64_t score_capacity(const Layout& l, const std::vector<Task>& tasks) {
  return fixed::most_score_floats(tasks, [&](const Task& task, TilePattern& tile) { plan(l, task, tile); });
}

// Decode: the slots of N + T tokens.
std::int64_t decode_slots(const Layout& l, std::int64_t tokens) {
  return (l.tokens + tokens + l.compression - 1) / l.compression;
}

// weights [H_c, D_out, D_in, c] from the seed; packed [H_c, c·D_in, D_out] with row u·D + i.
void make_weights(const Layout& l, std::int64_t d, std::uint64_t seed, const char* stream, Tensor& weights,
                  Tensor& packed) {
  const std::int64_t hc = l.compressed_heads, c = l.compression;
  weights = Tensor(Shape{hc, d, d, c});
  CounterRng(seed, stream).fill_normal(weights, 0.0f, static_cast<float>(1.0 / std::sqrt(static_cast<double>(c * d))));
  packed = Tensor(Shape{hc, c * d, d});
  for (std::int64_t h = 0; h < hc; ++h)
    for (std::int64_t o = 0; o < d; ++o)
      for (std::int64_t i = 0; i < d; ++i)
        for (std::int64_t u = 0; u < c; ++u)
          packed[(h * c * d + u * d + i) * d + o] = weights[((h * d + o) * d + i) * c + u];
}

// d weights [H_c, D_out, D_in, c] from the packed gradients [2, H_c, c·D_in, D_out] (make_weights' layout).
void unpack_weight_grads(const Layout& l, std::int64_t d, const Tensor& packed_grads, Tensor& dweights_k,
                         Tensor& dweights_v) {
  const std::int64_t hc = l.compressed_heads, c = l.compression;
  for (int which = 0; which < 2; ++which) {
    Tensor& grads = which == 0 ? dweights_k : dweights_v;
    const float* packed = packed_grads.data() + which * hc * c * d * d;
    for (std::int64_t h = 0; h < hc; ++h)
      for (std::int64_t o = 0; o < d; ++o)
        for (std::int64_t i = 0; i < d; ++i)
          for (std::int64_t u = 0; u < c; ++u)
            grads[((h * d + o) * d + i) * c + u] = packed[(h * c * d + u * d + i) * d + o];
  }
}

// What both forms share: the layout and tasks, the weights (fp32), the compressed memories and the
// decode caches (both of the problem's element type), and what only reads or fills those.
class MemoryCompressedShared : public Mechanism, public MemoryCompressedMemories {
 public:
  MemoryCompressedShared(const Problem& problem, const Layout& layout, std::uint64_t seed)
      : p_(problem), l_(layout), tasks_(tasks_of(layout, problem.heads)), seed_(seed) {}

  std::vector<NamedTensor> parameters() const override {
    if (l_.compressed_heads == 0) return {};
    return {{"compress_wk", &weights_k_}, {"compress_wv", &weights_v_}};
  }
  std::vector<NamedTensor> decode_state() const override {
    return {{"local_keys", &local_cache_.key_tensor()}, {"local_values", &local_cache_.value_tensor()},
            {"slot_keys", &slot_cache_.key_tensor()},   {"slot_values", &slot_cache_.value_tensor()},
            {"open_keys", &open_window_.key_tensor()},  {"open_values", &open_window_.value_tensor()}};
  }
  const Tensor& compressed_keys() const override { return memory_k_; }
  const Tensor& compressed_values() const override { return memory_v_; }
  std::vector<NamedTensor> saved() const override {
    if (l_.compressed_heads == 0) return {{"log_sum_exp", &lse_}};
    return {{"log_sum_exp", &lse_}, {"compressed_keys", &memory_k_}, {"compressed_values", &memory_v_}};
  }
  std::vector<NamedTensor> parameter_gradients() const override {
    if (l_.compressed_heads == 0) return {};
    return {{"dcompress_wk", &dweights_k_}, {"dcompress_wv", &dweights_v_}};
  }

 protected:
  // Decode: local heads a ring of their block; compressed heads the slots completed so far
  // ([⌈(N+T)/c⌉, D] keys and values) and the open window's raw rows ([c, D]), compressed into the
  // next slot when its last token arrives. A token sees the slots that end at or before it. The
  // caches hold the problem's element type; the step's buffers (scaled query, accumulator) fp32.
  void prepare_caches(std::int64_t tokens) {
    const std::int64_t d = p_.head_dim, c = l_.compression, compressed = p_.batch * l_.compressed_heads;
    local_cache_ = KvCache(p_.batch * l_.local_heads, l_.block, d, p_.dtype);
    slot_cache_ = KvCache(compressed, decode_slots(l_, tokens), d, p_.dtype);
    open_window_ = KvCache(compressed, c, d, p_.dtype);
    step_buffers_ = Tensor(Shape{p_.batch * p_.heads, 2, d});
  }

  // The training tensors both forms keep (the members below).
  void prepare_shared_backward() {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression;
    lse_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
    ranges_ = fixed::task_ranges_by_head(tasks_, p_.heads);
    if (hc == 0) return;
    memory_grads_ = Tensor(Shape{p_.threads, 2, l_.slots, d});
    packed_grads_ = Tensor(Shape{2, hc, c * d, d});
    dweights_k_ = Tensor(weights_k_.shape());
    dweights_v_ = Tensor(weights_v_.shape());
  }

  // The prefill's part of a decode: local heads keep their context's last block rows, compressed
  // heads the completed slots and the open window's rows.
  void load_decode_context(const Tensor& k, const Tensor& v) {
    if (p_.dtype == DType::BF16) return load_context_rows<bf16>(k, v);
    load_context_rows<float>(k, v);
  }

  Problem p_;
  Layout l_;
  std::vector<Task> tasks_;
  std::uint64_t seed_;
  Tensor weights_k_, weights_v_, packed_k_, packed_v_, memory_k_, memory_v_;
  // Decoding only (prepare_caches).
  KvCache local_cache_, slot_cache_, open_window_;
  Tensor step_buffers_;  // per head the scaled query and the accumulator
  std::int64_t length_ = 0;
  // Training only (prepare_backward): the log-sum-exp [B·H, N], dK̂ and dV̂ per thread
  // [threads, 2, N_c, D], the packed weight gradients [2, H_c, c·D, D] and the weights' (fp32).
  Tensor lse_, memory_grads_, packed_grads_, dweights_k_, dweights_v_;
  std::vector<std::size_t> ranges_;  // tasks of each head

 private:
  template <class T>
  void load_context_rows(const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, c = l_.compression, done = n / c;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      const std::int64_t b = head / p_.heads, h = head % p_.heads;
      const T *keys = elements<T>(k) + head * n * d, *values = elements<T>(v) + head * n * d;
      if (h < l_.local_heads) {
        const std::int64_t kept = std::min(n, l_.block), first = n - kept;
        local_cache_.store(b * l_.local_heads + h, first % l_.block, keys + first * d, values + first * d, kept);
      } else {
        const std::int64_t hc = h - l_.local_heads, index = b * l_.compressed_heads + hc;
        const std::int64_t memory_at = index * l_.slots * d;
        slot_cache_.store(index, 0, elements<T>(memory_k_) + memory_at, elements<T>(memory_v_) + memory_at, done);
        open_window_.store(index, 0, keys + done * c * d, values + done * c * d, n - done * c);
      }
    }
    length_ = n;
  }
};

class MemoryCompressed final : public MemoryCompressedShared {
 public:
  MemoryCompressed(const Problem& problem, const Layout& layout, std::uint64_t seed)
      : MemoryCompressedShared(problem, layout, seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression;
    if (hc > 0) {
      make_weights(l_, d, seed_, "memory-compressed/compress_wk", weights_k_, packed_k_);
      make_weights(l_, d, seed_, "memory-compressed/compress_wv", weights_v_, packed_v_);
      memory_k_ = Tensor::bhnd(p_.batch, hc, l_.slots, d);
      memory_v_ = Tensor::bhnd(p_.batch, hc, l_.slots, d);
      tail_ = Tensor(Shape{hc, c * d});
    }
    const std::int64_t scores = score_capacity(l_, tasks_);
    kernels_.clear();
    for (std::int64_t t = 0; t < p_.threads; ++t) kernels_.emplace_back(scores, 0, d);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (l_.compressed_heads > 0) {
      compress(k, packed_k_, memory_k_);
      compress(v, packed_v_, memory_v_);
    }
    const std::int64_t d = p_.head_dim;
    fixed::run_tile_tasks(
        p_.batch, tasks_, kernels_, [&](std::int64_t b, const Task& task, TileAttention& kernel, TilePattern& tile) {
          plan(l_, task, tile);
          const bool local = task.head < l_.local_heads;
          const std::int64_t memory_head = task.head - l_.local_heads;
          const float* keys = local ? k.head(b, task.head) : memory_k_.head(b, memory_head);
          const float* values = local ? v.head(b, task.head) : memory_v_.head(b, memory_head);
          float* lse = lse_.empty() ? nullptr : lse_.data() + (b * p_.heads + task.head) * p_.seq_len + task.start;
          return kernel.run(tile, q.head(b, task.head) + task.start * d, d, keys, values,
                            out.head(b, task.head) + task.start * d, d, false, lse);
        });
    if (!step_buffers_.empty()) load_decode_context(k, v);
  }

  void prepare_backward() override {
    for (auto& kernel : kernels_) kernel.enable_backward();
    prepare_shared_backward();
    deltas_ = Tensor(Shape{p_.threads, p_.seq_len});
    if (l_.compressed_heads > 0) tail_rows_ = Tensor(Shape{p_.threads, l_.compression * p_.head_dim});
  }

  // One task per head index h (batch entries in turn): the convolution weights' gradients of a
  // compressed head sum over the batch, and a head's tiles write overlapping dK, dV rows.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    if (!packed_grads_.empty()) packed_grads_.fill(0.0f);
    block_sparse::run_heads(p_.heads, p_.threads, [&](std::int64_t h, int thread) {
      std::int64_t flops = 0;
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t head = b * p_.heads + h, offset = head * n * d;
        float* delta = deltas_.data() + thread * n;
        block_sparse::HeadGrads g{.out = out.data() + offset,
                                  .dout = dout.data() + offset,
                                  .delta = delta,
                                  .dq = dq.data() + offset,
                                  .dk = dk.data() + offset,
                                  .dv = dv.data() + offset,
                                  .d = d};
        const bool local = h < l_.local_heads;
        const float* keys = local ? k.data() + offset : memory_k_.head(b, h - l_.local_heads);
        const float* values = local ? v.data() + offset : memory_v_.head(b, h - l_.local_heads);
        float* key_grads = local ? g.dk : memory_grads_.data() + thread * 2 * l_.slots * d;
        float* value_grads = local ? g.dv : key_grads + l_.slots * d;
        flops += block_sparse::begin_head(g, n, n);
        if (!local) std::fill_n(key_grads, 2 * l_.slots * d, 0.0f);
        TilePattern tile;
        for (std::size_t t = ranges_[static_cast<std::size_t>(h)]; t < ranges_[static_cast<std::size_t>(h + 1)]; ++t) {
          const Task& task = tasks_[t];
          plan(l_, task, tile);
          const fixed::TileGrads grads{.q = q.data() + offset + task.start * d,
                                       .dout = g.dout + task.start * d,
                                       .dq = g.dq + task.start * d,
                                       .ld = d,
                                       .lse = lse_.data() + head * n + task.start,
                                       .delta = delta + task.start,
                                       .dk = key_grads,
                                       .dv = value_grads};
          flops += kernels_[static_cast<std::size_t>(thread)].backward(tile, grads, keys, values, false);
        }
        if (!local) {
          compress_backward(k.data() + offset, key_grads, h - l_.local_heads, 0, g.dk, thread);
          compress_backward(v.data() + offset, value_grads, h - l_.local_heads, 1, g.dv, thread);
        }
      }
      return flops;
    });
    unpack_weight_grads(l_, d, packed_grads_, dweights_k_, dweights_v_);
  }

  void prepare_decode(std::int64_t tokens) override { prepare_caches(tokens); }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, i = length_;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      const std::int64_t b = head / p_.heads, h = head % p_.heads;
      const float *key = k.data() + head * d, *value = v.data() + head * d;
      if (h < l_.local_heads) {
        const std::int64_t index = b * l_.local_heads + h, block = l_.block, first = i / block * block;
        local_cache_.store(index, i % block, key, value, 1);
        return attend_ring(row, query, local_cache_.keys(index), local_cache_.values(index), block, first,
                           i - first + 1);
      }
      const std::int64_t index = b * l_.compressed_heads + h - l_.local_heads;
      return append_compressed(index, h - l_.local_heads, i, key, value) +
             attend_rows(row, query, slot_cache_.keys(index), slot_cache_.values(index), (i + 1) / l_.compression);
    });
    ++length_;
  }

 private:
  // The convolution's backward for one compressed head hc of one batch entry: x [N, D] its input
  // rows, memory_grads [N_c, D] the gradient of its output. Writes dx [N, D] (every row of a
  // compressed head is in exactly one window) and adds Xᵀ·d(memory) to the packed weight gradient.
  void compress_backward(const float* x, const float* memory_grads, std::int64_t hc, int which, float* dx, int thread) {
    const std::int64_t d = p_.head_dim, c = l_.compression, n = p_.seq_len, full = n / c, rest = n % c;
    const float* packed = (which == 0 ? packed_k_ : packed_v_).data() + hc * c * d * d;
    float* packed_grad = packed_grads_.data() + (which * l_.compressed_heads + hc) * c * d * d;
    if (full > 0) {
      ops::gemm(false, true, full, c * d, d, 1.0f, memory_grads, d, packed, d, 0.0f, dx, c * d);
      ops::gemm(true, false, c * d, d, full, 1.0f, x, c * d, memory_grads, d, 1.0f, packed_grad, d);
    }
    if (rest > 0) {
      float* tail = tail_rows_.data() + thread * c * d;
      ops::gemm(false, true, 1, c * d, d, 1.0f, memory_grads + full * d, d, packed, d, 0.0f, tail, c * d);
      std::copy_n(tail, rest * d, dx + full * c * d);
      std::fill_n(tail, c * d, 0.0f);
      std::copy_n(x + full * c * d, rest * d, tail);  // the zero-padded last window
      ops::gemm(true, false, c * d, d, 1, 1.0f, tail, c * d, memory_grads + full * d, d, 1.0f, packed_grad, d);
    }
  }

  // Token i's raw key and value join the open window of compressed head (index, hc); the token that
  // completes it turns the window into slot i / c (one row of c·D times the packed weights, for K
  // and V). Returns the FLOPs outside ops::gemm (none).
  std::int64_t append_compressed(std::int64_t index, std::int64_t hc, std::int64_t i, const float* key,
                                 const float* value) {
    const std::int64_t d = p_.head_dim, c = l_.compression;
    open_window_.store(index, i % c, key, value, 1);
    if ((i + 1) % c != 0) return 0;
    const std::int64_t slot = i / c;
    ops::gemm(false, false, 1, d, c * d, 1.0f, open_window_.keys(index), c * d, packed_k_.data() + hc * c * d * d, d,
              0.0f, slot_cache_.keys(index) + slot * d, d);
    ops::gemm(false, false, 1, d, c * d, 1.0f, open_window_.values(index), c * d, packed_v_.data() + hc * c * d * d, d,
              0.0f, slot_cache_.values(index) + slot * d, d);
    return 0;
  }

  // memory[b, h] = strided convolution of the compressed heads' rows of x (see header).
  void compress(const Tensor& x, const Tensor& packed, Tensor& memory) {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression, n = p_.seq_len;
    const std::int64_t full = n / c, rest = n % c;
    for (std::int64_t b = 0; b < p_.batch; ++b) {
      const float* rows = x.head(b, l_.local_heads);
      float* slots = memory.head(b, 0);
      if (full > 0) {
        const ops::MatmulShape shape{
            .batch = hc, .m = full, .n = d, .k = c * d, .lda = c * d, .stride_a = n * d, .stride_c = l_.slots * d};
        ops::matmul(shape, rows, packed.data(), slots);
      }
      if (rest > 0) {
        for (std::int64_t h = 0; h < hc; ++h)
          std::copy_n(rows + h * n * d + full * c * d, rest * d, tail_.data() + h * c * d);
        const ops::MatmulShape shape{.batch = hc, .m = 1, .n = d, .k = c * d, .stride_c = l_.slots * d};
        ops::matmul(shape, tail_.data(), packed.data(), slots + full * d);
      }
    }
  }

  Tensor tail_;
  std::vector<TileAttention> kernels_;
  // Training only (prepare_backward).
  Tensor deltas_, tail_rows_;
};

// One slot of the bf16 form's compression: slot[o] = Σ_{u<c, i<D} packed[u·D + i, o]·x[u·D + i] over
// the window's `rows` bf16 rows (x: [rows, D]; the rows past them read as 0), summed in fp32 in that
// order and rounded once. The same loop in the forward and in decoding, so both compute one slot
// bit for bit. Counts no FLOPs (callers count 2·c·D·D per slot, the fp32 form's product).
void compress_slot(const bf16* x, std::int64_t rows, const float* packed, std::int64_t d, float* sum, bf16* slot) {
  std::fill_n(sum, d, 0.0f);
  for (std::int64_t e = 0; e < rows * d; ++e) {
    const float value = to_float(x[e]);
    const float* weights = packed + e * d;
#pragma omp simd
    for (std::int64_t o = 0; o < d; ++o) sum[o] += value * weights[o];
  }
  narrow(sum, slot, d);
}

// Slots per chunk of the bf16 backward's widened convolution input (compress_backward_bf16).
constexpr std::int64_t kWidenedSlots = 256;
// Windows the bf16 backward widens at once: a chunk of the full ones, or the padded last one alone.
std::int64_t widened_slots(const Layout& l) {
  return std::max<std::int64_t>(std::min(kWidenedSlots, l.tokens / l.compression), 1);
}

// The bf16 form (header): K̂, V̂ = bf16 slots of compress_slot; the tiles on the bf16 gathered kernel;
// decoding on bf16 caches (decode_common's bf16 rows); the backward as the fp32 form's on the bf16
// kernel's backward, the convolution's in fp32 on widened rows.
class MemoryCompressedBf16 final : public MemoryCompressedShared {
 public:
  MemoryCompressedBf16(const Problem& problem, const Layout& layout, std::uint64_t seed)
      : MemoryCompressedShared(problem, layout, seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim;
    if (hc > 0) {
      make_weights(l_, d, seed_, "memory-compressed/compress_wk", weights_k_, packed_k_);
      make_weights(l_, d, seed_, "memory-compressed/compress_wv", weights_v_, packed_v_);
      memory_k_ = Tensor::bhnd(p_.batch, hc, l_.slots, d, DType::BF16);
      memory_v_ = Tensor::bhnd(p_.batch, hc, l_.slots, d, DType::BF16);
      sums_ = Tensor(Shape{p_.threads, d});
    }
    const fixed::TileCapacity capacity =
        fixed::most_tile_capacity(tasks_, [&](const Task& task, TilePattern& tile) { plan(l_, task, tile); });
    kernels_.clear();
    for (std::int64_t t = 0; t < p_.threads; ++t) kernels_.emplace_back(capacity, d);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (l_.compressed_heads > 0) compress(k, v);
    const std::int64_t d = p_.head_dim, n = p_.seq_len;
    fixed::run_tile_tasks(
        p_.batch, tasks_, kernels_,
        [&](std::int64_t b, const Task& task, fixed::TileAttentionBf16& kernel, TilePattern& tile) {
          plan(l_, task, tile);
          const std::int64_t head = b * p_.heads + task.head;
          const bool local = task.head < l_.local_heads;
          const std::int64_t memory_at = (b * l_.compressed_heads + task.head - l_.local_heads) * l_.slots * d;
          const bf16* keys = local ? k.bf16_data() + head * n * d : memory_k_.bf16_data() + memory_at;
          const bf16* values = local ? v.bf16_data() + head * n * d : memory_v_.bf16_data() + memory_at;
          const std::int64_t rows = head * n * d + task.start * d;
          float* lse = lse_.empty() ? nullptr : lse_.data() + head * n + task.start;
          return kernel.attend(tile, q.bf16_data() + rows, d, keys, values, out.bf16_data() + rows, d, lse);
        });
    if (!step_buffers_.empty()) load_decode_context(k, v);
  }

  void prepare_backward() override {
    for (auto& kernel : kernels_) kernel.enable_backward();
    prepare_shared_backward();
    heads_ = fixed::HeadBackward<bf16>(p_.threads, p_.seq_len, p_.head_dim);
    if (l_.compressed_heads > 0) widened_ = Tensor(Shape{p_.threads, widened_slots(l_) * l_.compression * p_.head_dim});
  }

  // As the fp32 form: one task per head index h (batch entries in turn). δ = dO·out in fp32 from the
  // bf16 rows; a head's dK, dV accumulate in fp32 (local heads: the tiles; compressed heads: the
  // convolution's input gradient from the fp32 dK̂, dV̂) and are rounded once; dq rounded per tile.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const block_sparse::BackwardTensors t{q, k, v, out, dout, dq, dk, dv};
    if (!packed_grads_.empty()) packed_grads_.fill(0.0f);
    block_sparse::run_heads(p_.heads, p_.threads, [&](std::int64_t h, int thread) {
      std::int64_t flops = 0;
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t head = b * p_.heads + h, offset = head * n * d;
        const fixed::HeadRowsOf<bf16> rows = heads_.begin(t, offset, lse_.data() + head * n, thread, flops);
        const bool local = h < l_.local_heads;
        const std::int64_t memory_at = (b * l_.compressed_heads + h - l_.local_heads) * l_.slots * d;
        const bf16* keys = local ? k.bf16_data() + offset : memory_k_.bf16_data() + memory_at;
        const bf16* values = local ? v.bf16_data() + offset : memory_v_.bf16_data() + memory_at;
        float* key_grads = local ? rows.dk : memory_grads_.data() + thread * 2 * l_.slots * d;
        float* value_grads = local ? rows.dv : key_grads + l_.slots * d;
        if (!local) std::fill_n(key_grads, 2 * l_.slots * d, 0.0f);
        TilePattern tile;
        for (std::size_t i = ranges_[static_cast<std::size_t>(h)]; i < ranges_[static_cast<std::size_t>(h + 1)]; ++i) {
          const Task& task = tasks_[i];
          plan(l_, task, tile);
          fixed::TileGradsOf<bf16> grads = fixed::rows_grads(rows, task.start, 1, d);
          grads.dk = key_grads;
          grads.dv = value_grads;
          flops += kernels_[static_cast<std::size_t>(thread)].backward(tile, grads, keys, values, false);
        }
        if (!local) {
          compress_backward_bf16(k.bf16_data() + offset, key_grads, h - l_.local_heads, 0, rows.dk, thread);
          compress_backward_bf16(v.bf16_data() + offset, value_grads, h - l_.local_heads, 1, rows.dv, thread);
        }
        heads_.finish(t, offset, thread);
      }
      return flops;
    });
    unpack_weight_grads(l_, d, packed_grads_, dweights_k_, dweights_v_);
  }

  void prepare_decode(std::int64_t tokens) override {
    prepare_caches(tokens);
    step_sums_ = Tensor(Shape{p_.batch * p_.heads, p_.head_dim});
  }

  // As the fp32 step, on bf16 rows (attend_rows rounds P as the forward's tiles do).
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t d = p_.head_dim, i = length_, c = l_.compression;
    attend_every_head(q, out, step_buffers_, p_.threads, [&](std::int64_t head, RowSoftmax& row, const float* query) {
      const std::int64_t b = head / p_.heads, h = head % p_.heads;
      const bf16 *key = k.bf16_data() + head * d, *value = v.bf16_data() + head * d;
      if (h < l_.local_heads) {
        const std::int64_t index = b * l_.local_heads + h, block = l_.block, first = i / block * block;
        local_cache_.store(index, i % block, key, value, 1);
        return attend_ring(row, query, local_cache_.keys<bf16>(index), local_cache_.values<bf16>(index), block, first,
                           i - first + 1);
      }
      const std::int64_t hc = h - l_.local_heads, index = b * l_.compressed_heads + hc;
      open_window_.store(index, i % c, key, value, 1);
      std::int64_t flops = 0;
      if ((i + 1) % c == 0) {
        float* sum = step_sums_.data() + head * d;
        compress_slot(open_window_.keys<bf16>(index), c, packed_k_.data() + hc * c * d * d, d, sum,
                      slot_cache_.keys<bf16>(index) + i / c * d);
        compress_slot(open_window_.values<bf16>(index), c, packed_v_.data() + hc * c * d * d, d, sum,
                      slot_cache_.values<bf16>(index) + i / c * d);
        flops += 2 * matmul_flops(1, d, c * d);
      }
      return flops +
             attend_rows(row, query, slot_cache_.keys<bf16>(index), slot_cache_.values<bf16>(index), (i + 1) / c);
    });
    ++length_;
  }

 private:
  // K̂, V̂ of every compressed head: each slot by compress_slot; 2·2·N_c·c·D·D FLOPs per head.
  void compress(const Tensor& k, const Tensor& v) {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression, n = p_.seq_len;
    const std::int64_t heads = p_.batch * hc, slots = l_.slots;
#pragma omp parallel for num_threads(p_.threads) schedule(static) collapse(2)
    for (std::int64_t head = 0; head < heads; ++head)
      for (std::int64_t t = 0; t < slots; ++t) {
        const std::int64_t b = head / hc, h = head % hc, rows = std::min(c, n - t * c);
        const std::int64_t from = ((b * p_.heads + l_.local_heads + h) * n + t * c) * d, to = (head * slots + t) * d;
        float* sum = sums_.data() + omp_get_thread_num() * d;
        compress_slot(k.bf16_data() + from, rows, packed_k_.data() + h * c * d * d, d, sum, memory_k_.bf16_data() + to);
        compress_slot(v.bf16_data() + from, rows, packed_v_.data() + h * c * d * d, d, sum, memory_v_.bf16_data() + to);
      }
    FlopCounter::add(heads * 2 * matmul_flops(slots, d, c * d));
  }

  // The convolution's backward for one compressed head hc of one batch entry, as the fp32 form's
  // compress_backward: x [N, D] its bf16 input rows, memory_grads [N_c, D] the fp32 gradient of its
  // slots. Writes dx [N, D] (fp32: the head's accumulator) and adds Xᵀ·d(memory) to the packed weight
  // gradient, X widened kWidenedSlots windows at a time (the zero-padded last window on its own).
  void compress_backward_bf16(const bf16* x, const float* memory_grads, std::int64_t hc, int which, float* dx,
                              int thread) {
    const std::int64_t d = p_.head_dim, c = l_.compression, n = p_.seq_len, full = n / c, rest = n % c;
    const float* packed = (which == 0 ? packed_k_ : packed_v_).data() + hc * c * d * d;
    float* packed_grad = packed_grads_.data() + (which * l_.compressed_heads + hc) * c * d * d;
    float* rows = widened_.data() + thread * widened_slots(l_) * c * d;
    if (full > 0) ops::gemm(false, true, full, c * d, d, 1.0f, memory_grads, d, packed, d, 0.0f, dx, c * d);
    for (std::int64_t first = 0; first < full; first += kWidenedSlots) {
      const std::int64_t slots = std::min(kWidenedSlots, full - first);
      widen(x + first * c * d, rows, slots * c * d);
      ops::gemm(true, false, c * d, d, slots, 1.0f, rows, c * d, memory_grads + first * d, d, 1.0f, packed_grad, d);
    }
    if (rest > 0) {
      ops::gemm(false, true, 1, c * d, d, 1.0f, memory_grads + full * d, d, packed, d, 0.0f, rows, c * d);
      std::copy_n(rows, rest * d, dx + full * c * d);
      std::fill_n(rows, c * d, 0.0f);
      widen(x + full * c * d, rows, rest * d);  // the zero-padded last window
      ops::gemm(true, false, c * d, d, 1, 1.0f, rows, c * d, memory_grads + full * d, d, 1.0f, packed_grad, d);
    }
  }

  Tensor sums_;  // [threads, D] a slot's fp32 sums in the forward
  std::vector<fixed::TileAttentionBf16> kernels_;
  Tensor step_sums_;  // decoding: per head a slot's fp32 sums
  // Training only (prepare_backward): widened input windows per thread [threads, widened_slots·c·D].
  Tensor widened_;
  fixed::HeadBackward<bf16> heads_;
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const MemoryCompressedConfig& c, std::uint64_t seed) {
  if (problem.dtype == DType::BF16) return std::make_unique<MemoryCompressedBf16>(problem, Layout(problem, c), seed);
  return std::make_unique<MemoryCompressed>(problem, Layout(problem, c), seed);
}

std::int64_t flops(const Problem& p, const MemoryCompressedConfig& c) {
  const Layout l(p, c);
  TilePattern tile;
  std::int64_t total = 0;
  for (const auto& task : tasks_of(l, p.heads)) {
    plan(l, task, tile);
    total += fixed::tile_flops(tile, p.head_dim);
  }
  const std::int64_t convolutions =
      2 * l.compressed_heads * matmul_flops(l.slots, p.head_dim, l.compression * p.head_dim);
  return p.batch * (total + convolutions);
}

std::int64_t workspace(const Problem& p, const MemoryCompressedConfig& config) {
  const Layout l(p, config);
  const std::int64_t d = p.head_dim, c = l.compression, hc = l.compressed_heads;
  if (p.dtype == DType::BF16) {  // weights and packed copies fp32, K̂ V̂ bf16, the slot sums per thread
    const std::int64_t floats = 4 * hc * c * d * d + (hc > 0 ? p.threads * d : 0),
                       halves = 2 * p.batch * hc * l.slots * d;
    const auto capacity = fixed::most_tile_capacity(tasks_of(l, p.heads),
                                                    [&](const Task& task, TilePattern& tile) { plan(l, task, tile); });
    return floats * static_cast<std::int64_t>(sizeof(float)) + halves * static_cast<std::int64_t>(sizeof(bf16)) +
           p.threads * fixed::TileAttentionBf16::bytes(capacity, d);
  }
  const std::int64_t floats = 4 * hc * c * d * d + 2 * p.batch * hc * l.slots * d + hc * c * d;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         p.threads * TileAttention::bytes(score_capacity(l, tasks_of(l, p.heads)), 0, d);
}

std::int64_t backward_flops(const Problem& p, const MemoryCompressedConfig& c) {
  const Layout l(p, c);
  const std::int64_t d = p.head_dim;
  TilePattern tile;
  std::int64_t total = 2 * p.heads * p.seq_len * d;  // δ
  for (const auto& task : tasks_of(l, p.heads)) {
    plan(l, task, tile);
    total += fixed::tile_backward_flops(tile, d, false);
  }
  // Per compressed head, for K and V: d(input) = d(memory)·packedᵀ and d(packed) += Xᵀ·d(memory).
  const std::int64_t convolutions = 2 * l.compressed_heads * 2 * matmul_flops(l.slots, l.compression * d, d);
  return p.batch * (total + convolutions);
}

std::int64_t backward_workspace(const Problem& p, const MemoryCompressedConfig& config) {
  const Layout l(p, config);
  const std::int64_t d = p.head_dim, c = l.compression, hc = l.compressed_heads, threads = p.threads;
  if (p.dtype == DType::BF16) {
    std::int64_t floats = p.batch * p.heads * p.seq_len;
    if (hc > 0) floats += threads * 2 * l.slots * d + threads * widened_slots(l) * c * d + 4 * hc * c * d * d;
    const auto capacity = fixed::most_tile_capacity(tasks_of(l, p.heads),
                                                    [&](const Task& task, TilePattern& tile) { plan(l, task, tile); });
    return floats * static_cast<std::int64_t>(sizeof(float)) + fixed::HeadBackward<bf16>::bytes(threads, p.seq_len, d) +
           threads * fixed::TileAttentionBf16::backward_bytes(capacity, d);
  }
  std::int64_t floats = p.batch * p.heads * p.seq_len + threads * p.seq_len;
  if (hc > 0) floats += threads * 2 * l.slots * d + threads * c * d + 2 * hc * c * d * d + 2 * hc * d * d * c;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         threads * TileAttention::backward_bytes(score_capacity(l, tasks_of(l, p.heads)), 0, d);
}

std::int64_t decode_workspace(const Problem& p, const MemoryCompressedConfig& c, std::int64_t tokens) {
  const Layout l(p, c);
  const std::int64_t d = p.head_dim, compressed = p.batch * l.compressed_heads;
  const std::int64_t step_floats = p.batch * p.heads * (p.dtype == DType::BF16 ? 3 : 2) * d;  // bf16: + slot sums
  return KvCache::bytes(p.batch * l.local_heads, l.block, d, p.dtype) +
         KvCache::bytes(compressed, decode_slots(l, tokens), d, p.dtype) +
         KvCache::bytes(compressed, l.compression, d, p.dtype) + step_floats * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<MemoryCompressedConfig> config_fields(const MemoryCompressedConfig*) {
  return {
      int_field("block", &MemoryCompressedConfig::block, 1, 1 << 20, "local attention block, tokens (clamped to N)"),
      int_field("compression", &MemoryCompressedConfig::compression, 1, 1024,
                "convolution kernel = stride c, tokens per memory slot"),
      choice_field("mode", &MemoryCompressedConfig::mode,
                   {{"local", "local"}, {"compressed", "compressed"}, {"split", "split"}},
                   "heads: all local, all compressed, or split (first half local)"),
      int_field("tile", &MemoryCompressedConfig::tile, 1, 1024, "query rows per computed tile (implementation)")};
}

MemoryCompressedConfig resolve(const Problem& p, MemoryCompressedConfig c) {
  c.block = std::min(c.block, p.seq_len);
  return c;
}

std::string unsupported(const Problem& p, const MemoryCompressedConfig& c) {
  if (c.mode == "split" && p.heads < 2)  // the one head would be local: no compressed attention at all
    return "mode=split gives half the heads local and half compressed attention: with --heads 1 only local "
           "attention would run; give --heads 2 or more, or --param mode=compressed (or mode=local)";
  return fixed::gathered_bf16_unsupported(p);
}

template <>
Implementation implementation<MemoryCompressedConfig>() {
  Implementation impl = implement<MemoryCompressedConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
