#include "taxonomy/low_rank/synthesizer.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/bf16_softmax.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb {
namespace {

// The logits' row stride: padded for fp32's sgemm; dense rows in bf16 (oneDNN's bf16 matmul
// kernels write dense rows; vanilla's choice too).
std::int64_t logits_ld(const Problem& p) { return p.dtype == DType::BF16 ? p.seq_len : ops::padded_ld(p.seq_len); }

std::int64_t softmax_entries(const Problem& p) {
  return p.causal ? p.seq_len * (p.seq_len + 1) / 2 : p.seq_len * p.seq_len;
}

Tensor normal_tensor(Shape shape, std::uint64_t seed, const char* stream, double variance) {
  Tensor t(std::move(shape));
  CounterRng(seed, stream).fill_normal(t, 0.0f, static_cast<float>(std::sqrt(variance)));
  return t;
}

// Entry (h, a, b) of a parameter with a position axis is drawn by its coordinates
// (CounterRng::normal_at): the parameters of N tokens are the first rows (or columns) of those of
// N + T — what decoding past the context needs.
float position_draw(const CounterRng& rng, std::int64_t h, std::int64_t a, std::int64_t b, float std_dev) {
  return std_dev * static_cast<float>(rng.normal_at(h, a, b));
}

// [H, rows, cols] with entry (h, first_row + r, c) of the stream (position_draw).
Tensor position_tensor(std::int64_t h, std::int64_t rows, std::int64_t cols, std::uint64_t seed, const char* stream,
                       double variance, std::int64_t first_row = 0) {
  Tensor t(Shape{h, rows, cols});
  const CounterRng rng(seed, stream);
  const auto std_dev = static_cast<float>(std::sqrt(variance));
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t head = 0; head < h; ++head)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        t[(head * rows + r) * cols + c] = position_draw(rng, head, first_row + r, c, std_dev);
  return t;
}

// [W₂; b₂] per head for `n` positions, [H, D+1, n]: W₂'s entry (h, r, j) and b₂'s (h, 0, j).
Tensor stacked_output_weights(std::int64_t h, std::int64_t d, std::int64_t n, std::uint64_t seed) {
  Tensor stacked(Shape{h, d + 1, n});
  const CounterRng w2(seed, "synthesizer/w2"), b2(seed, "synthesizer/b2");
  const auto std_dev = static_cast<float>(std::sqrt(1.0 / static_cast<double>(d)));
  for (std::int64_t head = 0; head < h; ++head)
    for (std::int64_t r = 0; r <= d; ++r)
      for (std::int64_t j = 0; j < n; ++j)
        stacked[(head * (d + 1) + r) * n + j] =
            r < d ? position_draw(w2, head, r, j, std_dev) : position_draw(b2, head, 0, j, std_dev);
  return stacked;
}

