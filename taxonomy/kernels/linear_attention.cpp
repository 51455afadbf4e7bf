#include "taxonomy/kernels/linear_attention.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"

namespace xfb {

struct ChunkedLinearAttention::Buffers {
  float* phi_q;       // [C, ld_m]
  float* phi_k;       // [C, ld_m]
  float* scores;      // [C, ld_c]
  float* values;      // [C, ld_v]: V_c and a ones column at D
  float* numerators;  // [C, ld_v]
  float* state;       // [M, ld_v]
  float* query_rows;  // bf16: Q_c widened [C, D] (nullptr in fp32)
  float* key_rows;    // bf16: K_c widened [C, D] (nullptr in fp32)
};

struct ChunkedLinearAttention::GradBuffers {
  float* output_grads;   // G' [C, ld_v]
  float* feature_grads;  // dφ [C, ld_m]
  float* adjoint;        // dS' (non-causal) or R (causal) [M, ld_v]
  float* masked;         // B = tril(G'·V'ᵀ) [C, ld_c] (causal)
  float* gradient_rows;  // bf16: a chunk's fp32 dq, dk or dv rows [C, D] before rounding (nullptr in fp32)
};

namespace {

std::int64_t clamp_chunk(const Problem& p, std::int64_t chunk) {
  return std::max<std::int64_t>(1, std::min(chunk, p.seq_len));
}

// values[r] = [v_r | 1] for the rows of one chunk.
template <class T>
void load_values(const T* v, std::int64_t rows, std::int64_t d, float* values, std::int64_t ld) {
  for (std::int64_t r = 0; r < rows; ++r) {
    if constexpr (std::is_same_v<T, bf16>)
      widen(v + r * d, values + r * ld, d);
    else
      std::copy(v + r * d, v + (r + 1) * d, values + r * ld);
    values[r * ld + d] = 1.0f;
  }
}

// out[r] = numerators[r][0:D] / numerators[r][D] (rounded to bf16 for a bf16 out); z[r] =
// numerators[r][D] when z is given. Returns its FLOPs (D per row).
template <class T>
std::int64_t normalise(const float* numerators, std::int64_t rows, std::int64_t d, std::int64_t ld, T* out, float* z) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* src = numerators + r * ld;
    if (z != nullptr) z[r] = src[d];
    const float inverse = 1.0f / src[d];
    T* dst = out + r * d;
#pragma omp simd
    for (std::int64_t j = 0; j < d; ++j) dst[j] = stored<T>(src[j] * inverse);
  }
  return rows * d;
}

// Multiplies the [m, d+1] state by exp(old − new) after the key shift moved. Returns its FLOPs.
std::int64_t rescale(float* state, std::int64_t m, std::int64_t cols, std::int64_t ld, float old_shift,
                     float new_shift) {
  const float factor = std::exp(old_shift - new_shift);
  for (std::int64_t r = 0; r < m; ++r) {
    float* row = state + r * ld;
#pragma omp simd
    for (std::int64_t j = 0; j < cols; ++j) row[j] *= factor;
  }
  return m * cols;
}

// Zeroes entries j > i of a square [rows, rows] block (row stride ld).
void mask_future(float* scores, std::int64_t rows, std::int64_t ld) {
  for (std::int64_t r = 0; r + 1 < rows; ++r) std::fill(scores + r * ld + r + 1, scores + r * ld + rows, 0.0f);
}

}  // namespace

