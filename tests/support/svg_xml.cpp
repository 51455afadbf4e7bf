#include "tests/support/svg_xml.hpp"

#include <algorithm>
#include <cctype>
#include <set>
#include <stdexcept>

namespace xfb::test {
namespace {

[[noreturn]] void xml_error(const std::string& what) { throw std::runtime_error("XML error: " + what); }

// Every '&' in `raw` (text as written) starts a predefined entity or a character reference.
void check_references(const std::string& raw) {
  static const std::set<std::string> entities = {"amp", "lt", "gt", "quot", "apos"};
  for (auto at = raw.find('&'); at != std::string::npos; at = raw.find('&', at + 1)) {
    const auto end = raw.find(';', at);
    const std::string name = end == std::string::npos ? "" : raw.substr(at + 1, end - at - 1);
    const bool hex = name.size() > 2 && name.compare(0, 2, "#x") == 0;
    const bool digits = name.size() > 1 && name[0] == '#' &&
                        std::all_of(name.begin() + (hex ? 2 : 1), name.end(),
                                    [hex](unsigned char c) { return hex ? std::isxdigit(c) : std::isdigit(c); });
    if (entities.count(name) == 0 && !digits) xml_error("stray '&' in " + raw);
  }
}

// Below `raw` (references as written): no repeated attribute, no '<' in an attribute value, no '&'
// that starts no reference.
void check_node(pugi::xml_node raw) {
  if (raw.type() == pugi::node_pcdata) check_references(raw.value());
  std::set<std::string> names;
  for (pugi::xml_attribute attribute : raw.attributes()) {
    if (!names.insert(attribute.name()).second) xml_error(std::string("duplicate attribute ") + attribute.name());
    if (std::string(attribute.value()).find('<') != std::string::npos) xml_error("'<' in an attribute value");
    check_references(attribute.value());
  }
  for (pugi::xml_node child : raw.children()) check_node(child);
}

// `raw` (parsed as a fragment, so text at the top level is kept) has one root element, no text
// beside it, and passes check_node.
void check_document(const pugi::xml_document& raw) {
  int elements = 0;
  for (pugi::xml_node child : raw.children()) {
    const bool text = child.type() == pugi::node_pcdata || child.type() == pugi::node_cdata;
    if (text) xml_error("text beside the root element");
    elements += child.type() == pugi::node_element;
  }
  if (elements != 1) xml_error(std::to_string(elements) + " root elements");
  check_node(raw);
}

void load(pugi::xml_document& document, const std::string& text, unsigned options) {
  const pugi::xml_parse_result result = document.load_string(text.c_str(), options);
  if (!result) xml_error(std::string(result.description()) + " at offset " + std::to_string(result.offset));
}

}  // namespace

std::vector<double> doubles(const std::string& list) {
  std::vector<double> values;
  std::size_t start = 0;
  while (start < list.size()) {
    auto end = list.find_first_of(", ", start);
    if (end == std::string::npos) end = list.size();
    if (end > start) values.push_back(std::stod(list.substr(start, end - start)));
    start = end + 1;
  }
  return values;
}

pugi::xml_document parse_xml(const std::string& text) {
  pugi::xml_document raw;
  load(raw, text, (pugi::parse_default & ~pugi::parse_escapes) | pugi::parse_fragment);
  check_document(raw);
  pugi::xml_document document;
  load(document, text, pugi::parse_default);
  return document;
}

std::string at(pugi::xml_node element, const char* name) {
  const pugi::xml_attribute attribute = element.attribute(name);
  if (!attribute) throw std::runtime_error(std::string("<") + element.name() + "> has no attribute " + name);
  return attribute.value();
}

std::vector<pugi::xml_node> find_all(pugi::xml_node node, const std::string& name, const std::string& css_class) {
  std::string query = "descendant-or-self::" + name;
  if (!css_class.empty()) query += "[@class='" + css_class + "']";
  std::vector<pugi::xml_node> found;
  for (const pugi::xpath_node& hit : node.select_nodes(query.c_str())) found.push_back(hit.node());
  return found;
}

}  // namespace xfb::test
