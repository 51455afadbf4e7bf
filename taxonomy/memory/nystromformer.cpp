#include "taxonomy/memory/nystromformer.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"
#include "taxonomy/engines/pattern_common.hpp"

namespace xfb {
namespace {

// The sizes one problem runs with.
struct Sizes {
  std::int64_t n, d, m, k, iterations;
  std::int64_t ldm, ldn;  // row strides of the [·, m] and [m, N] score matrices
  bool exact;             // m = N: exact attention
};

Sizes sizes_of(const Problem& p, const NystromformerConfig& c) {
  const std::int64_t m = std::min(c.landmarks, p.seq_len);
  return {.n = p.seq_len,
          .d = p.head_dim,
          .m = m,
          .k = c.conv_kernel,
          .iterations = c.iterations,
          .ldm = ops::padded_ld(m),
          .ldn = ops::padded_ld(p.seq_len),
          .exact = m == p.seq_len};
}

// Σ over the k taps of the rows they read inside [0, N): P of the header.
std::int64_t conv_pairs(const Sizes& s) {
  std::int64_t pairs = 0;
  for (std::int64_t t = 0; t < s.k; ++t) pairs += std::max<std::int64_t>(0, s.n - std::abs(t - s.k / 2));
  return pairs;
}

// Segment j of the N rows: its first row and its length (the header's rule).
std::pair<std::int64_t, std::int64_t> segment(const Sizes& s, std::int64_t j) {
  const std::int64_t length = s.n / s.m, longer = s.n % s.m;
  return {j * length + std::min(j, longer), length + (j < longer ? 1 : 0)};
}

// Softmax over each of `rows` rows of n values (row stride ld); returns its FLOPs.
std::int64_t softmax_rows(float* x, std::int64_t rows, std::int64_t n, std::int64_t ld) {
  for (std::int64_t r = 0; r < rows; ++r) ops::softmax_in_place(x + r * ld, n);
  return kSoftmaxFlopsPerElement * rows * n;
}

// dst = c·I − src over [m, m] (row stride ld).
void identity_minus(float c, const float* src, float* dst, std::int64_t m, std::int64_t ld) {
  for (std::int64_t i = 0; i < m; ++i) {
#pragma omp simd
    for (std::int64_t j = 0; j < m; ++j) dst[i * ld + j] = -src[i * ld + j];
    dst[i * ld + i] += c;
  }
}

// dst = c·I over [m, m] (row stride ld).
void scaled_identity(float c, float* dst, std::int64_t m, std::int64_t ld) {
  for (std::int64_t i = 0; i < m; ++i) {
    std::fill_n(dst + i * ld, m, 0.0f);
    dst[i * ld + i] = c;
  }
}

// Non-product FLOPs of the pseudo-inverse: Z₀ (column sums, their maximum, the scaling) and the
// 7I − AZ of each iteration.
std::int64_t pinv_elementwise_flops(const Sizes& s) { return 2 * s.m * s.m + s.m + s.iterations * s.m * s.m; }

std::int64_t pinv_flops(const Sizes& s) {
  return pinv_elementwise_flops(s) + s.iterations * 4 * matmul_flops(s.m, s.m, s.m);
}

// The iterations' matrices. With `history` (the backward) every iterate Z_0 … Z_I and each
// iteration's AZ, 7I − AZ, 15I − AZ·(…), 13I − AZ·(…) have their own slot; without it (the
// forward) two slots alternate for Z and three hold the products.
class Chain {
 public:
  Chain(float* base, const Sizes& s, bool history)
      : base_(base), size_(s.m * s.ldm), iterations_(s.iterations), history_(history) {}
  static std::int64_t slots(const Sizes& s, bool history) { return history ? 5 * s.iterations + 1 : 5; }

  float* z(std::int64_t i) const { return at(history_ ? i : i % 2); }
  float* product(std::int64_t i) const { return part(i, 0); }                        // AZ
  float* first(std::int64_t i) const { return part(i, 1); }                          // 7I − AZ
  float* second(std::int64_t i) const { return part(i, 2); }                         // 15I − AZ·(7I − AZ)
  float* third(std::int64_t i) const { return history_ ? part(i, 3) : part(i, 1); }  // 13I − AZ·(…)

