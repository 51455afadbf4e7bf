#include "taxonomy/memory/luna.hpp"

#include <omp.h>

#include <algorithm>
#include <array>
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

constexpr std::int64_t kFloat = static_cast<std::int64_t>(sizeof(float));
// Decode state floats (Aᵀ and B over every head) from which a step runs its heads in parallel.
constexpr std::int64_t kParallelStepFloats = std::int64_t{1} << 18;

// Rows of P a problem uses: all l when causal, the first min(l, N) otherwise (resolve has cut them).
std::int64_t rows_used(const LunaConfig& c) { return c.projected_length; }

// a = elu(z) + 1 in place over n values (1 FLOP each).
void elu_plus_one(float* z, std::int64_t n) {
#pragma omp simd
  for (std::int64_t i = 0; i < n; ++i) z[i] = z[i] > 0.0f ? z[i] + 1.0f : ops::fast_exp(z[i]);
}

// Fused row kernels of the per-token sums, in 8-lane vectors whose sums stay in registers (an
// `omp simd` reduction's epilogue reloads its lanes from a stack store, a store-forwarding stall
// that dominated the per-token loops).
using Lanes = float __attribute__((vector_size(32)));
constexpr std::int64_t kLanes = 8;
inline Lanes load(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, Lanes v) { __builtin_memcpy(p, &v, sizeof v); }
inline float lane_sum(Lanes v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// Σ x[f]·y[f] over n values.
float dot(const float* __restrict x, const float* __restrict y, std::int64_t n) {
  Lanes acc = {};
  std::int64_t f = 0;
  for (; f + kLanes <= n; f += kLanes) acc += load(x + f) * load(y + f);
  float sum = lane_sum(acc);
  for (; f < n; ++f) sum += x[f] * y[f];
  return sum;
}

// row += w·x, then returns Σ row·y; with acc, also acc += b·row. Over n values.
float update_and_dot(float* __restrict row, float w, const float* __restrict x, const float* __restrict y,
                     float* __restrict acc = nullptr, float b = 0.0f, std::int64_t n = 0) {
  Lanes sum = {};
  std::int64_t f = 0;
  for (; f + kLanes <= n; f += kLanes) {
    const Lanes r = load(row + f) + w * load(x + f);
    store(row + f, r);
    sum += r * load(y + f);
    if (acc != nullptr) store(acc + f, load(acc + f) + b * r);
  }
  float total = lane_sum(sum);
  for (; f < n; ++f) {
    row[f] += w * x[f];
    total += row[f] * y[f];
    if (acc != nullptr) acc[f] += b * row[f];
  }
  return total;
}

// rows_j += a[j]·x for j < count (rows [count, n], row stride n), then out = scale·Σ_j w[j]·rows_j,
// with out's partial sums in registers, 32 columns at a time. Over n values.
void update_and_combine(float* __restrict rows, const float* __restrict a, const float* __restrict x,
                        const float* __restrict w, std::int64_t count, float scale, float* __restrict out,
                        std::int64_t n) {
  std::int64_t f = 0;
  for (; f + 4 * kLanes <= n; f += 4 * kLanes) {
    const Lanes x0 = load(x + f), x1 = load(x + f + kLanes), x2 = load(x + f + 2 * kLanes),
                x3 = load(x + f + 3 * kLanes);
    Lanes o0 = {}, o1 = {}, o2 = {}, o3 = {};
    for (std::int64_t j = 0; j < count; ++j) {
      float* r = rows + j * n + f;
      const Lanes r0 = load(r) + a[j] * x0, r1 = load(r + kLanes) + a[j] * x1;
      const Lanes r2 = load(r + 2 * kLanes) + a[j] * x2, r3 = load(r + 3 * kLanes) + a[j] * x3;
      store(r, r0), store(r + kLanes, r1), store(r + 2 * kLanes, r2), store(r + 3 * kLanes, r3);
      o0 += w[j] * r0, o1 += w[j] * r1, o2 += w[j] * r2, o3 += w[j] * r3;
    }
    store(out + f, scale * o0), store(out + f + kLanes, scale * o1);
    store(out + f + 2 * kLanes, scale * o2), store(out + f + 3 * kLanes, scale * o3);
  }
  for (; f < n; ++f) {
    float o = 0.0f;
    for (std::int64_t j = 0; j < count; ++j) o += w[j] * (rows[j * n + f] += a[j] * x[f]);
    out[f] = scale * o;
  }
}

// In-place softmax of each column of x [rows, cols] over its rows; scratch: 2·cols floats.
void softmax_columns(float* __restrict x, std::int64_t rows, std::int64_t cols, float* __restrict scratch) {
  float* __restrict peak = scratch;
  float* __restrict sum = scratch + cols;
  std::copy(x, x + cols, peak);
  for (std::int64_t r = 1; r < rows; ++r) {
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) peak[j] = std::max(peak[j], x[r * cols + j]);
  }
  std::fill(sum, sum + cols, 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) sum[j] += x[r * cols + j] = ops::fast_exp(x[r * cols + j] - peak[j]);
  }
  for (std::int64_t j = 0; j < cols; ++j) sum[j] = 1.0f / sum[j];
  for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) x[r * cols + j] *= sum[j];
  }
}

