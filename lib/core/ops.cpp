#include "lib/core/ops.hpp"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <stdexcept>
#include <string>

#include "lib/core/bf16_rows.hpp"
#include "lib/core/dnnl_context.hpp"
#include "lib/core/flop_counter.hpp"

namespace xfb::ops {
namespace {

using dnnl::memory;
using tag = memory::format_tag;
using dt = memory::data_type;

std::string key_of(const char* op, std::initializer_list<std::int64_t> values) {
  std::string key = op;
  for (auto v : values) key += ":" + std::to_string(v);
  return key;
}

void execute(const DnnlContext::CachedPrimitive& cached, std::unordered_map<int, memory> args) {
  auto& context = DnnlContext::instance();
  args.emplace(DNNL_ARG_SCRATCHPAD, context.scratchpad_memory(cached));
  cached.primitive.execute(context.stream(), args);
  context.stream().wait();
}

dnnl::primitive_attr user_scratchpad_attr() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

memory::desc dense_1d(std::int64_t n) { return memory::desc({n}, dt::f32, tag::a); }

}  // namespace

namespace {

// The memory descriptors and cache key of the matmul of `s` on operands of the given element types
// (C accumulates in fp32 whatever its storage). The f32 key is the one the fp32 matmul always had;
// other types append theirs.
struct MatmulPlan {
  memory::desc a, b, c;
  std::string key;
};

// A shape's row and batch strides with the defaults (packed) filled in.
struct MatmulStrides {
  std::int64_t lda, ldb, ldc, stride_a, stride_b, stride_c;
};
MatmulStrides strides_of(const MatmulShape& s) {
  if (s.batch <= 0 || s.m <= 0 || s.n <= 0 || s.k <= 0) throw std::invalid_argument("matmul: empty shape");
  MatmulStrides t{};
  t.lda = s.lda ? s.lda : (s.trans_a ? s.m : s.k);
  t.ldb = s.ldb ? s.ldb : (s.trans_b ? s.k : s.n);
  t.ldc = s.ldc ? s.ldc : s.n;
  t.stride_a = s.stride_a >= 0 ? s.stride_a : (s.trans_a ? s.k : s.m) * t.lda;
  t.stride_b = s.stride_b >= 0 ? s.stride_b : (s.trans_b ? s.n : s.k) * t.ldb;
  t.stride_c = s.stride_c >= 0 ? s.stride_c : s.m * t.ldc;
  return t;
}

MatmulPlan plan_matmul(const MatmulShape& s, dt a_type, dt b_type, dt c_type) {
  const auto [lda, ldb, ldc, stride_a, stride_b, stride_c] = strides_of(s);
  const std::int64_t batch_a = stride_a == 0 ? 1 : s.batch;
  const std::int64_t batch_b = stride_b == 0 ? 1 : s.batch;
  const memory::dims a_dims{batch_a, s.m, s.k}, b_dims{batch_b, s.k, s.n}, c_dims{s.batch, s.m, s.n};
  const memory::dims a_strides = s.trans_a ? memory::dims{stride_a, 1, lda} : memory::dims{stride_a, lda, 1};
  const memory::dims b_strides = s.trans_b ? memory::dims{stride_b, 1, ldb} : memory::dims{stride_b, ldb, 1};
  const memory::dims c_strides{stride_c, ldc, 1};
  MatmulPlan plan{
      memory::desc(a_dims, a_type, a_strides), memory::desc(b_dims, b_type, b_strides),
      memory::desc(c_dims, c_type, c_strides),
      key_of("matmul", {s.batch, s.m, s.n, s.k, s.trans_a, s.trans_b, lda, ldb, ldc, stride_a, stride_b, stride_c,
                        static_cast<std::int64_t>(std::bit_cast<std::uint32_t>(s.alpha)), s.accumulate})};
  if (a_type != dt::f32 || b_type != dt::f32 || c_type != dt::f32)
    plan.key += key_of(":types", {static_cast<std::int64_t>(a_type), static_cast<std::int64_t>(b_type),
                                  static_cast<std::int64_t>(c_type)});
  return plan;
}

// The plan's primitive, created on first use.
const DnnlContext::CachedPrimitive& matmul_primitive(const MatmulShape& s, const MatmulPlan& plan) {
  auto& context = DnnlContext::instance();
  return context.primitive(plan.key, [&] {
    auto attr = user_scratchpad_attr();
    if (s.alpha != 1.0f) attr.set_output_scales(0, {s.alpha});
    if (s.accumulate) {
      dnnl::post_ops post;
      post.append_sum(1.0f);
      attr.set_post_ops(post);
    }
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(plan.a, plan.b, plan.c), attr, context.engine());
    return std::make_pair(dnnl::primitive(dnnl::matmul(pd)), pd.scratchpad_desc());
  });
}

void typed_matmul(const MatmulShape& s, dt a_type, dt b_type, dt c_type, const void* a, const void* b, void* c) {
  const MatmulPlan plan = plan_matmul(s, a_type, b_type, c_type);
  const auto& cached = matmul_primitive(s, plan);
  auto& engine = DnnlContext::instance().engine();
  execute(cached, {{DNNL_ARG_SRC, memory(plan.a, engine, const_cast<void*>(a))},
                   {DNNL_ARG_WEIGHTS, memory(plan.b, engine, const_cast<void*>(b))},
                   {DNNL_ARG_DST, memory(plan.c, engine, c)}});
  FlopCounter::add(s.batch * matmul_flops(s.m, s.n, s.k));
}

// --- The bf16 matmul where oneDNN has none (oneDNN 2.6 below AVX-512) ---------------------------
// C[b] in tiles of ≤ kWidenRows × kWidenCols, each summed over k in blocks of ≤ kWidenDepth: the
// block of op(A) and of op(B) widened to fp32 (exact) in the thread's part of the context's
// scratchpad, multiplied by sgemm on the thread into an fp32 tile (fp32 FMAs of exact bf16 products:
// the numerics of a bf16 product with fp32 accumulation), then C = alpha·tile (+ C when accumulate),
// stored fp32 or rounded to bf16. Widening costs (m·k·⌈n/kWidenCols⌉ + k·n·⌈m/kWidenRows⌉)
// conversions, ≤ 1/128 of the FLOPs; the scratchpad holds threads × widened_floats() floats (library
// pool, like oneDNN's own scratchpad: it exists only on CPUs without oneDNN's bf16 matmul).
constexpr std::int64_t kWidenRows = 64, kWidenCols = 256, kWidenDepth = 256;
constexpr std::int64_t widened_floats() {
  return kWidenRows * kWidenDepth + kWidenDepth * kWidenCols + kWidenRows * kWidenCols;
}
std::int64_t widened_scratch_bytes() {
  return DnnlContext::instance().threads() * widened_floats() * static_cast<std::int64_t>(sizeof(float));
}

// dst [rows, cols] (packed) = the bf16 block src [rows, cols] (row stride ld), widened.
void widen_block(const bf16* src, std::int64_t ld, std::int64_t rows, std::int64_t cols, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r) widen(src + r * ld, dst + r * cols, cols);
}