 private:
  float* at(std::int64_t slot) const { return base_ + slot * size_; }
  float* part(std::int64_t i, std::int64_t which) const {
    return history_ ? at(iterations_ + 1 + 4 * i + which) : at(2 + which);
  }
  float* base_;
  std::int64_t size_, iterations_;
  bool history_;
};

// The pseudo-inverse of a (row-stochastic [m, m], row stride ldm) into the chain; returns the
// column j* of the largest column sum and α = 1/that sum (Z₀ = α·aᵀ).
struct PinvScale {
  std::int64_t column;
  float alpha;
};
PinvScale pseudo_inverse(const float* a, const Chain& chain, const Sizes& s) {
  const std::int64_t m = s.m, ld = s.ldm;
  std::int64_t column = 0;
  float largest = -1.0f;
  for (std::int64_t j = 0; j < m; ++j) {
    float sum = 0.0f;
    for (std::int64_t i = 0; i < m; ++i) sum += a[i * ld + j];
    if (sum > largest) {
      largest = sum;
      column = j;
    }
  }
  const float alpha = 1.0f / largest;
  float* z = chain.z(0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < m; ++j) z[i * ld + j] = alpha * a[j * ld + i];
  for (std::int64_t it = 0; it < s.iterations; ++it) {
    const float* zi = chain.z(it);
    float* product = chain.product(it);
    ops::gemm(false, false, m, m, m, 1.0f, a, ld, zi, ld, 0.0f, product, ld);
    identity_minus(7.0f, product, chain.first(it), m, ld);
    scaled_identity(15.0f, chain.second(it), m, ld);
    ops::gemm(false, false, m, m, m, -1.0f, product, ld, chain.first(it), ld, 1.0f, chain.second(it), ld);
    scaled_identity(13.0f, chain.third(it), m, ld);
    ops::gemm(false, false, m, m, m, -1.0f, product, ld, chain.second(it), ld, 1.0f, chain.third(it), ld);
    ops::gemm(false, false, m, m, m, 0.25f, zi, ld, chain.third(it), ld, 0.0f, chain.z(it + 1), ld);
  }
  return {column, alpha};
}

// dst = the means of the segments of rows x [N, D] → [m, D].
void segment_means(const float* x, float* dst, const Sizes& s) {
  const std::int64_t d = s.d;
  for (std::int64_t j = 0; j < s.m; ++j) {
    const auto [first, length] = segment(s, j);
    float* mean = dst + j * d;
    std::fill_n(mean, d, 0.0f);
    for (std::int64_t r = first; r < first + length; ++r) add_row(mean, x + r * d, d);
    scale_row(mean, mean, 1.0f / static_cast<float>(length), d);
  }
}

// dx rows += the gradient of segment_means for its gradient g [m, D] (g scaled in place).
void segment_means_backward(float* g, float* dx, const Sizes& s) {
  const std::int64_t d = s.d;
  for (std::int64_t j = 0; j < s.m; ++j) {
    const auto [first, length] = segment(s, j);
    scale_row(g + j * d, g + j * d, 1.0f / static_cast<float>(length), d);
    for (std::int64_t r = first; r < first + length; ++r) add_row(dx + r * d, g + j * d, d);
  }
}

// 16 floats (one 512-bit vector, two 256-bit ones on AVX2), unaligned loads and stores. Without
// AVX-512, GCC warns (-Wpsabi) that passing one by value changes the ABI: every function that does
// so, down to conv_backward_taps, has internal linkage, so no such call crosses a TU's boundary.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
using Lanes = float __attribute__((vector_size(64)));
inline Lanes load_lanes(const float* p) {
  Lanes x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}
inline void store_lanes(float* p, Lanes x) { __builtin_memcpy(p, &x, sizeof(x)); }

// dst[0, 16·Vectors) += Σ_{t0 ≤ t < t1} w[t]·in[(t − t0)·step + ·], summed in Vectors independent
// register accumulators and stored once.
template <int Vectors>
void tap_block(const float* in, std::int64_t step, const float* w, std::int64_t t0, std::int64_t t1, float* dst) {
  Lanes acc[Vectors];
#pragma GCC unroll 8
  for (int j = 0; j < Vectors; ++j) acc[j] = load_lanes(dst + 16 * j);
  for (std::int64_t t = t0; t < t1; ++t, in += step) {
    const Lanes tap = Lanes{} + w[t];
#pragma GCC unroll 8
    for (int j = 0; j < Vectors; ++j) acc[j] += tap * load_lanes(in + 16 * j);
  }
#pragma GCC unroll 8
  for (int j = 0; j < Vectors; ++j) store_lanes(dst + 16 * j, acc[j]);
}

// The same for one feature.
void tap_scalar(const float* in, std::int64_t step, const float* w, std::int64_t t0, std::int64_t t1, float* dst) {
  float acc = *dst;
  for (std::int64_t t = t0; t < t1; ++t, in += step) acc += w[t] * *in;
  *dst = acc;
}

// dst row i += Σ_t w[t]·src row (i + direction·(t − ⌊k/2⌋)) over the rows inside [0, N): the
// convolution (direction 1) or its transpose (direction −1).
void accumulate_taps(const float* src, const float* w, float* dst, const Sizes& s, std::int64_t direction) {
  const std::int64_t n = s.n, d = s.d, half = s.k / 2;
  for (std::int64_t i = 0; i < n; ++i) {
    // Every row reads at least the centre tap (offset 0), so [t0, t1) is never empty.
    const std::int64_t t0 =
        direction > 0 ? std::max<std::int64_t>(0, half - i) : std::max<std::int64_t>(0, i + half - n + 1);
    const std::int64_t t1 = direction > 0 ? std::min(s.k, n + half - i) : std::min(s.k, i + half + 1);
    const float* first = src + (i + direction * (t0 - half)) * d;  // the row tap t0 reads
    const std::int64_t step = direction * d;
    float* row = dst + i * d;
    std::int64_t f = 0;
    for (; f + 64 <= d; f += 64) tap_block<4>(first + f, step, w, t0, t1, row + f);
    for (; f + 16 <= d; f += 16) tap_block<1>(first + f, step, w, t0, t1, row + f);
    for (; f < d; ++f) tap_scalar(first + f, step, w, t0, t1, row + f);
  }
}

// out [N, D] += conv(v) with the head's taps w [k].
void conv_add(const float* v, const float* w, float* out, const Sizes& s) { accumulate_taps(v, w, out, s, 1); }

// dv [N, D] += the convolution's transpose applied to dout.
void conv_backward_values(const float* dout, const float* w, float* dv, const Sizes& s) {
  accumulate_taps(dout, w, dv, s, -1);
}

// dw [k] += ∂⟨dout, conv(v)⟩/∂w for one (batch, head): per tap, the dot product of dout's rows
// with the rows of v it reads, summed in vector accumulators and reduced once.
void conv_backward_taps(const float* dout, const float* v, float* dw, const Sizes& s) {
  const std::int64_t n = s.n, d = s.d, half = s.k / 2;
  for (std::int64_t t = 0; t < s.k; ++t) {
    const std::int64_t i0 = std::max<std::int64_t>(0, half - t), i1 = std::min(n, n + half - t);
    Lanes acc[4] = {};
    float tail = 0.0f;
    for (std::int64_t i = i0; i < i1; ++i) {
      const float* g = dout + i * d;
      const float* src = v + (i + t - half) * d;
      std::int64_t f = 0;
      for (; f + 64 <= d; f += 64) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; ++j) acc[j] += load_lanes(g + f + 16 * j) * load_lanes(src + f + 16 * j);
      }
      for (; f + 16 <= d; f += 16) acc[0] += load_lanes(g + f) * load_lanes(src + f);
      for (; f < d; ++f) tail += g[f] * src[f];
    }
    const Lanes total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    float sum = tail;
    for (int l = 0; l < 16; ++l) sum += total[l];
    dw[t] += sum;
  }
}
#pragma GCC diagnostic pop

