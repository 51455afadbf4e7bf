// The models of "Efficient Transformers: A Survey" (Tay et al., arXiv 2009.06732), Table 1 (v1),
// plus LRA's local attention and the two exact baselines. Metadata only: implementations are
// attached in taxonomy/registry.cpp.
#include <stdexcept>

#include "lib/registry.hpp"

namespace xfb {

namespace {
using C = ModelClass;
struct Row {
  const char* name;
  const char* display;
  std::vector<ModelClass> classes;
  const char* complexity;
  bool decodes;
  const char* paper;
  const char* arxiv;
  int year;
  int survey_row;
};

const std::vector<Row>& rows() {
  static const std::vector<Row> table = {
      {"vanilla", "Transformer (materialised softmax attention)", {C::Exact}, "O(N²)", true, "Vaswani et al. 2017",
       "1706.03762", 2017, 0},
      {"exact-tiled", "Exact tiled attention (online softmax)", {C::Exact}, "O(N²)", true, "Dao et al. 2022",
       "2205.14135", 2022, 0},
      {"memory-compressed", "Memory Compressed Transformer", {C::FixedPatterns, C::Memory}, "O(N_c²)", true,
       "Liu et al. 2018", "1801.10198", 2018, 1},
      {"image-transformer", "Image Transformer", {C::FixedPatterns}, "O(N·m)", true, "Parmar et al. 2018",
       "1802.05751", 2018, 2},
      {"set-transformer", "Set Transformer", {C::Memory}, "O(kN)", false, "Lee et al. 2019", "1810.00825", 2019, 3},
      {"transformer-xl", "Transformer-XL", {C::Recurrence}, "O(N²)", true, "Dai et al. 2019", "1901.02860", 2019, 4},
      {"sparse-transformer", "Sparse Transformer", {C::FixedPatterns}, "O(N√N)", true, "Child et al. 2019",
       "1904.10509", 2019, 5},
      {"reformer", "Reformer", {C::LearnablePatterns}, "O(N log N)", true, "Kitaev et al. 2020", "2001.04451", 2020,
       6},
      {"routing", "Routing Transformer", {C::LearnablePatterns}, "O(N log N)", true, "Roy et al. 2020",
       "2003.05997", 2020, 7},
      {"axial", "Axial Transformer", {C::FixedPatterns}, "O(N√N)", true, "Ho et al. 2019", "1912.12180", 2019, 8},
      {"compressive", "Compressive Transformer", {C::Recurrence}, "O(N²)", true, "Rae et al. 2020", "1911.05507",
       2020, 9},
      {"sinkhorn", "Sinkhorn Transformer", {C::LearnablePatterns}, "O(B²)", true, "Tay et al. 2020b", "2002.11296",
       2020, 10},
      {"longformer", "Longformer", {C::FixedPatterns, C::Memory}, "O(n(k+m))", true, "Beltagy et al. 2020",
       "2004.05150", 2020, 11},
      {"etc", "ETC", {C::FixedPatterns, C::Memory}, "O(N_g² + N·N_g)", false, "Ainslie et al. 2020", "2004.08483",
       2020, 12},
      {"synthesizer", "Synthesizer", {C::LowRank, C::LearnablePatterns}, "O(N²)", true, "Tay et al. 2020a",
       "2005.00743", 2020, 13},
      {"performer", "Performer", {C::Kernels}, "O(N)", true, "Choromanski et al. 2020", "2009.14794", 2020, 14},
      {"linformer", "Linformer", {C::LowRank}, "O(N)", false, "Wang et al. 2020", "2006.04768", 2020, 15},
      {"linear-transformer", "Linear Transformer", {C::Kernels}, "O(N)", true, "Katharopoulos et al. 2020",
       "2006.16236", 2020, 16},
      {"bigbird", "Big Bird", {C::FixedPatterns, C::Memory}, "O(N)", false, "Zaheer et al. 2020", "2007.14062", 2020,
       17},
      {"local", "Local Attention (LRA)", {C::FixedPatterns}, "O(N·b)", true, "Tay et al. 2021 (LRA)", "2011.04006",
       2021, 0},
  };
  return table;
}
}  // namespace

std::vector<ModelInfo> survey_models() {
  std::vector<ModelInfo> models;
  for (const auto& r : rows()) {
    ModelInfo info;
    info.name = r.name;
    info.display_name = r.display;
    info.classes = r.classes;
    info.complexity = r.complexity;
    info.decodes = r.decodes;
    info.paper = r.paper;
    info.arxiv = r.arxiv;
    info.year = r.year;
    info.survey_row = r.survey_row;
    models.push_back(std::move(info));
  }
  return models;
}

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

bool ModelInfo::has_class(ModelClass c) const {
  for (auto own : classes)
    if (own == c) return true;
  return false;
}

}  // namespace xfb
