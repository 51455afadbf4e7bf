#include "taxonomy/low_rank/linformer.hpp"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "lib/core/bf16.hpp"
#include "lib/core/bf16_rows.hpp"
#include "lib/core/bf16_softmax.hpp"
#include "lib/core/config_table.hpp"
#include "lib/core/flop_counter.hpp"
#include "lib/core/ops.hpp"
#include "lib/core/rng.hpp"

namespace xfb {
namespace {

constexpr std::int64_t kFloatBytes = sizeof(float);

std::int64_t projected_length(const Problem& p, const LinformerConfig& c) { return std::min(c.k, p.seq_len); }

// Projection matrices per tensor: H for per-head sharing, else 1.
std::int64_t matrices_per_tensor(const Problem& p, const LinformerConfig& c) {
  return c.sharing == LinformerSharing::PerHead ? p.heads : 1;
}

// One tensor's projections (fp32 in both dtypes): [H, k, N] per head, else [k, N]; entries
// N(0, 1/k) from the seed's `stream`, or E = I (projection=identity).
Tensor make_projection(const Problem& p, const LinformerConfig& c, std::uint64_t seed, const char* stream) {
  const std::int64_t count = matrices_per_tensor(p, c), n = p.seq_len, k = projected_length(p, c);
  Tensor t = count > 1 ? Tensor(Shape{count, k, n}) : Tensor(Shape{k, n});
  if (!c.identity) {
    CounterRng(seed, stream).fill_normal(t, 0.0f, 1.0f / std::sqrt(static_cast<float>(k)));
    return t;
  }
  for (std::int64_t m = 0; m < count; ++m)
    for (std::int64_t i = 0; i < k; ++i) t[(m * k + i) * n + i] = 1.0f;
  return t;
}

// The projections (or, with prefix "d", their gradients) by name: E and F, or the one E = F of
// key-value sharing.
std::vector<NamedTensor> projection_parameters(const LinformerConfig& c, const Tensor& e, const Tensor& f,
                                               const std::string& prefix = "") {
  if (c.sharing == LinformerSharing::KeyValue) return {{prefix + "projection_ef", &e}};
  return {{prefix + "projection_e", &e}, {prefix + "projection_f", &f}};
}

class Linformer final : public Mechanism {
 public:
  Linformer(const Problem& problem, const LinformerConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed), k_(projected_length(problem, config)), ld_(ops::padded_ld(k_)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    e_ = make_projection(p_, c_, seed_, "linformer/E");
    if (c_.sharing != LinformerSharing::KeyValue) f_ = make_projection(p_, c_, seed_, "linformer/F");
    const std::int64_t bh = p_.batch * p_.heads;
    keys_ = Tensor(Shape{bh, k_, p_.head_dim});
    values_ = Tensor(Shape{bh, k_, p_.head_dim});
    scores_ = Tensor(Shape{bh, p_.seq_len, ld_});
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bh = p_.batch * p_.heads;
    const Tensor& f = c_.sharing == LinformerSharing::KeyValue ? e_ : f_;
    project(e_, k, keys_);
    project(f, v, values_);
    ops::matmul({.batch = bh,
                 .m = n,
                 .n = k_,
                 .k = d,
                 .trans_b = true,
                 .ldc = ld_,
                 .alpha = 1.0f / std::sqrt(static_cast<float>(d))},
                q.data(), keys_.data(), scores_.data());
    ops::softmax_rows_masked(scores_.data(), bh, n, k_, ld_, false);
    ops::matmul({.batch = bh, .m = n, .n = d, .k = k_, .lda = ld_}, scores_.data(), values_.data(), out.data());
  }

  std::vector<NamedTensor> parameters() const override { return projection_parameters(c_, e_, f_); }

  void prepare_backward() override {
    const std::int64_t bh = p_.batch * p_.heads;
    score_grads_ = Tensor(scores_.shape());
    key_grads_ = Tensor(Shape{bh, k_, p_.head_dim});
    value_grads_ = Tensor(Shape{bh, k_, p_.head_dim});
    de_ = Tensor(e_.shape());
    if (c_.sharing != LinformerSharing::KeyValue) df_ = Tensor(f_.shape());
  }

