#include "taxonomy/baselines/vanilla.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "lib/core/bf16_softmax.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
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

// --- bf16 (issue 31) ---------------------------------------------------------------------------

// The score rows' stride: padded against cache conflicts in fp32 (ops::padded_ld); dense (N) in
// bf16, where oneDNN 2.6 runs QKᵀ on its AMX/AVX512_BF16 brgemm kernels only into dense rows (a
// padded fp32 output falls back to a generic gemm about 6× slower at N = 4096).
std::int64_t score_ld(const Problem& p) { return p.dtype == DType::BF16 ? p.seq_len : ops::padded_ld(p.seq_len); }

constexpr std::int64_t kBlock = 32;  // columns per block of the P·V loop

// One query's scores against n cached keys: scores[j] = scale·⟨q, k_j⟩ (fp32 accumulation of
// exact products), q [d] and k [n, d] bf16. The decode step's form for D % 16 ≠ 0.
void score_row(const bf16* q, const bf16* k, std::int64_t n, std::int64_t d, float scale, float* scores) {
  for (std::int64_t j = 0; j < n; ++j) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (std::int64_t c = 0; c < d; ++c) sum += to_float(q[c]) * to_float(k[j * d + c]);
    scores[j] = scale * sum;
  }
}

// out[c] = Σ_{j < keys} p[j]·v[j, c] for c < d, fp32 accumulation in blocks of kBlock columns,
// rounded to bf16; p: bf16-representable fp32 weights, v: [keys, d] bf16.
void weighted_values(const float* p, const bf16* v, std::int64_t keys, std::int64_t d, bf16* out) {
  for (std::int64_t c0 = 0; c0 < d; c0 += kBlock) {
    const std::int64_t width = std::min(kBlock, d - c0);
    float acc[kBlock] = {};
    for (std::int64_t j = 0; j < keys; ++j) {
#pragma omp simd
      for (std::int64_t c = 0; c < width; ++c) acc[c] += p[j] * to_float(v[j * d + c0 + c]);
    }
    narrow(acc, out + c0, width);
  }
}

