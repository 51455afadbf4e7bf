#include "taxonomy/fixed_patterns/local.hpp"

#include "lib/core/config_table.hpp"
#include "taxonomy/engines/block_sparse.hpp"

namespace xfb {
namespace {

namespace bs = block_sparse;

class Local final : public Mechanism {
 public:
  Local(const Problem& problem, const LocalConfig& config) : p_(problem), tiling_(problem.seq_len, config.block) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = bs::ThreadScratch(p_.threads, tiling_.block);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    bs::run_tiles(
        p_.batch * p_.heads, tiling_.tasks(), scratch_,
        [&](std::int64_t head) { return bs::head_view(q, k, v, out, head); },
        [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
          return bs::block_tile(tiling_, task, p_.causal, lo, hi);
        });
  }

 private:
  Problem p_;
  bs::BlockTiling tiling_;
  bs::ThreadScratch scratch_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const LocalConfig& c, std::uint64_t) {
  return std::make_unique<Local>(problem, c);
}

std::int64_t flops(const Problem& p, const LocalConfig& c) {
  const bs::BlockTiling tiling(p.seq_len, c.block);
  return p.batch * p.heads *
         bs::plan_flops(tiling.tasks(), p.head_dim, [&](std::int64_t task, std::int64_t* lo, std::int64_t* hi) {
           return bs::block_tile(tiling, task, p.causal, lo, hi);
         });
}

std::int64_t workspace(const Problem& p, const LocalConfig& c) {
  return bs::ThreadScratch::tracked_bytes(p.threads,
                                          bs::BlockTiling(p.seq_len, c.block).block);
}

}  // namespace

Implementation local_implementation() {
  return implement(ModelSpec<LocalConfig>{
      .fields = {int_field("block", &LocalConfig::block, 1, 1000000, "tokens per local block (clamped to N)")},
      .create = create,
      .flops = flops,
      .workspace = workspace,
      .resolve = [](const Problem& p, LocalConfig c) {
        c.block = bs::BlockTiling(p.seq_len, c.block).block;
        return c;
      }});
}

}  // namespace xfb
