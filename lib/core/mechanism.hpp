#pragma once
// The interface every attention mechanism implements, and the implementation the registry holds.
//
// A mechanism computes O = attention(Q, K, V) for per-head tensors of shape [B, H, N, D]
// (batch, heads, tokens, features per head; row-major), optionally causal (token i depends only
// on tokens j <= i). O has M rows per (batch, head): M = N, except for a downsampling model
// (Perceiver's latents, Funnel's pooled queries, TokenLearner's tokens), whose `output_rows`
// gives M (Implementation::output_rows; `output_rows_of` below). Parameters (projections, random features, centroids …)
// are made from the seed in the untimed `prepare`; `forward` is the timed work.
//
// The backward contract (mechanisms that implement it; the registry's `backward_flops` says which):
// after `prepare_backward` (untimed), every forward also saves what the backward needs (listed by
// `saved`); `backward` then maps dO to dQ, dK, dV and the gradient of every learned parameter the
// mechanism owns (`parameter_gradients`, named "d" + the parameter's name). Choices the papers do not
// differentiate (fixed patterns, random blocks, hash buckets) are held as the forward made them.
// `backward` reads the saved state without changing it, so it may be repeated after one forward.
//
// The decode contract (mechanisms that implement it; the registry's `decode_workspace_bytes` says
// which), on a causal problem of N context tokens: after `prepare_decode(T)` (untimed), every
// forward — the prefill — also leaves the decoding state of its N tokens (KV cache, recurrent
// state, window, memories), and `decode_step` then generates up to T further tokens one at a time,
// each from that token's q, k, v alone ([B, H, 1, D]; the B sequences in lock-step), appending it to
// the state. The step's output for token N + t is the last output row of the causal forward over
// the N + t + 1 tokens so far, of the same model (same seed and parameters), up to fp32 rounding:
// that is the test that the incremental form is the same model. For M = N that is the row N + t of
// the causal forward over N + T tokens; for a downsampling model (Perceiver AR's last M positions)
// it is the last row of the window ending at that token. A new forward restarts the state.
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "lib/core/params.hpp"
#include "lib/core/tensor.hpp"

namespace xfb {

struct Problem {
  std::int64_t batch = 1;       // sequences per call
  std::int64_t heads = 8;       // attention heads
  std::int64_t seq_len = 1024;  // tokens, N
  std::int64_t head_dim = 64;   // features per head, D
  bool causal = false;          // token i attends only to j <= i
  int threads = 1;              // OpenMP threads the mechanism runs on; per-thread buffers are sized
                                // for exactly this many (the harness sets the OpenMP team to match)
  DType dtype = DType::F32;     // element type of q, k, v, out, the saved tensors and the decode state;
                                // bf16 (issue 31): products accumulate and softmax statistics stay fp32
};

struct NamedTensor {
  std::string name;  // file stem for --dump, e.g. "random_features"
  const Tensor* tensor = nullptr;
};

// Σ bytes of the named tensors.
inline std::int64_t total_bytes(const std::vector<NamedTensor>& tensors) {
  std::int64_t bytes = 0;
  for (const auto& named : tensors) bytes += named.tensor->bytes();
  return bytes;
}

class Mechanism {
 public:
  virtual ~Mechanism() = default;
  // Untimed. q, k, v: [B, H, N, D]. Builds parameters, buffers and oneDNN primitives. Nothing may
  // be fitted to the inputs (a causal output would depend on later tokens).
  virtual void prepare(const Tensor& q, const Tensor& k, const Tensor& v) = 0;
  // Timed. Writes every element of out: [B, H, M, D] (M = output_rows_of; N for most models).
  virtual void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) = 0;
  // Every parameter tensor the mechanism used (for --dump).
  virtual std::vector<NamedTensor> parameters() const { return {}; }

