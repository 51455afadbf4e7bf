#pragma once
// The mixture-of-experts feed-forward sublayer of `--scope layer` (`--ffn switch|gshard`): Switch
// Transformer (Fedus et al. 2021, arXiv 2101.03961) and GShard (Lepikhin et al. 2020, arXiv 2006.16668) as
// Mesh-TensorFlow's moe.py runs them. docs/layer.md#mixture-of-experts is the exact definition.
//
// On the T = B·M rows a = LN₂(h) ([T, d], d = H·D), X experts, each an FFN W₁ₑ [d, F], GELU, W₂ₑ [F, d]:
//   router:  p = softmax(a·W_r) per row (W_r [d, X], no bias; fp32 like everything here).
//   groups:  consecutive rows of S = group_size (0: all T); the last group may be shorter (S_g rows).
//   choice:  Switch: e₁ = argmax p, gate g₁ = p_e₁. GShard: e₁, e₂ the two largest (ties: lower index),
//            gates renormalised g_j = p_ej/(p_e₁ + p_e₂); the second is kept when u_t < g₂/0.2 with u_t the
//            seeded uniform of row t (stream "moe/second_draw"; Mesh-TF's "random" policy).
//   capacity per group C_g = min(S_g, max(4, ⌊k·S_g·cf/X⌋)) (k = 1 Switch, 2 GShard; Mesh-TF's minimum 4).
//            Within a group first choices take slots in row order, then second choices take what is left
//            (row order); a choice past its expert's capacity is dropped (its gate becomes 0; nothing is
//            renormalised again). A row whose every choice is dropped outputs 0 (the residual alone).
//   output:  y_t = Σ_kept g_j·FFN_ej(a_t), FFN_e(z) = GELU(z·W₁ₑ)·W₂ₑ; the layer adds it to h.
//   aux loss L = 0.01 · mean_g X·Σ_i f_gi·P_gi, f_gi the fraction of group g's rows whose first choice is i
//            (before capacity), P_gi the mean of p_i over the group.
// Dispatch: the kept rows of expert e are gathered into its buffer ([slots, d], slots = Σ_g C_g), run as
// two products on its c_e rows (oneDNN matmul, c_e the rows routed to e) and scattered back, weighted.
//
// FLOPs (R routed token-expert pairs, G groups): 2·T·d·X (router) + 5·T·X (softmax) + T·X + 2·G·X (aux loss)
//   + 3·T (GShard's renormalisation) + R·(4·d·F + 5·F + 2·d) (experts, GELU, weighted combine).
// Backward of ⟨dy, y⟩ + L (routing held fixed, the second-choice draw and capacity not differentiated):
//   per kept pair dg = ⟨dy_t, FFN_e(a_t)⟩, the expert products' gradients, da_t = Σ g_j·∂FFN, the gates'
//   gradient through the renormalisation into dp, plus ∂L/∂p = 0.01·X·f_gi/(G·S_g), softmax backward into
//   dlogits, dW_r = aᵀ·dlogits, da += dlogits·W_rᵀ. FLOPs: R·(8·d·F + 11·F + 4·d) + 4·T·d·X + 4·T·X + T·X
//   (aux term) + 6·T (GShard's renormalisation).
// The training forward keeps the experts' inputs, pre-activations, activations and outputs (slots rows each).
//
// bf16 (the layer's dtype, issue 31): a, y, dy, W₁, W₂ (the fp32 draws rounded) and the experts' buffers
// (inputs, pre-activations, activations, outputs and their gradients) are bf16; the router stays fp32 as
// Switch's selective precision has it (a widened exactly, W_r, the probabilities, gates and dW_r fp32). The
// expert products accumulate in fp32 and round once into their bf16 buffer; GELU and its backward run in
// fp32 on widened chunks; y_t = round(h_t + Σ g·out) and da (fp32) sum in fp32. Weight gradients are fp32.
// The FLOPs are the fp32 form's.
#include <cstdint>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/point_config.hpp"

namespace xfb {

class MoeFfn {
 public:
  static constexpr double kAuxLossCoefficient = 1e-2;  // Switch and Mesh-TF
  static constexpr double kSecondThreshold = 0.2;      // GShard's random policy: keep with min(1, g₂/0.2)
  static constexpr std::int64_t kMinCapacity = 4;      // Mesh-TF's floor on the capacity

  // rows T, width d, FFN width F; weights N(0, 1/fan_in) from `seed` under the streams moe/w_router,
  // moe/w_1 ([X, d, F]), moe/w_2 ([X, F, d]), moe/second_draw ([T]).
  MoeFfn(const MoeSettings& settings, std::int64_t rows, std::int64_t width, std::int64_t d_ff, int threads,
         std::uint64_t seed, DType dtype = DType::F32);

