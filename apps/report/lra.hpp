#pragma once
// Long Range Arena (Tay et al., ICLR 2021, arXiv 2011.04006): the efficiency benchmark's published
// Table 2 and our comparison with it, for `table --paper lra` (the sweep preset is in
// apps/bench/presets.hpp).
#include <cstdint>
#include <string>
#include <vector>

#include "apps/report/report.hpp"
#include "apps/report/table.hpp"

namespace xfb {

// One row of LRA Table 2: training steps per second and peak memory per device (GB) at
// N = 1K, 2K, 3K, 4K (byte-level text classification, batch 32, TPU v3 4×4).
struct LraPublished {
  const char* model;     // registry name
  const char* lra_name;  // as printed in the paper
  double steps_per_s[4];
  double memory_gb[4];
  bool doubtful[4];  // the cell is as printed but very likely a typo
};
const std::vector<LraPublished>& lra_table2();

// Our speed-ups and memory ratios over vanilla next to LRA's (relative to its Transformer), per
// length, with Spearman's ρ between the two model orderings (doubtful cells excluded). Report
// lengths map to LRA's columns when N = 1000·k or 1024·k, k = 1…4. Throws InputError when the
// report has no such length with a vanilla point.
std::string render_lra_comparison(const Report& report, TableFormat format);

}  // namespace xfb