class Nystromformer final : public Mechanism {
 public:
  Nystromformer(const Problem& problem, const NystromformerConfig& config, std::uint64_t seed)
      : p_(problem), s_(sizes_of(problem, config)), seed_(seed) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    if (s_.k > 0) {
      conv_weights_ = Tensor(Shape{p_.heads, s_.k});
      const float bound = 1.0f / std::sqrt(static_cast<float>(s_.k));
      CounterRng(seed_, "nystromformer/conv_weights").fill_uniform(conv_weights_, -bound, bound);
    }
    const std::int64_t threads = p_.threads, m = s_.m, d = s_.d;
    kernel_f_ = Tensor(Shape{threads, s_.n, s_.ldm});
    if (p_.dtype == DType::BF16) widened_ = Tensor(Shape{threads, 4, s_.n * d});
    if (s_.exact) return;
    kernel_b_ = Tensor(Shape{threads, m, s_.ldn});
    kernel_a_ = Tensor(Shape{threads, m, s_.ldm});
    chain_ = Tensor(Shape{threads, Chain::slots(s_, false), m, s_.ldm});
    small_ = Tensor(Shape{threads, kSmallParts, m, d});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t bh_count = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < bh_count; ++bh) {
      const int thread = omp_get_thread_num();
      const std::int64_t at = bh * s_.n * s_.d;
      if (p_.dtype != DType::BF16) {
        flops += forward_head(bh, q.data() + at, k.data() + at, v.data() + at, out.data() + at, thread);
        continue;
      }
      float* rows = widened_.data() + thread * widened_.dim(1) * widened_.dim(2);  // q, k, v, out
      const std::int64_t size = s_.n * s_.d;
      widen(q.bf16_data() + at, rows, size);
      widen(k.bf16_data() + at, rows + size, size);
      widen(v.bf16_data() + at, rows + 2 * size, size);
      flops += forward_head(bh, rows, rows + size, rows + 2 * size, rows + 3 * size, thread);
      narrow(rows + 3 * size, out.bf16_data() + at, size);
    }
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> parameters() const override {
    if (s_.k == 0) return {};
    return {{"conv_weights", &conv_weights_}};
  }

  void prepare_backward() override {
    const std::int64_t bh = p_.batch * p_.heads, threads = p_.threads, m = s_.m, d = s_.d;
    saved_f_ = Tensor(Shape{bh, s_.n, s_.ldm});
    grad_f_ = Tensor(Shape{threads, s_.n, s_.ldm});
    if (s_.k > 0) d_conv_weights_ = Tensor(conv_weights_.shape());
    if (p_.dtype == DType::BF16) widened_gradients_ = Tensor(Shape{threads, 7, s_.n * d});
    if (s_.exact) return;
    saved_b_ = Tensor(Shape{bh, m, s_.ldn});
    saved_a_ = Tensor(Shape{bh, m, s_.ldm});
    saved_small_ = Tensor(Shape{bh, kSmallParts, m, d});
    grad_b_ = Tensor(Shape{threads, m, s_.ldn});
    grad_small_ = Tensor(Shape{threads, kSmallParts, m, d});
    history_ = Tensor(Shape{threads, Chain::slots(s_, true), m, s_.ldm});
    grad_chain_ = Tensor(Shape{threads, kGradSlots, m, s_.ldm});
  }

  std::vector<NamedTensor> saved() const override {
    if (s_.exact) return {{"kernel_f", &saved_f_}};
    return {
        {"kernel_f", &saved_f_}, {"kernel_b", &saved_b_}, {"kernel_a", &saved_a_}, {"landmarks_bv_zbv", &saved_small_}};
  }

  std::vector<NamedTensor> parameter_gradients() const override {
    if (s_.k == 0) return {};
    return {{"dconv_weights", &d_conv_weights_}};
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t bh_count = p_.batch * p_.heads;
    std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
    {
      const int thread = omp_get_thread_num();
      const std::int64_t size = s_.n * s_.d;
      float* rows = widened_gradients_.empty() ? nullptr : widened_gradients_.data() + thread * 7 * size;
#pragma omp for schedule(dynamic, 1)
      for (std::int64_t bh = 0; bh < bh_count; ++bh) {
        const std::int64_t at = bh * size;
        if (rows == nullptr) {
          flops += backward_head(bh, {q.data() + at, k.data() + at, v.data() + at, dout.data() + at},
                                 {dq.data() + at, dk.data() + at, dv.data() + at}, thread);
          continue;
        }
        // bf16: q, k, v, dO widened, the fp32 backward into fp32 dQ, dK, dV, each rounded once.
        const Tensor* inputs[4] = {&q, &k, &v, &dout};
        widen_spans(inputs, at, size, rows, size);
        flops += backward_head(bh, {rows, rows + size, rows + 2 * size, rows + 3 * size},
                               {rows + 4 * size, rows + 5 * size, rows + 6 * size}, thread);
        Tensor* grads[3] = {&dq, &dk, &dv};
        narrow_spans(rows + 4 * size, size, grads, at, size);
      }
      if (s_.k > 0) {
#pragma omp for schedule(dynamic, 1)
        for (std::int64_t h = 0; h < p_.heads; ++h) {
          float* dw = d_conv_weights_.data() + h * s_.k;
          std::fill_n(dw, s_.k, 0.0f);
          for (std::int64_t b = 0; b < p_.batch; ++b) {
            const std::int64_t at = (b * p_.heads + h) * size;
            if (rows == nullptr) {
              conv_backward_taps(dout.data() + at, v.data() + at, dw, s_);
              continue;
            }
            widen(dout.bf16_data() + at, rows, size);
            widen(v.bf16_data() + at, rows + size, size);
            conv_backward_taps(rows, rows + size, dw, s_);
          }
        }
      }
    }
    FlopCounter::add(flops + (s_.k > 0 ? bh_count * 2 * s_.d * conv_pairs(s_) : 0));
  }

 private:
  // The [m, D] parts of small_ and saved_small_: Q̃, K̃, B·v, Z·B·v; of grad_small_ their gradients.
  enum SmallPart { kQueryLandmarks, kKeyLandmarks, kValuesB, kValuesZb, kSmallParts };
  // grad_chain_'s slots: dZ twice (alternating), two product gradients, d(AZ), dA.
  enum GradSlot { kGradZ, kGradZNext, kGradThird, kGradSecond, kGradProduct, kGradA, kGradSlots };

  bool training() const { return !saved_f_.empty(); }

  float* small_part(std::int64_t bh, int thread, SmallPart part) {
    const std::int64_t size = s_.m * s_.d;
    return training() ? saved_small_.data() + (bh * kSmallParts + part) * size
                      : small_.data() + (thread * kSmallParts + part) * size;
  }

  // One (batch, head) of the forward; returns the FLOPs ops::gemm does not count.
  // qh, kh, vh, oh: its rows [N, D] (fp32; the bf16 form's widened rows).
  std::int64_t forward_head(std::int64_t bh, const float* qh, const float* kh, const float* vh, float* oh, int thread) {
    const std::int64_t n = s_.n, d = s_.d, m = s_.m;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    float* f = training() ? saved_f_.data() + bh * n * s_.ldm : kernel_f_.data() + thread * n * s_.ldm;
    std::int64_t flops = 0;
    if (s_.exact) {
      ops::gemm(false, true, n, n, d, scale, qh, d, kh, d, 0.0f, f, s_.ldm);
      flops += softmax_rows(f, n, n, s_.ldm);
      ops::gemm(false, false, n, d, n, 1.0f, f, s_.ldm, vh, d, 0.0f, oh, d);
    } else {
      float* lq = small_part(bh, thread, kQueryLandmarks);
      float* lk = small_part(bh, thread, kKeyLandmarks);
      float* bv = small_part(bh, thread, kValuesB);
      float* zbv = small_part(bh, thread, kValuesZb);
      float* a = training() ? saved_a_.data() + bh * m * s_.ldm : kernel_a_.data() + thread * m * s_.ldm;
      float* b = training() ? saved_b_.data() + bh * m * s_.ldn : kernel_b_.data() + thread * m * s_.ldn;
      segment_means(qh, lq, s_);
      segment_means(kh, lk, s_);
      flops += 2 * (n * d + m * d);
      ops::gemm(false, true, m, m, d, scale, lq, d, lk, d, 0.0f, a, s_.ldm);
      flops += softmax_rows(a, m, m, s_.ldm);
      const Chain chain(chain_.data() + thread * chain_.dim(1) * m * s_.ldm, s_, false);
      pseudo_inverse(a, chain, s_);
      flops += pinv_elementwise_flops(s_);
      ops::gemm(false, true, m, n, d, scale, lq, d, kh, d, 0.0f, b, s_.ldn);
      flops += softmax_rows(b, m, n, s_.ldn);
      ops::gemm(false, false, m, d, n, 1.0f, b, s_.ldn, vh, d, 0.0f, bv, d);
      ops::gemm(false, false, m, d, m, 1.0f, chain.z(s_.iterations), s_.ldm, bv, d, 0.0f, zbv, d);
      ops::gemm(false, true, n, m, d, scale, qh, d, lk, d, 0.0f, f, s_.ldm);
      flops += softmax_rows(f, n, m, s_.ldm);
      ops::gemm(false, false, n, d, m, 1.0f, f, s_.ldm, zbv, d, 0.0f, oh, d);
    }
    if (s_.k > 0) {
      conv_add(vh, conv_weights_.data() + bh % p_.heads * s_.k, oh, s_);
      flops += 2 * d * conv_pairs(s_);
    }
    return flops;
  }

  // One (batch, head) of the backward: dq, dk, dv written; returns the FLOPs ops::gemm does not
  // count (the convolution taps' gradient is counted by the caller).
  // One (batch, head) of the backward on fp32 rows [N, D]: x = q, k, v, dO; grads = dQ, dK, dV.
  std::int64_t backward_head(std::int64_t bh, const std::array<const float*, 4>& x, const std::array<float*, 3>& grads,
                             int thread) {
    const std::int64_t n = s_.n, d = s_.d, ldm = s_.ldm;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const float *qh = x[0], *kh = x[1], *vh = x[2], *g = x[3];
    float *dqh = grads[0], *dkh = grads[1], *dvh = grads[2];
    const float* f = saved_f_.data() + bh * n * ldm;
    float* df = grad_f_.data() + thread * n * ldm;
    std::int64_t flops = 0;
    if (s_.exact) {
      ops::gemm(true, false, n, d, n, 1.0f, f, ldm, g, d, 0.0f, dvh, d);
      ops::gemm(false, true, n, n, d, 1.0f, g, d, vh, d, 0.0f, df, ldm);
      flops += softmax_backward_rows(f, df, n, n, ldm);
      ops::gemm(false, false, n, d, n, scale, df, ldm, kh, d, 0.0f, dqh, d);
      ops::gemm(true, false, n, d, n, scale, df, ldm, qh, d, 0.0f, dkh, d);
    } else {
      flops += landmark_backward(bh, qh, kh, vh, g, dqh, dkh, dvh, thread);
    }
    if (s_.k > 0) {
      conv_backward_values(g, conv_weights_.data() + bh % p_.heads * s_.k, dvh, s_);
      flops += 2 * d * conv_pairs(s_);
    }
    return flops;
  }

  // The backward of F·(Z·(B·v)) for one (batch, head), m < N.
  std::int64_t landmark_backward(std::int64_t bh, const float* qh, const float* kh, const float* vh, const float* g,
                                 float* dqh, float* dkh, float* dvh, int thread) {
    const std::int64_t n = s_.n, d = s_.d, m = s_.m, ldm = s_.ldm, ldn = s_.ldn;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const float* f = saved_f_.data() + bh * n * ldm;
    const float* b = saved_b_.data() + bh * m * ldn;
    const float* a = saved_a_.data() + bh * m * ldm;
    const float* lq = saved_small_.data() + (bh * kSmallParts + kQueryLandmarks) * m * d;
    const float* lk = lq + m * d;
    const float* bv = lk + m * d;
    const float* zbv = bv + m * d;
    float* df = grad_f_.data() + thread * n * ldm;
    float* db = grad_b_.data() + thread * m * ldn;
    float* dlq = grad_small_.data() + thread * kSmallParts * m * d;
    float* dlk = dlq + m * d;
    float* dbv = dlk + m * d;
    float* dzbv = dbv + m * d;
    std::int64_t flops = 0;
    // out = F·zbv
    ops::gemm(true, false, m, d, n, 1.0f, f, ldm, g, d, 0.0f, dzbv, d);
    ops::gemm(false, true, n, m, d, 1.0f, g, d, zbv, d, 0.0f, df, ldm);
    flops += softmax_backward_rows(f, df, n, m, ldm);
    ops::gemm(false, false, n, d, m, scale, df, ldm, lk, d, 0.0f, dqh, d);
    ops::gemm(true, false, m, d, n, scale, df, ldm, qh, d, 0.0f, dlk, d);
    // zbv = Z·bv, with Z recomputed
    const Chain chain(history_.data() + thread * history_.dim(1) * m * ldm, s_, true);
    const PinvScale pinv = pseudo_inverse(a, chain, s_);
    flops += pinv_elementwise_flops(s_);
    float* grads = grad_chain_.data() + thread * kGradSlots * m * ldm;
    auto slot = [&](GradSlot which) { return grads + which * m * ldm; };
    ops::gemm(false, true, m, m, d, 1.0f, dzbv, d, bv, d, 0.0f, slot(kGradZ), ldm);
    ops::gemm(true, false, m, d, m, 1.0f, chain.z(s_.iterations), ldm, dzbv, d, 0.0f, dbv, d);
    // bv = B·v, B = softmax(s·Q̃·kᵀ)
    ops::gemm(false, true, m, n, d, 1.0f, dbv, d, vh, d, 0.0f, db, ldn);
    ops::gemm(true, false, n, d, m, 1.0f, b, ldn, dbv, d, 0.0f, dvh, d);
    flops += softmax_backward_rows(b, db, m, n, ldn);
    ops::gemm(false, false, m, d, n, scale, db, ldn, kh, d, 0.0f, dlq, d);
    ops::gemm(true, false, n, d, m, scale, db, ldn, lq, d, 0.0f, dkh, d);
    // Z = pinv(A), A = softmax(s·Q̃·K̃ᵀ)
    flops += pinv_backward(a, chain, pinv, grads);
    float* da = slot(kGradA);
    flops += softmax_backward_rows(a, da, m, m, ldm);
    ops::gemm(false, false, m, d, m, scale, da, ldm, lk, d, 1.0f, dlq, d);
    ops::gemm(true, false, m, d, m, scale, da, ldm, lq, d, 1.0f, dlk, d);
    segment_means_backward(dlq, dqh, s_);
    segment_means_backward(dlk, dkh, s_);
    return flops + 2 * (n * d + m * d);
  }

  // From dZ_I (slot kGradZ) to dA (slot kGradA) through the iterations and Z₀ = α·Aᵀ.
  std::int64_t pinv_backward(const float* a, const Chain& chain, const PinvScale& pinv, float* grads) const {
    const std::int64_t m = s_.m, ld = s_.ldm, size = m * ld;
    float* dz = grads + kGradZ * size;
    float* dz_next = grads + kGradZNext * size;
    float* d_third = grads + kGradThird * size;  // d(13I − …), then d(7I − AZ)
    float* d_second = grads + kGradSecond * size;
    float* d_product = grads + kGradProduct * size;
    float* da = grads + kGradA * size;
    for (std::int64_t i = 0; i < m; ++i) std::fill_n(da + i * ld, m, 0.0f);
    for (std::int64_t it = s_.iterations - 1; it >= 0; --it) {
      const float* z = chain.z(it);
      const float* product = chain.product(it);
      ops::gemm(true, false, m, m, m, 0.25f, z, ld, dz, ld, 0.0f, d_third, ld);
      ops::gemm(false, true, m, m, m, 0.25f, dz, ld, chain.third(it), ld, 0.0f, dz_next, ld);
      ops::gemm(false, true, m, m, m, -1.0f, d_third, ld, chain.second(it), ld, 0.0f, d_product, ld);
      ops::gemm(true, false, m, m, m, -1.0f, product, ld, d_third, ld, 0.0f, d_second, ld);
      ops::gemm(false, true, m, m, m, -1.0f, d_second, ld, chain.first(it), ld, 1.0f, d_product, ld);
      ops::gemm(true, false, m, m, m, -1.0f, product, ld, d_second, ld, 0.0f, d_third, ld);
      for (std::int64_t i = 0; i < m; ++i) {
#pragma omp simd
        for (std::int64_t j = 0; j < m; ++j) d_product[i * ld + j] -= d_third[i * ld + j];
      }
      ops::gemm(false, true, m, m, m, 1.0f, d_product, ld, z, ld, 1.0f, da, ld);
      ops::gemm(true, false, m, m, m, 1.0f, a, ld, d_product, ld, 1.0f, dz_next, ld);
      std::swap(dz, dz_next);
    }
    // Z₀ = α·Aᵀ with α = 1/Σ_i A[i, j*]: dA += α·dZ₀ᵀ, and column j* gains −α²·⟨dZ₀, Aᵀ⟩.
    float dot = 0.0f;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < m; ++j) {
        da[i * ld + j] += pinv.alpha * dz[j * ld + i];
        dot += dz[j * ld + i] * a[i * ld + j];
      }
    const float shift = -pinv.alpha * pinv.alpha * dot;
    for (std::int64_t i = 0; i < m; ++i) da[i * ld + pinv.column] += shift;
    return s_.iterations * m * m + 4 * m * m + m;
  }

  Problem p_;
  Sizes s_;
  std::uint64_t seed_;
  Tensor conv_weights_;  // [H, k]
  // Per thread: F [N, m], and for m < N B [m, N], A [m, m], the iterations' slots, the [m, D] parts.
  Tensor kernel_f_, kernel_b_, kernel_a_, chain_, small_;
  Tensor widened_;            // bf16 form: per thread one head's q, k, v and output rows in fp32 [4, N·D]
  Tensor widened_gradients_;  // bf16 training: per thread a head's q, k, v, dO, dQ, dK, dV in fp32 [7, N·D]
  // Training (prepare_backward): per (batch, head) F, B, A and the [m, D] parts; per thread their
  // gradients, the iterations' history and its gradients; the taps' gradient.
  Tensor saved_f_, saved_b_, saved_a_, saved_small_;
  Tensor grad_f_, grad_b_, grad_small_, history_, grad_chain_, d_conv_weights_;
};

}  // namespace