// The softmax backward of each column: grad holds dP on entry and P ⊙ (dP − Σ_rows P·dP) on return.
// scratch: cols floats. Returns its FLOPs.
std::int64_t softmax_columns_backward(const float* __restrict p, float* __restrict grad, std::int64_t rows,
                                      std::int64_t cols, float* __restrict scratch) {
  std::fill(scratch, scratch + cols, 0.0f);
  for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) scratch[j] += p[r * cols + j] * grad[r * cols + j];
  }
  for (std::int64_t r = 0; r < rows; ++r) {
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) grad[r * cols + j] = p[r * cols + j] * (grad[r * cols + j] - scratch[j]);
  }
  return kSoftmaxBackwardFlopsPerElement * rows * cols;
}

// Per-token FLOPs outside ops::gemm, per (batch, head).
std::int64_t causal_step_flops(std::int64_t l, std::int64_t d) { return 8 * l * d + 6 * l + d; }
std::int64_t causal_pass1_flops(std::int64_t l, std::int64_t d) { return 8 * l * d + 5 * l + d; }
std::int64_t causal_pass2_flops(std::int64_t l, std::int64_t d) { return 12 * l * d + 3 * l; }

class Luna final : public Mechanism {
 public:
  Luna(const Problem& problem, const LunaConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed), l_(rows_used(config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    const std::int64_t h = p_.heads, d = p_.head_dim, threads = p_.threads;
    projected_ = Tensor(Shape{h, l_, d});
    const CounterRng rng(seed_, "luna/projected_sequence");
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (std::int64_t head = 0; head < h; ++head)
      for (std::int64_t j = 0; j < l_; ++j)
        for (std::int64_t f = 0; f < d; ++f)
          projected_[(head * l_ + j) * d + f] = scale * static_cast<float>(rng.normal_at(head, j, f));
    if (p_.causal) {
      weights_ = Tensor(Shape{threads, c_.chunk, l_});
      key_sums_ = Tensor(Shape{threads, l_, d});
      value_sums_ = Tensor(Shape{threads, l_, d});
      vectors_ = Tensor(Shape{threads, 2, l_});
    } else {
      packed_ = Tensor(Shape{p_.batch * h, l_, d});
      pack_scores_ = Tensor(Shape{threads, p_.seq_len, l_});
      unpack_scores_ = Tensor(Shape{threads, c_.chunk, l_});
      vectors_ = Tensor(Shape{threads, 2, l_});
    }
    if (bf16_form()) widened_ = Tensor(Shape{threads, 4, p_.seq_len, d});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    if (bf16_form()) return widened_forward(q, k, v, out);
    if (p_.causal)
      causal_forward(q, k, v, out);
    else
      noncausal_forward(q, k, v, out);
  }

  std::vector<NamedTensor> parameters() const override { return {{"projected_sequence", &projected_}}; }

  void prepare_backward() override {
    const std::int64_t bh = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    d_projected_ = Tensor(projected_.shape());
    if (p_.causal) {
      saved_weights_ = Tensor(Shape{bh, n, l_});
      saved_probs_ = Tensor(Shape{bh, n, l_});
      weight_grads_ = Tensor(Shape{p_.threads, n, l_});
    } else {
      saved_pack_ = Tensor(Shape{bh, n, l_});
      saved_unpack_ = Tensor(Shape{bh, n, l_});
      packed_grads_ = Tensor(Shape{p_.threads, l_, d});
    }
    if (bf16_form()) widened_gradients_ = Tensor(Shape{p_.threads, 7, n, d});
  }

  std::vector<NamedTensor> saved() const override {
    if (p_.causal) return {{"pack_weights", &saved_weights_}, {"unpack_probabilities", &saved_probs_}};
    return {{"pack_probabilities", &saved_pack_}, {"unpack_probabilities", &saved_unpack_}, {"packed", &packed_}};
  }

  std::vector<NamedTensor> parameter_gradients() const override { return {{"dprojected_sequence", &d_projected_}}; }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t nd = p_.seq_len * p_.head_dim, ld = l_ * p_.head_dim;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t head = 0; head < p_.heads; ++head) {
      const int thread = omp_get_thread_num();
      float* d_projected = d_projected_.data() + head * ld;
      std::fill(d_projected, d_projected + ld, 0.0f);
      for (std::int64_t b = 0; b < p_.batch; ++b) {
        const std::int64_t bh = b * p_.heads + head, at = bh * nd;
        if (bf16_form()) {
          flops += widened_backward(bh, {&q, &k, &v, &dout}, {&dq, &dk, &dv}, d_projected, thread);
          continue;
        }
        const Rows rows{q.data() + at, k.data() + at, v.data() + at};
        const Grads grads{dout.data() + at, dq.data() + at, dk.data() + at, dv.data() + at, d_projected};
        flops += p_.causal ? causal_backward(bh, rows, grads, thread) : noncausal_backward(bh, rows, grads, thread);
      }
    }
    FlopCounter::add(flops);
  }

  void prepare_decode(std::int64_t) override {
    if (!p_.causal) throw std::logic_error("luna: decoding needs a causal problem");
    decode_keys_ = Tensor(Shape{p_.batch * p_.heads, l_, p_.head_dim}, p_.dtype);
    decode_values_ = Tensor(Shape{p_.batch * p_.heads, l_, p_.head_dim}, p_.dtype);
  }

  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t tasks = p_.batch * p_.heads, d = p_.head_dim;
    const std::int64_t t = ++steps_;
    // A step reads its state once; below kParallelStepFloats a parallel region costs more than it saves.
    const bool parallel = 2 * tasks * l_ * d >= kParallelStepFloats;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(static) reduction(+ : flops) if (parallel)
    for (std::int64_t bh = 0; bh < tasks; ++bh) {
      const int thread = omp_get_thread_num();
      if (bf16_form()) {
        widened_step(bh, q, k, v, out, t, thread);
      } else {
        step_rows(bh, q.data() + bh * d, k.data() + bh * d, v.data() + bh * d, t, decode_keys_.data() + bh * d * l_,
                  decode_values_.data() + bh * l_ * d, out.data() + bh * d, thread);
      }
      flops += 2 * l_ * d + 2 * l_ + causal_step_flops(l_, d);
    }
    FlopCounter::add(flops);
  }

  std::vector<NamedTensor> decode_state() const override {
    return {{"key_sums", &decode_keys_}, {"value_sums", &decode_values_}};
  }
  std::int64_t state_bytes() const override {
    return total_bytes(decode_state()) + static_cast<std::int64_t>(sizeof(steps_));
  }

 private:
  struct Rows {
    const float *q, *k, *v;
  };
  struct Grads {
    const float* dout;
    float *dq, *dk, *dv, *d_projected;
  };

  float scale() const { return 1.0f / std::sqrt(static_cast<float>(p_.head_dim)); }
  bool bf16_form() const { return p_.dtype == DType::BF16; }

  // One decode step of (batch, head) bh on fp32 rows: the pack weights of k, then causal_step on
  // the sums keys = Aᵀ, values = B [l, D].
  void step_rows(std::int64_t bh, const float* q, const float* k, const float* v, std::int64_t t, float* keys,
                 float* values, float* out, int thread) {
    const std::int64_t d = p_.head_dim;
    float* weights = vectors_.data() + (thread * 2 + 1) * l_;
    for (std::int64_t j = 0; j < l_; ++j) weights[j] = scale() * dot(k, projected(bh) + j * d, d);
    elu_plus_one(weights, l_);
    causal_step(q, k, v, weights, t, keys, values, vectors_.data() + thread * 2 * l_, nullptr, out);
  }

  // The bf16 forms (luna.hpp): a head's rows widened into the thread's fp32 rows [4, N, D] (q, k,
  // v, out), the fp32 computation, the output (and, decoding, the sums) rounded once.
  void widened_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t tasks = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim, nd = n * d;
    const bool decoding = !decode_keys_.empty();
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < tasks; ++bh) {
      const int thread = omp_get_thread_num();
      float* rows = widened_.data() + thread * 4 * nd;
      const Rows x{rows, rows + nd, rows + 2 * nd};
      float* out_rows = rows + 3 * nd;
      widen(q.bf16_data() + bh * nd, rows, nd);
      widen(k.bf16_data() + bh * nd, rows + nd, nd);
      widen(v.bf16_data() + bh * nd, rows + 2 * nd, nd);
      if (p_.causal) {
        float* keys = key_sums_.data() + thread * d * l_;
        float* values = value_sums_.data() + thread * l_ * d;
        std::fill(keys, keys + d * l_, 0.0f);
        std::fill(values, values + l_ * d, 0.0f);
        flops += causal_head(bh, x, out_rows, keys, values, thread);
        if (decoding) {
          narrow(keys, decode_keys_.bf16_data() + bh * d * l_, d * l_);
          narrow(values, decode_values_.bf16_data() + bh * l_ * d, l_ * d);
        }
      } else {
        flops += pack(bh, x.k, x.v, thread);
        for (std::int64_t r0 = 0; r0 < n; r0 += c_.chunk)
          flops += unpack(bh, r0, x.q + r0 * d, out_rows + r0 * d, thread);
      }
      narrow(out_rows, out.bf16_data() + bh * nd, nd);
    }
    if (p_.causal) steps_ = n;
    FlopCounter::add(flops);
  }

  // A bf16 step: the state widened into the thread's fp32 sums, the step in fp32, the state and
  // the output rounded back (one rounding per state element per token).
  void widened_step(std::int64_t bh, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, std::int64_t t,
                    int thread) {
    const std::int64_t d = p_.head_dim;
    float* keys = key_sums_.data() + thread * d * l_;
    float* values = value_sums_.data() + thread * l_ * d;
    bf16* state_keys = decode_keys_.bf16_data() + bh * d * l_;
    bf16* state_values = decode_values_.bf16_data() + bh * l_ * d;
    widen(state_keys, keys, d * l_);
    widen(state_values, values, l_ * d);
    float* rows = widened_.data() + thread * widened_.dim(1) * widened_.dim(2) * d;  // q, k, v, out [4, D]
    widen(q.bf16_data() + bh * d, rows, d);
    widen(k.bf16_data() + bh * d, rows + d, d);
    widen(v.bf16_data() + bh * d, rows + 2 * d, d);
    step_rows(bh, rows, rows + d, rows + 2 * d, t, keys, values, rows + 3 * d, thread);
    narrow(keys, state_keys, d * l_);
    narrow(values, state_values, l_ * d);
    narrow(rows + 3 * d, out.bf16_data() + bh * d, d);
  }

  // The bf16 backward of (batch, head) bh: q, k, v, dO widened into the thread's fp32 rows
  // [7, N, D] with fp32 dQ, dK, dV (rounded once); dP accumulates in fp32 as in the fp32 form.
  std::int64_t widened_backward(std::int64_t bh, const std::array<const Tensor*, 4>& inputs,
                                const std::array<Tensor*, 3>& grads, float* d_projected, int thread) {
    const std::int64_t nd = p_.seq_len * p_.head_dim;
    float* rows = widened_gradients_.data() + thread * 7 * nd;
    widen_spans(inputs, bh * nd, nd, rows, nd);
    const Rows x{rows, rows + nd, rows + 2 * nd};
    const Grads g{rows + 3 * nd, rows + 4 * nd, rows + 5 * nd, rows + 6 * nd, d_projected};
    const std::int64_t flops = p_.causal ? causal_backward(bh, x, g, thread) : noncausal_backward(bh, x, g, thread);
    narrow_spans(rows + 4 * nd, nd, grads, bh * nd, nd);
    return flops;
  }
  const float* projected(std::int64_t bh) const { return projected_.data() + bh % p_.heads * l_ * p_.head_dim; }

  // ---- non-causal ----

  // One task per (batch, head), pack then unpack: no barrier between them (a descheduled thread
  // stalls every barrier on a shared machine); parallelism min(B·H, threads).
  void noncausal_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t tasks = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < tasks; ++bh) {
      const int thread = omp_get_thread_num();
      const std::int64_t at = bh * n * d;
      flops += pack(bh, k.data() + at, v.data() + at, thread);
      for (std::int64_t r0 = 0; r0 < n; r0 += c_.chunk)
        flops += unpack(bh, r0, q.data() + at + r0 * d, out.data() + at + r0 * d, thread);
    }
    FlopCounter::add(flops);
  }

  // The pack probabilities of (batch, head) bh: the saved ones when the backward is prepared.
  float* pack_probabilities(std::int64_t bh, int thread) {
    const std::int64_t size = p_.seq_len * l_;
    return saved_pack_.empty() ? pack_scores_.data() + thread * size : saved_pack_.data() + bh * size;
  }

  // Y_P[bh] = softmax(c·P·Kᵀ)·V, the scores kept transposed ([N, l]: the product K·Pᵀ has N rows,
  // which oneDNN's sgemm runs faster than l rows, and the softmax over N vectorises over l).
  // Returns the FLOPs outside ops::gemm.
  std::int64_t pack(std::int64_t bh, const float* k, const float* v, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    float* scores = pack_probabilities(bh, thread);
    ops::gemm(false, true, n, l_, d, scale(), k, d, projected(bh), d, 0.0f, scores, l_);
    softmax_columns(scores, n, l_, vectors_.data() + thread * 2 * l_);
    ops::gemm(true, false, l_, d, n, 1.0f, scores, l_, v, d, 0.0f, packed_.data() + bh * l_ * d, d);
    return kSoftmaxFlopsPerElement * l_ * n;
  }

  // Rows [r0, r0 + rows) of O = softmax(c·Q·Y_Pᵀ)·Y_P; q and out point at row r0.
  std::int64_t unpack(std::int64_t bh, std::int64_t r0, const float* q, float* out, int thread) {
    const std::int64_t d = p_.head_dim, rows = std::min(c_.chunk, p_.seq_len - r0);
    float* scores = saved_unpack_.empty() ? unpack_scores_.data() + thread * c_.chunk * l_
                                          : saved_unpack_.data() + (bh * p_.seq_len + r0) * l_;
    const float* packed = packed_.data() + bh * l_ * d;
    ops::gemm(false, true, rows, l_, d, scale(), q, d, packed, d, 0.0f, scores, l_);
    for (std::int64_t r = 0; r < rows; ++r) ops::softmax_in_place(scores + r * l_, l_);
    ops::gemm(false, false, rows, d, l_, 1.0f, scores, l_, packed, d, 0.0f, out, d);
    return kSoftmaxFlopsPerElement * rows * l_;
  }

  std::int64_t noncausal_backward(std::int64_t bh, const Rows& x, const Grads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const float c = scale();
    const float* packed = packed_.data() + bh * l_ * d;
    float* packed_grad = packed_grads_.data() + thread * l_ * d;
    float* score_grads = unpack_scores_.data() + thread * c_.chunk * l_;
    std::int64_t flops = 0;
    for (std::int64_t r0 = 0; r0 < n; r0 += c_.chunk) {
      const std::int64_t rows = std::min(c_.chunk, n - r0), at = r0 * d;
      const float* probs = saved_unpack_.data() + (bh * n + r0) * l_;
      ops::gemm(false, true, rows, l_, d, 1.0f, g.dout + at, d, packed, d, 0.0f, score_grads, l_);
      ops::gemm(true, false, l_, d, rows, 1.0f, probs, l_, g.dout + at, d, r0 == 0 ? 0.0f : 1.0f, packed_grad, d);
      flops += softmax_backward_rows(probs, score_grads, rows, l_, l_);
      ops::gemm(false, false, rows, d, l_, c, score_grads, l_, packed, d, 0.0f, g.dq + at, d);
      ops::gemm(true, false, l_, d, rows, c, score_grads, l_, x.q + at, d, 1.0f, packed_grad, d);
    }
    const float* probs = saved_pack_.data() + bh * n * l_;
    float* pack_grads = pack_scores_.data() + thread * n * l_;
    ops::gemm(false, true, n, l_, d, 1.0f, x.v, d, packed_grad, d, 0.0f, pack_grads, l_);
    ops::gemm(false, false, n, d, l_, 1.0f, probs, l_, packed_grad, d, 0.0f, g.dv, d);
    flops += softmax_columns_backward(probs, pack_grads, n, l_, vectors_.data() + thread * 2 * l_);
    ops::gemm(true, false, l_, d, n, c, pack_grads, l_, x.k, d, 1.0f, g.d_projected, d);
    ops::gemm(false, false, n, d, l_, c, pack_grads, l_, projected(bh), d, 0.0f, g.dk, d);
    return flops;
  }

  // ---- causal ----

  void causal_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    const std::int64_t tasks = p_.batch * p_.heads, n = p_.seq_len, d = p_.head_dim;
    const bool decoding = !decode_keys_.empty();
    std::int64_t flops = 0;