ChunkedLinearAttention::ChunkedLinearAttention(const Problem& problem, std::int64_t chunk, std::int64_t feature_dim)
    : p_(problem),
      chunk_(clamp_chunk(problem, chunk)),
      m_(feature_dim),
      ld_m_(ops::padded_ld(feature_dim)),
      ld_c_(ops::padded_ld(chunk_)),
      ld_v_(ops::padded_ld(problem.head_dim + 1)) {
  const std::int64_t threads = p_.threads;
  phi_q_ = Tensor(Shape{threads, chunk_, ld_m_});
  phi_k_ = Tensor(Shape{threads, chunk_, ld_m_});
  if (p_.causal) scores_ = Tensor(Shape{threads, chunk_, ld_c_});
  values_ = Tensor(Shape{threads, chunk_, ld_v_});
  numerators_ = Tensor(Shape{threads, chunk_, ld_v_});
  state_ = Tensor(Shape{threads, m_, ld_v_});
  if (p_.dtype == DType::BF16) input_rows_ = Tensor(Shape{threads, 2, chunk_, p_.head_dim});
}

ChunkedLinearAttention::Buffers ChunkedLinearAttention::buffers(int thread) {
  float* rows = input_rows_.empty() ? nullptr : input_rows_.data() + thread * 2 * chunk_ * p_.head_dim;
  return {phi_q_.data() + thread * chunk_ * ld_m_,
          phi_k_.data() + thread * chunk_ * ld_m_,
          p_.causal ? scores_.data() + thread * chunk_ * ld_c_ : nullptr,
          values_.data() + thread * chunk_ * ld_v_,
          numerators_.data() + thread * chunk_ * ld_v_,
          state_.data() + thread * m_ * ld_v_,
          rows,
          rows == nullptr ? nullptr : rows + chunk_ * p_.head_dim};
}

void ChunkedLinearAttention::forward(const FeatureMap& map, const Tensor& q, const Tensor& k, const Tensor& v,
                                     Tensor& out) {
  if (p_.dtype == DType::BF16)
    forward_heads(map, q.bf16_data(), k.bf16_data(), v.bf16_data(), out.bf16_data());
  else
    forward_heads(map, q.data(), k.data(), v.data(), out.data());
}

template <class T>
void ChunkedLinearAttention::forward_heads(const FeatureMap& map, const T* q, const T* k, const T* v, T* out) {
  const std::int64_t tasks = p_.batch * p_.heads, head_size = p_.seq_len * p_.head_dim;
  T* states = nullptr;
  if (!decode_states_.empty()) {
    if constexpr (std::is_same_v<T, bf16>)
      states = decode_states_.bf16_data();
    else
      states = decode_states_.data();
  }
  std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
  {
    const Buffers b = buffers(omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t offset = task * head_size;
      float* z = normalisers_.empty() ? nullptr : normalisers_.data() + task * p_.seq_len;
      float* shifts = shifts_.empty() ? nullptr : shifts_.data() + task * shifts_.dim(1);
      T* final_state = states == nullptr ? nullptr : states + task * m_ * ld_v_;
      float* final_shift = decode_shifts_.empty() ? nullptr : decode_shifts_.data() + task;
      flops += p_.causal ? head_causal(map, q + offset, k + offset, v + offset, out + offset, z, shifts, b, final_state,
                                       final_shift)
                         : head_full(map, q + offset, k + offset, v + offset, out + offset, z, shifts, b);
    }
  }
  FlopCounter::add(flops);
}

template <class T>
std::int64_t ChunkedLinearAttention::load_key_chunk(const FeatureMap& map, const T* k, const T* v, std::int64_t c0,
                                                    std::int64_t rows, float& shift, const Buffers& b,
                                                    bool rescale_state) const {
  const std::int64_t d = p_.head_dim;
  const float old_shift = shift;
  std::int64_t flops = map.keys(fp32_rows(k, c0, rows, d, b.key_rows), rows, b.phi_k, ld_m_, shift);
  if (c0 > 0 && map.shifts() && rescale_state) flops += rescale(b.state, m_, d + 1, ld_v_, old_shift, shift);
  load_values(v + c0 * d, rows, d, b.values, ld_v_);
  return flops;
}

