// The model cards: the technique classes of "Efficient Transformers: A Survey" (Tay et al., arXiv
// 2009.06732) — names, the survey's letters, parsing — and the cards of the registry's rows
// (taxonomy/registry_rows.hpp), read without their implementations.
#include "taxonomy/cards.hpp"

#include <stdexcept>
#include <type_traits>

#include "taxonomy/registry_rows.hpp"

namespace xfb {

namespace {
struct ClassNames {
  ModelClass c;
  const char* name;
  const char* letter;
};
constexpr ClassNames kClassNames[] = {
    {ModelClass::Exact, "exact", "X"},
    {ModelClass::FixedPatterns, "fixed_patterns", "FP"},
    {ModelClass::LearnablePatterns, "learnable_patterns", "LP"},
    {ModelClass::Memory, "memory", "M"},
    {ModelClass::LowRank, "low_rank", "LR"},
    {ModelClass::Kernels, "kernels", "KR"},
    {ModelClass::Recurrence, "recurrence", "RC"},
    {ModelClass::Downsampling, "downsampling", "DS"},
    {ModelClass::Sparse, "sparse_models", "Sparse"},
};
}  // namespace

std::string class_name(ModelClass c) {
  for (const auto& entry : kClassNames)
    if (entry.c == c) return entry.name;
  throw std::logic_error("unknown class");
}

std::string class_letter(ModelClass c) {
  for (const auto& entry : kClassNames)
    if (entry.c == c) return entry.letter;
  throw std::logic_error("unknown class");
}

bool parse_class(const std::string& name, ModelClass& out) {
  for (const auto& entry : kClassNames)
    if (name == entry.name || name == entry.letter) {
      out = entry.c;
      return true;
    }
  return false;
}

const std::vector<ModelClass>& all_classes() {
  static const std::vector<ModelClass> classes = {
      ModelClass::Exact,      ModelClass::FixedPatterns, ModelClass::LearnablePatterns,
      ModelClass::Memory,     ModelClass::LowRank,       ModelClass::Kernels,
      ModelClass::Recurrence, ModelClass::Downsampling,  ModelClass::Sparse};
  return classes;
}

bool ModelCard::has_class(ModelClass c) const {
  for (auto own : classes)
    if (own == c) return true;
  return false;
}

const std::vector<ModelCard>& model_cards() {
  static const std::vector<ModelCard> cards = [] {
    std::vector<ModelCard> all;
    for_each_row([&]<class Config>(Model<Config>, const ModelCard& card) {
      all.push_back(card);
      all.back().has_implementation = !std::is_void_v<Config>;
    });
    return all;
  }();
  return cards;
}

const ModelCard* find_card(const std::string& name) {
  for (const auto& card : model_cards())
    if (card.name == name) return &card;
  return nullptr;
}

}  // namespace xfb