class Synthesizer final : public Mechanism {
 public:
  Synthesizer(const Problem& problem, const SynthesizerConfig& config, std::uint64_t seed)
      : p_(problem),
        c_(config),
        seed_(seed),
        ld_(logits_ld(problem)),
        mix_(static_cast<float>(config.vanilla_weight)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, n = p_.seq_len, d = p_.head_dim, bh = p_.batch * p_.heads;
    const double inv_d = 1.0 / static_cast<double>(d);
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        w1_ = normal_tensor({h, d, d}, seed_, "synthesizer/w1", inv_d);
        b1_ = normal_tensor({h, d}, seed_, "synthesizer/b1", inv_d);
        w2_ = position_tensor(h, d, n, seed_, "synthesizer/w2", inv_d);
        b2_ = Tensor(Shape{h, n});  // b₂'s entry (h, j) is draw (h, 0, j), as in stacked_output_weights
        {
          const CounterRng b2(seed_, "synthesizer/b2");
          for (std::int64_t head = 0; head < h; ++head)
            for (std::int64_t j = 0; j < n; ++j)
              b2_[head * n + j] = position_draw(b2, head, 0, j, static_cast<float>(std::sqrt(inv_d)));
        }
        w2_with_bias_ = stack_bias(w2_, b2_);
        hidden_ = Tensor(Shape{bh, n, d + 1});
        for (std::int64_t r = 0; r < bh * n; ++r) hidden_[r * (d + 1) + d] = 1.0f;
        break;
      case SynthesizerVariant::Random:
        r_ = position_tensor(h, n, n, seed_, "synthesizer/r", 1.0);
        break;
      case SynthesizerVariant::FactorizedRandom: {
        const double variance = 1.0 / std::sqrt(static_cast<double>(c_.factor_rank));
        r1_ = position_tensor(h, n, c_.factor_rank, seed_, "synthesizer/r1", variance);
        r2_ = position_tensor(h, n, c_.factor_rank, seed_, "synthesizer/r2", variance);
        break;
      }
    }
    logits_ = Tensor(Shape{bh, n, ld_});
    if (bf16_form()) {
      if (c_.variant == SynthesizerVariant::Dense) widened_queries_ = Tensor(Shape{bh, n, d});
      if (mix_ > 0.0f) ops::prepare_bf16_matmul(scores_shape(), false);
      ops::prepare_bf16_matmul(output_shape(), true);
    }
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (bf16_form()) return forward_bf16(q, k, v, out);
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bh = p_.batch * p_.heads;
    if (mix_ > 0.0f) ops::matmul(scores_shape(), q.data(), k.data(), logits_.data());
    synthetic_logits(q.data());
    ops::softmax_rows_masked(logits_.data(), bh, n, n, ld_, p_.causal);
    ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .lda = ld_}, logits_.data(), v.data(), out.data());
    if (!decode_values_.empty()) load_caches<float>(k, v);  // the prefill of a decode
  }

  // Decode: the cached values (and keys when α > 0) of every token, and the synthesiser's
  // parameters extended to the N + T positions (dense: [W₂; b₂] [H, D+1, N+T]; random: R's rows of
  // the decoded tokens [H, T, N+T]; factorized: R₁'s rows of the decoded tokens [H, T, k] and R₂
  // [H, N+T, k]) — the same draws as a model built for N + T tokens (position_draw).
  void prepare_decode(std::int64_t tokens) override {
    const std::int64_t h = p_.heads, d = p_.head_dim, n = p_.seq_len, total = n + tokens, bh = p_.batch * p_.heads;
    decode_values_ = Tensor(Shape{bh, total, d}, p_.dtype);
    if (mix_ > 0.0f) decode_keys_ = Tensor(Shape{bh, total, d}, p_.dtype);
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        decode_synthetic_ = stacked_output_weights(h, d, total, seed_);
        decode_hidden_ = Tensor(Shape{bh, d + 1});
        break;
      case SynthesizerVariant::Random:
        decode_synthetic_ = position_tensor(h, tokens, total, seed_, "synthesizer/r", 1.0, n);
        break;
      case SynthesizerVariant::FactorizedRandom: {
        const double variance = 1.0 / std::sqrt(static_cast<double>(c_.factor_rank));
        decode_factor_rows_ = position_tensor(h, tokens, c_.factor_rank, seed_, "synthesizer/r1", variance, n);
        decode_synthetic_ = position_tensor(h, total, c_.factor_rank, seed_, "synthesizer/r2", variance);
        break;
      }
    }
    decode_logits_ = Tensor(Shape{bh, ops::padded_ld(total)});
    if (bf16_form()) decode_queries_ = Tensor(Shape{bh, d});
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (bf16_form()) return decode_step_bf16(q, k, v, out);
    const std::int64_t d = p_.head_dim, i = length_, total = decode_values_.dim(1), keys = i + 1;
    if (i >= total) throw std::logic_error("synthesizer: decode step past the prepared capacity");
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < p_.batch * p_.heads; ++bh) {
      std::copy_n(v.data() + bh * d, d, decode_values_.data() + (bh * total + i) * d);
      if (mix_ > 0.0f) std::copy_n(k.data() + bh * d, d, decode_keys_.data() + (bh * total + i) * d);
      float* logits = decode_logits_.data() + bh * decode_logits_.dim(1);
      flops += step_logits(bh, i, q.data() + bh * d, logits);
      const float sum = ops::exp_and_sum(logits, keys, ops::row_max(logits, keys, logits[0]));
      ops::gemm(false, false, 1, d, keys, 1.0f / sum, logits, keys, decode_values_.data() + bh * total * d, d, 0.0f,
                out.data() + bh * d, d);
      flops += kSoftmaxFlopsPerElement * keys;
    }
    FlopCounter::add(flops);
    ++length_;
  }

  std::vector<NamedTensor> decode_state() const override {
    if (mix_ > 0.0f) return {{"key_cache", &decode_keys_}, {"value_cache", &decode_values_}};
    return {{"value_cache", &decode_values_}};
  }

  std::vector<NamedTensor> decode_parameters() const override {
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        return {{"w2_b2", &decode_synthetic_}};
      case SynthesizerVariant::Random:
        return {{"r_decoded_rows", &decode_synthetic_}};
      case SynthesizerVariant::FactorizedRandom:
        return {{"r1_decoded_rows", &decode_factor_rows_}, {"r2", &decode_synthetic_}};
    }
    return {};
  }

  std::vector<NamedTensor> parameters() const override {
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        return {{"w1", &w1_}, {"b1", &b1_}, {"w2", &w2_}, {"b2", &b2_}};
      case SynthesizerVariant::Random:
        return {{"r", &r_}};
      case SynthesizerVariant::FactorizedRandom:
        return {{"r1", &r1_}, {"r2", &r2_}};
    }
    return {};
  }

  void prepare_backward() override {
    const std::int64_t h = p_.heads, n = p_.seq_len, d = p_.head_dim, bh = p_.batch * p_.heads;
    logit_grads_ = Tensor(logits_.shape());
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        for (auto [grad, param] :
             {std::pair{&dw1_, &w1_}, std::pair{&db1_, &b1_}, std::pair{&dw2_, &w2_}, std::pair{&db2_, &b2_}})
          *grad = Tensor(param->shape());
        stacked_grads_ = Tensor(Shape{h, d + 1, n});
        hidden_grads_ = Tensor(Shape{bh, n, d + 1});
        break;
      case SynthesizerVariant::Random:
        dr_ = Tensor(r_.shape());
        break;
      case SynthesizerVariant::FactorizedRandom:
        dr1_ = Tensor(r1_.shape());
        dr2_ = Tensor(r2_.shape());
        break;
    }
    if (bf16_form()) {
      if (c_.variant == SynthesizerVariant::Dense) query_grads_ = Tensor(Shape{bh, n, d});
      ops::prepare_bf16_matmul(value_grad_shape(), true);
      ops::prepare_bf16_matmul(probability_grad_shape(), false);
      if (accumulate()) {
        ops::prepare_bf16_matmul(query_grad_shape(), c_.variant != SynthesizerVariant::Dense);
        ops::prepare_bf16_matmul(key_grad_shape(), true);
      }
    }
  }

  // Softmax attention's backward from the saved P to dL (the logits' gradient), then dL through
  // α·Q·Kᵀ/√D and (1 − α)·L_syn to Q, K and the synthesiser's parameters (summed over the batch).
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    if (bf16_form()) return backward_bf16(q, k, v, dout, dq, dk, dv);
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bh = p_.batch * p_.heads;
    ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .trans_a = true, .lda = ld_}, logits_.data(), dout.data(),
                dv.data());
    ops::matmul({.batch = bh, .m = n, .n = n, .k = d, .trans_b = true, .ldc = ld_}, dout.data(), v.data(),
                logit_grads_.data());
    ops::softmax_backward_rows_masked(logits_.data(), logit_grads_.data(), bh, n, n, ld_, p_.causal);
    if (accumulate()) {
      const float scale = mix_ / std::sqrt(static_cast<float>(d));
      ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .lda = ld_, .alpha = scale}, logit_grads_.data(), k.data(),
                  dq.data());
      ops::matmul({.batch = bh, .m = n, .n = d, .k = n, .trans_a = true, .lda = ld_, .alpha = scale},
                  logit_grads_.data(), q.data(), dk.data());
    } else {
      dk.fill(0.0f);
      if (c_.variant != SynthesizerVariant::Dense) dq.fill(0.0f);
    }
    synthetic_backward(q.data(), dq.data(), accumulate());
  }

  std::vector<NamedTensor> saved() const override {
    if (c_.variant == SynthesizerVariant::Dense) return {{"probabilities", &logits_}, {"hidden", &hidden_}};
    return {{"probabilities", &logits_}};
  }
  std::vector<NamedTensor> parameter_gradients() const override {
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        return {{"dw1", &dw1_}, {"db1", &db1_}, {"dw2", &dw2_}, {"db2", &db2_}};
      case SynthesizerVariant::Random:
        return {{"dr", &dr_}};
      case SynthesizerVariant::FactorizedRandom:
        return {{"dr1", &dr1_}, {"dr2", &dr2_}};
    }
    return {};
  }

 private:
  // One head's logits of token i over keys 0 … i (logits: i + 1 floats), as the forward makes them.
  // Returns the FLOPs outside ops::gemm.
  std::int64_t step_logits(std::int64_t bh, std::int64_t i, const float* q, float* logits) {
    const std::int64_t h = bh % p_.heads, d = p_.head_dim, n = p_.seq_len, keys = i + 1;
    const std::int64_t total = decode_values_.dim(1);
    std::int64_t flops = 0;
    const float mix_scale = mix_ / std::sqrt(static_cast<float>(d));
    if (mix_ > 0.0f)
      flops += bf16_form() ? row_scores(q, decode_keys_.bf16_data() + bh * total * d, keys, d, mix_scale, logits)
                           : row_scores(q, decode_keys_.data() + bh * total * d, keys, d, mix_scale, logits);
    const float beta = accumulate() ? 1.0f : 0.0f;
    switch (c_.variant) {
      case SynthesizerVariant::Dense: {
        float* hidden = decode_hidden_.data() + bh * (d + 1);
        ops::gemm(false, false, 1, d, d, 1.0f, q, d, w1_.data() + h * d * d, d, 0.0f, hidden, d + 1);
        for (std::int64_t c = 0; c < d; ++c) hidden[c] = std::max(hidden[c] + b1_[h * d + c], 0.0f);
        hidden[d] = 1.0f;
        ops::gemm(false, false, 1, keys, d + 1, synthetic_weight(), hidden, d + 1,
                  decode_synthetic_.data() + h * (d + 1) * total, total, beta, logits, keys);
        flops += 2 * d;
        break;
      }
      case SynthesizerVariant::Random: {
        const float* row = decode_synthetic_.data() + (h * (total - n) + i - n) * total;
        if (accumulate()) {
          for (std::int64_t j = 0; j < keys; ++j) logits[j] += synthetic_weight() * row[j];
          flops += 2 * keys;
        } else {
          std::copy_n(row, keys, logits);
        }
        break;
      }
      case SynthesizerVariant::FactorizedRandom: {
        const std::int64_t k = c_.factor_rank;
        ops::gemm(false, true, 1, keys, k, synthetic_weight(),
                  decode_factor_rows_.data() + (h * (total - n) + i - n) * k, k,
                  decode_synthetic_.data() + h * total * k, k, beta, logits, keys);
        break;
      }
    }
    return flops;
  }

  bool bf16_form() const { return p_.dtype == DType::BF16; }
  ops::MatmulShape scores_shape() const {  // α·Q·Kᵀ/√D into the logits
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    return {.batch = p_.batch * p_.heads,
            .m = n,
            .n = n,
            .k = d,
            .trans_b = true,
            .ldc = ld_,
            .alpha = mix_ / std::sqrt(static_cast<float>(d))};
  }
  ops::MatmulShape output_shape() const {  // P·V, P bf16 over the logits' bytes (row stride 2·ld)
    const std::int64_t n = p_.seq_len;
    return {.batch = p_.batch * p_.heads, .m = n, .n = p_.head_dim, .k = n, .lda = 2 * ld_, .stride_a = 2 * n * ld_};
  }
  const bf16* probabilities() const { return reinterpret_cast<const bf16*>(logits_.data()); }
  // The bf16 backward's products (P and dS bf16 over their fp32 buffers, row stride 2·ld): dV = Pᵀ·dO,
  // dP = dO·Vᵀ (fp32), dQ (+)= α/√D·dS·K (fp32 into the dense form's accumulator, else bf16), dK =
  // α/√D·dSᵀ·Q.
  ops::MatmulShape value_grad_shape() const {
    const std::int64_t n = p_.seq_len;
    return {.batch = p_.batch * p_.heads,
            .m = n,
            .n = p_.head_dim,
            .k = n,
            .trans_a = true,
            .lda = 2 * ld_,
            .stride_a = 2 * n * ld_};
  }
  ops::MatmulShape probability_grad_shape() const {
    return {
        .batch = p_.batch * p_.heads, .m = p_.seq_len, .n = p_.seq_len, .k = p_.head_dim, .trans_b = true, .ldc = ld_};
  }
  ops::MatmulShape query_grad_shape() const {
    const std::int64_t n = p_.seq_len;
    return {.batch = p_.batch * p_.heads,
            .m = n,
            .n = p_.head_dim,
            .k = n,
            .lda = 2 * ld_,
            .stride_a = 2 * n * ld_,
            .alpha = mix_ / std::sqrt(static_cast<float>(p_.head_dim)),
            .accumulate = c_.variant == SynthesizerVariant::Dense};
  }
  ops::MatmulShape key_grad_shape() const {
    ops::MatmulShape shape = query_grad_shape();
    shape.trans_a = true;
    shape.accumulate = false;
    return shape;
  }

  // The bf16 backward (synthesizer.hpp): dV and dP on the bf16 matmul from the saved bf16 P; dL =
  // P·(dP − Σ P·dP) in fp32, which feeds the synthesiser's parameter gradients as in fp32 (dense: on
  // Q widened, dQ's part into an fp32 accumulator); then, α > 0, dL rounded to bf16 in place for
  // dQ and dK on the bf16 matmul. dq, dk, dv are rounded once.
  void backward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, Tensor& dq, Tensor& dk,
                     Tensor& dv) {
    const std::int64_t n = p_.seq_len, bh = p_.batch * p_.heads;
    ops::matmul(value_grad_shape(), probabilities(), dout.bf16_data(), dv.bf16_data());
    ops::matmul(probability_grad_shape(), dout.bf16_data(), v.bf16_data(), logit_grads_.data());
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t r = 0; r < bh * n; ++r) {
      const std::int64_t valid = p_.causal ? r % n + 1 : n;
      const bf16* p = probabilities() + r * 2 * ld_;
      float* grad = logit_grads_.data() + r * ld_;
      float delta = 0.0f;
      for (std::int64_t j = 0; j < valid; ++j) delta += to_float(p[j]) * grad[j];
#pragma omp simd
      for (std::int64_t j = 0; j < valid; ++j) grad[j] = to_float(p[j]) * (grad[j] - delta);
      std::fill(grad + valid, grad + n, 0.0f);
    }
    FlopCounter::add(bh * kSoftmaxBackwardFlopsPerElement * softmax_entries(p_));
    const bool dense = c_.variant == SynthesizerVariant::Dense;
    if (dense) widen(q.bf16_data(), widened_queries_.data(), q.size());
    synthetic_backward(dense ? widened_queries_.data() : nullptr, dense ? query_grads_.data() : nullptr, false);
    if (accumulate()) {
#pragma omp parallel for num_threads(p_.threads) schedule(static)
      for (std::int64_t r = 0; r < bh * n; ++r)
        round_row_in_place(logit_grads_.data() + r * ld_, n, [](std::int64_t, float x) { return x; });
      const auto* score_grads = reinterpret_cast<const bf16*>(logit_grads_.data());
      if (dense)
        ops::matmul(query_grad_shape(), score_grads, k.bf16_data(), query_grads_.data());
      else
        ops::matmul(query_grad_shape(), score_grads, k.bf16_data(), dq.bf16_data());
      ops::matmul(key_grad_shape(), score_grads, q.bf16_data(), dk.bf16_data());
    } else {
      std::fill_n(dk.bf16_data(), dk.size(), bf16{});
      if (!dense) std::fill_n(dq.bf16_data(), dq.size(), bf16{});
    }
    if (dense) narrow(query_grads_.data(), dq.bf16_data(), dq.size());
  }

  // The bf16 form (header of synthesizer.hpp): α·Q·Kᵀ/√D on the bf16 matmul into fp32 logits, the
  // synthetic logits in fp32 (dense: on the queries widened), softmax in fp32 with P rounded to
  // bf16 in place, O = P·V on the bf16 matmul rounded to bf16.
  void forward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t n = p_.seq_len, bh = p_.batch * p_.heads;
    if (mix_ > 0.0f) ops::matmul(scores_shape(), q.bf16_data(), k.bf16_data(), logits_.data());
    if (c_.variant == SynthesizerVariant::Dense) widen(q.bf16_data(), widened_queries_.data(), q.size());
    synthetic_logits(widened_queries_.empty() ? nullptr : widened_queries_.data());
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t r = 0; r < bh * n; ++r)
      softmax_row_to_bf16(logits_.data() + r * ld_, n, p_.causal ? r % n + 1 : n);
    FlopCounter::add(bh * kSoftmaxFlopsPerElement * softmax_entries(p_));
    ops::matmul(output_shape(), probabilities(), v.bf16_data(), out.bf16_data());
    if (!decode_values_.empty()) load_caches<bf16>(k, v);
  }

  // (1 − α)·L_syn into the logits, added to α·Q·Kᵀ/√D when α > 0; q: fp32 [B, H, N, D] (dense only).
  void synthetic_logits(const float* q) {
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        dense_logits(q);
        break;
      case SynthesizerVariant::Random:
        random_logits();
        break;
      case SynthesizerVariant::FactorizedRandom:
        factorized_logits();
        break;
    }
  }

  // dL (logit_grads_) through (1 − α)·L_syn into the synthesiser's parameters; dense: q, dq fp32
  // [B, H, N, D], dQ's part added to dq with add_to_dq.
  void synthetic_backward(const float* q, float* dq, bool add_to_dq) {
    switch (c_.variant) {
      case SynthesizerVariant::Dense:
        dense_backward(q, dq, add_to_dq);
        break;
      case SynthesizerVariant::Random:
        random_backward();
        break;
      case SynthesizerVariant::FactorizedRandom:
        factorized_backward();
        break;
    }
  }

  // The prefill of a decode: the context's values (and keys) into the caches (T: their type).
  template <class T>
  void load_caches(const Tensor& k, const Tensor& v) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, total = decode_values_.dim(1);
    for (std::int64_t head = 0; head < p_.batch * p_.heads; ++head) {
      std::copy_n(elements<T>(v) + head * n * d, n * d, elements<T>(decode_values_) + head * total * d);
      if (mix_ > 0.0f) std::copy_n(elements<T>(k) + head * n * d, n * d, elements<T>(decode_keys_) + head * total * d);
    }
    length_ = n;
  }

  // A bf16 step: the cached values (and keys) bf16, the query widened; the logit row and softmax in
  // fp32, P rounded to bf16 as the forward rounds it, P·V summed in fp32 and rounded once.
  void decode_step_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t d = p_.head_dim, i = length_, total = decode_values_.dim(1), keys = i + 1;
    if (i >= total) throw std::logic_error("synthesizer: decode step past the prepared capacity");
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < p_.batch * p_.heads; ++bh) {
      bf16* values = decode_values_.bf16_data() + bh * total * d;
      std::copy_n(v.bf16_data() + bh * d, d, values + i * d);
      if (mix_ > 0.0f) std::copy_n(k.bf16_data() + bh * d, d, decode_keys_.bf16_data() + (bh * total + i) * d);
      float* query = decode_queries_.data() + bh * d;
      widen(q.bf16_data() + bh * d, query, d);
      float* logits = decode_logits_.data() + bh * decode_logits_.dim(1);
      flops += step_logits(bh, i, query, logits);
      const float inverse = 1.0f / ops::exp_and_sum(logits, keys, ops::row_max(logits, keys, logits[0]));
      for (std::int64_t j = 0; j < keys; ++j) logits[j] = round_to_bf16(logits[j] * inverse);
      float* acc = query;  // the query is no longer needed
      flops += kSoftmaxFlopsPerElement * keys + weigh_rows(logits, values, keys, d, acc);
      narrow(acc, out.bf16_data() + bh * d, d);
    }
    FlopCounter::add(flops);
    ++length_;
  }

  float synthetic_weight() const { return 1.0f - mix_; }
  bool accumulate() const { return mix_ > 0.0f; }
  float* logits(std::int64_t b, std::int64_t h) { return logits_.data() + (b * p_.heads + h) * p_.seq_len * ld_; }

  // [W₂; b₂] per head: [H, D+1, N], so the product with [ReLU(…) | 1] adds the bias.
  static Tensor stack_bias(const Tensor& w2, const Tensor& b2) {
    const std::int64_t h = w2.dim(0), d = w2.dim(1), n = w2.dim(2);
    Tensor stacked(Shape{h, d + 1, n});
    for (std::int64_t head = 0; head < h; ++head) {
      std::copy(w2.data() + head * d * n, w2.data() + (head + 1) * d * n, stacked.data() + head * (d + 1) * n);
      std::copy(b2.data() + head * n, b2.data() + (head + 1) * n, stacked.data() + (head * (d + 1) + d) * n);
    }
    return stacked;
  }

  // hidden = [ReLU(Q·W₁ + b₁) | 1]: [B·H, N, D+1];  logits (+)= (1 − α)·hidden·[W₂; b₂]. q: fp32
  // [B, H, N, D].
  void dense_logits(const float* q) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, h = p_.heads, ld = d + 1;
    for (std::int64_t b = 0; b < p_.batch; ++b)
      ops::matmul({.batch = h, .m = n, .n = d, .k = d, .ldc = ld}, q + b * h * n * d, w1_.data(),
                  hidden_.data() + b * h * n * ld);
    const std::int64_t rows = p_.batch * h * n;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = hidden_.data() + r * ld;
      const float* bias = b1_.data() + (r / n) % h * d;
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) {
        const float x = row[c] + bias[c];
        row[c] = x > 0.0f ? x : 0.0f;
      }
    }
    for (std::int64_t b = 0; b < p_.batch; ++b)
      ops::matmul(
          {.batch = h, .m = n, .n = n, .k = ld, .ldc = ld_, .alpha = synthetic_weight(), .accumulate = accumulate()},
          hidden_.data() + b * h * n * ld, w2_with_bias_.data(), logits(b, 0));
    FlopCounter::add(rows * 2 * d);
  }

  void random_logits() {
    const std::int64_t n = p_.seq_len, h = p_.heads, rows = p_.batch * h * n;
    const float weight = synthetic_weight();
    const bool add = accumulate();
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* row = logits_.data() + r * ld_;
      const float* src = r_.data() + ((r / n) % h * n + r % n) * n;
      if (add) {
#pragma omp simd
        for (std::int64_t j = 0; j < n; ++j) row[j] += weight * src[j];
      } else {
        std::copy(src, src + n, row);
      }
    }
    if (add) FlopCounter::add(rows * 2 * n);
  }

  void factorized_logits() {
    const std::int64_t n = p_.seq_len, k = c_.factor_rank;
    for (std::int64_t b = 0; b < p_.batch; ++b)
      ops::matmul({.batch = p_.heads,
                   .m = n,
                   .n = n,
                   .k = k,
                   .trans_b = true,
                   .ldc = ld_,
                   .alpha = synthetic_weight(),
                   .accumulate = accumulate()},
                  r1_.data(), r2_.data(), logits(b, 0));
  }

  // d[W₂; b₂] = (1 − α)·Σ_b hiddenᵀ·dL;  d hidden = (1 − α)·dL·[W₂; b₂]ᵀ, masked by the ReLU;
  // db₁ = Σ rows of it, dW₁ = Σ_b Qᵀ·it, dQ (+)= it·W₁ᵀ (added with add_to_dq). q, dq: fp32 [B, H, N, D].
  void dense_backward(const float* q, float* dq, bool add_to_dq) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, h = p_.heads, ld = d + 1;
    for (std::int64_t b = 0; b < p_.batch; ++b) {
      const float* logit_grads = logit_grads_.data() + b * h * n * ld_;
      ops::matmul({.batch = h,
                   .m = ld,
                   .n = n,
                   .k = n,
                   .trans_a = true,
                   .lda = ld,
                   .ldb = ld_,
                   .alpha = synthetic_weight(),
                   .accumulate = b > 0},
                  hidden_.data() + b * h * n * ld, logit_grads, stacked_grads_.data());
      ops::matmul({.batch = h, .m = n, .n = ld, .k = n, .trans_b = true, .lda = ld_, .alpha = synthetic_weight()},
                  logit_grads, w2_with_bias_.data(), hidden_grads_.data() + b * h * n * ld);
    }
    const std::int64_t rows = p_.batch * h * n;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      float* grad = hidden_grads_.data() + r * ld;
      const float* hidden = hidden_.data() + r * ld;
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) grad[c] = hidden[c] > 0.0f ? grad[c] : 0.0f;
    }
    db1_.fill(0.0f);
    for (std::int64_t r = 0; r < rows; ++r) {
      float* bias = db1_.data() + (r / n) % h * d;
      const float* grad = hidden_grads_.data() + r * ld;
#pragma omp simd
      for (std::int64_t c = 0; c < d; ++c) bias[c] += grad[c];
    }
    for (std::int64_t b = 0; b < p_.batch; ++b) {
      ops::matmul({.batch = h, .m = d, .n = d, .k = n, .trans_a = true, .ldb = ld, .accumulate = b > 0},
                  q + b * h * n * d, hidden_grads_.data() + b * h * n * ld, dw1_.data());
      ops::matmul({.batch = h, .m = n, .n = d, .k = d, .trans_b = true, .lda = ld, .accumulate = add_to_dq},
                  hidden_grads_.data() + b * h * n * ld, w1_.data(), dq + b * h * n * d);
    }
    for (std::int64_t head = 0; head < h; ++head) {
      std::copy_n(stacked_grads_.data() + head * ld * n, d * n, dw2_.data() + head * d * n);
      std::copy_n(stacked_grads_.data() + (head * ld + d) * n, n, db2_.data() + head * n);
    }
    FlopCounter::add(2 * rows * d);  // the ReLU mask and db₁
  }

  // dR = (1 − α)·Σ_b dL.
  void random_backward() {
    const std::int64_t n = p_.seq_len, h = p_.heads;
    const float weight = synthetic_weight();
    dr_.fill(0.0f);
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t row = 0; row < h * n; ++row)
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const float* src = logit_grads_.data() + ((b * h * n) + row) * ld_;
        float* dst = dr_.data() + row * n;