template <class T>
std::int64_t ChunkedLinearAttention::head_full(const FeatureMap& map, const T* q, const T* k, const T* v, T* out,
                                               float* z, float* shifts, const Buffers& b) const {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  float shift = -std::numeric_limits<float>::infinity();
  std::int64_t flops = 0;
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {
    const std::int64_t rows = std::min(chunk_, n - c0);
    flops += load_key_chunk(map, k, v, c0, rows, shift, b);
    if (shifts != nullptr) shifts[c0 / chunk_] = shift;
    ops::gemm(true, false, m_, d + 1, rows, 1.0f, b.phi_k, ld_m_, b.values, ld_v_, c0 > 0 ? 1.0f : 0.0f, b.state,
              ld_v_);
  }
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {
    const std::int64_t rows = std::min(chunk_, n - c0);
    flops += map.queries(fp32_rows(q, c0, rows, d, b.query_rows), rows, b.phi_q, ld_m_);
    ops::gemm(false, false, rows, d + 1, m_, 1.0f, b.phi_q, ld_m_, b.state, ld_v_, 0.0f, b.numerators, ld_v_);
    flops += normalise(b.numerators, rows, d, ld_v_, out + c0 * d, z == nullptr ? nullptr : z + c0);
  }
  return flops;
}

template <class T>
std::int64_t ChunkedLinearAttention::head_causal(const FeatureMap& map, const T* q, const T* k, const T* v, T* out,
                                                 float* z, float* shifts, const Buffers& b, T* final_state,
                                                 float* final_shift) const {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  float shift = -std::numeric_limits<float>::infinity();
  std::int64_t flops = 0;
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {
    const std::int64_t rows = std::min(chunk_, n - c0);
    flops += load_key_chunk(map, k, v, c0, rows, shift, b);
    if (shifts != nullptr) shifts[c0 / chunk_] = shift;
    flops += map.queries(fp32_rows(q, c0, rows, d, b.query_rows), rows, b.phi_q, ld_m_);
    // Inside the chunk: the masked small product.
    ops::gemm(false, true, rows, rows, m_, 1.0f, b.phi_q, ld_m_, b.phi_k, ld_m_, 0.0f, b.scores, ld_c_);
    mask_future(b.scores, rows, ld_c_);
    ops::gemm(false, false, rows, d + 1, rows, 1.0f, b.scores, ld_c_, b.values, ld_v_, 0.0f, b.numerators, ld_v_);
    // Earlier chunks: the running state.
    if (c0 > 0)
      ops::gemm(false, false, rows, d + 1, m_, 1.0f, b.phi_q, ld_m_, b.state, ld_v_, 1.0f, b.numerators, ld_v_);
    if (c0 + rows < n || final_state != nullptr)
      ops::gemm(true, false, m_, d + 1, rows, 1.0f, b.phi_k, ld_m_, b.values, ld_v_, c0 > 0 ? 1.0f : 0.0f, b.state,
                ld_v_);
    flops += normalise(b.numerators, rows, d, ld_v_, out + c0 * d, z == nullptr ? nullptr : z + c0);
  }
  if (final_state != nullptr) {
    if constexpr (std::is_same_v<T, bf16>)
      narrow(b.state, final_state, m_ * ld_v_);  // the decode state's first rounding
    else
      std::copy_n(b.state, m_ * ld_v_, final_state);
    *final_shift = shift;
  }
  return flops;
}

void ChunkedLinearAttention::enable_decode() {
  if (!p_.causal) throw std::logic_error("ChunkedLinearAttention: decoding needs a causal problem");
  decode_states_ = Tensor(Shape{p_.batch * p_.heads, m_, ld_v_}, p_.dtype);
  decode_shifts_ = Tensor(Shape{p_.batch * p_.heads});
}