#pragma omp parallel for num_threads(p_.threads) schedule(dynamic, 1) reduction(+ : flops)
    for (std::int64_t bh = 0; bh < tasks; ++bh) {
      const int thread = omp_get_thread_num();
      float* keys = decoding ? decode_keys_.data() + bh * d * l_ : key_sums_.data() + thread * d * l_;
      float* values = decoding ? decode_values_.data() + bh * l_ * d : value_sums_.data() + thread * l_ * d;
      std::fill(keys, keys + d * l_, 0.0f);
      std::fill(values, values + l_ * d, 0.0f);
      const std::int64_t at = bh * n * d;
      flops +=
          causal_head(bh, Rows{q.data() + at, k.data() + at, v.data() + at}, out.data() + at, keys, values, thread);
    }
    steps_ = n;
    FlopCounter::add(flops);
  }

  // One head's causal rows, advancing the sums `keys` = Aᵀ [l, D] and `values` = B [l, D] from zero.
  std::int64_t causal_head(std::int64_t bh, const Rows& x, float* out, float* keys, float* values, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const bool saving = !saved_weights_.empty();
    float* probs = vectors_.data() + thread * 2 * l_;
    std::int64_t flops = 0;
    for (std::int64_t t0 = 0; t0 < n; t0 += c_.chunk) {
      const std::int64_t rows = std::min(c_.chunk, n - t0);
      float* weights = saving ? saved_weights_.data() + (bh * n + t0) * l_ : weights_.data() + thread * c_.chunk * l_;
      ops::gemm(false, true, rows, l_, d, scale(), x.k + t0 * d, d, projected(bh), d, 0.0f, weights, l_);
      elu_plus_one(weights, rows * l_);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t i = t0 + r;
        float* saved_probs = saving ? saved_probs_.data() + (bh * n + i) * l_ : nullptr;
        causal_step(x.q + i * d, x.k + i * d, x.v + i * d, weights + r * l_, i + 1, keys, values, probs, saved_probs,
                    out + i * d);
      }
      flops += rows * (l_ + causal_step_flops(l_, d));
    }
    return flops;
  }

  // Token t (1-based) with pack weights a: keys += a kᵀ, values += a vᵀ (both [l, D]), then
  // out = valuesᵀ·softmax(c/t · keys·q) / t. probs: l floats of scratch; saved_probs (or null)
  // receives π.
  void causal_step(const float* __restrict q, const float* __restrict k, const float* __restrict v,
                   const float* __restrict a, std::int64_t t, float* __restrict keys, float* __restrict values,
                   float* __restrict probs, float* saved_probs, float* __restrict out) const {
    const std::int64_t d = p_.head_dim, l = l_;
    for (std::int64_t j = 0; j < l; ++j) {
      probs[j] = update_and_dot(keys + j * d, a[j], k, q, nullptr, 0.0f, d);
    }
    const float score_scale = scale() / static_cast<float>(t);
#pragma omp simd
    for (std::int64_t j = 0; j < l; ++j) probs[j] *= score_scale;
    ops::softmax_in_place(probs, l);
    if (saved_probs != nullptr) std::copy(probs, probs + l, saved_probs);
    update_and_combine(values, a, v, probs, l, 1.0f / static_cast<float>(t), out, d);
  }

  std::int64_t causal_backward(std::int64_t bh, const Rows& x, const Grads& g, int thread) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, l = l_;
    const float c = scale();
    const float* weights = saved_weights_.data() + bh * n * l;
    const float* probs = saved_probs_.data() + bh * n * l;
    float* grads = weight_grads_.data() + thread * n * l;  // ds_t, then dz_t
    float* key_sums = key_sums_.data() + thread * d * l;
    float* value_sums = value_sums_.data() + thread * l * d;
    // Walk 1 (forward): A_t, B_t again; dπ_t = B_t·dO_t / t, ds_t, dq_t = (c/t)·A_t·ds_t.
    std::fill(key_sums, key_sums + d * l, 0.0f);
    std::fill(value_sums, value_sums + l * d, 0.0f);
    for (std::int64_t i = 0; i < n; ++i) {
      const float *a = weights + i * l, *v = x.v + i * d, *k = x.k + i * d, *dout = g.dout + i * d;
      const float inverse_t = 1.0f / static_cast<float>(i + 1);
      float* ds = grads + i * l;
      for (std::int64_t j = 0; j < l; ++j) {
        ds[j] = update_and_dot(value_sums + j * d, a[j], v, dout, nullptr, 0.0f, d) * inverse_t;
      }
      softmax_backward_rows(probs + i * l, ds, 1, l, l);
      update_and_combine(key_sums, a, k, ds, l, c * inverse_t, g.dq + i * d, d);
    }
    // Walk 2 (backward) with the suffix sums G_B [l, D] and G_Aᵀ [l, D] in the same buffers.
    float* suffix_values = value_sums;
    float* suffix_keys = key_sums;
    std::fill(suffix_keys, suffix_keys + d * l, 0.0f);
    std::fill(suffix_values, suffix_values + l * d, 0.0f);
    float* da = vectors_.data() + thread * 2 * l;
    for (std::int64_t i = n - 1; i >= 0; --i) {
      const float *a = weights + i * l, *pi = probs + i * l, *q = x.q + i * d, *k = x.k + i * d, *v = x.v + i * d;
      const float* dout = g.dout + i * d;
      const float inverse_t = 1.0f / static_cast<float>(i + 1);
      float* __restrict dv = g.dv + i * d;
      float* __restrict dk = g.dk + i * d;
      std::fill(dv, dv + d, 0.0f);
      for (std::int64_t j = 0; j < l; ++j) {
        da[j] = update_and_dot(suffix_values + j * d, pi[j] * inverse_t, dout, v, dv, a[j], d);
      }
      float* __restrict ds = grads + i * l;
      const float q_scale = c * inverse_t;
      std::fill(dk, dk + d, 0.0f);
      for (std::int64_t j = 0; j < l; ++j) {
        da[j] += update_and_dot(suffix_keys + j * d, ds[j] * q_scale, q, k, dk, a[j], d);
      }
#pragma omp simd
      for (std::int64_t j = 0; j < l; ++j) ds[j] = a[j] > 1.0f ? da[j] : da[j] * a[j];  // dz
    }
    ops::gemm(false, false, n, d, l, c, grads, l, projected(bh), d, 1.0f, g.dk, d);
    ops::gemm(true, false, l, d, n, c, grads, l, x.k, d, 1.0f, g.d_projected, d);
    return n * (causal_pass1_flops(l, d) + causal_pass2_flops(l, d));
  }

  Problem p_;
  LunaConfig c_;
  std::uint64_t seed_;
  std::int64_t l_;
  Tensor projected_;
  // Non-causal: Y_P per (batch, head); per thread pack scores [l, ld(N)] and an unpack block.
  Tensor packed_, pack_scores_, unpack_scores_;
  // Causal: per thread pack weights of a chunk, the sums Aᵀ and B [l, D], two l-vectors.
  Tensor weights_, key_sums_, value_sums_, vectors_;
  // Backward: dP; non-causal saved probabilities and per thread dY_P; causal saved a and π and per
  // thread ds/dz rows [N, l].
  Tensor d_projected_, saved_pack_, saved_unpack_, packed_grads_, saved_weights_, saved_probs_, weight_grads_;
  // Decoding: Aᵀ and B per (batch, head); the tokens seen.
  Tensor decode_keys_, decode_values_;
  std::int64_t steps_ = 0;
  // bf16 only: per thread a head's fp32 rows: q, k, v, out [4, N, D]; in training q, k, v, dO, dQ, dK, dV.
  Tensor widened_, widened_gradients_;
};

