#include "taxonomy/fixed_patterns/image_transformer.hpp"

#include <algorithm>

#include "taxonomy/fixed_patterns/block_sparse.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;

ImageTransformerConfig config_from(const ParamValues& values) {
  return {.query_block = values.get_int("query_block"), .memory_flange = values.get_int("memory_flange")};
}

// Query tiles inside query blocks of l_q tokens, each attending to its block's memory block.
struct Plan {
  bs::BlockTiling blocks;
  std::int64_t flange;
  bool causal;
  Plan(const Problem& p, const ImageTransformerConfig& c)
      : blocks(p.seq_len, c.query_block), flange(std::min(c.memory_flange, p.seq_len)), causal(p.causal) {}
  std::int64_t max_memory() const { return std::min(blocks.n, flange + blocks.block); }
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    const std::int64_t memory_start = std::max<std::int64_t>(0, blocks.block_start(task) - flange);
    const bs::Tile tile{.rows = blocks.rows(task), .q_first = blocks.first_row(task), .k_first = memory_start};
    bs::prefix_bounds(tile.rows, tile.q_first - memory_start, blocks.block_end(task) - memory_start, causal, lo, hi);
    return tile;
  }
};

class ImageTransformer final : public Mechanism {
 public:
  ImageTransformer(const Problem& problem, const ImageTransformerConfig& config)
      : p_(problem), plan_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratch(p_.threads, plan_.max_memory());
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    bs::run_tiles(
        p_.batch * p_.heads, plan_.blocks.tasks(), scratch_,
        [&](std::int64_t head) { return bs::head_view(q, k, v, out, head); }, plan_);
  }

 private:
  Problem p_;
  Plan plan_;
  bs::ThreadScratch scratch_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const ParamValues& values, std::uint64_t) {
  return std::make_unique<ImageTransformer>(problem, config_from(values));
}

std::int64_t flops(const Problem& p, const ParamValues& values) {
  const Plan plan(p, config_from(values));
  return p.batch * p.heads * bs::plan_flops(plan.blocks.tasks(), p.head_dim, plan);
}

std::int64_t workspace(const Problem& p, const ParamValues& values) {
  return bs::ThreadScratch::tracked_bytes(p.threads, Plan(p, config_from(values)).max_memory());
}

}  // namespace

Implementation image_transformer_implementation() {
  return {{
              {"query_block", ParamType::Int, "256", 1, 1000000, {}, "l_q: tokens per query block (clamped to N)"},
              {"memory_flange",
               ParamType::Int,
               "128",
               0,
               1000000,
               {},
               "l_m: preceding tokens each query block also attends to"},
          },
          create,
          flops,
          workspace};
}

}  // namespace xfb
