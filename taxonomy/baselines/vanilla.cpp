#include "taxonomy/baselines/vanilla.hpp"

#include <cmath>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"

namespace xfb {
namespace {

std::int64_t softmax_entries(const Problem& p) {
  return p.causal ? p.seq_len * (p.seq_len + 1) / 2 : p.seq_len * p.seq_len;
}

class Vanilla final : public Mechanism {
 public:
  explicit Vanilla(const Problem& problem) : p_(problem) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scores_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len, ops::padded_ld(p_.seq_len)});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, ld = scores_.dim(2);
    ops::MatmulShape qk{.batch = p_.batch * p_.heads, .m = n, .n = n, .k = d, .trans_b = true, .ldc = ld,
                        .alpha = 1.0f / std::sqrt(static_cast<float>(d))};
    ops::matmul(qk, q.data(), k.data(), scores_.data());
    ops::softmax_rows_masked(scores_.data(), p_.batch * p_.heads, n, n, ld, p_.causal);
    ops::MatmulShape pv{.batch = p_.batch * p_.heads, .m = n, .n = d, .k = n, .lda = ld};
    ops::matmul(pv, scores_.data(), v.data(), out.data());
  }

  void prepare_backward() override { score_grads_ = Tensor(scores_.shape()); }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t bh = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, ld = scores_.dim(2);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .trans_a = true, .lda = ld}, scores_.data(), dout.data(),
                dv.data());
    ops::matmul({.batch = bh, .m = n, .n = n, .k = d, .trans_b = true, .ldc = ld}, dout.data(), v.data(),
                score_grads_.data());
    ops::softmax_backward_rows_masked(scores_.data(), score_grads_.data(), bh, n, n, ld, p_.causal);
    ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .lda = ld, .alpha = scale}, score_grads_.data(), k.data(),
                dq.data());
    ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .trans_a = true, .lda = ld, .alpha = scale},
                score_grads_.data(), q.data(), dk.data());
  }

  std::vector<NamedTensor> saved() const override { return {{"probabilities", &scores_}}; }

 private:
  Problem p_;
  Tensor scores_, score_grads_;
};

std::unique_ptr<Mechanism> create(const Problem& problem, const VanillaConfig&, std::uint64_t) {
  return std::make_unique<Vanilla>(problem);
}

std::int64_t flops(const Problem& p, const VanillaConfig&) {
  const std::int64_t bh = p.batch * p.heads;
  return 2 * bh * matmul_flops(p.seq_len, p.seq_len, p.head_dim) + kSoftmaxFlopsPerElement * bh * softmax_entries(p);
}

std::int64_t workspace(const Problem& p, const VanillaConfig&) {
  return p.batch * p.heads * p.seq_len * ops::padded_ld(p.seq_len) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_flops(const Problem& p, const VanillaConfig&) {
  const std::int64_t bh = p.batch * p.heads;
  return 4 * bh * matmul_flops(p.seq_len, p.seq_len, p.head_dim) + kSoftmaxBackwardFlopsPerElement * bh * softmax_entries(p);
}

// The dP/dS buffer; P itself is the forward's score buffer.
std::int64_t backward_workspace(const Problem& p, const VanillaConfig& c) { return workspace(p, c); }

}  // namespace

Implementation vanilla_implementation() {
  return implement(ModelSpec<VanillaConfig>{.fields = {}, .create = create,
                                                  .flops = flops,
                                                  .workspace = workspace,
                                                  .backward_flops = backward_flops,
                                                  .backward_workspace = backward_workspace});
}

}  // namespace xfb