std::int64_t heads_of(const Problem& p) { return p.batch * p.heads; }

}  // namespace

std::unique_ptr<Mechanism> create(const Problem& problem, const LunaConfig& c, std::uint64_t seed) {
  return std::make_unique<Luna>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const LunaConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, l = rows_used(c);
  if (p.causal) return heads_of(p) * n * (matmul_flops(1, l, d) + l + causal_step_flops(l, d));
  return heads_of(p) * (4 * matmul_flops(n, l, d) + 2 * kSoftmaxFlopsPerElement * n * l);
}

std::int64_t workspace(const Problem& p, const LunaConfig& c) {
  const std::int64_t d = p.head_dim, l = rows_used(c), threads = p.threads;
  const std::int64_t parameters = p.heads * l * d;
  const std::int64_t widened = p.dtype == DType::BF16 ? threads * 4 * p.seq_len * d : 0;
  if (p.causal) return (parameters + threads * (c.chunk * l + 2 * d * l + 2 * l) + widened) * kFloat;
  return (parameters + heads_of(p) * l * d + threads * (l * p.seq_len + c.chunk * l + 2 * l) + widened) * kFloat;
}

std::int64_t backward_flops(const Problem& p, const LunaConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, l = rows_used(c);
  if (p.causal)
    return heads_of(p) * n * (causal_pass1_flops(l, d) + causal_pass2_flops(l, d) + 2 * matmul_flops(1, l, d));
  return heads_of(p) * (8 * matmul_flops(n, l, d) + 2 * kSoftmaxBackwardFlopsPerElement * n * l);
}

