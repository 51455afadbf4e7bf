#include "taxonomy/downsampling/tokenlearner.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {
namespace {

constexpr float kLayerNormEps = 1e-6f;
// Rows of the weight MLP per step (its buffers stay in cache).
constexpr std::int64_t kChunkRows = 256;

std::int64_t chunk_rows(const Problem& p) { return std::min(kChunkRows, p.seq_len); }
std::int64_t chunks(const Problem& p) { return (p.seq_len + kChunkRows - 1) / kChunkRows; }

// erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7), branch-free so the loops vectorise.
inline float fast_erf(float x) {
  const float a = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * a);
  const float poly =
      t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f + t * 1.061405429f))));
  const float magnitude = 1.0f - poly * ops::fast_exp(-a * a);
  return std::copysign(magnitude, x);
}

constexpr float kInverseSqrt2 = 0.70710678118654752f;
constexpr float kInverseSqrt2Pi = 0.39894228040143268f;

// x := GELU(x + bias) over a [rows, f] block (bias per column).
void bias_gelu(float* x, const float* bias, std::int64_t rows, std::int64_t f) {
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = x + r * f;
#pragma omp simd
    for (std::int64_t j = 0; j < f; ++j) {
      const float z = row[j] + bias[j];
      row[j] = 0.5f * z * (1.0f + fast_erf(z * kInverseSqrt2));
    }
  }
}

// The bf16 form's fp32 floats per thread: α [S, ld] and a widened chunk of v [chunk rows, D] while
// the weights are computed; later the widened tokens [3, S, D], the scores [S, S] and O [S, D].
std::int64_t bf16_thread_floats(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t d = p.head_dim, s = c.tokens;
  return std::max(s * ops::padded_ld(p.seq_len) + chunk_rows(p) * d, 4 * s * d + s * s);
}

// The bf16 form's backward adds per thread fp32 Q̃, K̃, Ṽ [3, S, D], P [S, S], dO [S, D] (widened) and
// a chunk's gradient rows [chunk rows, D]; α and a chunk of x widen into bf16_thread_floats.
std::int64_t bf16_backward_floats(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t d = p.head_dim, s = c.tokens;
  return 4 * s * d + s * s + chunk_rows(p) * d;
}

class TokenLearner final : public Mechanism {
 public:
  TokenLearner(const Problem& problem, const TokenLearnerConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed), ld_(ops::padded_ld(problem.seq_len)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, d = p_.head_dim, f = c_.bottleneck, s = c_.tokens;
    ln_gains_ = Tensor(Shape{h, d});
    ln_shifts_ = Tensor(Shape{h, d});
    w1_ = Tensor(Shape{h, d, f});
    b1_ = Tensor(Shape{h, f});
    w2_ = Tensor(Shape{h, f, s});
    b2_ = Tensor(Shape{h, s});
    CounterRng(seed_, "tokenlearner/ln_gains").fill_normal(ln_gains_, 1.0f, 0.1f);
    CounterRng(seed_, "tokenlearner/ln_shifts").fill_normal(ln_shifts_, 0.0f, 0.1f);
    CounterRng(seed_, "tokenlearner/w1").fill_normal(w1_, 0.0f, std::sqrt(2.0f / static_cast<float>(d + f)));
    CounterRng(seed_, "tokenlearner/b1").fill_normal(b1_, 0.0f, 0.1f);
    CounterRng(seed_, "tokenlearner/w2").fill_normal(w2_, 0.0f, std::sqrt(2.0f / static_cast<float>(f + s)));
    CounterRng(seed_, "tokenlearner/b2").fill_normal(b2_, 0.0f, 0.1f);
    const std::int64_t bh = p_.batch * h, rows = chunk_rows(p_);
    weights_ = Tensor(Shape{bh, s, ld_}, p_.dtype);
    pooled_ = Tensor(Shape{3, bh, s, d}, p_.dtype);
    probs_ = Tensor(Shape{bh, s, s}, p_.dtype);
    normalised_ = Tensor(Shape{p_.threads, rows, d});
    hidden_ = Tensor(Shape{p_.threads, rows, f});
    if (p_.dtype == DType::BF16) {
      widened_ = Tensor(Shape{p_.threads, bf16_thread_floats(p_, c_)});
      ops::prepare_bf16_matmul(pooling_shape(), true);
    }
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (p_.dtype == DType::BF16) return forward_bf16(q, k, v, out);
    const std::int64_t heads = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < heads; ++bh) flops += head_forward(bh, q, k, v, out, omp_get_thread_num());
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> parameters() const override {
    return {
        {"ln_gains", &ln_gains_}, {"ln_shifts", &ln_shifts_}, {"w1", &w1_}, {"b1", &b1_}, {"w2", &w2_}, {"b2", &b2_}};
  }

