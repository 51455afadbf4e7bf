#pragma once
// Named sweep configurations for `sweep --preset`: Long Range Arena's efficiency setting (Tay et al.,
// ICLR 2021, arXiv 2011.04006; docs/lra.md).
#include <cstdint>
#include <string>
#include <vector>

namespace xfb {

// A named sweep configuration. Parameters are `model.key=value`.
struct SweepPreset {
  std::string name;
  std::string description;
  std::vector<std::string> models;
  std::vector<std::int64_t> seq_lens;
  std::string scope;  // attention | layer
  std::int64_t batch = 1, heads = 8, head_dim = 64;
  std::int64_t d_ff = 0;  // layer scope FFN width
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

}  // namespace xfb
