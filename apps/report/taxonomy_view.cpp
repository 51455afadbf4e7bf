#include "apps/report/taxonomy_view.hpp"

#include <algorithm>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "apps/report/svg.hpp"
#include "taxonomy/cards.hpp"

namespace xfb {
namespace {

using svg::escape;
using svg::num;

std::string letters(const ModelCard& m) {
  std::string text;
  for (auto c : m.classes) {
    if (!text.empty()) text += '+';
    text += class_letter(c);
  }
  return text;
}

// Table 1's rows in survey order, then the revision's models, then the models in neither table.
std::vector<const ModelCard*> table_order() {
  std::vector<const ModelCard*> models;
  for (const auto& m : model_cards()) models.push_back(&m);
  std::stable_sort(models.begin(), models.end(), [](const ModelCard* a, const ModelCard* b) {
    auto rank = [](const ModelCard* m) { return m->survey_row ? m->survey_row : m->revision ? 1000 : 2000; };
    return rank(a) < rank(b);
  });
  return models;
}

// Which of the survey's tables a model is in: "v1" (2020, and the revision's too), "revision" (added in
// 2022), "" (neither).
std::string survey_table(const ModelCard& m) { return m.survey_row ? "v1" : m.revision ? "revision" : ""; }

std::string markdown() {
  std::ostringstream out;
  out << "Table 1 of Tay et al., *Efficient Transformers: A Survey* (arXiv 2009.06732): the v1 rows (2020) by "
         "number, then the models the revision (v3, ACM Computing Surveys 2022) adds, from the xfbench registry; rows "
         "without a table are in neither.\n\n";
  out << "| # | table | model | name | paper | year | complexity | decode | class | implemented |\n"
      << "|---:|:---|:---|:---|:---|---:|:---|:---:|:---|:---:|\n";
  for (const auto* m : table_order())
    out << "| " << (m->survey_row ? std::to_string(m->survey_row) : "") << " | " << survey_table(*m) << " | "
        << m->display_name << " | `" << m->name << "` | " << m->paper << " (arXiv " << m->arxiv << ") | " << m->year
        << " | " << m->complexity << (m->revised_complexity.empty() ? "" : " (revision: " + m->revised_complexity + ")")
        << " | " << (m->decodes() ? "✓" : "✗") << (m->decode_note.empty() ? "" : " (" + m->decode_note + ")") << " | "
        << letters(*m) << " | " << (m->has_implementation ? "yes" : "no") << " |\n";
  out << "\nClasses: FP fixed patterns, LP learnable patterns, M memory, LR low rank, KR kernels, RC recurrence, DS "
         "downsampling and Sparse the sparse models (conditional computation; both the revision's); X the exact "
         "baselines. Decode: the model supports causal (autoregressive) "
         "attention.\n";
  return out.str();
}

std::string json() {
  nlohmann::json rows = nlohmann::json::array();
  for (const auto* m : table_order()) {
    std::vector<std::string> classes;
    for (auto c : m->classes) classes.push_back(class_name(c));
    rows.push_back({{"survey_row", m->survey_row},
                    {"table", survey_table(*m)},
                    {"name", m->name},
                    {"model", m->display_name},
                    {"paper", m->paper},
                    {"arxiv", m->arxiv},
                    {"year", m->year},
                    {"complexity", m->complexity},
                    {"revised_complexity", m->revised_complexity},
                    {"decode", m->decodes()},
                    {"decode_note", m->decode_note},
                    {"classes", classes},
                    {"class_letters", letters(*m)},
                    {"implemented", m->has_implementation}});
  }
  return nlohmann::json{{"source",
                         "Tay et al., Efficient Transformers: A Survey, arXiv 2009.06732, Table 1 (v1, 2020; "
                         "revision v3, 2022)"},
                        {"models", rows}}
             .dump(2) +
         "\n";
}

struct Region {
  ModelClass cls;
  double cx, cy, rx, ry;
  double label_x, label_y;
};

// Figure-2-like layout: FP overlaps M and (for Long-Short) LR from above, LR overlaps LP, KR and RC stand alone;
// the revision's DS overlaps FP and M from above, its sparse models stand alone, top right.
const std::vector<Region>& regions() {
  static const std::vector<Region> layout = {
      {ModelClass::Downsampling, 450, 200, 260, 110, 450, 115},
      {ModelClass::FixedPatterns, 300, 400, 230, 170, 190, 340},
      {ModelClass::Memory, 600, 400, 230, 170, 710, 340},
      {ModelClass::Recurrence, 970, 400, 115, 110, 970, 335},
      {ModelClass::LowRank, 320, 670, 200, 150, 190, 610},
      {ModelClass::LearnablePatterns, 600, 720, 200, 130, 690, 645},
      {ModelClass::Kernels, 950, 720, 120, 120, 950, 650},
      {ModelClass::Sparse, 960, 165, 125, 95, 960, 120},
  };
  return layout;
}

struct Anchor {
  std::vector<ModelClass> classes;  // sorted
  double x, y;
};

// Where models of each class combination are listed (centre of the stack).
const std::vector<Anchor>& anchors() {
  using C = ModelClass;
  static const std::vector<Anchor> list = {
      {{C::Downsampling}, 450, 150},
      {{C::FixedPatterns, C::Downsampling}, 330, 272},
      {{C::Memory, C::Downsampling}, 570, 272},
      {{C::FixedPatterns}, 200, 410},
      {{C::FixedPatterns, C::Memory}, 450, 420},
      {{C::Memory}, 700, 410},
      {{C::Recurrence}, 970, 410},
      {{C::FixedPatterns, C::LowRank}, 330, 550},
      {{C::LowRank}, 230, 700},
      {{C::LearnablePatterns, C::LowRank}, 465, 720},
      {{C::LearnablePatterns}, 660, 730},
      {{C::Kernels}, 950, 725},
      {{C::Sparse}, 960, 175},
      {{C::Exact}, 90, 918},
  };
  return list;
}

std::string svg_diagram() {
  constexpr double width = 1100, height = 960, line = 16;
  std::ostringstream out;
  out << svg::open_document(width, height, "Efficient Transformers: a taxonomy (xfbench registry)");
  out << "<text class=\"title\" x=\"20\" y=\"30\">Efficient attention models by class, after Tay et al., "
         "Efficient Transformers: A Survey, Figure 2</text>\n";
  out << "<text class=\"note\" x=\"20\" y=\"50\">from the xfbench registry; bold: implemented in this build; grey: "
         "not implemented; DS, Sparse and the models marked \u2020 are the revision's (2022)</text>\n";
  for (const auto& r : regions()) {
    const std::string colour = svg::class_colour(class_name(r.cls));
    out << "<ellipse class=\"class-region\" data-class=\"" << class_name(r.cls) << "\" cx=\"" << num(r.cx) << "\" cy=\""
        << num(r.cy) << "\" rx=\"" << num(r.rx) << "\" ry=\"" << num(r.ry) << "\" fill=\"" << colour
        << "\" fill-opacity=\"0.10\" stroke=\"" << colour << "\" stroke-width=\"2\"/>\n";
    out << "<text class=\"class-label\" data-class=\"" << class_name(r.cls) << "\" x=\"" << num(r.label_x) << "\" y=\""
        << num(r.label_y) << "\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\" style=\"fill:" << colour
        << "\">" << escape(svg::class_title(class_name(r.cls))) << "</text>\n";
  }
  out << "<rect class=\"class-region\" data-class=\"exact\" x=\"20\" y=\"870\" width=\"500\" height=\"75\" "
         "fill=\"none\" "
         "stroke=\"#404040\" stroke-dasharray=\"6 4\"/>\n<text class=\"class-label\" data-class=\"exact\" x=\"30\" "
         "y=\"888\" font-size=\"13\" font-weight=\"bold\">exact baselines (not in the survey's taxonomy)</text>\n";
  std::map<std::vector<ModelClass>, std::vector<const ModelCard*>> placed;
  for (const auto& m : model_cards()) {
    auto classes = m.classes;
    std::sort(classes.begin(), classes.end());
    const bool known =
        std::any_of(anchors().begin(), anchors().end(), [&](const Anchor& a) { return a.classes == classes; });
    placed[known ? classes : std::vector<ModelClass>{m.classes.front()}].push_back(&m);
  }
  for (const auto& anchor : anchors()) {
    const auto& models = placed[anchor.classes];
    double y = anchor.y - line * static_cast<double>(models.size() - (models.empty() ? 0 : 1)) / 2;
    if (anchor.classes.front() == ModelClass::Exact) y = anchor.y;
    double x = anchor.x;
    for (const auto* m : models) {
      const bool in_row = anchor.classes.front() == ModelClass::Exact;  // the baselines sit side by side
      out << "<text class=\"model\" data-model=\"" << m->name << "\" data-classes=\"" << letters(*m)
          << "\" data-implemented=\"" << (m->has_implementation ? "true" : "false") << "\" x=\"" << num(x) << "\" y=\""
          << num(y) << "\" text-anchor=\"middle\" dominant-baseline=\"middle\" font-size=\"12\""
          << (m->has_implementation ? " font-weight=\"bold\"" : " style=\"fill:#777\"") << ">" << escape(m->name)
          << (m->survey_row ? ""
              : m->revision ? "\u2020"
                            : "*")
          << "</text>\n";
      if (in_row)
        x += 130;
      else
        y += line;
    }
  }
  out << "<text class=\"note\" x=\"560\" y=\"930\">* in neither version of the survey's Table 1 (LRA's local "
         "attention, the exact baselines)</text>\n";
  out << "</svg>\n";
  return out.str();
}

}  // namespace

std::string render_taxonomy(TaxonomyFormat format) {
  switch (format) {
    case TaxonomyFormat::Markdown:
      return markdown();
    case TaxonomyFormat::Json:
      return json();
    case TaxonomyFormat::Svg:
      return svg_diagram();
  }
  return "";
}

}  // namespace xfb
