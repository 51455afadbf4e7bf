#include "taxonomy/fixed_patterns/local.hpp"

#include "lib/core/config_table.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;

// Every query tile attends to its own block.
struct Plan {
  bs::BlockTiling tiling;
  bool causal;
  Plan(const Problem& p, const LocalConfig& c) : tiling(p.seq_len, c.block), causal(p.causal) {}
  bs::Tile operator()(std::int64_t task, std::int64_t* lo, std::int64_t* hi) const {
    return bs::block_tile(tiling, task, causal, lo, hi);
  }
};

class Local final : public Mechanism {
 public:
  Local(const Problem& problem, const LocalConfig& config) : p_(problem), plan_(problem, config) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratch(p_.threads, plan_.tiling.block, p_.head_dim);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    bs::run_tiles(
        p_.batch * p_.heads, plan_.tiling.tasks(), scratch_,
        [&](std::int64_t head) { return training_.saving(bs::head_view(q, k, v, out, head), head); }, plan_);
    if (!window_.empty()) window_.load_context(k, v, p_.threads);
  }

  // Decode: the current block's tokens (a window of b); token i sees [⌊i/b⌋·b, i].
  void prepare_decode(std::int64_t) override {
    window_ = WindowCache(p_.batch * p_.heads, plan_.tiling.block, p_.head_dim);
  }
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t token = window_.length(), block = plan_.tiling.block;
    window_.step(q, k, v, out, token / block * block, p_.threads);
  }
  std::vector<NamedTensor> decode_state() const override { return window_.state(); }

  void prepare_backward() override {
    training_.prepare(p_.batch * p_.heads, p_.seq_len, p_.threads, plan_.tiling.block, p_.head_dim);
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    training_.run({q, k, v, out, dout, dq, dk, dv}, p_.batch * p_.heads, plan_.tiling.tasks(), plan_);
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

std::unique_ptr<Mechanism> create(const Problem& problem, const LocalConfig& c, std::uint64_t) {
  return std::make_unique<Local>(problem, c);
}

std::int64_t flops(const Problem& p, const LocalConfig& c) {
  const Plan plan(p, c);
  return p.batch * p.heads * bs::plan_flops(plan.tiling.tasks(), p.head_dim, plan);
}

std::int64_t workspace(const Problem& p, const LocalConfig& c) {
  return bs::ThreadScratch::tracked_bytes(p.threads, bs::BlockTiling(p.seq_len, c.block).block, p.head_dim);
}

std::int64_t backward_flops(const Problem& p, const LocalConfig& c) {
  const Plan plan(p, c);
  return p.batch * p.heads * bs::plan_backward_flops(p.seq_len, plan.tiling.tasks(), p.head_dim, plan);
}

std::int64_t backward_workspace(const Problem& p, const LocalConfig& c) {
  return bs::TileTraining::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, Plan(p, c).tiling.block, p.head_dim);
}

std::int64_t decode_workspace(const Problem& p, const LocalConfig& c, std::int64_t) {
  return WindowCache::bytes(p.batch * p.heads, c.block, p.head_dim);
}

FieldTable<LocalConfig> config_fields(const LocalConfig*) {
  return {int_field("block", &LocalConfig::block, 1, 1000000, "tokens per local block (clamped to N)")};
}

LocalConfig resolve(const Problem& p, LocalConfig c) {
  c.block = bs::BlockTiling(p.seq_len, c.block).block;
  return c;
}

template <>
Implementation implementation<LocalConfig>() { return implement<LocalConfig>(); }

}  // namespace xfb
