#include "taxonomy/recurrence/transformer_xl.hpp"

#include "lib/core/config_table.hpp"

namespace xfb {

const FieldTable<TransformerXlConfig>& config_fields(const TransformerXlConfig*) {
  using C = TransformerXlConfig;
  static const FieldTable<C> table = {
      int_field("segment_len", &C::segment_len, 1, 65536, "L, tokens per segment"),
      int_field("memory_len", &C::memory_len, 0, 65536, "M, cached previous positions (memory slots)"),
      int_field("block_q", &C::block_q, 1, 4096, "query rows per task (tokens)")};
  return table;
}

SegmentAttentionConfig segment_config(const TransformerXlConfig& c) {
  return {.model = "transformer-xl", .segment_len = c.segment_len, .memory_len = c.memory_len, .block_q = c.block_q};
}

SegmentAttentionConfig transformer_xl_config(const ParamValues& values) {
  return segment_config(read_config(fields_of<TransformerXlConfig>(), values));
}

template <>
Implementation implementation<TransformerXlConfig>() {
  Implementation impl = implement<TransformerXlConfig>();
  impl.bf16_forward = true;  // storage only (segment_attention.hpp): forward, decode and backward
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