#pragma omp simd
        for (std::int64_t j = 0; j < n; ++j) dst[j] += weight * src[j];
      }
    FlopCounter::add(2 * p_.batch * h * n * n);
  }

  // dR₁ = (1 − α)·Σ_b dL·R₂, dR₂ = (1 − α)·Σ_b dLᵀ·R₁.
  void factorized_backward() {
    const std::int64_t n = p_.seq_len, h = p_.heads, k = c_.factor_rank;
    for (std::int64_t b = 0; b < p_.batch; ++b) {
      const float* logit_grads = logit_grads_.data() + b * h * n * ld_;
      ops::matmul({.batch = h, .m = n, .n = k, .k = n, .lda = ld_, .alpha = synthetic_weight(), .accumulate = b > 0},
                  logit_grads, r2_.data(), dr1_.data());
      ops::matmul({.batch = h,
                   .m = n,
                   .n = k,
                   .k = n,
                   .trans_a = true,
                   .lda = ld_,
                   .alpha = synthetic_weight(),
                   .accumulate = b > 0},
                  logit_grads, r1_.data(), dr2_.data());
    }
  }

  Problem p_;
  SynthesizerConfig c_;
  std::uint64_t seed_;
  std::int64_t ld_;
  float mix_;
  Tensor w1_, b1_, w2_, b2_, w2_with_bias_, hidden_, r_, r1_, r2_, logits_;
  Tensor widened_queries_;  // bf16 form, dense: Q widened [B·H, N, D]
  // Training only (prepare_backward).
  Tensor logit_grads_, dw1_, db1_, dw2_, db2_, stacked_grads_, hidden_grads_, dr_, dr1_, dr2_;
  Tensor query_grads_;  // bf16 form, dense: dQ accumulated in fp32 [B·H, N, D]
  // Decoding only (prepare_decode): caches [B·H, N+T, D] (bf16 in the bf16 form), the extended synthesiser parameters,
  // per head the hidden layer and the logit row.
  Tensor decode_values_, decode_keys_, decode_synthetic_, decode_factor_rows_, decode_hidden_, decode_logits_;
  Tensor decode_queries_;  // bf16 form: per head the step's query widened (then its fp32 output) [B·H, D]
  std::int64_t length_ = 0;
};

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const SynthesizerConfig& c, std::uint64_t seed) {
  return std::make_unique<Synthesizer>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const SynthesizerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  const bool mixed = static_cast<float>(c.vanilla_weight) > 0.0f;
  std::int64_t per_head = kSoftmaxFlopsPerElement * softmax_entries(p) + matmul_flops(n, d, n);
  if (mixed) per_head += matmul_flops(n, n, d);
  switch (c.variant) {
    case SynthesizerVariant::Dense:
      per_head += matmul_flops(n, d, d) + 2 * n * d + matmul_flops(n, n, d + 1);
      break;
    case SynthesizerVariant::Random:
      per_head += mixed ? 2 * n * n : 0;
      break;
    case SynthesizerVariant::FactorizedRandom:
      per_head += matmul_flops(n, n, c.factor_rank);
      break;
  }
  return p.batch * p.heads * per_head;
}

