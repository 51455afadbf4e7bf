#pragma once
// Model cards: what the survey says about each model (class, complexity, decode support, paper)
// and whether it is implemented — everything report code may know about a model. Report code includes this
// header, never the registry or a mechanism. The cards are the registry's rows
// (taxonomy/registry_rows.hpp) without their implementations; they live in their own library
// (xfbench_cards, taxonomy/cards.cpp), which links no mechanism.
#include <string>
#include <vector>

namespace xfb {

// Survey class tags (the survey's letters; DS, downsampling, and the sparse models — conditional computation:
// α-entmax attention and the mixtures of experts that replace the feed-forward layer — are the revision's).
enum class ModelClass {
  Exact,
  FixedPatterns,
  LearnablePatterns,
  Memory,
  LowRank,
  Kernels,
  Recurrence,
  Downsampling,
  Sparse
};
std::string class_name(ModelClass c);    // "fixed_patterns", …: the folder under taxonomy/
std::string class_letter(ModelClass c);  // "FP", …; "X" for the exact baselines
bool parse_class(const std::string& name, ModelClass& out);
const std::vector<ModelClass>& all_classes();

struct ModelCard {
  std::string name;          // command-line name, e.g. "sparse-transformer"
  std::string display_name;  // e.g. "Sparse Transformer"
  std::vector<ModelClass> classes;
  std::string complexity;  // as printed in the survey's Table 1 (v1's for a v1 row)
  // The revision's Table 1 figure where it prints another one for a v1 row (Routing: O(N√N) for
  // v1's O(N log N)); "" otherwise.
  std::string revised_complexity = "";
  // Per-token cost of incremental decoding with hyperparameters fixed, as the design implies:
  // "O(N)" (a KV cache), "O(1)" (a recurrent state), "O(b)" (a window), …; "" when it cannot
  // decode. The one statement of decoding: decodes() and (checked by the tests) the
  // implementation's decode contract follow it.
  std::string decode_cost;
  // Why decodes() differs from the survey's own Table 1 mark, when it does (Funnel: the survey marks
  // it as decoding, its paper gives no causal form); "" when they agree.
  std::string decode_note = "";
  std::string paper;  // authors and year
  std::string arxiv;  // arXiv id
  int year = 0;
  int survey_row = 0;  // row in the survey's Table 1 (v1); 0 when not in it
  // Added by the survey's revision (arXiv 2009.06732v3, ACM Computing Surveys 2022): in its Table 1,
  // not in v1's.
  bool revision = false;
  // A feed-forward model (the sparse class's mixtures of experts): the layer FFN it selects, "switch" or
  // "gshard" (docs/layer.md#mixture-of-experts). Its attention is its row's config type's; it runs in
  // layer scope only. "" for an attention model.
  std::string ffn = "";
  bool has_implementation = false;  // derived from the row (it names a config type); not written in it

  bool has_class(ModelClass c) const;
  // The survey's Table 1 "Decode" column: supports causal attention.
  bool decodes() const { return !decode_cost.empty(); }
};

// Every model's card, in registry order.
const std::vector<ModelCard>& model_cards();
// nullptr when unknown.
const ModelCard* find_card(const std::string& name);

}  // namespace xfb
