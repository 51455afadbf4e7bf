#include "apps/bench/presets.hpp"

#include <set>

#include "lib/core/errors.hpp"
#include "taxonomy/registry.hpp"

namespace xfb {

const SweepPreset& lra_preset() {
  // Parameter names are the implementations' (docs/lra.md). Linformer's k is
  // the byte-level text config's.
  static const SweepPreset preset = {
      "lra",
      "Long Range Arena efficiency benchmark (Tay et al. 2021, Table 2): layer scope, embedding 256 = 4 heads × 64, "
      "FFN 1024, batch 32, N = 1K–4K",
      {"vanilla", "local", "linformer", "reformer", "sinkhorn", "synthesizer", "bigbird", "linear-transformer",
       "performer"},
      {1024, 2048, 3072, 4096},
      "layer",
      32,
      4,
      64,
      1024,
      {"local.block=50", "sinkhorn.block=50", "bigbird.block=64", "bigbird.random_blocks=3", "performer.features=256",
       "reformer.n_rounds=1", "reformer.n_buckets=10", "linformer.k=32"},
  };
  return preset;
}

const SweepPreset* find_preset(const std::string& name) { return name == "lra" ? &lra_preset() : nullptr; }

std::vector<std::string> preset_names() { return {"lra"}; }

std::vector<std::string> preset_params(const SweepPreset& preset, const std::vector<std::string>& models) {
  const std::set<std::string> selected(models.begin(), models.end());
  std::vector<std::string> params;
  for (const auto& assignment : preset.params) {
    const auto dot = assignment.find('.'), eq = assignment.find('=');
    const std::string model = assignment.substr(0, dot), key = assignment.substr(dot + 1, eq - dot - 1);
    const ModelInfo* info = find_model(model);
    if (!selected.count(model) || info == nullptr || !info->implemented()) continue;
    bool known = false;
    std::string names;
    for (const auto& spec : info->impl.params) {
      known = known || spec.name == key;
      names += (names.empty() ? "" : ", ") + spec.name;
    }
    if (!known)
      throw InputError("--preset " + preset.name + " sets " + assignment + ", but " + model + " has no parameter '" +
                       key + "' in this build (it has: " + (names.empty() ? "none" : names) + ")");
    params.push_back(assignment);
  }
  return params;
}

}  // namespace xfb
