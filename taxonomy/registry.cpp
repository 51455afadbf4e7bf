// The one hand-written list that binds implementations to the survey's models.
// To add a mechanism: write taxonomy/<class>/<name>.{hpp,cpp} exposing `<name>_implementation()`,
// include it here, add one `attach` line, and add the .cpp to CMakeLists.txt.
#include <stdexcept>

#include "lib/registry.hpp"
#include "taxonomy/baselines/exact_tiled.hpp"
#include "taxonomy/baselines/vanilla.hpp"
#include "taxonomy/memory/set_transformer.hpp"
#include "taxonomy/recurrence/compressive.hpp"
#include "taxonomy/recurrence/transformer_xl.hpp"

namespace xfb {
namespace {
void attach(std::vector<ModelInfo>& models, const std::string& name, Implementation impl) {
  for (auto& model : models)
    if (model.name == name) {
      model.impl = std::move(impl);
      return;
    }
  throw std::logic_error("registry: no model named " + name);
}
}  // namespace

const std::vector<ModelInfo>& registry() {
  static const std::vector<ModelInfo> models = [] {
    auto list = survey_models();
    attach(list, "vanilla", vanilla_implementation());
    attach(list, "exact-tiled", exact_tiled_implementation());
    attach(list, "set-transformer", set_transformer_implementation());
    attach(list, "transformer-xl", transformer_xl_implementation());
    attach(list, "compressive", compressive_implementation());
    return list;
  }();
  return models;
}

const ModelInfo* find_model(const std::string& name) {
  for (const auto& model : registry())
    if (model.name == name) return &model;
  return nullptr;
}

}  // namespace xfb
