#include "taxonomy/fixed_patterns/image_transformer.hpp"

#include <algorithm>

#include "lib/core/config_table.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/single_plan.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;

// Query tiles inside query blocks of l_q tokens, each attending to its block's memory block; a
// decoded token to the last l_m + l_q tokens.
struct Plan {
  bs::BlockTiling blocks;
  std::int64_t flange;
  bool causal;
  Plan(const Problem& p, const ImageTransformerConfig& c)
      : blocks(p.seq_len, c.query_block), flange(std::min(c.memory_flange, p.seq_len)), causal(p.causal) {}
  std::int64_t tasks() const { return blocks.tasks(); }
  std::int64_t max_keys() const { return std::min(blocks.n, flange + blocks.block); }
  std::int64_t window() const { return flange + blocks.block; }
  std::int64_t window_start(std::int64_t token) const {
    return std::max<std::int64_t>(0, token / blocks.block * blocks.block - flange);
  }
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    const std::int64_t memory_start = std::max<std::int64_t>(0, blocks.block_start(task) - flange);
    const bs::Tile tile{.rows = blocks.rows(task), .q_first = blocks.first_row(task), .k_first = memory_start};
    bs::prefix_bounds(tile.rows, tile.q_first - memory_start, blocks.block_end(task) - memory_start, causal, lo, hi);
    return tile;
  }
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const ImageTransformerConfig& c, std::uint64_t) {
  return bs::single_plan_attention(problem, Plan(problem, c));
}

std::int64_t flops(const Problem& p, const ImageTransformerConfig& c) { return bs::single_plan_flops(p, Plan(p, c)); }

std::int64_t workspace(const Problem& p, const ImageTransformerConfig& c) {
  return bs::single_plan_workspace(p, Plan(p, c));
}

std::int64_t backward_flops(const Problem& p, const ImageTransformerConfig& c) {
  return bs::single_plan_backward_flops(p, Plan(p, c));
}

std::int64_t backward_workspace(const Problem& p, const ImageTransformerConfig& c) {
  return bs::single_plan_backward_workspace(p, Plan(p, c));
}

std::int64_t decode_workspace(const Problem& p, const ImageTransformerConfig& c, std::int64_t) {
  if (p.dtype == DType::BF16)
    return bs::WindowCacheBf16::bytes(p.batch * p.heads, c.memory_flange + c.query_block, p.head_dim);
  return WindowCache::bytes(p.batch * p.heads, c.memory_flange + c.query_block, p.head_dim);
}

FieldTable<ImageTransformerConfig> config_fields(const ImageTransformerConfig*) {
  return {int_field("query_block", &ImageTransformerConfig::query_block, 1, 1000000,
                    "l_q: tokens per query block (clamped to N)"),
          int_field("memory_flange", &ImageTransformerConfig::memory_flange, 0, 1000000,
                    "l_m: preceding tokens each query block also attends to (clamped to N)")};
}

ImageTransformerConfig resolve(const Problem& p, ImageTransformerConfig c) {
  const Plan plan(p, c);
  c.query_block = plan.blocks.block;
  c.memory_flange = plan.flange;
  return c;
}

std::string unsupported(const Problem& p, const ImageTransformerConfig&) { return bs::single_plan_bf16_unsupported(p); }

template <>
Implementation implementation<ImageTransformerConfig>() {
  Implementation impl = implement<ImageTransformerConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