  void prepare_backward() override {
    const std::int64_t s = c_.tokens, d = p_.head_dim, f = c_.bottleneck, rows = chunk_rows(p_);
    d_ln_gains_ = Tensor(ln_gains_.shape());
    d_ln_shifts_ = Tensor(ln_shifts_.shape());
    d_w1_ = Tensor(w1_.shape());
    d_b1_ = Tensor(b1_.shape());
    d_w2_ = Tensor(w2_.shape());
    d_b2_ = Tensor(b2_.shape());
    weight_grads_ = Tensor(Shape{p_.threads, s, ld_});
    token_grads_ = Tensor(Shape{p_.threads, 3 * s * d + s * s});
    mlp_grads_ = Tensor(Shape{p_.threads, 2, rows, f});
    row_grads_ = Tensor(Shape{p_.threads, 2, rows, d});
    norm_grads_ = Tensor(Shape{p_.threads, 2, d});
    if (p_.dtype == DType::BF16) bf16_grads_ = Tensor(Shape{p_.threads, bf16_backward_floats(p_, c_)});
  }

  std::vector<NamedTensor> saved() const override {
    return {{"weights", &weights_}, {"pooled_qkv", &pooled_}, {"token_attention", &probs_}};
  }

  std::vector<NamedTensor> parameter_gradients() const override {
    return {{"dln_gains", &d_ln_gains_},
            {"dln_shifts", &d_ln_shifts_},
            {"dw1", &d_w1_},
            {"db1", &d_b1_},
            {"dw2", &d_w2_},
            {"db2", &d_b2_}};
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < p_.heads; ++head) {
      const int thread = omp_get_thread_num();
      zero_head_gradients(head);
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const Grads g{q, k, v, dout, dq, dk, dv};
        flops += p_.dtype == DType::BF16 ? head_backward_bf16(b * p_.heads + head, g, thread)
                                         : head_backward(b * p_.heads + head, g, thread);
      }
    }
    FlopCounter::add(flops);
  }

 private:
  struct Grads {
    const Tensor &q, &k, &v, &dout;
    Tensor &dq, &dk, &dv;
  };

  // One head's parameter pointers.
  struct HeadParams {
    const float *gain, *shift, *w1, *b1, *w2, *b2;
  };
  HeadParams head_params(std::int64_t head) const {
    const std::int64_t d = p_.head_dim, f = c_.bottleneck, s = c_.tokens;
    return {ln_gains_.data() + head * d, ln_shifts_.data() + head * d, w1_.data() + head * d * f,
            b1_.data() + head * f,       w2_.data() + head * f * s,    b2_.data() + head * s};
  }

  float* pooled(std::int64_t which, std::int64_t bh) {
    return pooled_.data() + (which * p_.batch * p_.heads + bh) * c_.tokens * p_.head_dim;
  }

  // LN, Dense 1 and GELU of `rows` rows of v ([rows, D]) into the thread's normalised_ and hidden_.
  // Returns the FLOPs outside oneDNN.
  std::int64_t mlp_hidden(const HeadParams& w, const float* v_rows, std::int64_t rows, int thread) {
    const std::int64_t d = p_.head_dim, f = c_.bottleneck;
    float* xn = normalised_.data() + thread * normalised_.dim(1) * d;
    float* hid = hidden_.data() + thread * hidden_.dim(1) * f;
    ops::layer_norm_rows(v_rows, xn, rows, d, w.gain, w.shift, kLayerNormEps);
    ops::gemm(false, false, rows, f, d, 1.0f, xn, d, w.w1, f, 0.0f, hid, f);
    bias_gelu(hid, w.b1, rows, f);
    return kLayerNormFlopsPerElement * rows * d + (1 + kGeluFlopsPerElement) * rows * f;
  }

  // α of one (batch, head) in fp32 ([S, ld_]) from its values vh ([N, D], T = float or bf16; bf16
  // rows widened a chunk at a time into `scratch`, [chunk rows, D]). Returns the FLOPs outside oneDNN.
  template <class T>
  std::int64_t token_weights(std::int64_t bh, const T* vh, float* alpha, float* scratch, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, f = c_.bottleneck, s = c_.tokens;
    const HeadParams w = head_params(bh % p_.heads);
    const float* hid = hidden_.data() + thread * hidden_.dim(1) * f;
    std::int64_t flops = 0;
    for (std::int64_t r0 = 0; r0 < n; r0 += kChunkRows) {
      const std::int64_t rows = std::min(kChunkRows, n - r0);
      flops += mlp_hidden(w, fp32_rows(vh, r0, rows, d, scratch), rows, thread);
      ops::gemm(true, true, s, rows, f, 1.0f, w.w2, s, hid, f, 0.0f, alpha + r0, ld_);  // logitsᵀ
    }
    for (std::int64_t t = 0; t < s; ++t) {
      float* row = alpha + t * ld_;
      const float bias = w.b2[t];
#pragma omp simd
      for (std::int64_t j = 0; j < n; ++j) row[j] += bias;
      ops::softmax_in_place(row, n);
    }
    return flops + (1 + kSoftmaxFlopsPerElement) * s * n;
  }

  std::int64_t head_forward(std::int64_t bh, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                            int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, s = c_.tokens;
    const float* vh = v.data() + bh * n * d;
    float* alpha = weights_.data() + bh * s * ld_;
    std::int64_t flops = token_weights(bh, vh, alpha, nullptr, thread);
    float* tq = pooled(0, bh);
    float* tk = pooled(1, bh);
    float* tv = pooled(2, bh);
    ops::gemm(false, false, s, d, n, 1.0f, alpha, ld_, q.data() + bh * n * d, d, 0.0f, tq, d);
    ops::gemm(false, false, s, d, n, 1.0f, alpha, ld_, k.data() + bh * n * d, d, 0.0f, tk, d);
    ops::gemm(false, false, s, d, n, 1.0f, alpha, ld_, vh, d, 0.0f, tv, d);
    float* attention = probs_.data() + bh * s * s;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, s, s, d, scale, tq, d, tk, d, 0.0f, attention, s);
    for (std::int64_t t = 0; t < s; ++t) ops::softmax_in_place(attention + t * s, s);
    ops::gemm(false, false, s, d, s, 1.0f, attention, s, tv, d, 0.0f, out.data() + bh * s * d, d);
    return flops + kSoftmaxFlopsPerElement * s * s;
  }

  // The bf16 form's pooling: Q̃, K̃, Ṽ [B·H, S, D] = bf16(α·x) for the bf16 α and x, one batched
  // product per tensor (outside the head loop: the fallback below AVX-512 uses the scratchpad).
  ops::MatmulShape pooling_shape() const {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, s = c_.tokens;
    return {.batch = p_.batch * p_.heads,
            .m = s,
            .n = d,
            .k = n,
            .lda = ld_,
            .stride_a = s * ld_,
            .stride_b = n * d,
            .stride_c = s * d};
  }

  // bf16 (header): α in fp32 per head, rounded to bf16; Q̃, K̃, Ṽ = bf16(α·x) on the bf16 matmul
  // (fp32 sums); the token attention in fp32 on the widened tokens, P rounded to bf16 (kept) before
  // P·Ṽ, the output rounded.
  void forward_bf16(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t heads = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, s = c_.tokens;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < heads; ++bh) {
      float* alpha = thread_floats(omp_get_thread_num());
      flops += token_weights(bh, v.bf16_data() + bh * n * d, alpha, alpha + s * ld_, omp_get_thread_num());
      for (std::int64_t t = 0; t < s; ++t) narrow(alpha + t * ld_, weights_.bf16_data() + (bh * s + t) * ld_, n);
    }
    const Tensor* inputs[3] = {&q, &k, &v};
    for (std::int64_t which = 0; which < 3; ++which)
      ops::matmul(pooling_shape(), weights_.bf16_data(), inputs[which]->bf16_data(),
                  pooled_.bf16_data() + which * heads * s * d);
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < heads; ++bh) flops += token_attention_bf16(bh, out, omp_get_thread_num());
    FlopCounter::add(flops);
  }

  // One head's attention over its S bf16 tokens: widened into the thread's rows, S·Kᵀ/√D and the
  // softmax in fp32, P rounded to bf16 (probs_), out = bf16(P·Ṽ).
  std::int64_t token_attention_bf16(std::int64_t bh, Tensor& out, int thread) {
    const std::int64_t heads = p_.batch * p_.heads, d = p_.head_dim, s = c_.tokens;
    float* tokens = thread_floats(thread);  // Q̃, K̃, Ṽ [3, S, D], then the scores [S, S], then O [S, D]
    float* attention = tokens + 3 * s * d;
    float* result = attention + s * s;
    for (std::int64_t which = 0; which < 3; ++which)
      widen(pooled_.bf16_data() + (which * heads + bh) * s * d, tokens + which * s * d, s * d);
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(false, true, s, s, d, scale, tokens, d, tokens + s * d, d, 0.0f, attention, s);
    bf16* probs = probs_.bf16_data() + bh * s * s;
    for (std::int64_t t = 0; t < s; ++t) ops::softmax_in_place(attention + t * s, s);
    narrow(attention, probs, s * s);
    widen(probs, attention, s * s);
    ops::gemm(false, false, s, d, s, 1.0f, attention, s, tokens + 2 * s * d, d, 0.0f, result, d);
    narrow(result, out.bf16_data() + bh * s * d, s * d);
    return kSoftmaxFlopsPerElement * s * s;
  }

  float* thread_floats(int thread) { return widened_.data() + thread * widened_.dim(1); }

  void zero_head_gradients(std::int64_t head) {
    const std::int64_t d = p_.head_dim, f = c_.bottleneck, s = c_.tokens;
    std::fill_n(d_ln_gains_.data() + head * d, d, 0.0f);
    std::fill_n(d_ln_shifts_.data() + head * d, d, 0.0f);
    std::fill_n(d_w1_.data() + head * d * f, d * f, 0.0f);
    std::fill_n(d_b1_.data() + head * f, f, 0.0f);
    std::fill_n(d_w2_.data() + head * f * s, f * s, 0.0f);
    std::fill_n(d_b2_.data() + head * s, s, 0.0f);
  }

  // The backward of one (batch, head); adds its parameter gradients to the head's. Returns the
  // FLOPs outside oneDNN.
  std::int64_t head_backward(std::int64_t bh, const Grads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, s = c_.tokens, at = bh * n * d, all = p_.batch * p_.heads;
    const float* alpha = weights_.data() + bh * s * ld_;
    const TokenGrads t = token_grads(thread);
    std::int64_t flops =
        token_attention_backward(probs_.data() + bh * s * s, g.dout.data() + bh * s * d, pooled_.data() + bh * s * d,
                                 pooled_.data() + (all + bh) * s * d, pooled_.data() + (2 * all + bh) * s * d, t);
    // Through the pooling: dx = αᵀ·dx̃ and dα = Σ dx̃·xᵀ.
    ops::gemm(true, false, n, d, s, 1.0f, alpha, ld_, t.dq, d, 0.0f, g.dq.data() + at, d);
    ops::gemm(true, false, n, d, s, 1.0f, alpha, ld_, t.dk, d, 0.0f, g.dk.data() + at, d);
    ops::gemm(true, false, n, d, s, 1.0f, alpha, ld_, t.dv, d, 0.0f, g.dv.data() + at, d);
    float* dalpha = weight_grads_.data() + thread * s * ld_;
    ops::gemm(false, true, s, n, d, 1.0f, t.dq, d, g.q.data() + at, d, 0.0f, dalpha, ld_);
    ops::gemm(false, true, s, n, d, 1.0f, t.dk, d, g.k.data() + at, d, 1.0f, dalpha, ld_);
    ops::gemm(false, true, s, n, d, 1.0f, t.dv, d, g.v.data() + at, d, 1.0f, dalpha, ld_);
    const std::int64_t head = bh % p_.heads;
    flops += logit_grads(head, alpha, dalpha);
    for (std::int64_t r0 = 0; r0 < n; r0 += kChunkRows)
      flops += mlp_backward(head, g.v.data() + at + r0 * d, g.dv.data() + at + r0 * d, dalpha + r0,
                            std::min(kChunkRows, n - r0), thread);
    return flops;
  }

  // The bf16 form's backward of one (batch, head), the fp32 form's computation on widened values:
  // α, the tokens, P and dO widened (the thread's floats and bf16_grads_), x widened a chunk of rows at
  // a time; dq, dk, dv of a chunk summed in fp32 (dv with LN's input gradient) and rounded once.
  std::int64_t head_backward_bf16(std::int64_t bh, const Grads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, s = c_.tokens, at = bh * n * d, all = p_.batch * p_.heads;
    float* alpha = thread_floats(thread);  // α [S, ld_], then a chunk of widened rows [chunk rows, D]
    float* rows_buffer = alpha + s * ld_;
    float* tokens = bf16_grads_.data() + thread * bf16_grads_.dim(1);  // Q̃ K̃ Ṽ [3, S, D], P [S, S], dO [S, D]
    float *probs = tokens + 3 * s * d, *dout = probs + s * s, *grad = dout + s * d;  // grad: [chunk rows, D]
    for (std::int64_t t = 0; t < s; ++t) widen(weights_.bf16_data() + (bh * s + t) * ld_, alpha + t * ld_, n);
    for (std::int64_t which = 0; which < 3; ++which)
      widen(pooled_.bf16_data() + (which * all + bh) * s * d, tokens + which * s * d, s * d);
    widen(probs_.bf16_data() + bh * s * s, probs, s * s);
    widen(g.dout.bf16_data() + bh * s * d, dout, s * d);
    const TokenGrads t = token_grads(thread);
    std::int64_t flops = token_attention_backward(probs, dout, tokens, tokens + s * d, tokens + 2 * s * d, t);
    float* dalpha = weight_grads_.data() + thread * s * ld_;
    const Tensor* inputs[3] = {&g.q, &g.k, &g.v};
    const float* token_grads[3] = {t.dq, t.dk, t.dv};
    for (std::int64_t r0 = 0; r0 < n; r0 += kChunkRows) {
      const std::int64_t rows = std::min(kChunkRows, n - r0);
      for (int which = 0; which < 3; ++which) {
        widen(inputs[which]->bf16_data() + at + r0 * d, rows_buffer, rows * d);
        ops::gemm(false, true, s, rows, d, 1.0f, token_grads[which], d, rows_buffer, d, which == 0 ? 0.0f : 1.0f,
                  dalpha + r0, ld_);
      }
    }
    const std::int64_t head = bh % p_.heads;
    flops += logit_grads(head, alpha, dalpha);
    Tensor* outputs[3] = {&g.dq, &g.dk, &g.dv};
    for (std::int64_t r0 = 0; r0 < n; r0 += kChunkRows) {
      const std::int64_t rows = std::min(kChunkRows, n - r0);
      for (int which = 0; which < 3; ++which) {
        ops::gemm(true, false, rows, d, s, 1.0f, alpha + r0, ld_, token_grads[which], d, 0.0f, grad, d);
        if (which == 2) {
          widen(g.v.bf16_data() + at + r0 * d, rows_buffer, rows * d);
          flops += mlp_backward(head, rows_buffer, grad, dalpha + r0, rows, thread);
        }
        narrow(grad, outputs[which]->bf16_data() + at + r0 * d, rows * d);
      }
    }
    return flops;
  }

  // dα [S, ld_] → d logitsᵀ in place (the softmax over N with the weights α), and their sums into db2.
  // Returns the FLOPs.
  std::int64_t logit_grads(std::int64_t head, const float* alpha, float* dalpha) {
    const std::int64_t n = p_.seq_len, s = c_.tokens;
    const std::int64_t flops = softmax_backward_rows(alpha, dalpha, s, n, ld_);
    float* db2 = d_b2_.data() + head * s;
    for (std::int64_t t = 0; t < s; ++t) {
      float sum = 0.0f;
      const float* row = dalpha + t * ld_;
#pragma omp simd reduction(+ : sum)
      for (std::int64_t j = 0; j < n; ++j) sum += row[j];
      db2[t] += sum;
    }
    return flops + s * n;
  }

  // A thread's token gradients dQ̃, dK̃, dṼ [S, D] each and the S×S score gradient.
  struct TokenGrads {
    float *dq, *dk, *dv, *dscores;
  };
  TokenGrads token_grads(int thread) {
    const std::int64_t s = c_.tokens, d = p_.head_dim;
    float* base = token_grads_.data() + thread * token_grads_.dim(1);
    return {base, base + s * d, base + 2 * s * d, base + 3 * s * d};
  }

  // The attention over the S tokens backward: dQ̃, dK̃, dṼ from dO and the token attention P [S, S]
  // over the tokens tq, tk, tv [S, D] (fp32). Returns the FLOPs outside oneDNN.
  std::int64_t token_attention_backward(const float* attention, const float* dout, const float* tq, const float* tk,
                                        const float* tv, const TokenGrads& t) {
    const std::int64_t d = p_.head_dim, s = c_.tokens;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::gemm(true, false, s, d, s, 1.0f, attention, s, dout, d, 0.0f, t.dv, d);
    ops::gemm(false, true, s, s, d, 1.0f, dout, d, tv, d, 0.0f, t.dscores, s);
    const std::int64_t flops = softmax_backward_rows(attention, t.dscores, s, s, s);
    ops::gemm(false, false, s, d, s, scale, t.dscores, s, tk, d, 0.0f, t.dq, d);
    ops::gemm(true, false, s, d, s, scale, t.dscores, s, tq, d, 0.0f, t.dk, d);
    return flops;
  }

  // `rows` rows of the weight MLP backward: v_rows [rows, D] fp32, their d logitsᵀ the columns at
  // dlogits (row stride ld_); the MLP and LN recomputed, their parameter gradients added, LN's input
  // gradient added to dv_rows [rows, D] (fp32).
  std::int64_t mlp_backward(std::int64_t head, const float* v_rows, float* dv_rows, const float* dlogits,
                            std::int64_t rows, int thread) {
    const std::int64_t d = p_.head_dim, f = c_.bottleneck, s = c_.tokens;
    const HeadParams w = head_params(head);
    float* xn = normalised_.data() + thread * normalised_.dim(1) * d;
    float* pre = mlp_grads_.data() + thread * 2 * mlp_grads_.dim(2) * f;
    float* dz = pre + mlp_grads_.dim(2) * f;
    float* dxn = row_grads_.data() + thread * 2 * row_grads_.dim(2) * d;
    float* scratch = dxn + row_grads_.dim(2) * d;
    ops::layer_norm_rows(v_rows, xn, rows, d, w.gain, w.shift, kLayerNormEps);
    ops::gemm(false, false, rows, f, d, 1.0f, xn, d, w.w1, f, 0.0f, pre, f);
    float* hid = hidden_.data() + thread * hidden_.dim(1) * f;
    for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (std::int64_t j = 0; j < f; ++j) {
        const float z = pre[r * f + j] + w.b1[j];
        pre[r * f + j] = z;
        hid[r * f + j] = 0.5f * z * (1.0f + fast_erf(z * kInverseSqrt2));
      }
    }
    ops::gemm(true, true, f, s, rows, 1.0f, hid, f, dlogits, ld_, 1.0f, d_w2_.data() + head * f * s, s);
    ops::gemm(true, true, rows, f, s, 1.0f, dlogits, ld_, w.w2, s, 0.0f, dz, f);  // dGELU
    float* db1 = d_b1_.data() + head * f;
    for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
      for (std::int64_t j = 0; j < f; ++j) {
        const float z = pre[r * f + j];
        const float slope =
            0.5f * (1.0f + fast_erf(z * kInverseSqrt2)) + z * kInverseSqrt2Pi * ops::fast_exp(-0.5f * z * z);
        dz[r * f + j] *= slope;
      }
      add_row(db1, dz + r * f, f);
    }
    ops::gemm(true, false, d, f, rows, 1.0f, xn, d, dz, f, 1.0f, d_w1_.data() + head * d * f, f);
    ops::gemm(false, true, rows, d, f, 1.0f, dz, f, w.w1, f, 0.0f, dxn, d);
    float* norm_grads = norm_grads_.data() + thread * 2 * d;
    ops::layer_norm_backward(v_rows, dxn, rows, d, w.gain, dv_rows, norm_grads, norm_grads + d, scratch, kLayerNormEps);
    add_row(d_ln_gains_.data() + head * d, norm_grads, d);
    add_row(d_ln_shifts_.data() + head * d, norm_grads + d, d);
    return kLayerNormFlopsPerElement * rows * d + (1 + kGeluFlopsPerElement) * rows * f +
           (kGeluBackwardFlopsPerElement + 1) * rows * f + 2 * d;
  }

  Problem p_;
  TokenLearnerConfig c_;
  std::uint64_t seed_;
  std::int64_t ld_;
  Tensor ln_gains_, ln_shifts_, w1_, b1_, w2_, b2_;
  // α [B·H, S, ld], Q̃ K̃ Ṽ [3, B·H, S, D], the token attention [B·H, S, S] (fp32, or bf16 in the bf16
  // form); per thread the MLP's rows; bf16 form: per thread the fp32 floats of bf16_thread_floats.
  Tensor weights_, pooled_, probs_, normalised_, hidden_, widened_;
  // Backward (prepare_backward): the parameter gradients, per thread dα, the token gradients and
  // the S×S score gradient, the MLP's pre-activations and gradients, dLN and LN scratch, LN sums.
  Tensor d_ln_gains_, d_ln_shifts_, d_w1_, d_b1_, d_w2_, d_b2_;
  Tensor weight_grads_, token_grads_, mlp_grads_, row_grads_, norm_grads_;
  Tensor bf16_grads_;  // bf16 form: per thread the widened tokens, P and dO, a chunk's fp32 gradient rows
};

