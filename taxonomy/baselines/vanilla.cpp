#include "taxonomy/baselines/vanilla.hpp"

#include <cmath>
#include <stdexcept>

#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "taxonomy/engines/decode_common.hpp"

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
    ops::MatmulShape qk{.batch = p_.batch * p_.heads,
                        .m = n,
                        .n = n,
                        .k = d,
                        .trans_b = true,
                        .ldc = ld,
                        .alpha = 1.0f / std::sqrt(static_cast<float>(d))};
    ops::matmul(qk, q.data(), k.data(), scores_.data());
    ops::softmax_rows_masked(scores_.data(), p_.batch * p_.heads, n, n, ld, p_.causal);
    ops::MatmulShape pv{.batch = p_.batch * p_.heads, .m = n, .n = d, .k = n, .lda = ld};
    ops::matmul(pv, scores_.data(), v.data(), out.data());
    if (cache_.capacity() > 0) {  // the prefill of a decode: the context's keys and values
      cache_.load_context(k, v, p_.threads);
      length_ = n;
    }
  }

  void prepare_decode(std::int64_t tokens) override {
    cache_ = KvCache(p_.batch * p_.heads, p_.seq_len + tokens, p_.head_dim);
    step_scores_ = Tensor(Shape{p_.batch * p_.heads, ops::padded_ld(p_.seq_len + tokens)});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (length_ >= cache_.capacity()) throw std::logic_error("vanilla: decode step past the prepared capacity");
    const std::int64_t d = p_.head_dim, keys = length_ + 1, ld = step_scores_.dim(1);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      cache_.store(head, length_, k.data() + head * d, v.data() + head * d, 1);
      float* scores = step_scores_.data() + head * ld;
      ops::gemm(false, true, 1, keys, d, scale, q.data() + head * d, d, cache_.keys(head), d, 0.0f, scores, ld);
      const float sum = ops::exp_and_sum(scores, keys, ops::row_max(scores, keys, scores[0]));
      const float inverse = 1.0f / sum;
      for (std::int64_t j = 0; j < keys; ++j) scores[j] *= inverse;
      ops::gemm(false, false, 1, d, keys, 1.0f, scores, ld, cache_.values(head), d, 0.0f, out.data() + head * d, d);
      flops += kSoftmaxFlopsPerElement * keys;
    }
    FlopCounter::add(flops);
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"key_cache", &cache_.key_tensor()}, {"value_cache", &cache_.value_tensor()}};
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
    ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .trans_a = true, .lda = ld, .alpha = scale}, score_grads_.data(),
                q.data(), dk.data());
  }

  std::vector<NamedTensor> saved() const override { return {{"probabilities", &scores_}}; }

 private:
  Problem p_;
  Tensor scores_, score_grads_;
  KvCache cache_;            // decode: keys and values of every token so far, [B·H, N + T, D] each
  Tensor step_scores_;       // decode: one score row per head, [B·H, padded(N + T)]
  std::int64_t length_ = 0;  // decode: tokens in the cache
};

}  // namespace

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
  return 4 * bh * matmul_flops(p.seq_len, p.seq_len, p.head_dim) +
         kSoftmaxBackwardFlopsPerElement * bh * softmax_entries(p);
}

// The dP/dS buffer; P itself is the forward's score buffer.
std::int64_t backward_workspace(const Problem& p, const VanillaConfig& c) { return workspace(p, c); }

std::int64_t decode_workspace(const Problem& p, const VanillaConfig&, std::int64_t tokens) {
  const std::int64_t bh = p.batch * p.heads, capacity = p.seq_len + tokens;
  return KvCache::bytes(bh, capacity, p.head_dim) +
         bh * ops::padded_ld(capacity) * static_cast<std::int64_t>(sizeof(float));
}

template <>
Implementation implementation<VanillaConfig>() {
  return implement<VanillaConfig>();
}

}  // namespace xfb
