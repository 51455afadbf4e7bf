#pragma once
// The chunked engine shared by the kernel models (Performer, Linear Transformer): attention with a
// positive feature map φ: R^D → R^M,
//   out_i = Σ_j φ(q_i)·φ(k_j) v_j / Σ_j φ(q_i)·φ(k_j),   j over all keys, or j <= i when causal,
// computed without any N×N matrix and without an N×M×D prefix tensor.
//
// Work is split into tasks, one per (batch, head), run by OpenMP threads; each task walks the
// sequence in chunks of C rows (the last chunk may be shorter) with per-thread buffers only:
//   V'_c = [V_c | 1]   (values with a ones column, so the normaliser rides along every product)
//   S'   = Σ φ(K_c)ᵀ V'_c   — the running [M, D+1] state: numerator sums and normaliser z.
// Non-causal: pass 1 builds S' over all chunks; pass 2 computes out'_c = φ(Q_c)·S'.
// Causal, chunk c:  A = tril(φ(Q_c)·φ(K_c)ᵀ) [C, C] (j <= i inside the chunk);
//   out'_c = A·V'_c + φ(Q_c)·S'_{<c};  then S' += φ(K_c)ᵀ·V'_c.
// Finally out_i = out'_i[0:D] / out'_i[D]. Every product is one ops::gemm (oneDNN sgemm).
// Why per-head tasks rather than batched ops::matmul over B·H: the causal walk is sequential in
// the chunks, and keeping one head's chunk buffers on one core keeps them in cache and the
// workspace independent of N (batched calls per chunk would need [B·H, C, M] buffers and a
// synchronisation per product). Parallelism is therefore min(B·H, threads).
//
// Stabiliser: a feature map may scale its key features by exp(−shift) with a running shift that
// only grows (Performer's max subtraction). When it grows, S' is multiplied by exp(old − new),
// so all keys in S' always share one factor, which cancels in the ratio.
//
// FLOPs per head (exact, see linear_attention_flops), with n_c rows in chunk c:
//   features: N·(query_row + key_row)   (the feature map's own count, its gemm included)
//   rescales: M·(D+1) per chunk after the first, when the map shifts
//   normalise: N·D
//   non-causal: 4·N·M·(D+1)
//   causal, chunk c: 2·n_c²·M + 2·n_c²·(D+1) + [c > 0] 2·n_c·M·(D+1) + [not last] 2·n_c·M·(D+1)
// Workspace: per thread φ(Q_c), φ(K_c) [C, M], A [C, C], V'_c, out'_c [C, D+1], S' [M, D+1] (and
// in bf16 the widened Q_c, K_c [C, D]): independent of N.
//
// Backward (differentiable maps; see linear_attention_backward_flops): the forward saves each row's
// normaliser z_i = out'_i[D] (B·H·N floats) and, for a shifting map, the key shift in effect after
// each chunk (B·H·⌈N/C⌉ floats); the features are recomputed. The backward computes every key
// feature at the final shift s* (so no state rescales) and brings a causal row's z from its
// chunk's shift s_c to s* (× exp(s_c − s*)). With
// G'_i = [dO_i / z_i, −(dO_i·O_i)/z_i] (the gradient of out'_i):
//   non-causal:  S' = Σ φ(K_c)ᵀ V'_c;  dφ(Q_c) = G'_c·S'ᵀ;  dS' = Σ φ(Q_c)ᵀ G'_c;
//                dφ(K_c) = V'_c·dS'ᵀ;  dV_c = φ(K_c)·dS'[:, :D].
//   causal, a forward walk:  B = tril(G'_c·V'_cᵀ);  dφ(Q_c) = B·φ(K_c) + G'_c·S'_{<c}ᵀ;
//           and a reverse walk with R = Σ_{later chunks} φ(Q)ᵀ G':  A = tril(φ(Q_c)·φ(K_c)ᵀ);
//           dφ(K_c) = Bᵀ·φ(Q_c) + V'_c·Rᵀ;  dV_c = Aᵀ·G'_c[:, :D] + φ(K_c)·R[:, :D].
// dQ, dK from dφ through the map's own gradient. Memory stays O(N) (z) plus per-thread chunk
// buffers: no per-token state.
//
// bf16 (Problem::dtype == DType::BF16, issue 31): q, k, v, out, dout, dq, dk, dv and the decode
// state S' are bf16; everything in between is the fp32 computation above. Each chunk's query and
// key rows are widened into per-thread fp32 rows [C, D] (V_c straight into V'_c); the feature
// maps, the chunk buffers, the forward's running state and every product stay fp32 (ops::gemm,
// oneDNN's sgemm; one path on AVX-512 and AVX2): the products are small cache-resident chunk
// products on the calling thread, where the project has an fp32 gemm only, and bf16 operands would
// add a rounding per product. The gain is the halved streams of q, k, v, out. Outputs and gradients
// are rounded once, from fp32, when stored (a chunk's gradient rows through a per-thread fp32
// [C, D] buffer). The saved z and chunk shifts stay fp32: they are the normaliser sums and running
// maxima (the softmax statistics' analogues); rounding z would move every gradient by u, rounding
// a shift would scale exp(−shift) by up to u·|shift|.
// Decoding keeps S' [B·H, M, ld_v] in bf16 (half the bytes; the shift per head stays fp32): a step
// widens each state row, rescales and updates it in fp32, answers the query from the fp32 row and
// stores it rounded — one rounding per element per token, so after the prefill (its state rounded
// once) and t steps a state entry is within (t + 1)·u of its magnitude sum (Σ φ(k)|v|, Σ φ(k)), and
// a step's output within (t + 1)·u/(1 − (t + 1)·u)·(max|v| + |o|) of the fp32 walk's, plus the two
// outputs' bf16 roundings (tests/models/kernels/test_kernels_bf16.cpp). FLOPs are the fp32 form's.
#include <cstdint>