  // Attention backward over the k projected rows (P saved), then through the projections:
  // dK = Eᵀ·dK̄, dE = Σ dK̄·Kᵀ over the (batch, head) pairs that share E; V, F likewise.
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, bh = p_.batch * p_.heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ops::matmul({.batch = bh, .m = k_, .n = d, .k = n, .trans_a = true, .lda = ld_}, scores_.data(), dout.data(),
                value_grads_.data());
    ops::matmul({.batch = bh, .m = n, .n = k_, .k = d, .trans_b = true, .ldc = ld_}, dout.data(), values_.data(),
                score_grads_.data());
    ops::softmax_backward_rows_masked(scores_.data(), score_grads_.data(), bh, n, k_, ld_, false);
    ops::matmul({.batch = bh, .m = n, .n = d, .k = k_, .lda = ld_, .alpha = scale}, score_grads_.data(), keys_.data(),
                dq.data());
    ops::matmul({.batch = bh, .m = k_, .n = d, .k = n, .trans_a = true, .lda = ld_, .alpha = scale},
                score_grads_.data(), q.data(), key_grads_.data());
    const bool shared_kv = c_.sharing == LinformerSharing::KeyValue;
    project_backward(e_, key_grads_, k, dk, de_, false);
    project_backward(shared_kv ? e_ : f_, value_grads_, v, dv, shared_kv ? de_ : df_, shared_kv);
  }

  std::vector<NamedTensor> saved() const override {
    return {{"probabilities", &scores_}, {"projected_keys", &keys_}, {"projected_values", &values_}};
  }
  std::vector<NamedTensor> parameter_gradients() const override { return projection_parameters(c_, de_, df_, "d"); }

 private:
  // dst[b, h] = P_h · src[b, h]: [k, N]·[N, D]. Per-head projections: one matmul batched over the
  // heads per batch element. A shared projection is not broadcast (oneDNN 2.6 runs a broadcast
  // matmul operand on its reference kernel, ~1000× slower): one matmul per (batch, head).
  void project(const Tensor& projection, const Tensor& src, Tensor& dst) const {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const bool per_head = matrices_per_tensor(p_, c_) > 1;
    const ops::MatmulShape shape{.batch = per_head ? p_.heads : 1, .m = k_, .n = d, .k = n};
    const std::int64_t calls = per_head ? p_.batch : p_.batch * p_.heads;
    for (std::int64_t i = 0; i < calls; ++i) {
      const std::int64_t offset = i * shape.batch;  // first (batch, head) of this call
      ops::matmul(shape, projection.data(), src.data() + offset * n * d, dst.data() + offset * k_ * d);
    }
  }

  // The backward of dst = P·src for every (batch, head): dsrc = Pᵀ·dst_grad, and dP (+)= the sum of
  // dst_grad·srcᵀ over the pairs sharing P (accumulating onto dP's previous contents when `add`).
  void project_backward(const Tensor& projection, const Tensor& dst_grad, const Tensor& src, Tensor& src_grad,
                        Tensor& projection_grad, bool add) const {
    const std::int64_t n = p_.seq_len, d = p_.head_dim;
    const bool per_head = matrices_per_tensor(p_, c_) > 1;
    const std::int64_t heads = per_head ? p_.heads : 1, calls = per_head ? p_.batch : p_.batch * p_.heads;
    for (std::int64_t i = 0; i < calls; ++i) {
      const std::int64_t offset = i * heads;  // first (batch, head) of this call
      ops::matmul({.batch = heads, .m = n, .n = d, .k = k_, .trans_a = true}, projection.data(),
                  dst_grad.data() + offset * k_ * d, src_grad.data() + offset * n * d);
      ops::matmul({.batch = heads, .m = k_, .n = n, .k = d, .trans_b = true, .accumulate = add || i > 0},
                  dst_grad.data() + offset * k_ * d, src.data() + offset * n * d, projection_grad.data());
    }
  }