// Vanilla in bf16: q, k, v, out and the KV cache bf16 ([B, H, ·, D]); S = QKᵀ/√D in fp32 (a
// dense score buffer [B·H, N, N], score_ld) on oneDNN's bf16 matmul; softmax in fp32; P rounded to
// bf16 in place (softmax_row_to_bf16: [B·H, N, 2·N] bf16 over the same bytes); O = P·V on the
// bf16 matmul, fp32 accumulation, rounded to bf16. Where oneDNN has no bf16 matmul (below AVX-512),
// ops::matmul widens blocks to fp32 for sgemm (the same numerics). FLOPs are the fp32 form's. Decode: a bf16 KV cache
// (half the bytes) — in the bf16 tile kernels' layouts (Bf16KvCache: key pair panels, value row
// pairs; the step on vdpbf16ps or its convert path) when D is a multiple of 16, else plain rows
// [B·H, N + T, D] on convert-and-FMA loops. Backward: the saved P (bf16, in the score buffer), dV = Pᵀ·dO, dP = dO·Vᵀ
// in fp32 (a second dense [B·H, N, N] fp32 buffer), dS = P·(dP − Σ P·dP) in fp32 rounded to bf16 in place, dQ =
// dS·K/√D, dK = dSᵀ·Q/√D: bf16 operands, fp32 accumulation, dq, dk, dv stored bf16.
class VanillaBf16 final : public Mechanism {
 public:
  explicit VanillaBf16(const Problem& problem) : p_(problem) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scores_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len, score_ld(p_)});
    ops::prepare_bf16_matmul(scores_shape(), false);
    ops::prepare_bf16_matmul(output_shape(), true);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t bh = p_.batch * p_.heads, n = p_.seq_len, ld = scores_.dim(2);
    ops::matmul(scores_shape(), q.bf16_data(), k.bf16_data(), scores_.data());
    std::int64_t entries = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 16) reduction(+ : entries)
    for (std::int64_t index = 0; index < bh * n; ++index) {
      const std::int64_t head = index / n, i = index % n;
      float* head_scores = scores_.data() + head * n * ld;
      const std::int64_t valid = p_.causal ? i + 1 : n;
      softmax_row_to_bf16(head_scores + i * ld, n, valid);
      entries += valid;
    }
    FlopCounter::add(kSoftmaxFlopsPerElement * entries);
    const bf16* probabilities = reinterpret_cast<const bf16*>(scores_.data());  // row stride 2·ld
    ops::matmul(output_shape(), probabilities, v.bf16_data(), out.bf16_data());
    if (capacity_ > 0) load_context(k, v);
  }

  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim;
    capacity_ = p_.seq_len + tokens;
    if (tiles::fits_head_dim(d)) {
      tiled_cache_ = Bf16KvCache(heads, capacity_, d);
      step_scores_ = Tensor(Shape{heads, tiles::panels_for(capacity_) * tiles::kPanel});
      step_probs_ = Tensor(Shape{heads, capacity_ / 2 * 2 + 2}, DType::BF16);
      step_acc_ = Tensor(Shape{heads, d});
      return;
    }
    keys_ = Tensor(Shape{heads, capacity_, d}, DType::BF16);
    values_ = Tensor(Shape{heads, capacity_, d}, DType::BF16);
    step_scores_ = Tensor(Shape{heads, ops::padded_ld(capacity_)});
  }

  // One token: its key and value appended to the bf16 cache, its score row against the cached keys
  // (fp32 accumulation), softmax in fp32, the probabilities rounded to bf16 as the forward rounds
  // them, P·V accumulated in fp32 and rounded to bf16. 4·n·D + 5·n FLOPs per head, as in fp32.
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (length_ >= capacity_) throw std::logic_error("vanilla: decode step past the prepared capacity");
    if (tiled_cache_.capacity() > 0) return tiled_decode_step(q, k, v, out);
    const std::int64_t d = p_.head_dim, keys = length_ + 1, ld = step_scores_.dim(1);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      bf16* cached_keys = keys_.bf16_data() + head * capacity_ * d;
      bf16* cached_values = values_.bf16_data() + head * capacity_ * d;
      std::copy_n(k.bf16_data() + head * d, d, cached_keys + length_ * d);
      std::copy_n(v.bf16_data() + head * d, d, cached_values + length_ * d);
      float* scores = step_scores_.data() + head * ld;
      score_row(q.bf16_data() + head * d, cached_keys, keys, d, scale, scores);
      const float inverse = 1.0f / ops::exp_and_sum(scores, keys, ops::row_max(scores, keys, scores[0]));
      for (std::int64_t j = 0; j < keys; ++j) scores[j] = round_to_bf16(scores[j] * inverse);
      weighted_values(scores, cached_values, keys, d, out.bf16_data() + head * d);
    }
    FlopCounter::add(p_.batch * p_.heads * (2 * matmul_flops(1, keys, d) + kSoftmaxFlopsPerElement * keys));
    ++length_;
  }

  // The step on the bf16 tile kernels (D a multiple of 16): the cache in their layouts
  // (Bf16KvCache), one attend_block_bf16 over every cached token per head — the exponentials
  // rounded to bf16 before P·V and normalised after it (the forward normalises first: the two
  // roundings differ within the bound the tests state) — and the output rounded to bf16.
  void tiled_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t d = p_.head_dim, keys = length_ + 1, heads = p_.batch * p_.heads;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < heads; ++head) {
      tiled_cache_.store(head, length_, k.bf16_data() + head * d, v.bf16_data() + head * d);
      float* acc = step_acc_.data() + head * d;
      RowSoftmax row = begin_row(acc, d);
      attend_block_bf16(row, q.bf16_data() + head * d, tiled_cache_, head, 0, keys,
                        step_scores_.data() + head * step_scores_.dim(1),
                        step_probs_.bf16_data() + head * step_probs_.dim(1));
      finish_row(row, acc);
      tiles::round_row(acc, d, out.bf16_data() + head * d);
    }
    // The fp32 form's count (the dtype keeps FLOPs), 4·n·D + 5·n per head.
    FlopCounter::add(heads * (2 * matmul_flops(1, keys, d) + kSoftmaxFlopsPerElement * keys));
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    if (tiled_cache_.capacity() > 0)
      return {{"key_cache", &tiled_cache_.key_tensor()}, {"value_cache", &tiled_cache_.value_tensor()}};
    return {{"key_cache", &keys_}, {"value_cache", &values_}};
  }

  void prepare_backward() override {
    score_grads_ = Tensor(scores_.shape());
    for (const auto& shape : {value_grad_shape(), query_grad_shape(), key_grad_shape()})
      ops::prepare_bf16_matmul(shape, true);
    ops::prepare_bf16_matmul(probability_grad_shape(), false);
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t bh = p_.batch * p_.heads, n = p_.seq_len;
    const auto* probabilities = reinterpret_cast<const bf16*>(scores_.data());     // row stride 2·N
    const auto* score_grads = reinterpret_cast<const bf16*>(score_grads_.data());  // dS after the softmax backward
    ops::matmul(value_grad_shape(), probabilities, dout.bf16_data(), dv.bf16_data());
    ops::matmul(probability_grad_shape(), dout.bf16_data(), v.bf16_data(), score_grads_.data());
    std::int64_t entries = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 16) reduction(+ : entries)
    for (std::int64_t index = 0; index < bh * n; ++index) {
      const std::int64_t valid = p_.causal ? index % n + 1 : n;
      softmax_backward_row_to_bf16(probabilities + index * 2 * n, score_grads_.data() + index * n, n, valid);
      entries += valid;
    }
    FlopCounter::add(kSoftmaxBackwardFlopsPerElement * entries);
    ops::matmul(query_grad_shape(), score_grads, k.bf16_data(), dq.bf16_data());
    ops::matmul(key_grad_shape(), score_grads, q.bf16_data(), dk.bf16_data());
  }

  // The score buffer: after the forward, P in bf16 over each row's first half.
  std::vector<NamedTensor> saved() const override { return {{"probabilities", &scores_}}; }

 private:
  // The backward's products: dV = Pᵀ·dO, dP = dO·Vᵀ (fp32, dense rows), dQ = dS·K/√D, dK = dSᵀ·Q/√D,
  // P and dS bf16 with row stride 2·N.
  ops::MatmulShape value_grad_shape() const {
    const std::int64_t n = p_.seq_len;
    return {.batch = p_.batch * p_.heads,
            .m = n,
            .n = p_.head_dim,
            .k = n,
            .trans_a = true,
            .lda = 2 * n,
            .stride_a = 2 * n * n};
  }
  ops::MatmulShape probability_grad_shape() const {
    const std::int64_t n = p_.seq_len;
    return {.batch = p_.batch * p_.heads, .m = n, .n = n, .k = p_.head_dim, .trans_b = true, .ldc = n};
  }
  ops::MatmulShape query_grad_shape() const {
    const std::int64_t n = p_.seq_len;
    return {.batch = p_.batch * p_.heads,
            .m = n,
            .n = p_.head_dim,
            .k = n,
            .lda = 2 * n,
            .stride_a = 2 * n * n,
            .alpha = 1.0f / std::sqrt(static_cast<float>(p_.head_dim))};
  }
  ops::MatmulShape key_grad_shape() const {
    ops::MatmulShape shape = query_grad_shape();
    shape.trans_a = true;
    return shape;
  }

  // S = QKᵀ/√D into the fp32 score rows; O = P·V from the bf16 probabilities (row stride 2·ld).
  ops::MatmulShape scores_shape() const {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    return {.batch = p_.batch * p_.heads,
            .m = n,
            .n = n,
            .k = d,
            .trans_b = true,
            .ldc = scores_.dim(2),
            .alpha = 1.0f / std::sqrt(static_cast<float>(d))};
  }
  ops::MatmulShape output_shape() const {
    const std::int64_t n = p_.seq_len, ld = scores_.dim(2);
    return {.batch = p_.batch * p_.heads, .m = n, .n = p_.head_dim, .k = n, .lda = 2 * ld, .stride_a = 2 * n * ld};
  }

  // The prefill: every head's N context keys and values into the first N slots of the cache.
  void load_context(const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    length_ = n;
    if (tiled_cache_.capacity() > 0) return tiled_cache_.load_context(k, v, p_.threads);
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      std::copy_n(k.bf16_data() + head * n * d, n * d, keys_.bf16_data() + head * capacity_ * d);
      std::copy_n(v.bf16_data() + head * n * d, n * d, values_.bf16_data() + head * capacity_ * d);
    }
  }

  Problem p_;
  Tensor scores_;                 // fp32 S [B·H, N, N]; after the softmax, bf16 P over each row's first half
  Tensor score_grads_;            // backward: fp32 dP [B·H, N, N]; after the softmax backward, bf16 dS likewise
  std::int64_t capacity_ = 0;     // decode: N + T
  Tensor keys_, values_;          // decode, D not a multiple of 16: bf16 caches [B·H, N + T, D]
  Bf16KvCache tiled_cache_;       // decode, D a multiple of 16: the cache in the tile kernels' layouts
  Tensor step_scores_;            // decode: one fp32 score row per head, [B·H, padded(N + T)] (tiled: whole panels)
  Tensor step_probs_, step_acc_;  // decode, tiled: per head the bf16 probabilities [N + T + 2] and the fp32 accumulator
  std::int64_t length_ = 0;       // decode: tokens in the cache
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const VanillaConfig&, std::uint64_t) {
  if (problem.dtype == DType::BF16) return std::make_unique<VanillaBf16>(problem);
  return std::make_unique<Vanilla>(problem);
}

std::int64_t flops(const Problem& p, const VanillaConfig&) {
  const std::int64_t bh = p.batch * p.heads;
  return 2 * bh * matmul_flops(p.seq_len, p.seq_len, p.head_dim) + kSoftmaxFlopsPerElement * bh * softmax_entries(p);
}

std::int64_t workspace(const Problem& p, const VanillaConfig&) {
  return p.batch * p.heads * p.seq_len * score_ld(p) * static_cast<std::int64_t>(sizeof(float));
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
  if (p.dtype == DType::BF16 && tiles::fits_head_dim(p.head_dim))
    return Bf16KvCache::bytes(bh, capacity, p.head_dim) +
           bh * ((tiles::panels_for(capacity) * tiles::kPanel + p.head_dim) * 4 + (capacity / 2 * 2 + 2) * 2);
  return 2 * bh * capacity * p.head_dim * element_bytes(p.dtype) +  // the key and value caches
         bh * ops::padded_ld(capacity) * static_cast<std::int64_t>(sizeof(float));
}

template <>
Implementation implementation<VanillaConfig>() {
  Implementation impl = implement<VanillaConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