void validate(const Problem&, const NystromformerConfig& c) {
  if (c.conv_kernel % 2 == 0 && c.conv_kernel != 0)
    throw ParamError("nystromformer: conv_kernel must be odd (zero padding of k/2 keeps N rows) or 0, got " +
                     std::to_string(c.conv_kernel));
}

std::string unsupported(const Problem& p, const NystromformerConfig&) {
  return p.causal ? "Nyströmformer has no causal form: the landmarks average over all tokens" : "";
}

NystromformerConfig resolve(const Problem& p, NystromformerConfig c) {
  c.landmarks = std::min(c.landmarks, p.seq_len);
  return c;
}

std::unique_ptr<Mechanism> create(const Problem& problem, const NystromformerConfig& c, std::uint64_t seed) {
  return std::make_unique<Nystromformer>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const NystromformerConfig& c) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t n = s.n, d = s.d, m = s.m;
  std::int64_t head = s.k > 0 ? 2 * d * conv_pairs(s) : 0;
  if (s.exact) {
    head += 2 * matmul_flops(n, n, d) + kSoftmaxFlopsPerElement * n * n;
  } else {
    head += 2 * (n * d + m * d) + matmul_flops(m, m, d) + kSoftmaxFlopsPerElement * m * m + pinv_flops(s) +
            matmul_flops(m, n, d) + kSoftmaxFlopsPerElement * m * n + matmul_flops(m, d, n) + matmul_flops(m, d, m) +
            matmul_flops(n, m, d) + kSoftmaxFlopsPerElement * n * m + matmul_flops(n, d, m);
  }
  return p.batch * p.heads * head;
}

