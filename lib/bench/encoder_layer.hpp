#pragma once
// `--scope layer`: one pre-LN Transformer encoder layer around a mechanism.
//   x: [B, N, E] with E = H·D.   a = LN₁(x);  [q|k|v] = a·W_qkv (W_qkv: [E, 3E]);
//   q, k, v reshaped to [B, H, N, D];  o = mechanism(q, k, v);  h = x + merge(o)·W_o (W_o: [E, E]);
//   y = h + GELU(LN₂(h)·W₁)·W₂  (W₁: [E, F], W₂: [F, E]).  No biases; LN has gain and shift.
// FLOPs beyond the mechanism: 2·7·B·N·E (two LN) + 2·B·N·E·(3E + E + 2F) (products) + 5·B·N·F (GELU).
#include <cstdint>
#include <vector>

#include "lib/core/mechanism.hpp"

namespace xfb {

class EncoderLayer {
 public:
  EncoderLayer(const Problem& problem, std::int64_t d_ff, std::uint64_t seed);

  // Untimed: computes q, k, v for x once and prepares the mechanism with them.
  void prepare(Mechanism& mechanism, const Tensor& x);
  // Timed: y = layer(x).
  void forward(Mechanism& mechanism, const Tensor& x, Tensor& y);

  std::vector<NamedTensor> parameters() const;
  const Tensor& q() const { return q_; }
  const Tensor& k() const { return k_; }
  const Tensor& v() const { return v_; }
  const Tensor& attention_output() const { return o_; }

  static std::int64_t flops_outside_mechanism(const Problem& p, std::int64_t d_ff);
  static std::int64_t workspace_bytes(const Problem& p, std::int64_t d_ff);

 private:
  void project_qkv(const Tensor& x);

  Problem p_;
  std::int64_t e_, f_;
  Tensor w_qkv_, w_o_, w_1_, w_2_, ln1_gain_, ln1_shift_, ln2_gain_, ln2_shift_;
  Tensor normed_, qkv_, q_, k_, v_, o_, merged_, hidden_, ffn_;
};

}  // namespace xfb
