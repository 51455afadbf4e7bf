#include "taxonomy/fixed_patterns/bigbird.hpp"

#include <omp.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/gathered_attention.hpp"
#include "taxonomy/engines/gathered_attention_bf16.hpp"

namespace xfb {
namespace {

using fixed::TileAttention;
using fixed::TilePattern;

// Block geometry of one head: which blocks are global, each block's window and candidates.
struct BlockLayout {
  std::int64_t tokens = 0, block = 0, blocks = 0;
  std::int64_t front = 0, back = 0;    // global blocks at the start and at the end
  std::int64_t before = 0, after = 0;  // window reach in blocks
  std::int64_t random = 0;             // r

  BlockLayout(const Problem& p, const BigBirdConfig& c)
      : tokens(p.seq_len),
        block(c.block),
        blocks((p.seq_len + c.block - 1) / c.block),
        front((c.global_blocks + 1) / 2),
        back(c.global_blocks / 2),
        before((c.window_blocks - 1) / 2),
        after(c.window_blocks / 2),
        random(c.random_blocks) {
    if (front + back >= blocks) {
      front = blocks;
      back = 0;
    }
  }

  std::int64_t begin(std::int64_t blk) const { return blk * block; }
  std::int64_t end(std::int64_t blk) const { return std::min((blk + 1) * block, tokens); }
  bool global(std::int64_t blk) const { return blk < front || blk >= blocks - back; }
  // Window blocks [first, last) of a non-global query block.
  std::pair<std::int64_t, std::int64_t> window(std::int64_t qb) const {
    return {std::max(qb - before, front), std::min(qb + after, blocks - back - 1) + 1};
  }
  // The candidates for a non-global query block's random blocks are the non-global, full blocks
  // outside its window, ascending: [front, first) then [last, blocks − back), less a partial last
  // block. Their count and the i-th of them in O(1), without listing them (a list per block made
  // planning O(blocks²)).
  std::int64_t candidate_count(std::int64_t qb) const {
    const auto [first, last] = window(qb);
    const bool partial_last = tokens % block != 0 && back == 0 && blocks - 1 >= last;
    return (first - front) + (blocks - back - last) - (partial_last ? 1 : 0);
  }
  std::int64_t candidate(std::int64_t qb, std::int64_t i) const {
    const auto [first, last] = window(qb);
    return i < first - front ? front + i : last + (i - (first - front));
  }
  std::int64_t random_count(std::int64_t qb) const { return global(qb) ? 0 : std::min(random, candidate_count(qb)); }
};

// Key runs of query block qb; `chosen` are its random blocks in ascending order.
void plan_block(const BlockLayout& layout, std::int64_t qb, const std::vector<std::int64_t>& chosen,
                TilePattern& tile) {
  tile.reset(layout.end(qb) - layout.begin(qb));
  if (layout.global(qb)) {
    tile.add_run({.first = 0, .step = 1, .count = layout.tokens});
    return;
  }
  auto add_blocks = [&](std::int64_t first, std::int64_t last) {
    if (last > first)
      tile.add_run({.first = layout.begin(first), .step = 1, .count = layout.end(last - 1) - layout.begin(first)});
  };
  const auto [first, last] = layout.window(qb);
  add_blocks(0, layout.front);
  for (std::int64_t blk : chosen)
    if (blk < first) add_blocks(blk, blk + 1);
  add_blocks(first, last);
  for (std::int64_t blk : chosen)
    if (blk >= last) add_blocks(blk, blk + 1);
  add_blocks(layout.blocks - layout.back, layout.blocks);
}

// The first r candidates: a stand-in draw with the same FLOPs and buffer sizes as any real one.
std::vector<std::int64_t> any_draw(const BlockLayout& layout, std::int64_t qb) {
  std::vector<std::int64_t> list(static_cast<std::size_t>(layout.random_count(qb)));
  for (std::size_t i = 0; i < list.size(); ++i) list[i] = layout.candidate(qb, static_cast<std::int64_t>(i));
  return list;
}

// Position i of the candidate list as a partial Fisher–Yates has left it: the swapped value when
// the shuffle moved one there, else the i-th candidate (only the ≤ 2r touched positions are held).
struct SparseShuffle {
  const BlockLayout& layout;
  std::int64_t qb;
  std::vector<std::pair<std::int64_t, std::int64_t>> moved;  // (position, value)