inline void store_value(float* c, float value, bool accumulate) { *c = accumulate ? *c + value : value; }
inline void store_value(bf16* c, float value, bool accumulate) {
  *c = to_bf16(accumulate ? to_float(*c) + value : value);
}

// One C tile: rows [r0, r0 + rows) × columns [c0, c0 + cols) of batch entry `batch`.
template <class Out>
void widened_tile(const MatmulShape& s, const MatmulStrides& t, const bf16* a, const bf16* b, Out* c,
                  std::int64_t batch, std::int64_t r0, std::int64_t rows, std::int64_t c0, std::int64_t cols,
                  float* scratch) {
  float* wide_a = scratch;
  float* wide_b = wide_a + kWidenRows * kWidenDepth;
  float* tile = wide_b + kWidenDepth * kWidenCols;
  a += batch * t.stride_a;
  b += batch * t.stride_b;
  for (std::int64_t k0 = 0; k0 < s.k; k0 += kWidenDepth) {
    const std::int64_t depth = std::min(kWidenDepth, s.k - k0);
    if (s.trans_a)
      widen_block(a + k0 * t.lda + r0, t.lda, depth, rows, wide_a);  // [depth, rows]
    else
      widen_block(a + r0 * t.lda + k0, t.lda, rows, depth, wide_a);  // [rows, depth]
    if (s.trans_b)
      widen_block(b + c0 * t.ldb + k0, t.ldb, cols, depth, wide_b);  // [cols, depth]
    else
      widen_block(b + k0 * t.ldb + c0, t.ldb, depth, cols, wide_b);  // [depth, cols]
    const auto status =
        dnnl_sgemm(s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N', rows, cols, depth, 1.0f, wide_a,
                   s.trans_a ? rows : depth, wide_b, s.trans_b ? depth : cols, k0 == 0 ? 0.0f : 1.0f, tile, cols);
    if (status != dnnl_success) throw std::runtime_error("dnnl_sgemm failed with status " + std::to_string(status));
  }
  Out* out = c + batch * t.stride_c + r0 * t.ldc + c0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j)
      store_value(out + r * t.ldc + j, s.alpha * tile[r * cols + j], s.accumulate);
}