void ChunkedLinearAttention::decode_step(const FeatureMap& map, const Tensor& q, const Tensor& k, const Tensor& v,
                                         Tensor& out) {
  if (p_.dtype == DType::BF16)
    decode_heads(map, q.bf16_data(), k.bf16_data(), v.bf16_data(), out.bf16_data(), decode_states_.bf16_data());
  else
    decode_heads(map, q.data(), k.data(), v.data(), out.data(), decode_states_.data());
}

template <class T>
void ChunkedLinearAttention::decode_heads(const FeatureMap& map, const T* q, const T* k, const T* v, T* out,
                                          T* states) {
  const std::int64_t tasks = p_.batch * p_.heads, d = p_.head_dim;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
  {
    const Buffers b = buffers(omp_get_thread_num());
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < tasks; ++task)
      flops += head_step(map, q + task * d, k + task * d, v + task * d, out + task * d, states + task * m_ * ld_v_,
                         decode_shifts_[task], b);
  }
  FlopCounter::add(flops);
}

template <class T>
std::int64_t ChunkedLinearAttention::head_step(const FeatureMap& map, const T* q, const T* k, const T* v, T* out,
                                               T* state, float& shift, const Buffers& b) const {
  const std::int64_t d = p_.head_dim;
  const float old_shift = shift;
  std::int64_t flops = map.keys(fp32_rows(k, 0, 1, d, b.key_rows), 1, b.phi_k, ld_m_, shift);
  const bool grew = map.shifts() && shift > old_shift;
  if constexpr (!std::is_same_v<T, bf16>)
    if (grew) flops += rescale(state, m_, d + 1, ld_v_, old_shift, shift);
  flops += map.queries(fp32_rows(q, 0, 1, d, b.query_rows), 1, b.phi_q, ld_m_);
  // One pass over the state: S' += φ(k)ᵀ·[v | 1], then out' = φ(q)ᵀ·S' row by row. The padded
  // columns past D + 1 see zeros added (values is zero there) and are never read.
  float* values = b.values;
  load_values(v, 1, d, values, ld_v_);
  std::fill(values + d + 1, values + ld_v_, 0.0f);
  float* numerator = b.numerators;
  std::fill_n(numerator, ld_v_, 0.0f);
  if constexpr (std::is_same_v<T, bf16>) {
    // bf16 state: each row widened, rescaled (when the shift grew) and updated in fp32, answered
    // from the fp32 sum, and rounded back once: one rounding per state element per token.
    const float factor = grew ? std::exp(old_shift - shift) : 1.0f;
    if (grew) flops += m_ * (d + 1);
    for (std::int64_t r = 0; r < m_; ++r) {
      const float key_feature = b.phi_k[r], query_feature = b.phi_q[r];
      bf16* row = state + r * ld_v_;
#pragma omp simd
      for (std::int64_t j = 0; j < ld_v_; ++j) {
        const float updated = to_float(row[j]) * factor + key_feature * values[j];
        row[j] = to_bf16(updated);
        numerator[j] += query_feature * updated;
      }
    }
  } else {
    for (std::int64_t r = 0; r < m_; ++r) {
      const float key_feature = b.phi_k[r], query_feature = b.phi_q[r];
      float* row = state + r * ld_v_;
#pragma omp simd
      for (std::int64_t j = 0; j < ld_v_; ++j) {
        row[j] += key_feature * values[j];
        numerator[j] += query_feature * row[j];
      }
    }
  }
  flops += 4 * m_ * (d + 1) + normalise(numerator, 1, d, ld_v_, out, nullptr);
  return flops;
}

void ChunkedLinearAttention::enable_backward() {
  const std::int64_t threads = p_.threads;
  normalisers_ = Tensor(Shape{p_.batch * p_.heads, p_.seq_len});
  shifts_ = Tensor(Shape{p_.batch * p_.heads, (p_.seq_len + chunk_ - 1) / chunk_});
  output_grads_ = Tensor(Shape{threads, chunk_, ld_v_});
  feature_grads_ = Tensor(Shape{threads, chunk_, ld_m_});
  adjoint_ = Tensor(Shape{threads, m_, ld_v_});
  if (p_.causal) masked_grads_ = Tensor(Shape{threads, chunk_, ld_c_});
  if (p_.dtype == DType::BF16) gradient_rows_ = Tensor(Shape{threads, chunk_, p_.head_dim});
}

