// The model registry: one row per model, joining its survey card (the survey's Table 1, v1, plus
// LRA's local attention and the two exact baselines) and its implementation. No static-
// initialisation self-registration. To add a mechanism: its file pair under taxonomy/<class>/, one
// row here (with its header included), and its .cpp in CMakeLists.txt (docs/contributing.md).
#include "taxonomy/registry.hpp"

#include <utility>

#include "taxonomy/baselines/exact_tiled.hpp"
#include "taxonomy/baselines/vanilla.hpp"
#include "taxonomy/fixed_patterns/axial.hpp"
#include "taxonomy/fixed_patterns/bigbird.hpp"
#include "taxonomy/fixed_patterns/etc.hpp"
#include "taxonomy/fixed_patterns/image_transformer.hpp"
#include "taxonomy/fixed_patterns/local.hpp"
#include "taxonomy/fixed_patterns/longformer.hpp"
#include "taxonomy/fixed_patterns/memory_compressed.hpp"
#include "taxonomy/fixed_patterns/sparse_transformer.hpp"
#include "taxonomy/kernels/linear_transformer.hpp"
#include "taxonomy/kernels/performer.hpp"
#include "taxonomy/learnable_patterns/reformer.hpp"
#include "taxonomy/learnable_patterns/routing.hpp"
#include "taxonomy/learnable_patterns/sinkhorn.hpp"
#include "taxonomy/low_rank/linformer.hpp"
#include "taxonomy/low_rank/synthesizer.hpp"
#include "taxonomy/memory/set_transformer.hpp"
#include "taxonomy/recurrence/compressive.hpp"
#include "taxonomy/recurrence/transformer_xl.hpp"

namespace xfb {
namespace {

// A registry row: the survey card, its parameters and the implementation.
ModelInfo model(std::string name, std::string display_name, std::vector<ModelClass> classes, std::string complexity,
                bool decodes, std::string decode_cost, std::string paper, std::string arxiv, int year, int survey_row, Implementation impl) {
  ModelInfo info;
  info.name = std::move(name);
  info.display_name = std::move(display_name);
  info.classes = std::move(classes);
  info.complexity = std::move(complexity);
  info.decodes = decodes;
  info.decode_cost = std::move(decode_cost);
  info.paper = std::move(paper);
  info.arxiv = std::move(arxiv);
  info.year = year;
  info.survey_row = survey_row;
  info.params = impl.params;
  info.has_implementation = impl.create != nullptr;
  info.impl = std::move(impl);
  return info;
}

}  // namespace

const std::vector<ModelInfo>& registry() {
  using C = ModelClass;
  // name, display name, classes, complexity as the survey prints it, decodes (Table 1's Decode
  // column), the per-token cost of decoding with hyperparameters fixed (what the incremental form's
  // design implies; "" when the model does not decode), paper, arXiv id, year, survey row (0: not
  // in Table 1), implementation.
  static const std::vector<ModelInfo> models = {
      model("vanilla", "Transformer (materialised softmax attention)", {C::Exact}, "O(N²)", true, "O(N)",
            "Vaswani et al. 2017", "1706.03762", 2017, 0, vanilla_implementation()),
      model("exact-tiled", "Exact tiled attention (online softmax)", {C::Exact}, "O(N²)", true, "O(N)",
            "Dao et al. 2022", "2205.14135", 2022, 0, exact_tiled_implementation()),
      model("memory-compressed", "Memory Compressed Transformer", {C::FixedPatterns, C::Memory}, "O(N_c²)", true, "O(N_c)",
            "Liu et al. 2018", "1801.10198", 2018, 1, memory_compressed_implementation()),
      model("image-transformer", "Image Transformer", {C::FixedPatterns}, "O(N·m)", true, "O(l_q+l_m)",
            "Parmar et al. 2018", "1802.05751", 2018, 2, image_transformer_implementation()),
      model("set-transformer", "Set Transformer", {C::Memory}, "O(kN)", false, "",
            "Lee et al. 2019", "1810.00825", 2019, 3, set_transformer_implementation()),
      model("transformer-xl", "Transformer-XL", {C::Recurrence}, "O(N²)", true, "O(L+M)",
            "Dai et al. 2019", "1901.02860", 2019, 4, transformer_xl_implementation()),
      model("sparse-transformer", "Sparse Transformer", {C::FixedPatterns}, "O(N√N)", true, "O(√N)",
            "Child et al. 2019", "1904.10509", 2019, 5, sparse_transformer_implementation()),
      model("reformer", "Reformer", {C::LearnablePatterns}, "O(N log N)", true, "O(n_r·m)",
            "Kitaev et al. 2020", "2001.04451", 2020, 6, reformer_implementation()),
      model("routing", "Routing Transformer", {C::LearnablePatterns}, "O(N log N)", true, "O(N/k)",
            "Roy et al. 2020", "2003.05997", 2020, 7, routing_implementation()),
      model("axial", "Axial Transformer", {C::FixedPatterns}, "O(N√N)", true, "O(√N)",
            "Ho et al. 2019", "1912.12180", 2019, 8, axial_implementation()),
      model("compressive", "Compressive Transformer", {C::Recurrence}, "O(N²)", true, "O(L+M+M_c)",
            "Rae et al. 2020", "1911.05507", 2020, 9, compressive_implementation()),
      model("sinkhorn", "Sinkhorn Transformer", {C::LearnablePatterns}, "O(B²)", true, "O(b+N/b)",
            "Tay et al. 2020b", "2002.11296", 2020, 10, sinkhorn_implementation()),
      model("longformer", "Longformer", {C::FixedPatterns, C::Memory}, "O(n(k+m))", true, "O(w+g)",
            "Beltagy et al. 2020", "2004.05150", 2020, 11, longformer_implementation()),
      model("etc", "ETC", {C::FixedPatterns, C::Memory}, "O(N_g² + N·N_g)", false, "",
            "Ainslie et al. 2020", "2004.08483", 2020, 12, etc_implementation()),
      model("synthesizer", "Synthesizer", {C::LowRank, C::LearnablePatterns}, "O(N²)", true, "O(N)",
            "Tay et al. 2020a", "2005.00743", 2020, 13, synthesizer_implementation()),
      model("performer", "Performer", {C::Kernels}, "O(N)", true, "O(1)",
            "Choromanski et al. 2020", "2009.14794", 2020, 14, performer_implementation()),
      model("linformer", "Linformer", {C::LowRank}, "O(N)", false, "",
            "Wang et al. 2020", "2006.04768", 2020, 15, linformer_implementation()),
      model("linear-transformer", "Linear Transformer", {C::Kernels}, "O(N)", true, "O(1)",
            "Katharopoulos et al. 2020", "2006.16236", 2020, 16, linear_transformer_implementation()),
      model("bigbird", "Big Bird", {C::FixedPatterns, C::Memory}, "O(N)", false, "",
            "Zaheer et al. 2020", "2007.14062", 2020, 17, bigbird_implementation()),
      model("local", "Local Attention (LRA)", {C::FixedPatterns}, "O(N·b)", true, "O(b)",
            "Tay et al. 2021 (LRA)", "2011.04006", 2021, 0, local_implementation()),
  };
  return models;
}

const std::vector<ModelCard>& model_cards() {
  static const std::vector<ModelCard> cards(registry().begin(), registry().end());
  return cards;
}

const ModelCard* find_card(const std::string& name) {
  for (const auto& card : model_cards())
    if (card.name == name) return &card;
  return nullptr;
}

const ModelInfo* find_model(const std::string& name) {
  for (const auto& model : registry())
    if (model.name == name) return &model;
  return nullptr;
}

}  // namespace xfb