std::int64_t decode_workspace(const Problem& p, const SynthesizerConfig& c, std::int64_t tokens) {
  const std::int64_t h = p.heads, d = p.head_dim, n = p.seq_len, total = n + tokens, bh = p.batch * p.heads;
  const std::int64_t cache_bytes = bh * total * d * (c.vanilla_weight > 0 ? 2 : 1) * element_bytes(p.dtype);
  std::int64_t floats = bh * ops::padded_ld(total) + (p.dtype == DType::BF16 ? bh * d : 0);
  switch (c.variant) {
    case SynthesizerVariant::Dense:
      floats += h * (d + 1) * total + bh * (d + 1);
      break;
    case SynthesizerVariant::Random:
      floats += h * tokens * total;
      break;
    case SynthesizerVariant::FactorizedRandom:
      floats += h * (tokens + total) * c.factor_rank;
      break;
  }
  return floats * static_cast<std::int64_t>(sizeof(float)) + cache_bytes;
}

std::int64_t workspace(const Problem& p, const SynthesizerConfig& c) {
  const std::int64_t h = p.heads, n = p.seq_len, d = p.head_dim, bh = p.batch * p.heads;
  std::int64_t floats = bh * n * logits_ld(p);
  switch (c.variant) {
    case SynthesizerVariant::Dense:
      floats += h * (d * d + d + d * n + n) + h * (d + 1) * n + bh * n * (d + 1);
      if (p.dtype == DType::BF16) floats += bh * n * d;  // widened_queries_
      break;
    case SynthesizerVariant::Random:
      floats += h * n * n;
      break;
    case SynthesizerVariant::FactorizedRandom:
      floats += 2 * h * n * c.factor_rank;
      break;
  }
  return floats * static_cast<std::int64_t>(sizeof(float));
}

