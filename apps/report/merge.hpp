#pragma once
// Joins reports of one machine and build into one: the shards of a sweep (`sweep --shard i/n`), or
// sweeps that differ only in what a grid varies — the models, lengths, passes and parameters, and
// the fields of a point's identity (batch, heads, head_dim, threads, seed, scope, causal, d_ff,
// decode_tokens: the point field table's in_key fields). The inputs must agree on
// kMergeContextFields (`threads` excepted when the settings' threads differ) and on every other
// setting but `shard` (timing, timeout, memory limit, preset), and no point (ResultRow::key) may
// appear twice; otherwise InputError names the files and the difference. A setting that differs
// becomes the list of its values in first-seen order (`pass` a comma list), as a grid records it.
// The merged report keeps the first input's context plus `merged_from` (file, host, date, command
// line, shard of every input); with several thread counts, `threads` is the largest and
// `machine_by_threads` holds every input's peaks per thread count. Points are listed in the
// merged settings' order (models, then seq_lens).
#include <string>
#include <vector>

#include "apps/report/report.hpp"

namespace xfb {

inline const std::vector<std::string> kMergeContextFields = {"cpu_model",  "threads",         "onednn_version",
                                                             "onednn_isa", "kernel_isa",      "build_type",
                                                             "compiler",   "xfbench_version", "git_commit"};

struct NamedReport {
  std::string name;  // file name, for messages
  Report report;
};

Report merge_reports(const std::vector<NamedReport>& inputs);

}  // namespace xfb