std::int64_t workspace(const Problem& p, const NystromformerConfig& c) {
  const Sizes s = sizes_of(p, c);
  std::int64_t per_thread = s.n * s.ldm;
  if (!s.exact) per_thread += s.m * s.ldn + s.m * s.ldm + Chain::slots(s, false) * s.m * s.ldm + 4 * s.m * s.d;
  if (p.dtype == DType::BF16) per_thread += 4 * s.n * s.d;  // the widened head
  return (p.heads * s.k + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t backward_flops(const Problem& p, const NystromformerConfig& c) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t n = s.n, d = s.d, m = s.m;
  const std::int64_t softmax_back = kSoftmaxBackwardFlopsPerElement;
  std::int64_t head = s.k > 0 ? 4 * d * conv_pairs(s) : 0;
  if (s.exact) {
    head += 4 * matmul_flops(n, n, d) + softmax_back * n * n;
  } else {
    head += 4 * matmul_flops(n, m, d) + softmax_back * n * m;                    // F's side
    head += pinv_flops(s) + 2 * matmul_flops(m, m, d);                           // Z again, dZ, d(B·v)
    head += 4 * matmul_flops(m, n, d) + softmax_back * m * n;                    // B's side
    head += s.iterations * (8 * matmul_flops(m, m, m) + m * m) + 4 * m * m + m;  // through the iterations
    head += softmax_back * m * m + 2 * matmul_flops(m, d, m);                    // A's side
    head += 2 * (n * d + m * d);                                                 // the landmarks
  }
  return p.batch * p.heads * head;
}

std::int64_t backward_workspace(const Problem& p, const NystromformerConfig& c) {
  const Sizes s = sizes_of(p, c);
  const std::int64_t bh = p.batch * p.heads, m = s.m;
  std::int64_t saved = s.n * s.ldm, per_thread = s.n * s.ldm;
  if (!s.exact) {
    saved += m * s.ldn + m * s.ldm + 4 * m * s.d;
    per_thread += m * s.ldn + 4 * m * s.d + (Chain::slots(s, true) + 6) * m * s.ldm;
  }
  if (p.dtype == DType::BF16) per_thread += 7 * s.n * s.d;  // widened_gradients_
  return (bh * saved + p.threads * per_thread + p.heads * s.k) * static_cast<std::int64_t>(sizeof(float));
}

FieldTable<NystromformerConfig> config_fields(const NystromformerConfig*) {
  return {int_field("landmarks", &NystromformerConfig::landmarks, 1, 4096,
                    "m, landmarks (segment means) per head, clamped to N; m >= N is exact attention"),
          int_field("conv_kernel", &NystromformerConfig::conv_kernel, 0, 1023,
                    "taps of the depthwise convolution of v along the sequence (odd), tokens; 0 = no convolution"),
          int_field("iterations", &NystromformerConfig::iterations, 1, 64,
                    "iterations of the pseudo-inverse of the landmark kernel")};
}

template <>
Implementation implementation<NystromformerConfig>() {
  Implementation impl = implement<NystromformerConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
