#include "taxonomy/fixed_patterns/memory_compressed.hpp"

#include <algorithm>
#include <cmath>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/gathered_attention.hpp"

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
      : tokens(p.seq_len), block(std::min(c.block, p.seq_len)), compression(c.compression), tile(c.tile),
        slots((p.seq_len + c.compression - 1) / c.compression), causal(p.causal) {
    local_heads = c.mode == "local" ? p.heads : c.mode == "compressed" ? 0 : (p.heads + 1) / 2;
    compressed_heads = p.heads - local_heads;
  }
};

// One tile of query rows of one head.
struct Task {
  std::int64_t head = 0;
  std::int64_t start = 0, rows = 0;       // query rows [start, start + rows)
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
        tasks.push_back({.head = h, .start = i, .rows = std::min(l.tile, end - i), .block_begin = begin, .block_end = end});
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

class MemoryCompressed final : public Mechanism, public MemoryCompressedMemories {
 public:
  MemoryCompressed(const Problem& problem, const Layout& layout, std::uint64_t seed)
      : p_(problem), l_(layout), tasks_(tasks_of(layout, problem.heads)), seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression;
    if (hc > 0) {
      make_weights("memory-compressed/compress_wk", weights_k_, packed_k_);
      make_weights("memory-compressed/compress_wv", weights_v_, packed_v_);
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
    fixed::run_tile_tasks(p_.batch, tasks_, kernels_,
                          [&](std::int64_t b, const Task& task, TileAttention& kernel, TilePattern& tile) {
                            plan(l_, task, tile);
                            const bool local = task.head < l_.local_heads;
                            const std::int64_t memory_head = task.head - l_.local_heads;
                            const float* keys = local ? k.head(b, task.head) : memory_k_.head(b, memory_head);
                            const float* values = local ? v.head(b, task.head) : memory_v_.head(b, memory_head);
                            return kernel.run(tile, q.head(b, task.head) + task.start * d, d, keys, values,
                                              out.head(b, task.head) + task.start * d, d, false);
                          });
  }

  std::vector<NamedTensor> parameters() const override {
    if (l_.compressed_heads == 0) return {};
    return {{"compress_wk", &weights_k_}, {"compress_wv", &weights_v_}};
  }
  const Tensor& compressed_keys() const override { return memory_k_; }
  const Tensor& compressed_values() const override { return memory_v_; }

 private:
  // weights [H_c, D_out, D_in, c] from the seed; packed [H_c, c·D_in, D_out] with row u·D + i.
  void make_weights(const char* stream, Tensor& weights, Tensor& packed) const {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression;
    weights = Tensor(Shape{hc, d, d, c});
    CounterRng(seed_, stream).fill_normal(weights, 0.0f, static_cast<float>(1.0 / std::sqrt(static_cast<double>(c * d))));
    packed = Tensor(Shape{hc, c * d, d});
    for (std::int64_t h = 0; h < hc; ++h)
      for (std::int64_t o = 0; o < d; ++o)
        for (std::int64_t i = 0; i < d; ++i)
          for (std::int64_t u = 0; u < c; ++u)
            packed[(h * c * d + u * d + i) * d + o] = weights[((h * d + o) * d + i) * c + u];
  }

  // memory[b, h] = strided convolution of the compressed heads' rows of x (see header).
  void compress(const Tensor& x, const Tensor& packed, Tensor& memory) {
    const std::int64_t hc = l_.compressed_heads, d = p_.head_dim, c = l_.compression, n = p_.seq_len;
    const std::int64_t full = n / c, rest = n % c;
    for (std::int64_t b = 0; b < p_.batch; ++b) {
      const float* rows = x.head(b, l_.local_heads);
      float* slots = memory.head(b, 0);
      if (full > 0) {
        const ops::MatmulShape shape{.batch = hc, .m = full, .n = d, .k = c * d, .lda = c * d, .stride_a = n * d,
                                     .stride_c = l_.slots * d};
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

  Problem p_;
  Layout l_;
  std::vector<Task> tasks_;
  std::uint64_t seed_;
  Tensor weights_k_, weights_v_, packed_k_, packed_v_, memory_k_, memory_v_, tail_;
  std::vector<TileAttention> kernels_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const MemoryCompressedConfig& c, std::uint64_t seed) {
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
  const std::int64_t convolutions = 2 * l.compressed_heads * matmul_flops(l.slots, p.head_dim, l.compression * p.head_dim);
  return p.batch * (total + convolutions);
}

std::int64_t workspace(const Problem& p, const MemoryCompressedConfig& config) {
  const Layout l(p, config);
  const std::int64_t d = p.head_dim, c = l.compression, hc = l.compressed_heads;
  const std::int64_t floats = 4 * hc * c * d * d + 2 * p.batch * hc * l.slots * d + hc * c * d;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         p.threads * TileAttention::bytes(score_capacity(l, tasks_of(l, p.heads)), 0, d);
}

}  // namespace

Implementation memory_compressed_implementation() {
  return implement(ModelSpec<MemoryCompressedConfig>{
      .fields = {int_field("block", &MemoryCompressedConfig::block, 1, 1 << 20, "local attention block, tokens"),
                 int_field("compression", &MemoryCompressedConfig::compression, 1, 1024,
                           "convolution kernel = stride c, tokens per memory slot"),
                 choice_field("mode", &MemoryCompressedConfig::mode,
                              {{"local", "local"}, {"compressed", "compressed"}, {"split", "split"}},
                              "heads: all local, all compressed, or split (first half local)"),
                 int_field("tile", &MemoryCompressedConfig::tile, 1, 1024, "query rows per computed tile (implementation)")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, MemoryCompressedConfig c) {
        c.block = std::min(c.block, p.seq_len);
        return c;
      }});
}

}  // namespace xfb