  Problem p_;
  LinformerConfig c_;
  std::uint64_t seed_;
  std::int64_t k_, ld_;
  Tensor e_, f_, keys_, values_, scores_;
  Tensor score_grads_, key_grads_, value_grads_, de_, df_;  // training only
};

constexpr std::int64_t kWidenRows = 256;  // rows of K or V the bf16 projection widens at a time

// The bf16 form's fp32 floats per thread: a widened chunk of K or V [min(N, kWidenRows), D] and the
// projection's fp32 sum [k, D] (the backward: a chunk's gradient rows, so at least a chunk).
std::int64_t bf16_thread_floats(const Problem& p, const LinformerConfig& c) {
  const std::int64_t chunk = std::min(kWidenRows, p.seq_len);
  return (chunk + std::max(chunk, projected_length(p, c))) * p.head_dim;
}

// Linformer in bf16: q, k, v, out bf16 ([B, H, N, D]); E and F stay fp32 (the parameters the fp32 form
// draws). K̄ = bf16(E·K), V̄ = bf16(F·V) [B·H, k, D]: per (batch, head) an fp32 sum over chunks of
// kWidenRows rows of K (widened, exact) on sgemm, rounded once. S = Q·K̄ᵀ/√D in fp32 on oneDNN's bf16
// matmul (a dense [B·H, N, k] buffer, row stride k), the softmax in fp32 with P rounded to bf16 in
// place (softmax_row_to_bf16: row stride 2k), O = bf16(P·V̄) on the bf16 matmul. FLOPs are the fp32
// form's. Backward: the fp32 form's on the saved bf16 P, K̄, V̄ (backward()).
class LinformerBf16 final : public Mechanism {
 public:
  LinformerBf16(const Problem& problem, const LinformerConfig& config, std::uint64_t seed)
      : p_(problem), c_(config), seed_(seed), k_(projected_length(problem, config)) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    e_ = make_projection(p_, c_, seed_, "linformer/E");
    if (c_.sharing != LinformerSharing::KeyValue) f_ = make_projection(p_, c_, seed_, "linformer/F");
    const std::int64_t bh = p_.batch * p_.heads;
    keys_ = Tensor(Shape{bh, k_, p_.head_dim}, DType::BF16);
    values_ = Tensor(Shape{bh, k_, p_.head_dim}, DType::BF16);
    scores_ = Tensor(Shape{bh, p_.seq_len, k_});
    widened_ = Tensor(Shape{p_.threads, bf16_thread_floats(p_, c_)});
    ops::prepare_bf16_matmul(scores_shape(), false);
    ops::prepare_bf16_matmul(output_shape(), true);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const std::int64_t rows = p_.batch * p_.heads * p_.seq_len;
    project(e_, k, keys_);
    project(c_.sharing == LinformerSharing::KeyValue ? e_ : f_, v, values_);
    ops::matmul(scores_shape(), q.bf16_data(), keys_.bf16_data(), scores_.data());
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t row = 0; row < rows; ++row) softmax_row_to_bf16(scores_.data() + row * k_, k_, k_);
    FlopCounter::add(kSoftmaxFlopsPerElement * rows * k_);
    const bf16* probabilities = reinterpret_cast<const bf16*>(scores_.data());  // row stride 2k
    ops::matmul(output_shape(), probabilities, values_.bf16_data(), out.bf16_data());
  }

  std::vector<NamedTensor> parameters() const override { return projection_parameters(c_, e_, f_); }
  std::vector<NamedTensor> saved() const override {
    return {{"probabilities", &scores_}, {"projected_keys", &keys_}, {"projected_values", &values_}};
  }

  void prepare_backward() override {
    const std::int64_t bh = p_.batch * p_.heads;
    score_grads_ = Tensor(scores_.shape());
    key_grads_ = Tensor(Shape{bh, k_, p_.head_dim});
    value_grads_ = Tensor(Shape{bh, k_, p_.head_dim});
    de_ = Tensor(e_.shape());
    if (c_.sharing != LinformerSharing::KeyValue) df_ = Tensor(f_.shape());
    for (const auto& shape : {value_grad_shape(), key_grad_shape()}) ops::prepare_bf16_matmul(shape, false);
    ops::prepare_bf16_matmul(probability_grad_shape(), false);
    ops::prepare_bf16_matmul(query_grad_shape(), true);
  }

  // As the fp32 form, on the saved bf16 P, K̄, V̄: dV̄ = Pᵀ·dO and dP = dO·V̄ᵀ in fp32, dS = P·(dP − Σ P·dP)
  // in fp32 rounded to bf16 in place, dq = bf16(dS·K̄/√D), dK̄ = dSᵀ·Q/√D in fp32; then dk = bf16(Eᵀ·dK̄),
  // dE = Σ dK̄·Kᵀ (fp32) over the pairs sharing E, on K widened in chunks (V, F likewise).
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    const std::int64_t rows = p_.batch * p_.heads * p_.seq_len;
    const auto* probabilities = reinterpret_cast<const bf16*>(scores_.data());     // row stride 2k
    const auto* score_grads = reinterpret_cast<const bf16*>(score_grads_.data());  // dS, row stride 2k
    ops::matmul(value_grad_shape(), probabilities, dout.bf16_data(), value_grads_.data());
    ops::matmul(probability_grad_shape(), dout.bf16_data(), values_.bf16_data(), score_grads_.data());
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t row = 0; row < rows; ++row)
      softmax_backward_row_to_bf16(probabilities + row * 2 * k_, score_grads_.data() + row * k_, k_, k_);
    FlopCounter::add(kSoftmaxBackwardFlopsPerElement * rows * k_);
    ops::matmul(query_grad_shape(), score_grads, keys_.bf16_data(), dq.bf16_data());
    ops::matmul(key_grad_shape(), score_grads, q.bf16_data(), key_grads_.data());
    const bool shared_kv = c_.sharing == LinformerSharing::KeyValue;
    project_backward(e_, key_grads_, k, dk, de_, false);
    project_backward(shared_kv ? e_ : f_, value_grads_, v, dv, shared_kv ? de_ : df_, shared_kv);
  }

  std::vector<NamedTensor> parameter_gradients() const override { return projection_parameters(c_, de_, df_, "d"); }

 private:
  ops::MatmulShape value_grad_shape() const {  // dV̄ = Pᵀ·dO, fp32
    return {.batch = p_.batch * p_.heads, .m = k_, .n = p_.head_dim, .k = p_.seq_len, .trans_a = true, .lda = 2 * k_};
  }
  ops::MatmulShape probability_grad_shape() const {  // dP = dO·V̄ᵀ, fp32 [N, k]
    return {.batch = p_.batch * p_.heads, .m = p_.seq_len, .n = k_, .k = p_.head_dim, .trans_b = true};
  }
  ops::MatmulShape query_grad_shape() const {  // dq = dS·K̄/√D, bf16
    return {.batch = p_.batch * p_.heads,
            .m = p_.seq_len,
            .n = p_.head_dim,
            .k = k_,
            .lda = 2 * k_,
            .alpha = 1.0f / std::sqrt(static_cast<float>(p_.head_dim))};
  }
  ops::MatmulShape key_grad_shape() const {  // dK̄ = dSᵀ·Q/√D, fp32
    return {.batch = p_.batch * p_.heads,
            .m = k_,
            .n = p_.head_dim,
            .k = p_.seq_len,
            .trans_a = true,
            .lda = 2 * k_,
            .alpha = 1.0f / std::sqrt(static_cast<float>(p_.head_dim))};
  }

  // The backward of dst = bf16(P·src) for every (batch, head), dst_grad fp32 [B·H, k, D]:
  // src_grad = bf16(Pᵀ·dst_grad) and dP (+)= Σ dst_grad·srcᵀ over the pairs sharing P (onto dP's
  // contents when `add`). Tasks are (projection, chunk of kWidenRows columns): a task owns those
  // columns of its dP and those rows of every sharing pair's src_grad, so no two tasks write alike.
  void project_backward(const Tensor& projection, const Tensor& dst_grad, const Tensor& src, Tensor& src_grad,
                        Tensor& projection_grad, bool add) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, chunks = (n + kWidenRows - 1) / kWidenRows;
    const bool per_head = matrices_per_tensor(p_, c_) > 1;
    const std::int64_t matrices = per_head ? p_.heads : 1, pairs = per_head ? p_.batch : p_.batch * p_.heads;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t task = 0; task < matrices * chunks; ++task) {
      const std::int64_t matrix = task / chunks, c0 = task % chunks * kWidenRows, rows = std::min(kWidenRows, n - c0);
      float* widened = widened_.data() + omp_get_thread_num() * widened_.dim(1);
      float* grad_rows = widened + std::min(kWidenRows, n) * d;
      const float* e = projection.data() + matrix * k_ * n;
      float* de = projection_grad.data() + matrix * k_ * n;
      for (std::int64_t pair = 0; pair < pairs; ++pair) {
        const std::int64_t head = per_head ? pair * p_.heads + matrix : pair;
        const float* g = dst_grad.data() + head * k_ * d;
        widen(src.bf16_data() + (head * n + c0) * d, widened, rows * d);
        ops::gemm(false, true, k_, rows, d, 1.0f, g, d, widened, d, add || pair > 0 ? 1.0f : 0.0f, de + c0, n);
        ops::gemm(true, false, rows, d, k_, 1.0f, e + c0, n, g, d, 0.0f, grad_rows, d);
        narrow(grad_rows, src_grad.bf16_data() + (head * n + c0) * d, rows * d);
      }
    }
  }

  ops::MatmulShape scores_shape() const {
    return {.batch = p_.batch * p_.heads,
            .m = p_.seq_len,
            .n = k_,
            .k = p_.head_dim,
            .trans_b = true,
            .alpha = 1.0f / std::sqrt(static_cast<float>(p_.head_dim))};
  }
  ops::MatmulShape output_shape() const {
    return {.batch = p_.batch * p_.heads, .m = p_.seq_len, .n = p_.head_dim, .k = k_, .lda = 2 * k_};
  }

  // dst[b, h] = bf16(P_h · src[b, h]) for every (batch, head): src [N, D] bf16 widened kWidenRows rows
  // at a time, P_h's matching columns times them summed in fp32 (sgemm on the calling thread).
  void project(const Tensor& projection, const Tensor& src, Tensor& dst) {
    const std::int64_t n = p_.seq_len, d = p_.head_dim, heads = p_.batch * p_.heads;
    const bool per_head = matrices_per_tensor(p_, c_) > 1;
#pragma omp parallel for num_threads(p_.threads) schedule(static)
    for (std::int64_t head = 0; head < heads; ++head) {
      float* chunk = widened_.data() + omp_get_thread_num() * widened_.dim(1);
      float* sum = chunk + std::min(kWidenRows, n) * d;
      const float* matrix = projection.data() + (per_head ? head % p_.heads : 0) * k_ * n;
      for (std::int64_t c0 = 0; c0 < n; c0 += kWidenRows) {
        const std::int64_t rows = std::min(kWidenRows, n - c0);
        widen(src.bf16_data() + (head * n + c0) * d, chunk, rows * d);
        ops::gemm(false, false, k_, d, rows, 1.0f, matrix + c0, n, chunk, d, c0 > 0 ? 1.0f : 0.0f, sum, d);
      }
      narrow(sum, dst.bf16_data() + head * k_ * d, k_ * d);
    }
  }

  Problem p_;
  LinformerConfig c_;
  std::uint64_t seed_;
  std::int64_t k_;
  Tensor e_, f_;          // fp32 projections, as the fp32 form's
  Tensor keys_, values_;  // K̄, V̄ bf16 [B·H, k, D]
  Tensor scores_;         // fp32 S [B·H, N, k]; after the softmax, bf16 P over each row's first half
  Tensor widened_;  // per thread: a widened chunk and the projection's fp32 sum (backward: a chunk's gradient rows)
  Tensor score_grads_, key_grads_, value_grads_, de_, df_;  // training: fp32 dP (then bf16 dS), dK̄, dV̄, dE, dF
};

}  // namespace

