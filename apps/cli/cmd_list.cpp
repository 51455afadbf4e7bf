// `xfbench list`: the registry — every model of the survey's Table 1 (v1 and its revision's) and the exact
// baselines.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "apps/cli/commands.hpp"
#include "lib/core/errors.hpp"
#include "taxonomy/registry.hpp"

namespace xfb::cli {
namespace {

std::string classes_text(const ModelInfo& m) {
  std::string text;
  for (auto c : m.classes) text += (text.empty() ? "" : "+") + class_letter(c);
  return text;
}

nlohmann::json model_json(const ModelInfo& m) {
  nlohmann::json params = nlohmann::json::array();
  for (const auto& spec : m.impl.params) {
    nlohmann::json p = {{"name", spec.name},
                        {"type", param_type_name(spec.type)},
                        {"default", spec.default_value},
                        {"help", spec.help}};
    if (spec.type == ParamType::Choice) p["choices"] = spec.choices;
    if (spec.type == ParamType::Int || spec.type == ParamType::Float) p["range"] = {spec.min, spec.max};
    params.push_back(p);
  }
  std::vector<std::string> classes;
  for (auto c : m.classes) classes.push_back(class_name(c));
  return {{"name", m.name},
          {"display_name", m.display_name},
          {"classes", classes},
          {"complexity", m.complexity},
          {"revised_complexity", m.revised_complexity},
          {"decodes", m.decodes()},
          {"paper", m.paper},
          {"arxiv", m.arxiv},
          {"year", m.year},
          {"survey_row", m.survey_row},
          {"revision", m.revision},
          {"implemented", m.implemented()},
          {"backward", m.impl.has_backward()},
          {"incremental", m.impl.has_decode()},
          {"dtypes", m.impl.bf16_forward ? std::vector<std::string>{"f32", "bf16"} : std::vector<std::string>{"f32"}},
          {"ffn", m.ffn},
          {"decode_cost", m.decode_cost},
          {"params", params}};
}

// Left-aligns text in a column of `width` characters (UTF-8 aware: "²" is one column).
std::string pad(const std::string& text, std::size_t width) {
  std::size_t shown = 0;
  for (unsigned char c : text) shown += (c & 0xC0) != 0x80;
  return text + std::string(width > shown ? width - shown : 1, ' ');
}

int run_list(const std::string& class_filter, bool implemented_only, const std::string& format) {
  ModelClass wanted{};
  if (!class_filter.empty() && !parse_class(class_filter, wanted))
    throw InputError("unknown class '" + class_filter + "'");
  std::vector<const ModelInfo*> models;
  for (const auto& m : registry())
    if ((class_filter.empty() || m.has_class(wanted)) && (!implemented_only || m.implemented())) models.push_back(&m);
  if (format == "json") {
    nlohmann::json out = nlohmann::json::array();
    for (const auto* m : models) out.push_back(model_json(*m));
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  const bool md = format == "md";
  if (md)
    std::printf(
        "| model | name | class | complexity | decode | paper | implemented |\n|---|---|---|---|---|---|---|\n");
  else
    std::printf("%s%s%s%s%sPAPER\n", pad("MODEL", 21).c_str(), pad("CLASS", 9).c_str(), pad("COMPLEXITY", 18).c_str(),
                pad("DECODE", 8).c_str(), pad("IMPLEMENTED", 13).c_str());
  for (const auto* m : models) {
    const std::string complexity =
        m->complexity + (m->revised_complexity.empty() ? "" : " (revision: " + m->revised_complexity + ")");
    if (md)
      std::printf("| %s | `%s` | %s | %s | %s | %s (arXiv %s) | %s |\n", m->display_name.c_str(), m->name.c_str(),
                  classes_text(*m).c_str(), complexity.c_str(), m->decodes() ? "yes" : "no", m->paper.c_str(),
                  m->arxiv.c_str(), m->implemented() ? "yes" : "no");
    else
      std::printf("%s%s%s%s%s%s\n", pad(m->name, 21).c_str(), pad(classes_text(*m), 9).c_str(),
                  pad(m->complexity, 18).c_str(), pad(m->decodes() ? "yes" : "no", 8).c_str(),
                  pad(m->implemented() ? "yes" : "no", 13).c_str(), m->paper.c_str());
  }
  return 0;
}

}  // namespace

void add_list(CLI::App& app, Action& action) {
  auto* command = app.add_subcommand("list", "list the models: class, complexity, decode support, implemented");
  auto class_filter = std::make_shared<std::string>();
  auto implemented_only = std::make_shared<bool>(false);
  auto format = std::make_shared<std::string>("text");
  command->add_option("--class", *class_filter, "only this class (fixed_patterns, FP, learnable_patterns, …)")
      ->check(kNonEmpty);
  command->add_flag("--implemented", *implemented_only, "only implemented models");
  command->add_option("--format", *format, "text, md or json")
      ->check(CLI::IsMember({"text", "md", "json"}))
      ->capture_default_str();
  command->callback([=, &action] { action = [=] { return run_list(*class_filter, *implemented_only, *format); }; });
}

}  // namespace xfb::cli
