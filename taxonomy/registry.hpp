#pragma once
// The model registry: every model of the survey's Table 1 plus the exact baselines, one row per
// model joining its survey card and its implementation (taxonomy/registry_rows.hpp). No
// static-initialisation self-registration. Report code uses taxonomy/cards.hpp instead.
#include <string>
#include <vector>

#include "lib/core/mechanism.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {

struct ModelInfo : ModelCard {
  Implementation impl;

  bool implemented() const { return impl.create != nullptr; }
};

const std::vector<ModelInfo>& registry();
// nullptr when unknown.
const ModelInfo* find_model(const std::string& name);

}  // namespace xfb