// Per (batch, head): dV, dP (2·N²·D each), softmax backward 4 per entry; α > 0: dQ, dK (2·N²·D
// each); dense: d[W₂; b₂] and d hidden (2·N²·(D+1) each), ReLU mask and db₁ (2·N·D), dW₁ and dQ
// (2·N·D² each); random: 2·N²; factorized: 2·2·N²·k.
std::int64_t backward_flops(const Problem& p, const SynthesizerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim;
  std::int64_t per_head = 2 * matmul_flops(n, n, d) + kSoftmaxBackwardFlopsPerElement * softmax_entries(p);
  if (static_cast<float>(c.vanilla_weight) > 0.0f) per_head += 2 * matmul_flops(n, n, d);
  switch (c.variant) {
    case SynthesizerVariant::Dense:
      per_head += 2 * matmul_flops(n, n, d + 1) + 2 * n * d + 2 * matmul_flops(n, d, d);
      break;
    case SynthesizerVariant::Random:
      per_head += 2 * n * n;
      break;
    case SynthesizerVariant::FactorizedRandom:
      per_head += 2 * matmul_flops(n, c.factor_rank, n);
      break;
  }
  return p.batch * p.heads * per_head;
}

// The gradients mirror the forward's buffers: dL as the logits, each parameter's gradient as the
// parameter, and (dense) the stacked [W₂; b₂] and hidden-layer gradients as those buffers; bf16
// dense: dQ's fp32 accumulator as the widened queries.
std::int64_t backward_workspace(const Problem& p, const SynthesizerConfig& c) { return workspace(p, c); }

FieldTable<SynthesizerConfig> config_fields(const SynthesizerConfig*) {
  return {choice_field("variant", &SynthesizerConfig::variant,
                       {{"dense", SynthesizerVariant::Dense},
                        {"random", SynthesizerVariant::Random},
                        {"factorized-random", SynthesizerVariant::FactorizedRandom}},
                       "how the logits are synthesised: per-token MLP, fixed random N×N, or R₁·R₂ᵀ"),
          int_field("factor_rank", &SynthesizerConfig::factor_rank, 1, 4096,
                    "k of the factorized-random R₁·R₂ᵀ (R₁, R₂: N×k)"),
          real_field("vanilla_weight", &SynthesizerConfig::vanilla_weight, 0, 1,
                     "weight α of Q·Kᵀ/√D mixed into the logits (\"+ Vanilla\"); 0 = pure synthesizer")};
}

template <>
Implementation implementation<SynthesizerConfig>() {
  Implementation impl = implement<SynthesizerConfig>();
  impl.bf16_forward = true;  // forward and decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
