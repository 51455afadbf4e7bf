#pragma once
// Naive double-precision references, used only by tests, and tolerances derived from fp32
// epsilon and the problem size.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/tensor.hpp"

namespace xfb::test {

inline constexpr double kFloatEps = 1.1920928955078125e-07;

// The OpenMP team of the test process (tests/main.cpp sets it). Test helpers create mechanisms for
// this many threads, so their parallel paths and per-thread buffers are exercised.
inline constexpr int kTestThreads = 2;
inline Problem on_test_threads(Problem p) {
  p.threads = kTestThreads;
  return p;
}

// allowed(i, j): may query i attend to key j.
using MaskFn = std::function<bool(std::int64_t i, std::int64_t j)>;
inline bool full_mask(std::int64_t, std::int64_t) { return true; }
inline bool causal_mask(std::int64_t i, std::int64_t j) { return j <= i; }
// allowed(h, i, j): may query i of head h (within a batch element) attend to key j.
using HeadMask = std::function<bool(std::int64_t h, std::int64_t i, std::int64_t j)>;
inline HeadMask same_for_every_head(MaskFn allowed) {
  return [allowed](std::int64_t, std::int64_t i, std::int64_t j) { return allowed(i, j); };
}

// The count values at x as doubles.
inline std::vector<double> widened(const float* x, std::int64_t count) { return std::vector<double>(x, x + count); }

// O = softmax(Q·Kᵀ·scale restricted to mask)·V for one head; q: [nq, d], k, v: [nk, d].
// Rows with no allowed key are zero. Returns [nq, d].
std::vector<double> reference_attention(const double* q, const double* k, const double* v, std::int64_t nq,
                                        std::int64_t nk, std::int64_t d, double scale, const MaskFn& allowed);
std::vector<double> reference_attention(const float* q, const float* k, const float* v, std::int64_t nq,
                                        std::int64_t nk, std::int64_t d, double scale, const MaskFn& allowed);

// The analytic gradient of reference_attention for an output gradient dO [nq, d]:
//   dV = Pᵀ·dO;  dS = P ⊙ (dO·Vᵀ − rowsum(P ⊙ dO·Vᵀ));  dQ = scale·dS·K;  dK = scale·dSᵀ·Q.
// Each *_terms holds, per element, the sum of the absolute values of the terms the element is a sum
// of (with |dP| taken as Σ_c |dO·V|): what fp32 rounding errors scale with. dq_abs_ds and dk_abs_ds
// hold scale·Σ_j |dS_ij|·|K_jc| and scale·Σ_i |dS_ij|·|Q_ic|: what rounding dS to a relative u moves
// dQ and dK by, per unit of u (the bf16 kernels round dS once; tests/support/bf16_check.hpp).
struct AttentionGradients {
  std::vector<double> dq, dk, dv;
  std::vector<double> dq_terms, dk_terms, dv_terms;
  std::vector<double> dq_abs_ds, dk_abs_ds;
};
AttentionGradients reference_attention_backward(const float* q, const float* k, const float* v, const float* dout,
                                                std::int64_t nq, std::int64_t nk, std::int64_t d, double scale,
                                                const MaskFn& allowed);

// The relative rounding error fp32 attention gradients may carry, per unit of an element's terms:
// 8·eps·(largest |score| contribution + log2(nk) + log2(d) + 1).
double gradient_error_factor(const float* q, const float* k, std::int64_t nq, std::int64_t nk, std::int64_t d,
                             double scale);

// Tolerance for an attention output element: 8·eps·(largest |score| contribution + log2(nk) + 1)·max|v|.
double attention_tolerance(const float* q, const float* k, const float* v, std::int64_t nq, std::int64_t nk,
                           std::int64_t d, double scale);

// Inputs filled with N(0,1) from the seed; stream names "q", "k", "v".
struct AttentionInputs {
  Tensor q, k, v;
};
AttentionInputs random_inputs(const Problem& p, std::uint64_t seed);

// M, the rows of the registered model's output per (batch, head) on p (N but for a downsampling model).
std::int64_t model_output_rows(const std::string& model, const Problem& p, const std::vector<std::string>& params = {});

// Rows [first, first + count) of every head of a [B, H, L, D] tensor, as a [B, H, count, D] tensor.
Tensor rows_of(const Tensor& whole, std::int64_t first, std::int64_t count);

// Runs a registered mechanism (prepare + forward) and returns its output ([B, H, M, D]).
Tensor run_mechanism(const std::string& model, const Problem& p, const AttentionInputs& in,
                     const std::vector<std::string>& params = {}, std::uint64_t seed = 42);

// Largest |got − want| over all heads, and checks every element within tolerance (doctest CHECK
// with the element, the two values and the tolerance in the message).
void check_against_reference(const Tensor& got, const AttentionInputs& in, const Problem& p, const MaskFn& allowed,
                             const std::string& label);

}  // namespace xfb::test
