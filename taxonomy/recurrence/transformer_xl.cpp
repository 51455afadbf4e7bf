#include "taxonomy/recurrence/transformer_xl.hpp"

namespace xfb {
namespace {

std::unique_ptr<Mechanism> create(const Problem& problem, const ParamValues& values, std::uint64_t seed) {
  return std::make_unique<SegmentAttention>(problem, transformer_xl_config(values), seed);
}

std::int64_t flops(const Problem& p, const ParamValues& values) {
  return segment_attention_flops(p, transformer_xl_config(values));
}

std::int64_t workspace(const Problem& p, const ParamValues& values) {
  return segment_attention_workspace(p, transformer_xl_config(values));
}

}  // namespace

SegmentAttentionConfig transformer_xl_config(const ParamValues& values) {
  return {.model = "transformer-xl",
          .segment_len = values.get_int("segment_len"),
          .memory_len = values.get_int("memory_len"),
          .block_q = values.get_int("block_q")};
}

Implementation transformer_xl_implementation() {
  return {{
              {"segment_len", ParamType::Int, "512", 1, 65536, {}, "L, tokens per segment"},
              {"memory_len", ParamType::Int, "512", 0, 65536, {}, "M, cached previous positions (memory slots)"},
              {"block_q", ParamType::Int, "64", 1, 4096, {}, "query rows per task (tokens)"},
          },
          create,
          flops,
          workspace};
}

}  // namespace xfb