std::int64_t backward_workspace(const Problem& p, const LunaConfig& c) {
  const std::int64_t n = p.seq_len, d = p.head_dim, l = rows_used(c);
  const std::int64_t gradients = p.heads * l * d + (p.dtype == DType::BF16 ? p.threads * 7 * n * d : 0);
  if (p.causal) return (gradients + 2 * heads_of(p) * n * l + p.threads * n * l) * kFloat;
  return (gradients + 2 * heads_of(p) * n * l + p.threads * l * d) * kFloat;
}

std::int64_t decode_workspace(const Problem& p, const LunaConfig& c, std::int64_t) {
  return 2 * heads_of(p) * rows_used(c) * p.head_dim * element_bytes(p.dtype);
}

FieldTable<LunaConfig> config_fields(const LunaConfig*) {
  return {int_field("projected_length", &LunaConfig::projected_length, 1, 4096,
                    "l, rows of the learned projected sequence P per head (non-causal: clamped to N)"),
          int_field("chunk", &LunaConfig::chunk, 1, 65536,
                    "tokens per block: causal pack-weight products, non-causal query blocks (clamped to N)")};
}

LunaConfig resolve(const Problem& p, LunaConfig c) {
  if (!p.causal) c.projected_length = std::min(c.projected_length, p.seq_len);
  c.chunk = std::min(c.chunk, p.seq_len);
  return c;
}

template <>
Implementation implementation<LunaConfig>() {
  Implementation impl = implement<LunaConfig>();
  impl.bf16_forward = true;  // storage only (luna.hpp): forward, decode and backward
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