void validate(const Problem& problem, const LinformerConfig& c) {
  if (c.identity && c.k < problem.seq_len)
    throw ParamError("linformer: projection=identity needs k >= N (E = F = I is N×N); got k=" + std::to_string(c.k) +
                     ", N=" + std::to_string(problem.seq_len));
}

std::unique_ptr<Mechanism> create(const Problem& problem, const LinformerConfig& c, std::uint64_t seed) {
  if (problem.dtype == DType::BF16) return std::make_unique<LinformerBf16>(problem, c, seed);
  return std::make_unique<Linformer>(problem, c, seed);
}

std::int64_t flops(const Problem& p, const LinformerConfig& c) {
  const std::int64_t k = projected_length(p, c), n = p.seq_len, d = p.head_dim;
  return p.batch * p.heads * (4 * matmul_flops(n, k, d) + kSoftmaxFlopsPerElement * n * k);
}

// Floats of E and F (or the one E of key-value sharing); their gradients have as many.
std::int64_t projection_floats(const Problem& p, const LinformerConfig& c) {
  const std::int64_t tensors = c.sharing == LinformerSharing::KeyValue ? 1 : 2;
  return tensors * matrices_per_tensor(p, c) * projected_length(p, c) * p.seq_len;
}

std::int64_t workspace(const Problem& p, const LinformerConfig& c) {
  const std::int64_t k = projected_length(p, c), bh = p.batch * p.heads, projections = projection_floats(p, c);
  if (p.dtype == DType::BF16)  // bf16 K̄, V̄; fp32 scores with row stride k; the per-thread rows
    return (projections + bh * p.seq_len * k + p.threads * bf16_thread_floats(p, c)) * kFloatBytes +
           2 * bh * k * p.head_dim * element_bytes(DType::BF16);
  return (projections + 2 * bh * k * p.head_dim + bh * p.seq_len * ops::padded_ld(k)) * kFloatBytes;
}