ChunkedLinearAttention::GradBuffers ChunkedLinearAttention::grad_buffers(int thread) {
  return {output_grads_.data() + thread * chunk_ * ld_v_, feature_grads_.data() + thread * chunk_ * ld_m_,
          adjoint_.data() + thread * m_ * ld_v_, p_.causal ? masked_grads_.data() + thread * chunk_ * ld_c_ : nullptr,
          gradient_rows_.empty() ? nullptr : gradient_rows_.data() + thread * chunk_ * p_.head_dim};
}

void ChunkedLinearAttention::backward(const FeatureMap& map, const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& out, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv) {
  if (!map.differentiable() || normalisers_.empty())
    throw std::logic_error("ChunkedLinearAttention::backward: needs enable_backward and a differentiable map");
  if (p_.dtype == DType::BF16)
    backward_heads(map, q.bf16_data(), k.bf16_data(), v.bf16_data(), out.bf16_data(), dout.bf16_data(), dq.bf16_data(),
                   dk.bf16_data(), dv.bf16_data());
  else
    backward_heads(map, q.data(), k.data(), v.data(), out.data(), dout.data(), dq.data(), dk.data(), dv.data());
}

template <class T>
void ChunkedLinearAttention::backward_heads(const FeatureMap& map, const T* q, const T* k, const T* v, const T* out,
                                            const T* dout, T* dq, T* dk, T* dv) {
  const std::int64_t tasks = p_.batch * p_.heads, n = p_.seq_len, head_size = n * p_.head_dim;
  std::int64_t flops = 0;
#pragma omp parallel num_threads(p_.threads) reduction(+ : flops)
  {
    const int thread = omp_get_thread_num();
    const Buffers b = buffers(thread);
    const GradBuffers g = grad_buffers(thread);
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < tasks; ++task) {
      const std::int64_t offset = task * head_size;
      const HeadInputs<T> in{q + offset,
                             k + offset,
                             v + offset,
                             out + offset,
                             dout + offset,
                             normalisers_.data() + task * n,
                             shifts_.data() + task * shifts_.dim(1)};
      const HeadGrads<T> grads{dq + offset, dk + offset, dv + offset};
      flops += p_.causal ? head_backward_causal(map, in, grads, b, g) : head_backward_full(map, in, grads, b, g);
    }
  }
  FlopCounter::add(flops);
}

// G'[r] = [dO_r / z_r, −(dO_r·O_r)/z_r] with z_r the saved normaliser × z_scale.
template <class T>
std::int64_t ChunkedLinearAttention::output_grads(const HeadInputs<T>& in, std::int64_t c0, std::int64_t rows,
                                                  float z_scale, const GradBuffers& g) const {
  const std::int64_t d = p_.head_dim;
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* dout = in.dout + (c0 + r) * d;
    const T* out = in.out + (c0 + r) * d;
    const float inverse = 1.0f / (in.z[c0 + r] * z_scale);
    float* dst = g.output_grads + r * ld_v_;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t j = 0; j < d; ++j) {
      const float grad = as_float(dout[j]);
      dst[j] = grad * inverse;
      dot += grad * as_float(out[j]);
    }
    dst[d] = -dot * inverse;
  }
  return 3 * rows * d;
}

