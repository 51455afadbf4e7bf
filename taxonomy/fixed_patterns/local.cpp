#include "taxonomy/fixed_patterns/local.hpp"

#include "lib/core/config_table.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"
#include "taxonomy/engines/single_plan.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;

// Every query tile attends to its own block; a decoded token to its block's tokens so far.
struct Plan {
  bs::BlockTiling tiling;
  bool causal;
  Plan(const Problem& p, const LocalConfig& c) : tiling(p.seq_len, c.block), causal(p.causal) {}
  std::int64_t tasks() const { return tiling.tasks(); }
  std::int64_t max_keys() const { return tiling.block; }
  std::int64_t window() const { return tiling.block; }
  std::int64_t window_start(std::int64_t token) const { return token / tiling.block * tiling.block; }
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    return bs::block_tile(tiling, task, causal, lo, hi);
  }
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const LocalConfig& c, std::uint64_t) {
  return bs::single_plan_attention(problem, Plan(problem, c));
}

std::int64_t flops(const Problem& p, const LocalConfig& c) { return bs::single_plan_flops(p, Plan(p, c)); }

std::int64_t workspace(const Problem& p, const LocalConfig& c) { return bs::single_plan_workspace(p, Plan(p, c)); }

std::int64_t backward_flops(const Problem& p, const LocalConfig& c) {
  return bs::single_plan_backward_flops(p, Plan(p, c));
}

std::int64_t backward_workspace(const Problem& p, const LocalConfig& c) {
  return bs::single_plan_backward_workspace(p, Plan(p, c));
}

std::int64_t decode_workspace(const Problem& p, const LocalConfig& c, std::int64_t) {
  if (p.dtype == DType::BF16) return bs::WindowCacheBf16::bytes(p.batch * p.heads, c.block, p.head_dim);
  return WindowCache::bytes(p.batch * p.heads, c.block, p.head_dim);
}

FieldTable<LocalConfig> config_fields(const LocalConfig*) {
  return {int_field("block", &LocalConfig::block, 1, 1000000, "tokens per local block (clamped to N)")};
}

LocalConfig resolve(const Problem& p, LocalConfig c) {
  c.block = bs::BlockTiling(p.seq_len, c.block).block;
  return c;
}

std::string unsupported(const Problem& p, const LocalConfig&) { return bs::single_plan_bf16_unsupported(p); }

template <>
Implementation implementation<LocalConfig>() {
  Implementation impl = implement<LocalConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