template <class Out>
void widened_product(const MatmulShape& s, const bf16* a, const bf16* b, Out* c) {
  const MatmulStrides t = strides_of(s);
  auto& context = DnnlContext::instance();
  float* scratch = static_cast<float*>(context.reserve_scratchpad(widened_scratch_bytes()));
  const std::int64_t row_tiles = (s.m + kWidenRows - 1) / kWidenRows, col_tiles = (s.n + kWidenCols - 1) / kWidenCols;
  const std::int64_t tiles_per_batch = row_tiles * col_tiles;
#pragma omp parallel for num_threads(context.threads()) schedule(static)
  for (std::int64_t task = 0; task < s.batch * tiles_per_batch; ++task) {
    const std::int64_t batch = task / tiles_per_batch, r0 = task % tiles_per_batch / col_tiles * kWidenRows,
                       c0 = task % col_tiles * kWidenCols;
    widened_tile(s, t, a, b, c, batch, r0, std::min(kWidenRows, s.m - r0), c0, std::min(kWidenCols, s.n - c0),
                 scratch + omp_get_thread_num() * widened_floats());
  }
  FlopCounter::add(s.batch * matmul_flops(s.m, s.n, s.k));
}

}  // namespace

void widened_bf16_matmul(const MatmulShape& s, const bf16* a, const bf16* b, float* c) { widened_product(s, a, b, c); }
void widened_bf16_matmul(const MatmulShape& s, const bf16* a, const bf16* b, bf16* c) { widened_product(s, a, b, c); }

void matmul(const MatmulShape& s, const float* a, const float* b, float* c) {
  typed_matmul(s, dt::f32, dt::f32, dt::f32, a, b, c);
}

void matmul(const MatmulShape& s, const bf16* a, const bf16* b, float* c) {
  if (!bf16_matmul_available()) return widened_bf16_matmul(s, a, b, c);
  typed_matmul(s, dt::bf16, dt::bf16, dt::f32, a, b, c);
}

void matmul(const MatmulShape& s, const bf16* a, const bf16* b, bf16* c) {
  if (!bf16_matmul_available()) return widened_bf16_matmul(s, a, b, c);
  typed_matmul(s, dt::bf16, dt::bf16, dt::bf16, a, b, c);
}

void prepare_bf16_matmul(const MatmulShape& s, bool bf16_output) {
  if (!bf16_matmul_available()) {
    strides_of(s);  // the same shape checks
    DnnlContext::instance().reserve_scratchpad(widened_scratch_bytes());
    return;
  }
  matmul_primitive(s, plan_matmul(s, dt::bf16, dt::bf16, bf16_output ? dt::bf16 : dt::f32));
}

