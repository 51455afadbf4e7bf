#pragma once
// A strict little XML reader for tests of the SVG output: elements, attributes, text, comments,
// the XML declaration, the five predefined entities and numeric character references. Throws
// std::runtime_error on anything malformed (unclosed or mismatched tags, unquoted or duplicate
// attributes, stray '<' or '&', trailing content).
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace xfb::test {

struct XmlElement {
  std::string name;
  std::map<std::string, std::string> attributes;
  std::vector<std::unique_ptr<XmlElement>> children;
  std::string text;  // concatenated character data directly inside this element

  bool has(const std::string& attribute) const { return attributes.count(attribute) > 0; }
  const std::string& at(const std::string& attribute) const;
  // Every descendant (depth first, including this element) with `name` and, when given,
  // attribute `class` equal to `css_class`.
  std::vector<const XmlElement*> find_all(const std::string& element_name, const std::string& css_class = "") const;
};

std::unique_ptr<XmlElement> parse_xml(const std::string& document);

}  // namespace xfb::test