std::int64_t parameter_floats(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t d = p.head_dim, f = c.bottleneck, s = c.tokens;
  return p.heads * (2 * d + d * f + f + f * s + s);
}

}  // namespace

TokenLearnerConfig resolve(const Problem& p, TokenLearnerConfig c) {
  c.tokens = std::min(c.tokens, p.seq_len);
  return c;
}

std::int64_t output_rows(const Problem& p, const TokenLearnerConfig& c) { return std::min(c.tokens, p.seq_len); }

std::string unsupported(const Problem& p, const TokenLearnerConfig&) {
  if (p.causal) return "its weights are a softmax over all N tokens, so every learned token depends on the last one";
  return "";
}

std::unique_ptr<Mechanism> create(const Problem& problem, const TokenLearnerConfig& c, std::uint64_t seed) {
  return std::make_unique<TokenLearner>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, f = c.bottleneck, s = c.tokens;
  const std::int64_t mlp = kLayerNormFlopsPerElement * n * d + matmul_flops(n, f, d) +
                           (1 + kGeluFlopsPerElement) * n * f + matmul_flops(s, n, f) +
                           (1 + kSoftmaxFlopsPerElement) * s * n;
  const std::int64_t pooling = 3 * matmul_flops(s, d, n);
  const std::int64_t attention = matmul_flops(s, s, d) + kSoftmaxFlopsPerElement * s * s + matmul_flops(s, d, s);
  return p.batch * p.heads * (mlp + pooling + attention);
}