bool bf16_matmul_available() {
  static const bool available = [] {
    try {
      const memory::desc desc({1, 16, 16}, dt::bf16, tag::abc), out({1, 16, 16}, dt::f32, tag::abc);
      dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(desc, desc, out), DnnlContext::instance().engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return available;
}

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  const auto status =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (status != dnnl_success) throw std::runtime_error("dnnl_sgemm failed with status " + std::to_string(status));
  FlopCounter::add(matmul_flops(m, n, k));
}

void softmax(float* data, std::int64_t rows, std::int64_t cols) {
  auto& context = DnnlContext::instance();
  const memory::desc desc({rows, cols}, dt::f32, tag::ab);
  const auto& cached = context.primitive(key_of("softmax", {rows, cols}), [&] {
    dnnl::softmax_forward::primitive_desc pd(dnnl::softmax_forward::desc(dnnl::prop_kind::forward_inference, desc, 1),
                                             user_scratchpad_attr(), context.engine());
    return std::make_pair(dnnl::primitive(dnnl::softmax_forward(pd)), pd.scratchpad_desc());
  });
  memory mem(desc, context.engine(), data);
  execute(cached, {{DNNL_ARG_SRC, mem}, {DNNL_ARG_DST, mem}});
  FlopCounter::add(kSoftmaxFlopsPerElement * rows * cols);
}

void softmax_rows_masked(float* data, std::int64_t batch, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                         bool causal, std::int64_t causal_offset) {
  std::int64_t executed = 0;
  const std::int64_t total_rows = batch * rows;
#pragma omp parallel for schedule(dynamic, 16) reduction(+ : executed)
  for (std::int64_t index = 0; index < total_rows; ++index) {
    const std::int64_t r = index % rows;
    float* row = data + index * ld;
    const std::int64_t valid = causal ? std::clamp<std::int64_t>(r + 1 + causal_offset, 0, cols) : cols;
    executed += valid;
    if (valid == 0) {
      std::fill(row, row + cols, 0.0f);
      continue;
    }
    const float inverse = 1.0f / exp_and_sum(row, valid, row_max(row, valid, row[0]));
#pragma omp simd
    for (std::int64_t j = 0; j < valid; ++j) row[j] *= inverse;
    std::fill(row + valid, row + cols, 0.0f);
  }
  FlopCounter::add(kSoftmaxFlopsPerElement * executed);
}

void softmax_backward_rows_masked(const float* p, float* grad, std::int64_t batch, std::int64_t rows, std::int64_t cols,
                                  std::int64_t ld, bool causal) {
  std::int64_t executed = 0;
  const std::int64_t total_rows = batch * rows;
#pragma omp parallel for schedule(dynamic, 16) reduction(+ : executed)
  for (std::int64_t index = 0; index < total_rows; ++index) {
    const std::int64_t r = index % rows;
    const float* prob = p + index * ld;
    float* row = grad + index * ld;
    const std::int64_t valid = causal ? std::min(r + 1, cols) : cols;
    executed += valid;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (std::int64_t j = 0; j < valid; ++j) dot += prob[j] * row[j];
#pragma omp simd
    for (std::int64_t j = 0; j < valid; ++j) row[j] = prob[j] * (row[j] - dot);
    std::fill(row + valid, row + cols, 0.0f);
  }
  FlopCounter::add(kSoftmaxBackwardFlopsPerElement * executed);
}

void layer_norm(const float* x, float* y, std::int64_t rows, std::int64_t cols, const float* gamma, const float* beta,
                float eps) {
  auto& context = DnnlContext::instance();
  const memory::desc desc({rows, cols}, dt::f32, tag::ab);
  const memory::desc param_desc = dense_1d(cols);
  const auto flags = dnnl::normalization_flags::use_scale | dnnl::normalization_flags::use_shift;
  const auto& cached = context.primitive(
      key_of("layer_norm", {rows, cols, static_cast<std::int64_t>(std::bit_cast<std::uint32_t>(eps))}), [&] {
        dnnl::layer_normalization_forward::primitive_desc pd(
            dnnl::layer_normalization_forward::desc(dnnl::prop_kind::forward_inference, desc, eps, flags),
            user_scratchpad_attr(), context.engine());
        return std::make_pair(dnnl::primitive(dnnl::layer_normalization_forward(pd)), pd.scratchpad_desc());
      });
  auto& engine = context.engine();
  execute(cached, {{DNNL_ARG_SRC, memory(desc, engine, const_cast<float*>(x))},
                   {DNNL_ARG_DST, memory(desc, engine, y)},
                   {DNNL_ARG_SCALE, memory(param_desc, engine, const_cast<float*>(gamma))},
                   {DNNL_ARG_SHIFT, memory(param_desc, engine, const_cast<float*>(beta))}});
  FlopCounter::add(kLayerNormFlopsPerElement * rows * cols);
}

void gelu(float* data, std::int64_t n) {
  auto& context = DnnlContext::instance();
  const memory::desc desc = dense_1d(n);
  const auto& cached = context.primitive(key_of("gelu", {n}), [&] {
    dnnl::eltwise_forward::primitive_desc pd(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::eltwise_gelu_erf, desc),
        user_scratchpad_attr(), context.engine());
    return std::make_pair(dnnl::primitive(dnnl::eltwise_forward(pd)), pd.scratchpad_desc());
  });
  memory mem(desc, context.engine(), data);
  execute(cached, {{DNNL_ARG_SRC, mem}, {DNNL_ARG_DST, mem}});
  FlopCounter::add(kGeluFlopsPerElement * n);
}