template <class T>
std::int64_t ChunkedLinearAttention::head_backward_full(const FeatureMap& map, const HeadInputs<T>& in,
                                                        const HeadGrads<T>& grads, const Buffers& b,
                                                        const GradBuffers& g) const {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  const T *q = in.q, *k = in.k, *v = in.v;
  float shift = saved_shift(in.shifts, n - 1);  // every key at the final shift, as pass 2 of the forward saw them
  std::int64_t flops = 0;
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {  // S'
    const std::int64_t rows = std::min(chunk_, n - c0);
    flops += load_key_chunk(map, k, v, c0, rows, shift, b, false);
    ops::gemm(true, false, m_, d + 1, rows, 1.0f, b.phi_k, ld_m_, b.values, ld_v_, c0 > 0 ? 1.0f : 0.0f, b.state,
              ld_v_);
  }
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {  // dQ and dS'
    const std::int64_t rows = std::min(chunk_, n - c0);
    const float* query_rows = fp32_rows(q, c0, rows, d, b.query_rows);
    flops += map.queries(query_rows, rows, b.phi_q, ld_m_) + output_grads(in, c0, rows, 1.0f, g);
    ops::gemm(false, true, rows, m_, d + 1, 1.0f, g.output_grads, ld_v_, b.state, ld_v_, 0.0f, g.feature_grads, ld_m_);
    float* dq = fp32_target(grads.dq, c0, d, g.gradient_rows);
    flops += map.gradient(query_rows, rows, b.phi_q, g.feature_grads, ld_m_, dq, false);
    store_rows(dq, grads.dq, c0, rows, d);
    ops::gemm(true, false, m_, d + 1, rows, 1.0f, b.phi_q, ld_m_, g.output_grads, ld_v_, c0 > 0 ? 1.0f : 0.0f,
              g.adjoint, ld_v_);
  }
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {  // dK and dV
    const std::int64_t rows = std::min(chunk_, n - c0);
    flops += load_key_chunk(map, k, v, c0, rows, shift, b, false);
    ops::gemm(false, true, rows, m_, d + 1, 1.0f, b.values, ld_v_, g.adjoint, ld_v_, 0.0f, g.feature_grads, ld_m_);
    float* dk = fp32_target(grads.dk, c0, d, g.gradient_rows);
    flops += map.gradient(widened_rows(k, c0, d, b.key_rows), rows, b.phi_k, g.feature_grads, ld_m_, dk, true);
    store_rows(dk, grads.dk, c0, rows, d);
    float* dv = fp32_target(grads.dv, c0, d, g.gradient_rows);
    ops::gemm(false, false, rows, d, m_, 1.0f, b.phi_k, ld_m_, g.adjoint, ld_v_, 0.0f, dv, d);
    store_rows(dv, grads.dv, c0, rows, d);
  }
  return flops;
}

