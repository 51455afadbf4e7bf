#pragma once
// `--scope layer`: one pre-LN Transformer encoder layer around a mechanism.
//   x: [B, N, E] with E = H·D.   a = LN₁(x);  [q|k|v] = a·W_qkv (W_qkv: [E, 3E]);
//   q, k, v reshaped to [B, H, N, D];  o = mechanism(q, k, v);  h = x + merge(o)·W_o (W_o: [E, E]);
//   y = h + GELU(LN₂(h)·W₁)·W₂  (W₁: [E, F], W₂: [F, E]).  No biases; LN has gain and shift.
// FLOPs beyond the mechanism: 2·7·B·N·E (two LN) + 2·B·N·E·(3E + E + 2F) (products) + 5·B·N·F (GELU).
//
// A downsampling mechanism (Perceiver, Funnel, TokenLearner: o has M rows, M ≤ N) maps the N tokens
// to M: everything after the mechanism runs on B·M rows and y is [B, M, E]; the attention sublayer
// has no residual, h = merge(o)·W_o, because an output row is a new token (a latent, a pooled query, a
// learned token), not one of the input rows x could be added to. The FLOPs are then
// 7·B·(N + M)·E (LN₁ on N rows, LN₂ on M) + 2·B·N·E·3E + 2·B·M·E·(E + 2F) + 5·B·M·F, and dx flows
// through q, k, v alone.
//
// Training (prepare_backward): the forward also keeps LN₁'s output and the FFN pre-activation z
// apart, so everything the backward reads is saved: a₁ = LN₁(x), q, k, v, o, merge(o), h, LN₂(h),
// z, GELU(z) (and the mechanism's own saved state). The backward of y, given dy:
//   dW₂ = GELU(z)ᵀ·dy;  dz = (dy·W₂ᵀ)·GELU'(z);  dW₁ = LN₂(h)ᵀ·dz;  dh = dy + LN₂ᵀ(dz·W₁ᵀ);
//   dW_o = merge(o)ᵀ·dh;  do = split(dh·W_oᵀ);  (dq, dk, dv) = mechanism backward of do;
//   dW_qkv = a₁ᵀ·[dq|dk|dv];  dx = dh + LN₁ᵀ([dq|dk|dv]·W_qkvᵀ);  LN gains and shifts likewise.
// Backward FLOPs beyond the mechanism: twice the forward's products + 19·B·(N + M)·E (LN backward) +
// 11·B·M·F (GELU backward); M = N but for a downsampling mechanism.
//
// bf16 (Problem::dtype, issue 31): x, y, dy, dx, the weight matrices (the fp32 draws rounded), q, k, v, o and
// every saved activation are bf16; products accumulate in fp32 (ops::matmul on bf16) and round once into
// their bf16 result, or stay fp32 where the next step reads fp32 (the weights' gradients, dLN). LayerNorm
// statistics, GELU and the LayerNorm backward run in fp32 on widened values; gains, shifts and their
// gradients are fp32. The residual adds are the products' accumulation (one rounding of h and y); dh is
// accumulated in fp32 and rounded once for the products that read it, dx = round(round(dh) + LN₁ᵀ).
// FLOPs are the fp32 layer's.
//
// With a mixture of experts (`ffn` Switch or GShard, taxonomy/layer/moe_ffn.hpp) the FFN sublayer is
// y = h + moe(LN₂(h)): W₁, W₂, z and GELU(z) are the experts' own, and the FFN's FLOPs are MoeFfn's,
// which depend on the routing (R, the kept token-expert pairs, known after the forward).
#include <cstdint>
#include <memory>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/point_config.hpp"
#include "taxonomy/layer/moe_ffn.hpp"

namespace xfb {

class EncoderLayer {
 public:
  // out_rows: M, the mechanism's output rows (N unless it downsamples); residual: h = x + merge(o)·W_o
  // (false for a downsampling mechanism: h = merge(o)·W_o).
  EncoderLayer(const Problem& problem, std::int64_t d_ff, std::int64_t out_rows, bool residual, std::uint64_t seed,
               const MoeSettings& ffn = {});