void gelu_backward(const float* z, float* grad, std::int64_t n) {
  auto& context = DnnlContext::instance();
  const memory::desc desc = dense_1d(n);
  const auto& cached = context.primitive(key_of("gelu_backward", {n}), [&] {
    const dnnl::eltwise_forward::primitive_desc hint(
        dnnl::eltwise_forward::desc(dnnl::prop_kind::forward_training, dnnl::algorithm::eltwise_gelu_erf, desc),
        context.engine());
    dnnl::eltwise_backward::primitive_desc pd(
        dnnl::eltwise_backward::desc(dnnl::algorithm::eltwise_gelu_erf, desc, desc), user_scratchpad_attr(),
        context.engine(), hint);
    return std::make_pair(dnnl::primitive(dnnl::eltwise_backward(pd)), pd.scratchpad_desc());
  });
  auto& engine = context.engine();
  memory gradient(desc, engine, grad);
  execute(cached, {{DNNL_ARG_SRC, memory(desc, engine, const_cast<float*>(z))},
                   {DNNL_ARG_DIFF_DST, gradient},
                   {DNNL_ARG_DIFF_SRC, gradient}});
  FlopCounter::add(kGeluBackwardFlopsPerElement * n);
}

namespace {
// dx := dx + the LayerNorm backward of each row (fp32 dx), or round(dx + it) (bf16 dx); x fp32 or bf16.
template <class X, class DX>
void layer_norm_backward_rows(const X* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                              DX* dx, float* dgamma, float* dbeta, float* normalised, float eps) {
  const float inverse_cols = 1.0f / static_cast<float>(cols);
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const X* xr = x + r * cols;
    const float* gr = dy + r * cols;
    float* nr = normalised + r * cols;
    const auto [mean, rstd] = row_moments(xr, cols, eps);
    float sum_grad = 0.0f, sum_grad_normalised = 0.0f;
#pragma omp simd reduction(+ : sum_grad, sum_grad_normalised)
    for (std::int64_t c = 0; c < cols; ++c) {
      nr[c] = (as_float(xr[c]) - mean) * rstd;
      const float g = gr[c] * gamma[c];
      sum_grad += g;
      sum_grad_normalised += g * nr[c];
    }
    const float m1 = sum_grad * inverse_cols, m2 = sum_grad_normalised * inverse_cols;
    DX* dr = dx + r * cols;
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c)
      dr[c] = stored<DX>(as_float(dr[c]) + rstd * (gr[c] * gamma[c] - m1 - nr[c] * m2));
  }
  constexpr std::int64_t kColumns = 16;
