#pragma once
// The model registry: every model of the survey's Table 1 plus the exact baselines, in one
// hand-written list (taxonomy/registry.cpp). No static-initialisation self-registration.
#include <string>
#include <vector>

#include "lib/mechanism.hpp"

namespace xfb {

const std::vector<ModelInfo>& registry();
// nullptr when unknown.
const ModelInfo* find_model(const std::string& name);
// The survey metadata, without implementations (taxonomy/survey.cpp).
std::vector<ModelInfo> survey_models();

}  // namespace xfb
