#pragma once
// `transformer-xl` (Dai et al. 2019): segments of L tokens attend to [memory ; segment] with the
// relative-position score A_ij = q_iᵀk_j + q_iᵀW_R R_{i−j} + uᵀk_j + vᵀW_R R_{i−j}; the memory is
// a FIFO of the M previous positions' keys and values, updated after each segment. Contract,
// masks (causal = decoding; not causal = bidirectional within the segment, memory as past
// context) and FLOP formula: taxonomy/recurrence/segment_attention.hpp with n_cm = 0.
// Work O(N·(M + L)·D) and workspace O(B·H·(M + L)·D): linear and constant in N for fixed L, M
// (the survey's O(N²) is the attention span M + L).
// Decode: the memory (and compressed memory) and the open segment's rows; the FIFO update runs in
// the step after a segment closes (recurrence/segment_attention.hpp): O(n_cm + M + L) per token.
#include "lib/core/mechanism.hpp"
#include "taxonomy/recurrence/segment_attention.hpp"

namespace xfb {

struct TransformerXlConfig {
  std::int64_t segment_len = 512;  // L, tokens per segment
  std::int64_t memory_len = 512;   // M, memory slots (cached previous positions)
  std::int64_t block_q = 64;       // query rows per task, tokens
};

// The segment engine's configuration of a Transformer-XL config, and of parsed values (tests).
SegmentAttentionConfig segment_config(const TransformerXlConfig& c);
SegmentAttentionConfig transformer_xl_config(const ParamValues& values);
template <>
Implementation implementation<TransformerXlConfig>();

}  // namespace xfb