#include "lib/core/mechanism.hpp"

namespace xfb {

// A positive feature map, applied to `rows` consecutive rows of one head (x: [rows, D], row stride
// D) and written to phi ([rows, M], row stride ld). Implementations are const and thread-safe.
class FeatureMap {
 public:
  virtual ~FeatureMap() = default;
  virtual std::int64_t dim() const = 0;  // M
  // φ(q) up to a positive factor per row (it cancels in the row normalisation). Returns the
  // FLOPs it executed outside ops::gemm.
  virtual std::int64_t queries(const float* x, std::int64_t rows, float* phi, std::int64_t ld) const = 0;
  // φ(k)·exp(−shift). May raise `shift` (never lowers it); starts at −∞ for a task. Returns the
  // FLOPs it executed outside ops::gemm.
  virtual std::int64_t keys(const float* x, std::int64_t rows, float* phi, std::int64_t ld, float& shift) const = 0;
  // Whether keys() ever changes shift (then the engine rescales its state).
  virtual bool shifts() const = 0;
  // Backward (maps that have one): dx [rows, D] = (∂φ/∂x)ᵀ·dphi for query (keys = false) or key
  // rows whose φ(x) = phi (as queries()/keys() computed it; row stride ld for phi and dphi). The
  // per-row and shared stabilising factors are constants here: they cancel in the output, so the
  // output's derivative through them is zero. Returns its FLOPs.
  virtual bool differentiable() const { return false; }
  virtual std::int64_t gradient(const float* x, std::int64_t rows, const float* phi, float* dphi, std::int64_t ld,
                                float* dx, bool keys) const {
    (void)x, (void)rows, (void)phi, (void)dphi, (void)ld, (void)dx, (void)keys;
    return 0;
  }
};

// FLOPs of a feature map per row, gemm included; used by the analytic formulas.
struct FeatureCosts {
  std::int64_t dim = 0;        // M
  std::int64_t query_row = 0;  // per query row
  std::int64_t key_row = 0;    // per key row
  bool shifts = false;
  std::int64_t query_gradient_row = 0;  // the map's gradient per query row (backward)
  std::int64_t key_gradient_row = 0;    // per key row
};

class ChunkedLinearAttention {
 public:
  // chunk: rows per chunk C (clamped to N). Allocates the per-thread buffers.
  ChunkedLinearAttention(const Problem& problem, std::int64_t chunk, std::int64_t feature_dim);
  void forward(const FeatureMap& map, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);

  // Training: allocates the saved normalisers and the backward's buffers; the forward then saves z.
  void enable_backward();
  // After a forward of the same inputs; writes every element of dq, dk, dv. The map must be
  // differentiable.
  void backward(const FeatureMap& map, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv);
  const Tensor& normalisers() const { return normalisers_; }

  // Decoding (causal problems): allocates each head's state; a forward then also leaves it with
  // all N keys folded in (the last chunk's state update, skipped otherwise, runs too).
  void enable_decode();
  // One token per head (q, k, v, out: [B, H, 1, D]): folds the key into the state (rescaling it
  // when the key shift grows), then answers the query from it. FLOPs per head: the map's key and
  // query row, 2·M·(D+1) for the update, 2·M·(D+1) for φ(q)ᵀ·S', D to normalise, and M·(D+1) when
  // the shift grew. O(1) in the tokens so far.
  void decode_step(const FeatureMap& map, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out);
  const Tensor& decode_states() const { return decode_states_; }  // [B·H, M, ld_v]: S' per head
  const Tensor& decode_shifts() const { return decode_shifts_; }  // [B·H]: the key shift S' is at
  const Tensor& chunk_shifts() const { return shifts_; }

