#include "taxonomy/fixed_patterns/image_transformer.hpp"

#include <algorithm>

#include "lib/core/config_table.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;

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
    scratch_ = bs::ThreadScratch(p_.threads, plan_.max_memory(), p_.head_dim);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    bs::run_tiles(
        p_.batch * p_.heads, plan_.blocks.tasks(), scratch_,
        [&](std::int64_t head) { return training_.saving(bs::head_view(q, k, v, out, head), head); }, plan_);
    if (!window_.empty()) window_.load_context(k, v, p_.threads);
  }

  // Decode: the last l_m + l_q tokens; token i sees [max(0, q0 − l_m), i], q0 = ⌊i/l_q⌋·l_q.
  void prepare_decode(std::int64_t) override {
    window_ = WindowCache(p_.batch * p_.heads, plan_.flange + plan_.blocks.block, p_.head_dim);
  }
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t token = window_.length(), block_start = token / plan_.blocks.block * plan_.blocks.block;
    window_.step(q, k, v, out, std::max<std::int64_t>(0, block_start - plan_.flange), p_.threads);
  }
  std::vector<NamedTensor> decode_state() const override { return window_.state(); }

  void prepare_backward() override {
    training_.prepare(p_.batch * p_.heads, p_.seq_len, p_.threads, plan_.max_memory(), p_.head_dim);
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    training_.run({q, k, v, out, dout, dq, dk, dv}, p_.batch * p_.heads, plan_.blocks.tasks(), plan_);
  }

  std::vector<NamedTensor> saved() const override { return training_.saved(); }

 private:
  Problem p_;
  Plan plan_;
  bs::ThreadScratch scratch_;
  bs::TileTraining training_;
  WindowCache window_;  // decoding only
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const ImageTransformerConfig& c, std::uint64_t) {
  return std::make_unique<ImageTransformer>(problem, c);
}

std::int64_t flops(const Problem& p, const ImageTransformerConfig& c) {
  const Plan plan(p, c);
  return p.batch * p.heads * bs::plan_flops(plan.blocks.tasks(), p.head_dim, plan);
}

std::int64_t workspace(const Problem& p, const ImageTransformerConfig& c) {
  return bs::ThreadScratch::tracked_bytes(p.threads, Plan(p, c).max_memory(), p.head_dim);
}

std::int64_t backward_flops(const Problem& p, const ImageTransformerConfig& c) {
  const Plan plan(p, c);
  return p.batch * p.heads * bs::plan_backward_flops(p.seq_len, plan.blocks.tasks(), p.head_dim, plan);
}

std::int64_t backward_workspace(const Problem& p, const ImageTransformerConfig& c) {
  return bs::TileTraining::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, Plan(p, c).max_memory(), p.head_dim);
}

std::int64_t decode_workspace(const Problem& p, const ImageTransformerConfig& c, std::int64_t) {
  return WindowCache::bytes(p.batch * p.heads, c.memory_flange + c.query_block, p.head_dim);
}

FieldTable<ImageTransformerConfig> config_fields(const ImageTransformerConfig*) {
  return {int_field("query_block", &ImageTransformerConfig::query_block, 1, 1000000,
                    "l_q: tokens per query block (clamped to N)"),
          int_field("memory_flange", &ImageTransformerConfig::memory_flange, 0, 1000000,
                    "l_m: preceding tokens each query block also attends to")};
}

ImageTransformerConfig resolve(const Problem& p, ImageTransformerConfig c) {
  const Plan plan(p, c);
  c.query_block = plan.blocks.block;
  c.memory_flange = plan.flange;
  return c;
}

template <>
Implementation implementation<ImageTransformerConfig>() { return implement<ImageTransformerConfig>(); }

}  // namespace xfb