template <class T>
std::int64_t ChunkedLinearAttention::head_backward_causal(const FeatureMap& map, const HeadInputs<T>& in,
                                                          const HeadGrads<T>& grads, const Buffers& b,
                                                          const GradBuffers& g) const {
  const std::int64_t n = p_.seq_len, d = p_.head_dim;
  const T *q = in.q, *k = in.k, *v = in.v;
  const float final_shift = saved_shift(in.shifts, n - 1);
  float shift = final_shift;  // every key at the final shift; each row's z brought there from its chunk's
  std::int64_t flops = 0;
  // The chunk's features, G' and B = tril(G'·V'ᵀ).
  auto load_chunk = [&](std::int64_t c0, std::int64_t rows) {
    const float z_scale = map.shifts() ? std::exp(saved_shift(in.shifts, c0) - final_shift) : 1.0f;
    flops += load_key_chunk(map, k, v, c0, rows, shift, b, false) +
             map.queries(fp32_rows(q, c0, rows, d, b.query_rows), rows, b.phi_q, ld_m_) +
             output_grads(in, c0, rows, z_scale, g);
    ops::gemm(false, true, rows, rows, d + 1, 1.0f, g.output_grads, ld_v_, b.values, ld_v_, 0.0f, g.masked, ld_c_);
    mask_future(g.masked, rows, ld_c_);
  };
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk_) {  // forward walk: dQ
    const std::int64_t rows = std::min(chunk_, n - c0);
    load_chunk(c0, rows);
    ops::gemm(false, false, rows, m_, rows, 1.0f, g.masked, ld_c_, b.phi_k, ld_m_, 0.0f, g.feature_grads, ld_m_);
    if (c0 > 0)
      ops::gemm(false, true, rows, m_, d + 1, 1.0f, g.output_grads, ld_v_, b.state, ld_v_, 1.0f, g.feature_grads,
                ld_m_);
    float* dq = fp32_target(grads.dq, c0, d, g.gradient_rows);
    flops += map.gradient(widened_rows(q, c0, d, b.query_rows), rows, b.phi_q, g.feature_grads, ld_m_, dq, false);
    store_rows(dq, grads.dq, c0, rows, d);
    if (c0 + rows < n)
      ops::gemm(true, false, m_, d + 1, rows, 1.0f, b.phi_k, ld_m_, b.values, ld_v_, c0 > 0 ? 1.0f : 0.0f, b.state,
                ld_v_);
  }
  const std::int64_t last = (n - 1) / chunk_ * chunk_;
  for (std::int64_t c0 = last; c0 >= 0; c0 -= chunk_) {  // reverse walk: dK, dV
    const std::int64_t rows = std::min(chunk_, n - c0);
    load_chunk(c0, rows);
    ops::gemm(false, true, rows, rows, m_, 1.0f, b.phi_q, ld_m_, b.phi_k, ld_m_, 0.0f, b.scores, ld_c_);
    mask_future(b.scores, rows, ld_c_);
    ops::gemm(true, false, rows, m_, rows, 1.0f, g.masked, ld_c_, b.phi_q, ld_m_, 0.0f, g.feature_grads, ld_m_);
    if (c0 < last)
      ops::gemm(false, true, rows, m_, d + 1, 1.0f, b.values, ld_v_, g.adjoint, ld_v_, 1.0f, g.feature_grads, ld_m_);
    float* dk = fp32_target(grads.dk, c0, d, g.gradient_rows);
    flops += map.gradient(widened_rows(k, c0, d, b.key_rows), rows, b.phi_k, g.feature_grads, ld_m_, dk, true);
    store_rows(dk, grads.dk, c0, rows, d);
    float* dv = fp32_target(grads.dv, c0, d, g.gradient_rows);
    ops::gemm(true, false, rows, d, rows, 1.0f, b.scores, ld_c_, g.output_grads, ld_v_, 0.0f, dv, d);
    if (c0 < last) ops::gemm(false, false, rows, d, m_, 1.0f, b.phi_k, ld_m_, g.adjoint, ld_v_, 1.0f, dv, d);
    store_rows(dv, grads.dv, c0, rows, d);
    if (c0 > 0)
      ops::gemm(true, false, m_, d + 1, rows, 1.0f, b.phi_q, ld_m_, g.output_grads, ld_v_, c0 < last ? 1.0f : 0.0f,
                g.adjoint, ld_v_);
  }
  return flops;
}

std::int64_t linear_attention_flops(const Problem& p, std::int64_t chunk, const FeatureCosts& costs) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = costs.dim, c = clamp_chunk(p, chunk);
  const std::int64_t state_size = m * (d + 1);
  std::int64_t per_head = n * (costs.query_row + costs.key_row) + n * d;
  const std::int64_t chunks = (n + c - 1) / c;
  if (costs.shifts) per_head += (chunks - 1) * state_size;
  if (!p.causal) return p.batch * p.heads * (per_head + 4 * n * state_size);
  for (std::int64_t c0 = 0; c0 < n; c0 += c) {
    const std::int64_t rows = std::min(c, n - c0);
    per_head += matmul_flops(rows, rows, m) + matmul_flops(rows, d + 1, rows);
    if (c0 > 0) per_head += matmul_flops(rows, d + 1, m);
    if (c0 + rows < n) per_head += matmul_flops(m, d + 1, rows);
  }
  return p.batch * p.heads * per_head;
}

