// The one hand-written list that binds implementations to the survey's models.
// To add a mechanism: write taxonomy/<class>/<name>.{hpp,cpp} exposing `<name>_implementation()`,
// include it here, add one `attach` line, and add the .cpp to CMakeLists.txt.
#include <stdexcept>

#include "lib/registry.hpp"
#include "taxonomy/baselines/exact_tiled.hpp"
#include "taxonomy/baselines/vanilla.hpp"
#include "taxonomy/kernels/linear_transformer.hpp"
#include "taxonomy/kernels/performer.hpp"
#include "taxonomy/low_rank/linformer.hpp"
#include "taxonomy/low_rank/synthesizer.hpp"
#include "taxonomy/fixed_patterns/axial.hpp"
#include "taxonomy/fixed_patterns/image_transformer.hpp"
#include "taxonomy/fixed_patterns/local.hpp"
#include "taxonomy/fixed_patterns/sparse_transformer.hpp"
#include "taxonomy/fixed_patterns/bigbird.hpp"
#include "taxonomy/fixed_patterns/etc.hpp"
#include "taxonomy/fixed_patterns/longformer.hpp"
#include "taxonomy/fixed_patterns/memory_compressed.hpp"
#include "taxonomy/learnable_patterns/reformer.hpp"
#include "taxonomy/learnable_patterns/routing.hpp"
#include "taxonomy/learnable_patterns/sinkhorn.hpp"
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
    attach(list, "synthesizer", synthesizer_implementation());
    attach(list, "performer", performer_implementation());
    attach(list, "linformer", linformer_implementation());
    attach(list, "linear-transformer", linear_transformer_implementation());
    attach(list, "local", local_implementation());
    attach(list, "image-transformer", image_transformer_implementation());
    attach(list, "sparse-transformer", sparse_transformer_implementation());
    attach(list, "axial", axial_implementation());
    attach(list, "memory-compressed", memory_compressed_implementation());
    attach(list, "longformer", longformer_implementation());
    attach(list, "etc", etc_implementation());
    attach(list, "bigbird", bigbird_implementation());
    attach(list, "reformer", reformer_implementation());
    attach(list, "routing", routing_implementation());
    attach(list, "sinkhorn", sinkhorn_implementation());
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