  std::int64_t at(std::int64_t i) const {
    for (const auto& [position, value] : moved)
      if (position == i) return value;
    return layout.candidate(qb, i);
  }
  void set(std::int64_t i, std::int64_t value) {
    for (auto& [position, held] : moved)
      if (position == i) {
        held = value;
        return;
      }
    moved.emplace_back(i, value);
  }
  void swap(std::int64_t i, std::int64_t j) {
    const std::int64_t at_i = at(i), at_j = at(j);
    set(i, at_j);
    set(j, at_i);
  }
};

struct TileSizes {
  std::int64_t scores = 0, gathered = 0;
};
TileSizes tile_sizes(const BlockLayout& layout) {
  TileSizes sizes;
  TilePattern tile;
  for (std::int64_t qb = 0; qb < layout.blocks; ++qb) {
    plan_block(layout, qb, any_draw(layout, qb), tile);
    sizes.scores = std::max(sizes.scores, TileAttention::score_floats(tile.rows(), tile.computed_width()));
    if (!layout.global(qb)) sizes.gathered = std::max(sizes.gathered, tile.computed_width());
  }
  return sizes;
}

// The TileAttentionBf16 capacity of every query block's tile (the stand-in draw's widths are any draw's).
fixed::TileCapacity tile_capacity(const BlockLayout& layout) {
  std::vector<std::int64_t> blocks(static_cast<std::size_t>(layout.blocks));
  for (std::int64_t qb = 0; qb < layout.blocks; ++qb) blocks[static_cast<std::size_t>(qb)] = qb;
  return fixed::most_tile_capacity(
      blocks, [&](std::int64_t qb, TilePattern& tile) { plan_block(layout, qb, any_draw(layout, qb), tile); });
}

// T: the element type of q, k, v, out and the gradients (float, or bf16 on the bf16 kernel).
template <class T>
class BigBird final : public Mechanism {
 public:
  BigBird(const Problem& problem, const BigBirdConfig& config, std::uint64_t seed)
      : p_(problem), layout_(problem, config), seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    draw_random_blocks();
    kernels_.clear();
    for (std::int64_t t = 0; t < p_.threads; ++t) {
      if constexpr (std::is_same_v<T, bf16>) {
        kernels_.emplace_back(tile_capacity(layout_), p_.head_dim);
      } else {
        const auto sizes = tile_sizes(layout_);
        kernels_.emplace_back(sizes.scores, sizes.gathered, p_.head_dim);
      }
    }
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t blocks = layout_.blocks, n = p_.seq_len, d = p_.head_dim;
    std::int64_t softmax_flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : softmax_flops)
    {
      auto& kernel = kernels_[static_cast<std::size_t>(omp_get_thread_num())];
      TilePattern tile;
      std::vector<std::int64_t> chosen;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t index = 0; index < p_.batch * p_.heads * blocks; ++index) {
        const std::int64_t head = index / blocks, h = head % p_.heads, qb = index % blocks;
        random_of(h, qb, chosen);
        plan_block(layout_, qb, chosen, tile);
        const std::int64_t offset = head * n * d, first = layout_.begin(qb) * d;
        float* lse = lse_.empty() ? nullptr : lse_.data() + head * n + layout_.begin(qb);
        softmax_flops +=
            kernel.run(tile, elements<T>(q) + offset + first, d, elements<T>(k) + offset, elements<T>(v) + offset,
                       elements<T>(out) + offset + first, d, !layout_.global(qb), lse);
      }
    }
    FlopCounter::add(softmax_flops);
  }

  void prepare_backward() override {
    for (auto& kernel : kernels_) kernel.enable_backward();
    lse_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
    heads_ = fixed::HeadBackward<T>(p_.threads, p_.seq_len, p_.head_dim);
  }

  // One head per task (its query blocks write overlapping dK, dV rows); random blocks held fixed.
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
      std::vector<std::int64_t> chosen;
      for (std::int64_t qb = 0; qb < layout_.blocks; ++qb) {
        random_of(h, qb, chosen);
        plan_block(layout_, qb, chosen, tile);
        flops += kernel.backward(tile, fixed::rows_grads(rows, layout_.begin(qb), 1, d), elements<T>(k) + offset,
                                 elements<T>(v) + offset, !layout_.global(qb));
      }
      heads_.finish(t, offset, thread);
      return flops;
    });
  }

  std::vector<NamedTensor> saved() const override { return {{"log_sum_exp", &lse_}}; }
  std::string gradient_note() const override { return "random blocks held fixed"; }

  std::vector<NamedTensor> parameters() const override { return {{"random_blocks", &random_}}; }

 private:
  // Partial Fisher–Yates over each query block's candidates, counter-based so the draw depends
  // only on (seed, head, block).
  void draw_random_blocks() {
    const std::int64_t blocks = layout_.blocks, r = layout_.random;
    random_ = Tensor(Shape{p_.heads, blocks, r});
    random_.fill(-1.0f);
    const CounterRng rng(seed_, "bigbird/random_blocks");
    for (std::int64_t h = 0; h < p_.heads; ++h)
      for (std::int64_t qb = 0; qb < blocks; ++qb) {
        if (layout_.global(qb)) continue;
        const auto size = static_cast<std::uint64_t>(layout_.candidate_count(qb));
        const std::int64_t count = layout_.random_count(qb);
        SparseShuffle list{layout_, qb, {}};
        std::vector<std::int64_t> chosen;
        for (std::int64_t t = 0; t < count; ++t) {
          const auto index = static_cast<std::uint64_t>((h * blocks + qb) * r + t);
          list.swap(t, t + static_cast<std::int64_t>(rng.bits(index) % (size - static_cast<std::uint64_t>(t))));
          chosen.push_back(list.at(t));
        }
        std::sort(chosen.begin(), chosen.end());
        for (std::int64_t t = 0; t < count; ++t)
          random_[(h * blocks + qb) * r + t] = static_cast<float>(chosen[static_cast<std::size_t>(t)]);
      }
  }

  void random_of(std::int64_t h, std::int64_t qb, std::vector<std::int64_t>& chosen) const {
    chosen.clear();
    const std::int64_t r = layout_.random;
    for (std::int64_t t = 0; t < r; ++t) {
      const float blk = random_[(h * layout_.blocks + qb) * r + t];
      if (blk >= 0.0f) chosen.push_back(static_cast<std::int64_t>(blk));
    }
  }

  Problem p_;
  BlockLayout layout_;
  std::uint64_t seed_;
  Tensor random_;
  std::vector<fixed::GatheredKernel<T>> kernels_;
  Tensor lse_;                    // training only
  fixed::HeadBackward<T> heads_;  // training only
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const BigBirdConfig& c, std::uint64_t seed) {
  if (problem.dtype == DType::BF16) return std::make_unique<BigBird<bf16>>(problem, c, seed);
  return std::make_unique<BigBird<float>>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const BigBirdConfig& c) {
  const BlockLayout layout(p, c);
  TilePattern tile;
  std::int64_t per_head = 0;
  for (std::int64_t qb = 0; qb < layout.blocks; ++qb) {
    plan_block(layout, qb, any_draw(layout, qb), tile);
    per_head += fixed::tile_flops(tile, p.head_dim);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t workspace(const Problem& p, const BigBirdConfig& c) {
  const BlockLayout layout(p, c);
  const std::int64_t random = p.heads * layout.blocks * layout.random * static_cast<std::int64_t>(sizeof(float));
  if (p.dtype == DType::BF16)
    return random + p.threads * fixed::TileAttentionBf16::bytes(tile_capacity(layout), p.head_dim);
  const auto sizes = tile_sizes(layout);
  return random + p.threads * TileAttention::bytes(sizes.scores, sizes.gathered, p.head_dim);
}

std::int64_t backward_flops(const Problem& p, const BigBirdConfig& c) {
  const BlockLayout layout(p, c);
  TilePattern tile;
  std::int64_t per_head = 2 * p.seq_len * p.head_dim;  // δ
  for (std::int64_t qb = 0; qb < layout.blocks; ++qb) {
    plan_block(layout, qb, any_draw(layout, qb), tile);
    per_head += fixed::tile_backward_flops(tile, p.head_dim, !layout.global(qb));
  }
  return p.batch * p.heads * per_head;
}

std::int64_t backward_workspace(const Problem& p, const BigBirdConfig& c) {
  if (p.dtype == DType::BF16)
    return p.batch * p.heads * p.seq_len * static_cast<std::int64_t>(sizeof(float)) +
           fixed::HeadBackward<bf16>::bytes(p.threads, p.seq_len, p.head_dim) +
           p.threads * fixed::TileAttentionBf16::backward_bytes(tile_capacity(BlockLayout(p, c)), p.head_dim);
  const auto sizes = tile_sizes(BlockLayout(p, c));
  const std::int64_t floats = p.batch * p.heads * p.seq_len + p.threads * p.seq_len;
  return floats * static_cast<std::int64_t>(sizeof(float)) +
         p.threads * TileAttention::backward_bytes(sizes.scores, sizes.gathered, p.head_dim);
}

FieldTable<BigBirdConfig> config_fields(const BigBirdConfig*) {
  return {int_field("block", &BigBirdConfig::block, 1, 1 << 16, "block size b, tokens"),
          int_field("window_blocks", &BigBirdConfig::window_blocks, 1, 1 << 16,
                    "sliding-window blocks w (query block in the middle)"),
          int_field("random_blocks", &BigBirdConfig::random_blocks, 0, 1 << 16, "random key blocks r per query block"),
          int_field("global_blocks", &BigBirdConfig::global_blocks, 0, 1 << 16,
                    "global blocks g: first ceil(g/2) and last floor(g/2)")};
}

std::string unsupported(const Problem& p, const BigBirdConfig&) { return fixed::gathered_bf16_unsupported(p); }

template <>
Implementation implementation<BigBirdConfig>() {
  Implementation impl = implement<BigBirdConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
