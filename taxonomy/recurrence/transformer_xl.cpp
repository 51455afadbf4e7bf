#include "taxonomy/recurrence/transformer_xl.hpp"

#include "lib/core/config_table.hpp"

namespace xfb {
namespace {

std::unique_ptr<Mechanism> create(const Problem& problem, const TransformerXlConfig& c, std::uint64_t seed) {
  return std::make_unique<SegmentAttention>(problem, segment_config(c), seed);
}

std::int64_t flops(const Problem& p, const TransformerXlConfig& c) {
  return segment_attention_flops(p, segment_config(c));
}

std::int64_t workspace(const Problem& p, const TransformerXlConfig& c) {
  return segment_attention_workspace(p, segment_config(c));
}

const FieldTable<TransformerXlConfig>& fields() {
  using C = TransformerXlConfig;
  static const FieldTable<C> table = {
      int_field("segment_len", &C::segment_len, 1, 65536, "L, tokens per segment"),
      int_field("memory_len", &C::memory_len, 0, 65536, "M, cached previous positions (memory slots)"),
      int_field("block_q", &C::block_q, 1, 4096, "query rows per task (tokens)")};
  return table;
}

std::int64_t backward_flops(const Problem& p, const TransformerXlConfig& c) {
  return segment_attention_backward_flops(p, segment_config(c));
}

std::int64_t backward_workspace(const Problem& p, const TransformerXlConfig& c) {
  return segment_attention_backward_workspace(p, segment_config(c));
}

std::int64_t decode_workspace(const Problem& p, const TransformerXlConfig& c, std::int64_t tokens) {
  return segment_attention_decode_workspace(p, segment_config(c), tokens);
}

}  // namespace

SegmentAttentionConfig segment_config(const TransformerXlConfig& c) {
  return {.model = "transformer-xl", .segment_len = c.segment_len, .memory_len = c.memory_len, .block_q = c.block_q};
}

SegmentAttentionConfig transformer_xl_config(const ParamValues& values) {
  return segment_config(read_config(fields(), values));
}

Implementation transformer_xl_implementation() {
  return implement(
      ModelSpec<TransformerXlConfig>{.fields = fields(), .create = create, .flops = flops,
                                          .workspace = workspace,
                                          .backward_flops = backward_flops,
                                          .backward_workspace = backward_workspace,
                                          .decode_workspace = decode_workspace});
}

}  // namespace xfb
