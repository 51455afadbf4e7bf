#pragma once
// `compressive` (Rae et al. 2020): Transformer-XL plus a compressed memory. Slots evicted from the
// FIFO memory of M slots are compressed by rate c with f_c ∈ {max pool, mean pool, 1-D conv
// (kernel = stride = c, weights from the seed)} and kept in a FIFO of n_cm compressed slots;
// queries attend to [compressed memory ; memory ; segment] with the relative-position scores,
// compressed slots placed in the concatenated index directly before the memory. Contract, ragged
// last group, masks and FLOP formula: taxonomy/recurrence/segment_attention.hpp.
// Work O(N·(n_cm + M + L)·D + N·D²) (conv), workspace O(B·H·(n_cm + M + L)·D): linear and
// constant in N for fixed L, M, n_cm.
#include "lib/mechanism.hpp"
#include "taxonomy/recurrence/segment_attention.hpp"

namespace xfb {

SegmentAttentionConfig compressive_config(const ParamValues& values);
Implementation compressive_implementation();

}  // namespace xfb
