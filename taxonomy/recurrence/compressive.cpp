#include "taxonomy/recurrence/compressive.hpp"

namespace xfb {
namespace {

Compression compression_of(const std::string& name) {
  if (name == "max") return Compression::MaxPool;
  if (name == "mean") return Compression::MeanPool;
  return Compression::Conv;
}

std::unique_ptr<Mechanism> create(const Problem& problem, const ParamValues& values, std::uint64_t seed) {
  return std::make_unique<SegmentAttention>(problem, compressive_config(values), seed);
}

std::int64_t flops(const Problem& p, const ParamValues& values) {
  return segment_attention_flops(p, compressive_config(values));
}

std::int64_t workspace(const Problem& p, const ParamValues& values) {
  return segment_attention_workspace(p, compressive_config(values));
}

}  // namespace

SegmentAttentionConfig compressive_config(const ParamValues& values) {
  return {.model = "compressive",
          .segment_len = values.get_int("segment_len"),
          .memory_len = values.get_int("memory_len"),
          .compressed_len = values.get_int("compressed_len"),
          .rate = values.get_int("compression_rate"),
          .compression = compression_of(values.get_choice("compression")),
          .block_q = values.get_int("block_q")};
}

Implementation compressive_implementation() {
  return {{
              {"segment_len", ParamType::Int, "512", 1, 65536, {}, "L, tokens per segment"},
              {"memory_len", ParamType::Int, "512", 0, 65536, {}, "M, cached previous positions (memory slots)"},
              {"compressed_len", ParamType::Int, "512", 1, 65536, {}, "n_cm, compressed-memory slots"},
              {"compression_rate", ParamType::Int, "3", 1, 64, {}, "c, evicted memory slots per compressed slot"},
              {"compression", ParamType::Choice, "conv", 0, 0, {"conv", "max", "mean"},
               "f_c: 1-D convolution (kernel = stride = c), max pool or mean pool"},
              {"block_q", ParamType::Int, "64", 1, 4096, {}, "query rows per task (tokens)"},
          },
          create,
          flops,
          workspace};
}

}  // namespace xfb
