#pragma once
// `compressive` (Rae et al. 2020): Transformer-XL plus a compressed memory. Slots evicted from the
// FIFO memory of M slots are compressed by rate c with f_c ∈ {max pool, mean pool, 1-D conv
// (kernel = stride = c, weights from the seed)} and kept in a FIFO of n_cm compressed slots;
// queries attend to [compressed memory ; memory ; segment] with the relative-position scores,
// compressed slots placed in the concatenated index directly before the memory. Contract, ragged
// last group, masks and FLOP formula: taxonomy/recurrence/segment_attention.hpp.
// Work O(N·(n_cm + M + L)·D + N·D²) (conv), workspace O(B·H·(n_cm + M + L)·D): linear and
// constant in N for fixed L, M, n_cm.
// Decode: the memory (and compressed memory) and the open segment's rows; the FIFO update runs in
// the step after a segment closes (recurrence/segment_attention.hpp): O(n_cm + M + L) per token.
#include "lib/core/mechanism.hpp"
#include "taxonomy/recurrence/segment_attention.hpp"

namespace xfb {

struct CompressiveConfig {
  std::int64_t segment_len = 512;               // L, tokens per segment
  std::int64_t memory_len = 512;                // M, memory slots (cached previous positions)
  std::int64_t compressed_len = 512;            // n_cm, compressed-memory slots
  std::int64_t compression_rate = 3;            // c, evicted memory slots per compressed slot
  Compression compression = Compression::Conv;  // f_c
  std::int64_t block_q = 64;                    // query rows per task, tokens
  bool aux_loss = false;                        // attention-reconstruction loss in the backward (conv only)
};

// The segment engine's configuration of a compressive config, and of parsed values (tests).
SegmentAttentionConfig segment_config(const CompressiveConfig& c);
SegmentAttentionConfig compressive_config(const ParamValues& values);
template <>
Implementation implementation<CompressiveConfig>();

}  // namespace xfb
