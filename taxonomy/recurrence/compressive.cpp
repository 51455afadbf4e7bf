#include "taxonomy/recurrence/compressive.hpp"

#include "lib/core/config_table.hpp"

namespace xfb {

const FieldTable<CompressiveConfig>& config_fields(const CompressiveConfig*) {
  using C = CompressiveConfig;
  static const FieldTable<C> table = {
      int_field("segment_len", &C::segment_len, 1, 65536, "L, tokens per segment"),
      int_field("memory_len", &C::memory_len, 0, 65536, "M, cached previous positions (memory slots)"),
      int_field("compressed_len", &C::compressed_len, 1, 65536, "n_cm, compressed-memory slots"),
      int_field("compression_rate", &C::compression_rate, 1, 64, "c, evicted memory slots per compressed slot"),
      choice_field("compression", &C::compression,
                   {{"conv", Compression::Conv}, {"max", Compression::MaxPool}, {"mean", Compression::MeanPool}},
                   "f_c: 1-D convolution (kernel = stride = c), max pool or mean pool"),
      int_field("block_q", &C::block_q, 1, 4096, "query rows per task (tokens)"),
      choice_field("aux_loss", &C::aux_loss, {{"off", false}, {"on", true}},
                   "the attention-reconstruction loss training the conv (backward and train passes; needs conv)")};
  return table;
}

void validate(const Problem&, const CompressiveConfig& c) {
  if (c.aux_loss && c.compression != Compression::Conv)
    throw ParamError("compressive: aux_loss=on needs compression=conv (max and mean pooling have no weights to train)");
}

SegmentAttentionConfig segment_config(const CompressiveConfig& c) {
  return {.model = "compressive",
          .segment_len = c.segment_len,
          .memory_len = c.memory_len,
          .compressed_len = c.compressed_len,
          .rate = c.compression_rate,
          .compression = c.compression,
          .block_q = c.block_q,
          .aux_loss = c.aux_loss};
}

SegmentAttentionConfig compressive_config(const ParamValues& values) {
  return segment_config(read_config(fields_of<CompressiveConfig>(), values));
}

template <>
Implementation implementation<CompressiveConfig>() {
  Implementation impl = implement<CompressiveConfig>();
  impl.bf16_forward = true;  // storage only (segment_attention.hpp): forward, decode and backward
  impl.bf16_backward = true;
  return impl;
}

}  // namespace xfb
