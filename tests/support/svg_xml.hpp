#pragma once
// Reading the SVG that plot and taxonomy write, for tests: a strict well-formedness check on top of
// pugixml, attribute and element look-ups.
#include <pugixml.hpp>

#include <string>
#include <vector>

namespace xfb::test {

// The numbers of a comma- or space-separated list ("1,2 3.5").
std::vector<double> doubles(const std::string& list);

// `text` as a pugixml document (references decoded); throws std::runtime_error where it is not
// well-formed XML. pugixml, a fast non-validating parser, rejects unclosed and mismatched tags and
// malformed attributes itself; a first parse with references left as written adds what it lets
// through: content beside the root element, repeated attributes, '<' in attribute values and
// stray '&'.
pugi::xml_document parse_xml(const std::string& text);

// The value of `element`'s attribute `name`; throws where there is none (pugixml would give "").
std::string at(pugi::xml_node element, const char* name);

// Every element named `name` at or below `node` (document order, `node` included) and, when
// `css_class` is given, whose class attribute is exactly `css_class`.
std::vector<pugi::xml_node> find_all(pugi::xml_node node, const std::string& name, const std::string& css_class = "");

}  // namespace xfb::test