// dV̄, dP, dQ, dK̄ (2·N·k·D each) + 4 per score (softmax backward) + per tensor and (batch, head)
// d(input) and d(projection) (2·N·k·D each).
std::int64_t backward_flops(const Problem& p, const LinformerConfig& c) {
  const std::int64_t k = projected_length(p, c), n = p.seq_len, d = p.head_dim;
  return p.batch * p.heads * (8 * matmul_flops(n, k, d) + kSoftmaxBackwardFlopsPerElement * n * k);
}

// The gradients mirror the forward's buffers: dE, dF as E, F; dK̄, dV̄ as K̄, V̄; dS as the scores.
// bf16: dK̄, dV̄ fp32, dP/dS fp32 [B·H, N, k]; the per-thread rows are the forward's.
std::int64_t backward_workspace(const Problem& p, const LinformerConfig& c) {
  if (p.dtype != DType::BF16) return workspace(p, c);
  const std::int64_t k = projected_length(p, c), bh = p.batch * p.heads;
  return (projection_floats(p, c) + bh * p.seq_len * k + 2 * bh * k * p.head_dim) * kFloatBytes;
}

FieldTable<LinformerConfig> config_fields(const LinformerConfig*) {
  return {int_field("k", &LinformerConfig::k, 1, 1 << 20,
                    "projected sequence length (rows of E, F), tokens (clamped to N)"),
          choice_field("sharing", &LinformerConfig::sharing,
                       {{"per-head", LinformerSharing::PerHead},
                        {"headwise", LinformerSharing::Headwise},
                        {"key-value", LinformerSharing::KeyValue}},
                       "per-head: E_h, F_h per head; headwise: one E, F for all heads; key-value: one E = F"),
          choice_field("projection", &LinformerConfig::identity, {{"gaussian", false}, {"identity", true}},
                       "gaussian: entries N(0, 1/k) from the seed; identity: E = F = I (needs k >= N, exact "
                       "attention)")};
}

LinformerConfig resolve(const Problem& p, LinformerConfig c) {
  c.k = projected_length(p, c);
  return c;
}

template <>
Implementation implementation<LinformerConfig>() {
  Implementation impl = implement<LinformerConfig>();
  impl.bf16_forward = true;  // not causal: no decode
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