  // Timed: y += moe(a); a, y [T, d] in the dtype. Routes, gathers, runs the experts, combines; sets the
  // counts below.
  void forward(const float* a, float* y);
  void forward(const bf16* a, bf16* y);
  // Untimed: the training buffers (from then on the forward keeps what the backward reads).
  void prepare_training();
  // Timed, after a forward of the same a: da = ∂(⟨dy, y⟩ + L)/∂a (overwritten), dW_r, dW₁, dW₂.
  void backward(const float* a, const float* dy, float* da);
  void backward(const bf16* a, const bf16* dy, float* da);

  std::int64_t tokens_dropped() const { return dropped_; }  // rows whose every choice was dropped
  std::int64_t routed_pairs() const { return routed_; }     // R, the kept token-expert pairs
  // Kept pairs per expert: [X]; the max over the mean is the row's expert_load.
  const std::vector<std::int64_t>& expert_counts() const { return counts_; }
  double expert_load() const;  // max_e c_e / mean_e c_e (1 = balanced; 0 when nothing is routed)
  double aux_loss() const { return aux_loss_; }
  // Test only: the router's probabilities [T, X].
  const Tensor& probabilities() const { return probs_; }

  // moe_w_router [d, X], moe_w_1 [X, d, F], moe_w_2 [X, F, d], moe_second_draw [T] (GShard); the routing
  // of the last forward: moe_choice [T, k] (the expert of choice j), moe_slot [T, k] (its row in that
  // expert's buffer, −1 when dropped), moe_gate [T, k] (its gate, 0 when dropped), moe_aux_loss [1].
  std::vector<NamedTensor> parameters() const;
  std::vector<NamedTensor> saved() const;
  std::vector<NamedTensor> parameter_gradients() const;  // "d" + each weight's name
  // Test only, after a backward: the experts' output gradients g·dy ("moe_d_expert_out"), pre-activation
  // gradients ("moe_d_expert_pre"), input gradients ("moe_d_expert_in") and dlogits ("moe_d_logits", [T, X]).
  std::vector<NamedTensor> backward_intermediates() const;

  static std::int64_t groups(const MoeSettings& s, std::int64_t rows);
  static std::int64_t capacity(const MoeSettings& s, std::int64_t group_rows);
  static std::int64_t slots(const MoeSettings& s, std::int64_t rows);  // Σ_g C_g: one expert's buffer rows
  static std::int64_t flops(const MoeSettings& s, std::int64_t rows, std::int64_t width, std::int64_t d_ff,
                            std::int64_t routed);
  static std::int64_t backward_flops(const MoeSettings& s, std::int64_t rows, std::int64_t width, std::int64_t d_ff,
                                     std::int64_t routed);
  static std::int64_t workspace_bytes(const MoeSettings& s, std::int64_t rows, std::int64_t width, std::int64_t d_ff,
                                      DType dtype = DType::F32);
  static std::int64_t backward_workspace_bytes(const MoeSettings& s, std::int64_t rows, std::int64_t width,
                                               std::int64_t d_ff, DType dtype = DType::F32);

 private:
  void route();  // probs_ → choice_, gate_, slot_, counts_, first_fraction_, aux_loss_
  bool training() const { return !expert_pre_.empty(); }
  template <class T>
  void forward_as(const T* a, T* y);
  template <class T>
  void backward_as(const T* a, const T* dy, float* da);
  void router_logits(const float* a);
  void router_logits(const bf16* a);
  void router_weight_gradient(const float* a, const float* dlogits);
  void router_weight_gradient(const bf16* a, const float* dlogits);

  MoeSettings s_;
  DType dtype_;
  std::int64_t t_, d_, f_, x_, k_, slots_;
  int threads_;
  Tensor w_router_, w_1_, w_2_, second_draw_;
  Tensor probs_, choice_, gate_, slot_, aux_;      // [T, X], [T, k] × 3, [1]
  Tensor first_fraction_;                          // [G, X]: f_gi
  Tensor expert_in_, expert_hidden_, expert_out_;  // [X, slots, d], [X, slots, F], [X, slots, d] (dtype)
  Tensor router_rows_, gelu_scratch_;  // bf16 only, fp32: [min(T, 1024), d], GELU's chunks (ops::gelu on bf16)
  std::vector<std::int64_t> counts_;
  std::int64_t dropped_ = 0, routed_ = 0;
  double aux_loss_ = 0;
  // Training only.
  Tensor expert_pre_, d_expert_out_, d_expert_hidden_, d_expert_in_, d_probs_;
  Tensor dw_router_, dw_1_, dw_2_;
};

}  // namespace xfb