// Parameters (fp32), α, the tokens and the token attention (in the element size), per thread the
// MLP's rows (and the bf16 form's fp32 rows).
std::int64_t workspace(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t d = p.head_dim, f = c.bottleneck, s = c.tokens, bh = p.batch * p.heads;
  const std::int64_t state = bh * s * ops::padded_ld(p.seq_len) + 3 * bh * s * d + bh * s * s;
  std::int64_t per_thread = chunk_rows(p) * (d + f);
  if (p.dtype == DType::BF16) per_thread += bf16_thread_floats(p, c);
  constexpr std::int64_t kFloatBytes = sizeof(float);
  return (parameter_floats(p, c) + p.threads * per_thread) * kFloatBytes + state * element_bytes(p.dtype);
}

std::int64_t backward_flops(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, f = c.bottleneck, s = c.tokens;
  const std::int64_t attention = 4 * matmul_flops(s, s, d) + kSoftmaxBackwardFlopsPerElement * s * s;
  const std::int64_t pooling =
      3 * matmul_flops(n, d, s) + 3 * matmul_flops(s, n, d) + kSoftmaxBackwardFlopsPerElement * s * n + s * n;
  const std::int64_t recompute =
      kLayerNormFlopsPerElement * n * d + matmul_flops(n, f, d) + (1 + kGeluFlopsPerElement) * n * f;
  const std::int64_t mlp = matmul_flops(f, s, n) + matmul_flops(n, f, s) + (kGeluBackwardFlopsPerElement + 1) * n * f +
                           matmul_flops(d, f, n) + matmul_flops(n, d, f) + kLayerNormBackwardFlopsPerElement * n * d +
                           2 * d * chunks(p);
  return p.batch * p.heads * (attention + pooling + recompute + mlp);
}

std::int64_t backward_workspace(const Problem& p, const TokenLearnerConfig& c) {
  const std::int64_t d = p.head_dim, f = c.bottleneck, s = c.tokens, rows = chunk_rows(p);
  std::int64_t per_thread = s * ops::padded_ld(p.seq_len) + 3 * s * d + s * s + 2 * rows * f + 2 * rows * d + 2 * d;
  if (p.dtype == DType::BF16) per_thread += bf16_backward_floats(p, c);
  return (parameter_floats(p, c) + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<TokenLearnerConfig> config_fields(const TokenLearnerConfig*) {
  return {int_field("tokens", &TokenLearnerConfig::tokens, 1, 4096,
                    "S, learned tokens per head: the output rows (clamped to N)"),
          int_field("bottleneck", &TokenLearnerConfig::bottleneck, 1, 4096, "F, hidden units of the weight MLP")};
}

template <>
Implementation implementation<TokenLearnerConfig>() {
  Implementation impl = implement<TokenLearnerConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
