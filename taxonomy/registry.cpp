// The model registry: the cards (taxonomy/cards.cpp) joined by name with the implementations the
// rows name (taxonomy/registry_rows.hpp). No static-initialisation self-registration.
#include "taxonomy/registry.hpp"

#include <stdexcept>
#include <type_traits>
#include <utility>

#include "taxonomy/registry_rows.hpp"

namespace xfb {
namespace {

struct NamedImplementation {
  std::string name;
  Implementation impl;
};

std::vector<NamedImplementation> implementations() {
  std::vector<NamedImplementation> all;
  for_each_row([&]<class Config>(Model<Config>, const ModelCard& card) {
    if constexpr (!std::is_void_v<Config>) all.push_back({card.name, implementation<Config>()});
  });
  return all;
}

// The card with its implementation; throws std::logic_error unless a card with an implementation
// has exactly one and a card without one has none.
ModelInfo join(const ModelCard& card, const std::vector<NamedImplementation>& impls) {
  ModelInfo info{card, {}};
  int found = 0;
  for (const auto& named : impls)
    if (named.name == card.name) {
      info.impl = named.impl;
      ++found;
    }
  if (found != (card.has_implementation ? 1 : 0))
    throw std::logic_error("registry: " + card.name + " has " + std::to_string(found) + " implementations");
  return info;
}

}  // namespace

const std::vector<ModelInfo>& registry() {
  static const std::vector<ModelInfo> models = [] {
    const std::vector<NamedImplementation> impls = implementations();
    std::vector<ModelInfo> all;
    for (const auto& card : model_cards()) all.push_back(join(card, impls));
    return all;
  }();
  return models;
}

const ModelInfo* find_model(const std::string& name) {
  for (const auto& model : registry())
    if (model.name == name) return &model;
  return nullptr;
}

}  // namespace xfb
