#pragma once
// A mechanism that is one block_sparse plan (every query tile attends to one interval of its
// head's keys) and decodes over a window of the most recent tokens: `local` and
// `image-transformer`. The plan gives
//   tasks()                 query tiles per head;
//   operator()(task, lo, hi) the tile and its rows' key intervals (block_sparse::run_tiles);
//   max_keys()              the widest tile's keys: the per-thread score tiles' columns;
//   window()                the decoding window's tokens;
//   window_start(token)     the first token the decoded token sees.
// Forward: run_tiles over every head (saving each row's log-sum-exp once prepare_backward ran);
// backward: block_sparse::TileTraining; decode: engines/decode_common.hpp WindowCache.
// SinglePlanAttentionBf16 is the same on bf16 tensors (engines/block_sparse_bf16.hpp: run_tiles_bf16,
// TileTrainingBf16, WindowCacheBf16), created when Problem::dtype is bf16; every query row is in
// exactly one task (each output and dQ row is written by one tile).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "lib/core/tile_kernels.hpp"
#include "lib/core/tile_kernels_bf16.hpp"
#include "taxonomy/engines/block_sparse.hpp"
#include "taxonomy/engines/block_sparse_bf16.hpp"
#include "taxonomy/engines/decode_common.hpp"

namespace xfb::block_sparse {

template <class Plan>
class SinglePlanAttention final : public Mechanism {
 public:
  SinglePlanAttention(const Problem& problem, const Plan& plan) : p_(problem), plan_(plan) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = ThreadScratch(p_.threads, plan_.max_keys(), p_.head_dim);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    run_tiles(
        p_.batch * p_.heads, plan_.tasks(), scratch_,
        [&](std::int64_t head) { return training_.saving(head_view(q, k, v, out, head), head); }, plan_);
    if (!window_.empty()) window_.load_context(k, v, p_.threads);
  }

  void prepare_decode(std::int64_t) override {
    window_ = WindowCache(p_.batch * p_.heads, plan_.window(), p_.head_dim);
  }
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    window_.step(q, k, v, out, plan_.window_start(window_.length()), p_.threads);
  }
  std::vector<NamedTensor> decode_state() const override { return window_.state(); }

  void prepare_backward() override {
    training_.prepare(p_.batch * p_.heads, p_.seq_len, p_.threads, plan_.max_keys(), p_.head_dim);
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    training_.run({q, k, v, out, dout, dq, dk, dv}, p_.batch * p_.heads, plan_.tasks(), plan_);
  }

  std::vector<NamedTensor> saved() const override { return training_.saved(); }

 private:
  Problem p_;
  Plan plan_;
  ThreadScratch scratch_;
  TileTraining training_;
  WindowCache window_;  // decoding only
};

template <class Plan>
class SinglePlanAttentionBf16 final : public Mechanism {
 public:
  SinglePlanAttentionBf16(const Problem& problem, const Plan& plan) : p_(problem), plan_(plan) {}

  void prepare(const Tensor&, const Tensor&, const Tensor&) override {
    scratch_ = ThreadScratchBf16(p_.threads, plan_.max_keys(), p_.head_dim);
  }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    run_tiles_bf16(
        p_.batch * p_.heads, plan_.tasks(), scratch_,
        [&](std::int64_t head) { return training_.saving(head_view_bf16(q, k, v, out, head), head); }, plan_);
    if (!window_.empty()) window_.load_context(k, v, p_.threads);
  }

  void prepare_decode(std::int64_t) override {
    window_ = WindowCacheBf16(p_.batch * p_.heads, plan_.window(), p_.head_dim);
  }
  void decode_step(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    window_.step(q, k, v, out, plan_.window_start(window_.length()), p_.threads);
  }
  std::vector<NamedTensor> decode_state() const override { return window_.state(); }

  void prepare_backward() override {
    training_.prepare(p_.batch * p_.heads, p_.seq_len, p_.threads, plan_.max_keys(), p_.head_dim);
  }

  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout, Tensor& dq,
                Tensor& dk, Tensor& dv) override {
    training_.run({q, k, v, out, dout, dq, dk, dv}, p_.batch * p_.heads, plan_.tasks(), plan_);
  }

  std::vector<NamedTensor> saved() const override { return training_.saved(); }

 private:
  Problem p_;
  Plan plan_;
  ThreadScratchBf16 scratch_;
  TileTrainingBf16 training_;
  WindowCacheBf16 window_;  // decoding only
};

// The mechanism of the problem's element type.
template <class Plan>
std::unique_ptr<Mechanism> single_plan_attention(const Problem& problem, const Plan& plan) {
  if (problem.dtype == DType::BF16) return std::make_unique<SinglePlanAttentionBf16<Plan>>(problem, plan);
  return std::make_unique<SinglePlanAttention<Plan>>(problem, plan);
}

// Why the bf16 form cannot run the problem ("" when it can, or the problem is fp32).
inline std::string single_plan_bf16_unsupported(const Problem& p) {
  return tiles::bf16_head_dim_unsupported("the bf16 block-sparse engine", p.dtype, p.head_dim);
}

// Its FLOPs and tracked bytes (lib/core/config_table.hpp) on the plan of a problem.
template <class Plan>
std::int64_t single_plan_flops(const Problem& p, const Plan& plan) {
  return p.batch * p.heads * plan_flops(plan.tasks(), p.head_dim, plan);
}
template <class Plan>
std::int64_t single_plan_workspace(const Problem& p, const Plan& plan) {
  if (p.dtype == DType::BF16) return ThreadScratchBf16::tracked_bytes(p.threads, plan.max_keys(), p.head_dim);
  return ThreadScratch::tracked_bytes(p.threads, plan.max_keys(), p.head_dim);
}
template <class Plan>
std::int64_t single_plan_backward_flops(const Problem& p, const Plan& plan) {
  return p.batch * p.heads * plan_backward_flops(p.seq_len, plan.tasks(), p.head_dim, plan);
}
template <class Plan>
std::int64_t single_plan_backward_workspace(const Problem& p, const Plan& plan) {
  if (p.dtype == DType::BF16)
    return TileTrainingBf16::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, plan.max_keys(), p.head_dim);
  return TileTraining::tracked_bytes(p.batch * p.heads, p.seq_len, p.threads, plan.max_keys(), p.head_dim);
}

}  // namespace xfb::block_sparse