  // Untimed, after prepare: allocates the backward's buffers and what the forward saves for it.
  virtual void prepare_backward() { throw std::logic_error("this mechanism has no backward pass"); }
  // Timed. q, k, v, out: the last forward's; dout and out: [B, H, M, D]; dq, dk, dv: [B, H, N, D].
  // Writes every element of
  // dq, dk, dv (= ∂⟨dout, O⟩/∂q, …) and of every parameter gradient.
  virtual void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                        Tensor& dq, Tensor& dk, Tensor& dv) {
    (void)q, (void)k, (void)v, (void)out, (void)dout, (void)dq, (void)dk, (void)dv;
    throw std::logic_error("this mechanism has no backward pass");
  }
  // What the forward keeps for the backward beyond its inputs and output (the row's saved_bytes).
  virtual std::vector<NamedTensor> saved() const { return {}; }
  // Bytes of everything saved: saved()'s tensors, plus integer state (sort orders, assignments) that
  // a mechanism keeps in other buffers.
  virtual std::int64_t saved_bytes() const { return total_bytes(saved()); }
  // The gradients of the learned parameters, named "d<parameter>" (for --dump and the tests). Other
  // results of a training step the dump should carry use names without that prefix (routing's
  // "updated_centroids", its EMA step).
  virtual std::vector<NamedTensor> parameter_gradients() const { return {}; }
  // What the backward treats as a constant beyond what every model holds (its pattern), in one
  // line for the row (e.g. a memory under stop-gradient); "" for nothing to say.
  virtual std::string gradient_note() const { return ""; }

  // Untimed, after prepare (causal problem): allocates the state for N + tokens tokens and the step's
  // buffers; from now on every forward also builds the state of its context.
  virtual void prepare_decode(std::int64_t tokens) {
    (void)tokens;
    throw std::logic_error("this mechanism has no incremental form");
  }
  // Timed, one token: q, k, v, out [B, H, 1, D]. Reads nothing of earlier tokens but its state.
  virtual void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) {
    (void)q, (void)k, (void)v, (void)out;
    throw std::logic_error("this mechanism has no incremental form");
  }
  // What the model keeps between steps (for --dump and the row's state_bytes).
  virtual std::vector<NamedTensor> decode_state() const { return {}; }
  // The learned or drawn tensors the steps read that parameters() does not hold at the size they
  // read (a position axis extended to N + tokens, the rows of the decoded positions); for --dump,
  // as "decode_<name>". Contract: after prepare_decode, parameters() ∪ decode_parameters() hold
  // every learned or drawn tensor a decode step reads, at the size it reads. A name is that of the
  // parameter it extends (then it is that parameter of the model built for N + tokens, whole), or
  // joins the names of the parameters it holds with a note of the part (e.g. "w2_b2", "r_decoded_rows");
  // the model's header gives the shape and layout.
  virtual std::vector<NamedTensor> decode_parameters() const { return {}; }
  // Bytes of the state: decode_state()'s tensors plus integer state kept in other buffers.
  virtual std::int64_t state_bytes() const { return total_bytes(decode_state()); }
};

// A model's implementation as the registry holds it, on parsed parameter values (a model writes
// it with a typed config and lib/core/config_table.hpp's implement()).
struct Implementation {
  std::vector<ParamSpec> params;
  std::function<std::unique_ptr<Mechanism>(const Problem&, const ParamValues&, std::uint64_t seed)> create;
  // FLOPs one forward executes (conventions in lib/core/flop_counter.hpp); equals the counter exactly.
  std::function<std::int64_t(const Problem&, const ParamValues&)> flops;
  // Tracked bytes one forward needs beyond its inputs and output (parameters, buffers, scratchpad),
  // with per-thread buffers for Problem::threads threads.
  std::function<std::int64_t(const Problem&, const ParamValues&)> workspace_bytes;
  // The values as they run on the problem: derived defaults computed, blocks clamped.
  std::function<ParamValues(const Problem&, const ParamValues&)> resolved;
  // Optional: throws ParamError (one line) for values the model rejects for this problem. Called
  // before anything runs or is written; the functions above may assume it passed.
  std::function<void(const Problem&, const ParamValues&)> validate;
  // Optional: why the model cannot run this valid problem ("" when it can): the point becomes an
  // `unsupported` row with that reason (beyond the survey's Decode column).
  std::function<std::string(const Problem&, const ParamValues&)> unsupported;
  // Optional, present exactly when the mechanism implements the backward contract: FLOPs one
  // backward executes (equal to the counter), and the tracked bytes `prepare_backward` adds to the
  // forward's workspace (saved tensors, backward buffers, parameter gradients).
  std::function<std::int64_t(const Problem&, const ParamValues&)> backward_flops;
  std::function<std::int64_t(const Problem&, const ParamValues&)> backward_workspace_bytes;
  bool has_backward() const { return static_cast<bool>(backward_flops); }
  // Optional, present exactly when the mechanism implements the decode contract: the tracked bytes
  // `prepare_decode(tokens)` adds to the forward's workspace (the state at its N + tokens capacity
  // and the step's buffers).
  std::function<std::int64_t(const Problem&, const ParamValues&, std::int64_t tokens)> decode_workspace_bytes;
  bool has_decode() const { return static_cast<bool>(decode_workspace_bytes); }
  // Optional, present exactly for a downsampling model: M, the output's rows per (batch, head) on
  // the problem (1 ≤ M ≤ N); absent means M = N.
  std::function<std::int64_t(const Problem&, const ParamValues&)> output_rows;
  bool downsamples() const { return static_cast<bool>(output_rows); }
  // The element types the mechanism computes in (Problem::dtype): fp32 always; bf16 only when the
  // model has a bf16 form: its forward and, when it decodes, its decode (bf16_forward), its backward
  // (bf16_backward). The harness makes every other bf16 point an `unsupported` row (apps/bench/
  // point.cpp), so no model computes a bf16 point in fp32 silently.
  bool bf16_forward = false;
  bool bf16_backward = false;
};

// M, the rows of the model's output per (batch, head) on the problem.
inline std::int64_t output_rows_of(const Implementation& impl, const Problem& p, const ParamValues& values) {
  return impl.output_rows ? impl.output_rows(p, values) : p.seq_len;
}

}  // namespace xfb
