#pragma once
// Joins reports of the same sweep (typically its shards, `sweep --shard i/n`) into one.
// The inputs must agree on kMergeContextFields and on every setting except `shard`, and no point
// (ResultRow::key) may appear twice; otherwise InputError names the files and the difference.
// The merged report keeps the first input's context plus `merged_from` (file, host, date,
// command line, shard of every input) and lists the points in the unsharded sweep's order
// (settings.models, then settings.seq_lens).
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