  // Untimed: computes q, k, v for x once and prepares the mechanism with them.
  void prepare(Mechanism& mechanism, const Tensor& x);
  // Timed: y = layer(x); x [B, N, E], y [B, M, E].
  void forward(Mechanism& mechanism, const Tensor& x, Tensor& y);

  std::vector<NamedTensor> parameters() const;

  // Untimed: the layer's own backward buffers and saved activations (may run before prepare, so a
  // mechanism's setup-only buffers peak over them).
  void prepare_training();
  // Untimed, after prepare: prepare_training() unless done, then mechanism.prepare_backward().
  void prepare_backward(Mechanism& mechanism);
  // Timed, after a forward of x: dx = ∂⟨dy, y⟩/∂x ([B, N, E]; dy [B, M, E]), the layer's weight gradients and the
  // mechanism's (through its backward).
  void backward(Mechanism& mechanism, const Tensor& x, const Tensor& dy, Tensor& dx);
  // What the forward keeps for the backward (beyond the mechanism's own), and the weights' gradients
  // named "d" + parameter name.
  std::vector<NamedTensor> saved() const;
  std::vector<NamedTensor> parameter_gradients() const;
  // The mechanism's gradients inside the last backward: do (its output's) and dq, dk, dv.
  std::vector<NamedTensor> attention_gradients() const;
  // Test only, after a backward: dz (the dense FFN's pre-activation gradient, "layer_dffn_pre"), dh in fp32
  // ("layer_dhidden") and, bf16 only, dh rounded for the products ("layer_dhidden_rounded").
  std::vector<NamedTensor> backward_intermediates() const;
  const Tensor& q() const { return q_; }
  const Tensor& k() const { return k_; }
  const Tensor& v() const { return v_; }
  const Tensor& attention_output() const { return o_; }
  // The mixture of experts, nullptr for the dense FFN.
  const MoeFfn* moe() const { return moe_.get(); }

  // routed: R of a mixture of experts' forward (ignored for the dense FFN). The byte estimates are in p.dtype.
  static std::int64_t flops_outside_mechanism(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                              const MoeSettings& ffn = {}, std::int64_t routed = 0);
  static std::int64_t workspace_bytes(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                      const MoeSettings& ffn = {});
  static std::int64_t backward_flops_outside_mechanism(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                                       const MoeSettings& ffn = {}, std::int64_t routed = 0);
  // Tracked bytes prepare_backward adds (the mechanism's own backward workspace not included).
  static std::int64_t backward_workspace_bytes(const Problem& p, std::int64_t d_ff, std::int64_t out_rows,
                                               const MoeSettings& ffn = {});

 private:
  template <class T>
  void project_qkv(const Tensor& x);
  template <class T>
  void forward_as(Mechanism& mechanism, const Tensor& x, Tensor& y);
  template <class T>
  void backward_as(Mechanism& mechanism, const Tensor& x, const Tensor& dy, Tensor& dx);
  bool training() const { return training_; }
  bool bf16_form() const { return p_.dtype == DType::BF16; }
  const Tensor& first_normed() const { return training() ? first_normed_ : normed_; }

  Problem p_;
  std::int64_t e_, f_, m_;  // E = H·D, F = d_ff, M output rows
  bool residual_, training_ = false;
  std::unique_ptr<MoeFfn> moe_;
  Tensor w_qkv_, w_o_, w_1_, w_2_, ln1_gain_, ln1_shift_, ln2_gain_, ln2_shift_;
  Tensor normed_, qkv_, q_, k_, v_, o_, merged_, hidden_, ffn_;
  Tensor gelu_scratch_;  // bf16 dense FFN: GELU's fp32 chunks (ops::gelu on bf16)
  // Training only: saved activations, gradients of activations and of the weights. d_normed_,
  // ln_scratch_ and d_hidden_ are fp32 in either dtype; d_hidden_rounded_ is dh rounded (bf16 only).
  Tensor first_normed_, ffn_pre_;
  Tensor d_ffn_, d_normed_, d_hidden_, d_hidden_rounded_, d_merged_, d_qkv_, ln_scratch_, do_, dq_, dk_, dv_;
  Tensor dw_qkv_, dw_o_, dw_1_, dw_2_, d_ln1_gain_, d_ln1_shift_, d_ln2_gain_, d_ln2_shift_;
};

}  // namespace xfb