#pragma omp parallel for schedule(static)
  for (std::int64_t c0 = 0; c0 < cols; c0 += kColumns) {
    const std::int64_t width = std::min(kColumns, cols - c0);
    float gain[kColumns] = {}, shift[kColumns] = {};
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < width; ++c) {
        gain[c] += dy[r * cols + c0 + c] * normalised[r * cols + c0 + c];
        shift[c] += dy[r * cols + c0 + c];
      }
    std::copy_n(gain, width, dgamma + c0);
    std::copy_n(shift, width, dbeta + c0);
  }
  FlopCounter::add(kLayerNormBackwardFlopsPerElement * rows * cols);
}
}  // namespace

void layer_norm_backward(const float* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                         float* dx, float* dgamma, float* dbeta, float* normalised, float eps) {
  layer_norm_backward_rows(x, dy, rows, cols, gamma, dx, dgamma, dbeta, normalised, eps);
}

void layer_norm_backward(const bf16* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                         float* dx, float* dgamma, float* dbeta, float* normalised, float eps) {
  layer_norm_backward_rows(x, dy, rows, cols, gamma, dx, dgamma, dbeta, normalised, eps);
}

void layer_norm_backward(const bf16* x, const float* dy, std::int64_t rows, std::int64_t cols, const float* gamma,
                         bf16* dx, float* dgamma, float* dbeta, float* normalised, float eps) {
  layer_norm_backward_rows(x, dy, rows, cols, gamma, dx, dgamma, dbeta, normalised, eps);
}

void layer_norm(const bf16* x, bf16* y, std::int64_t rows, std::int64_t cols, const float* gamma, const float* beta,
                float eps) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const bf16* in = x + r * cols;
    bf16* out = y + r * cols;
    const auto [mean, inverse_std] = row_moments(in, cols, eps);
#pragma omp simd
    for (std::int64_t c = 0; c < cols; ++c)
      out[c] = to_bf16((to_float(in[c]) - mean) * inverse_std * gamma[c] + beta[c]);
  }
  FlopCounter::add(kLayerNormFlopsPerElement * rows * cols);
}

void gelu(const float* z, float* out, std::int64_t n, float*) {
  if (z != out) std::copy_n(z, n, out);
  gelu(out, n);
}

void gelu_backward(const float* z, float* grad, std::int64_t n, float*) { gelu_backward(z, grad, n); }

void gelu(const bf16* z, bf16* out, std::int64_t n, float* scratch) {
  for (std::int64_t at = 0; at < n; at += kBf16EltwiseChunk) {
    const std::int64_t count = std::min(kBf16EltwiseChunk, n - at);
    widen(z + at, scratch, count);
    gelu(scratch, count);
    narrow(scratch, out + at, count);
  }
}

void gelu_backward(const bf16* z, bf16* grad, std::int64_t n, float* scratch) {
  const std::int64_t chunk = std::min(kBf16EltwiseChunk, n);
  float* values = scratch + chunk;
  for (std::int64_t at = 0; at < n; at += chunk) {
    const std::int64_t count = std::min(chunk, n - at);
    widen(z + at, values, count);
    widen(grad + at, scratch, count);
    gelu_backward(values, scratch, count);
    narrow(scratch, grad + at, count);
  }
}

void add(const float* a, const float* b, float* c, std::int64_t n) {
  auto& context = DnnlContext::instance();
  const memory::desc desc = dense_1d(n);
  const auto& cached = context.primitive(key_of("add", {n}), [&] {
    dnnl::binary::primitive_desc pd(dnnl::binary::desc(dnnl::algorithm::binary_add, desc, desc, desc),
                                    user_scratchpad_attr(), context.engine());
    return std::make_pair(dnnl::primitive(dnnl::binary(pd)), pd.scratchpad_desc());
  });
  auto& engine = context.engine();
  execute(cached, {{DNNL_ARG_SRC_0, memory(desc, engine, const_cast<float*>(a))},
                   {DNNL_ARG_SRC_1, memory(desc, engine, const_cast<float*>(b))},
                   {DNNL_ARG_DST, memory(desc, engine, c)}});
  FlopCounter::add(n);
}

}  // namespace xfb::ops
