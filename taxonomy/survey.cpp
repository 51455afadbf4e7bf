// The technique classes of "Efficient Transformers: A Survey" (Tay et al., arXiv 2009.06732): names,
// the survey's letters, parsing. The models themselves are rows of taxonomy/registry.cpp.
#include <stdexcept>

#include "taxonomy/cards.hpp"

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
  static const std::vector<ModelClass> classes = {ModelClass::Exact,   ModelClass::FixedPatterns,
                                                  ModelClass::LearnablePatterns, ModelClass::Memory,
                                                  ModelClass::LowRank, ModelClass::Kernels,
                                                  ModelClass::Recurrence};
  return classes;
}

bool ModelCard::has_class(ModelClass c) const {
  for (auto own : classes)
    if (own == c) return true;
  return false;
}

}  // namespace xfb