std::int64_t linear_attention_backward_flops(const Problem& p, std::int64_t chunk, const FeatureCosts& costs) {
  const std::int64_t n = p.seq_len, d = p.head_dim, m = costs.dim, c = clamp_chunk(p, chunk);
  const std::int64_t features = costs.query_row + costs.key_row, output_grads = 3 * d;
  std::int64_t per_head = n * (costs.query_gradient_row + costs.key_gradient_row);  // dQ and dK through the map
  if (!p.causal) {
    // S'; dφ(Q), dS'; dφ(K), dV.
    per_head += n * (costs.key_row + costs.query_row + output_grads + costs.key_row) + 3 * matmul_flops(n, m, d + 1) +
                matmul_flops(n, m, d + 1) + matmul_flops(n, d, m);
    return p.batch * p.heads * per_head;
  }
  const std::int64_t last = (n - 1) / c * c;
  for (std::int64_t c0 = 0; c0 < n; c0 += c) {
    const std::int64_t rows = std::min(c, n - c0);
    const std::int64_t chunk_load = rows * (features + output_grads) + matmul_flops(rows, rows, d + 1);
    per_head += 2 * chunk_load;                                   // both walks load the chunk
    per_head += matmul_flops(rows, m, rows);                      // B·φ(K)
    if (c0 > 0) per_head += matmul_flops(rows, m, d + 1);         // G'·S'ᵀ
    if (c0 + rows < n) per_head += matmul_flops(m, d + 1, rows);  // S' update
    per_head +=
        matmul_flops(rows, rows, m) + matmul_flops(rows, m, rows) + matmul_flops(rows, d, rows);  // A, Bᵀ·φ(Q), Aᵀ·G'
    if (c0 < last) per_head += matmul_flops(rows, m, d + 1) + matmul_flops(rows, d, m);           // V'·Rᵀ, φ(K)·R
    if (c0 > 0) per_head += matmul_flops(m, d + 1, rows);                                         // R update
  }
  return p.batch * p.heads * per_head;
}

std::int64_t linear_attention_backward_workspace(const Problem& p, std::int64_t chunk, std::int64_t feature_dim) {
  const std::int64_t c = clamp_chunk(p, chunk), ld_v = ops::padded_ld(p.head_dim + 1);
  std::int64_t per_thread = c * ld_v + c * ops::padded_ld(feature_dim) + feature_dim * ld_v;
  if (p.causal) per_thread += c * ops::padded_ld(c);
  if (p.dtype == DType::BF16) per_thread += c * p.head_dim;  // the fp32 gradient rows before rounding
  const std::int64_t saved = p.batch * p.heads * (p.seq_len + (p.seq_len + c - 1) / c);  // z, chunk shifts
  return (saved + p.threads * per_thread) * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t linear_attention_decode_workspace(const Problem& p, std::int64_t feature_dim) {
  const std::int64_t heads = p.batch * p.heads;
  return heads * (feature_dim * ops::padded_ld(p.head_dim + 1) * element_bytes(p.dtype) +  // S'
                  static_cast<std::int64_t>(sizeof(float)));                               // the key shift
}

std::int64_t linear_attention_workspace(const Problem& p, std::int64_t chunk, std::int64_t feature_dim) {
  const std::int64_t c = clamp_chunk(p, chunk), ld_v = ops::padded_ld(p.head_dim + 1);
  std::int64_t per_thread = 2 * c * ops::padded_ld(feature_dim) + 2 * c * ld_v + feature_dim * ld_v;
  if (p.causal) per_thread += c * ops::padded_ld(c);
  if (p.dtype == DType::BF16) per_thread += 2 * c * p.head_dim;  // the widened query and key rows
  return p.threads * per_thread * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace xfb