 private:
  struct Buffers;
  struct GradBuffers;
  // One head's inputs for the backward (T: the element type of q, k, v, out, dout; z and the chunk
  // shifts are fp32) and its gradients.
  template <class T>
  struct HeadInputs {
    const T *q, *k, *v, *out, *dout;
    const float *z, *shifts;
  };
  template <class T>
  struct HeadGrads {
    T *dq, *dk, *dv;
  };
  // The passes over every head, on fp32 (T = float) or bf16 (T = bf16) tensors.
  template <class T>
  void forward_heads(const FeatureMap& map, const T* q, const T* k, const T* v, T* out);
  template <class T>
  void backward_heads(const FeatureMap& map, const T* q, const T* k, const T* v, const T* out, const T* dout, T* dq,
                      T* dk, T* dv);
  template <class T>
  void decode_heads(const FeatureMap& map, const T* q, const T* k, const T* v, T* out, T* states);
  template <class T>
  std::int64_t head_backward_full(const FeatureMap& map, const HeadInputs<T>& in, const HeadGrads<T>& grads,
                                  const Buffers& b, const GradBuffers& g) const;
  template <class T>
  std::int64_t head_backward_causal(const FeatureMap& map, const HeadInputs<T>& in, const HeadGrads<T>& grads,
                                    const Buffers& b, const GradBuffers& g) const;
  // G'_c of chunk rows [c0, c0 + rows) into g.output_grads. Returns its FLOPs (3·D per row).
  // z_scale: multiplies the saved z (the shift correction of a causal chunk; 1 otherwise).
  template <class T>
  std::int64_t output_grads(const HeadInputs<T>& in, std::int64_t c0, std::int64_t rows, float z_scale,
                            const GradBuffers& g) const;
  // The saved shift after chunk c of head `task` (−∞ when nothing was saved).
  float saved_shift(const float* shifts, std::int64_t c0) const { return shifts[c0 / chunk_]; }
  GradBuffers grad_buffers(int thread);
  // z, shifts: the head's saved normalisers and chunk shifts (training) or nullptr; final_state,
  // final_shift: where the head's decoding state goes (decoding) or nullptr.
  template <class T>
  std::int64_t head_causal(const FeatureMap& map, const T* q, const T* k, const T* v, T* out, float* z, float* shifts,
                           const Buffers& b, T* final_state, float* final_shift) const;
  template <class T>
  std::int64_t head_step(const FeatureMap& map, const T* q, const T* k, const T* v, T* out, T* state, float& shift,
                         const Buffers& b) const;
  template <class T>
  std::int64_t head_full(const FeatureMap& map, const T* q, const T* k, const T* v, T* out, float* z, float* shifts,
                         const Buffers& b) const;
  // The key side of chunk [c0, c0 + rows): φ(K) into b.phi_k (moving the running shift, and
  // rescaling the state to it when the map shifts and rescale_state; the backward's keys sit at the
  // final shift and never move it), and [V | 1] into b.values. Returns its FLOPs. bf16: the key
  // rows are widened into b.key_rows first (where the map's gradient reads them).
  template <class T>
  std::int64_t load_key_chunk(const FeatureMap& map, const T* k, const T* v, std::int64_t c0, std::int64_t rows,
                              float& shift, const Buffers& b, bool rescale_state = true) const;
  Buffers buffers(int thread);

  Problem p_;
  std::int64_t chunk_, m_, ld_m_, ld_c_, ld_v_;
  Tensor phi_q_, phi_k_, scores_, values_, numerators_, state_;
  Tensor input_rows_;  // bf16 only: each thread's widened query and key rows [threads, 2, C, D]
  Tensor normalisers_, shifts_, output_grads_, feature_grads_, adjoint_, masked_grads_;  // training only
  Tensor gradient_rows_;                  // bf16 training only: each thread's fp32 dq/dk/dv rows [threads, C, D]
  Tensor decode_states_, decode_shifts_;  // decoding only
};

std::int64_t linear_attention_flops(const Problem& p, std::int64_t chunk, const FeatureCosts& costs);
std::int64_t linear_attention_workspace(const Problem& p, std::int64_t chunk, std::int64_t feature_dim);
// The backward's FLOPs and the bytes enable_backward adds.
std::int64_t linear_attention_backward_flops(const Problem& p, std::int64_t chunk, const FeatureCosts& costs);
std::int64_t linear_attention_backward_workspace(const Problem& p, std::int64_t chunk, std::int64_t feature_dim);
// The bytes enable_decode adds (the state and shift of every head; independent of N).
std::int64_t linear_attention_decode_workspace(const Problem& p, std::int64_t feature_dim);

}  // namespace xfb
