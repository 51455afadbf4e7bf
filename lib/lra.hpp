#pragma once
// Long Range Arena (Tay et al., ICLR 2021, arXiv 2011.04006): the efficiency benchmark's sweep
// preset and its published Table 2, for `sweep --preset lra` and `table --paper lra`.
#include <cstdint>
#include <string>
#include <vector>

#include "lib/report.hpp"
#include "lib/table.hpp"

namespace xfb {

// A named sweep configuration. Parameters are `model.key=value`.
struct SweepPreset {
  std::string name;
  std::string description;
  std::vector<std::string> models;
  std::vector<std::int64_t> seq_lens;
  std::string scope;         // attention | layer
  std::int64_t batch = 1, heads = 8, head_dim = 64;
  std::int64_t d_ff = 0;     // layer scope FFN width
  std::vector<std::string> params;
};

// LRA's efficiency setting: the byte-level text config's layer (embedding 256 = 4 heads × 64,
// FFN 1024), batch 32, N = 1K–4K (1024·k), the models of LRA Table 2 with LRA's settings.
const SweepPreset& lra_preset();
// nullptr when unknown.
const SweepPreset* find_preset(const std::string& name);
std::vector<std::string> preset_names();

// The preset's parameters for the selected models: assignments for models that are not
// implemented in this build are dropped (their points become `unsupported` rows); an implemented
// model that lacks a preset parameter is an InputError naming it.
std::vector<std::string> preset_params(const SweepPreset& preset, const std::vector<std::string>& models);

// One row of LRA Table 2: training steps per second and peak memory per device (GB) at
// N = 1K, 2K, 3K, 4K (byte-level text classification, batch 32, TPU v3 4×4).
struct LraPublished {
  const char* model;      // registry name
  const char* lra_name;   // as printed in the paper
  double steps_per_s[4];
  double memory_gb[4];
  bool doubtful[4];       // the cell is as printed but very likely a typo
};
const std::vector<LraPublished>& lra_table2();

// Our speed-ups and memory ratios over vanilla next to LRA's (relative to its Transformer), per
// length, with Spearman's ρ between the two model orderings (doubtful cells excluded). Report
// lengths map to LRA's columns when N = 1000·k or 1024·k, k = 1…4. Throws InputError when the
// report has no such length with a vanilla point.
std::string render_lra_comparison(const Report& report, TableFormat format);

}  // namespace xfb
