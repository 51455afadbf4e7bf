#include "tests/xml_lite.hpp"

#include <cctype>
#include <stdexcept>

namespace xfb::test {

const std::string& XmlElement::at(const std::string& attribute) const {
  auto found = attributes.find(attribute);
  if (found == attributes.end()) throw std::runtime_error("<" + name + "> has no attribute " + attribute);
  return found->second;
}

std::vector<const XmlElement*> XmlElement::find_all(const std::string& element_name, const std::string& css_class) const {
  std::vector<const XmlElement*> found;
  if (name == element_name && (css_class.empty() || (has("class") && at("class") == css_class))) found.push_back(this);
  for (const auto& child : children) {
    auto below = child->find_all(element_name, css_class);
    found.insert(found.end(), below.begin(), below.end());
  }
  return found;
}

namespace {

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  std::unique_ptr<XmlElement> document() {
    skip_space();
    if (s_.compare(i_, 5, "<?xml") == 0) {
      const auto end = s_.find("?>", i_);
      if (end == std::string::npos) fail("unterminated XML declaration");
      i_ = end + 2;
    }
    skip_misc();
    auto root = element();
    skip_misc();
    if (i_ != s_.size()) fail("content after the root element");
    return root;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("XML error at offset " + std::to_string(i_) + ": " + what);
  }
  void skip_space() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  void skip_misc() {
    for (;;) {
      skip_space();
      if (s_.compare(i_, 4, "<!--") != 0) return;
      const auto end = s_.find("-->", i_);
      if (end == std::string::npos) fail("unterminated comment");
      i_ = end + 3;
    }
  }
  std::string name() {
    const auto start = i_;
    while (i_ < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[i_])) || s_[i_] == '-' || s_[i_] == '_' ||
                              s_[i_] == ':' || s_[i_] == '.'))
      ++i_;
    if (i_ == start) fail("expected a name");
    return s_.substr(start, i_ - start);
  }
  std::string decode(const std::string& raw) {
    std::string out;
    for (std::size_t k = 0; k < raw.size(); ++k) {
      if (raw[k] == '<') fail("'<' in character data");
      if (raw[k] != '&') {
        out += raw[k];
        continue;
      }
      const auto end = raw.find(';', k);
      if (end == std::string::npos) fail("unterminated entity");
      const std::string entity = raw.substr(k + 1, end - k - 1);
      if (entity == "amp") out += '&';
      else if (entity == "lt") out += '<';
      else if (entity == "gt") out += '>';
      else if (entity == "quot") out += '"';
      else if (entity == "apos") out += '\'';
      else if (!entity.empty() && entity[0] == '#') {
        const unsigned long code = entity.size() > 1 && entity[1] == 'x' ? std::stoul(entity.substr(2), nullptr, 16)
                                                                          : std::stoul(entity.substr(1));
        if (code > 0x7f) fail("non-ASCII character reference (not needed by the tests)");
        out += static_cast<char>(code);
      } else
        fail("unknown entity &" + entity + ";");
      k = end;
    }
    return out;
  }
  std::unique_ptr<XmlElement> element() {
    if (i_ >= s_.size() || s_[i_] != '<') fail("expected '<'");
    ++i_;
    auto e = std::make_unique<XmlElement>();
    e->name = name();
    for (;;) {
      skip_space();
      if (i_ >= s_.size()) fail("unterminated tag <" + e->name);
      if (s_.compare(i_, 2, "/>") == 0) {
        i_ += 2;
        return e;
      }
      if (s_[i_] == '>') {
        ++i_;
        break;
      }
      const std::string key = name();
      skip_space();
      if (i_ >= s_.size() || s_[i_] != '=') fail("attribute " + key + " without '='");
      ++i_;
      skip_space();
      if (i_ >= s_.size() || (s_[i_] != '"' && s_[i_] != '\'')) fail("unquoted attribute " + key);
      const char quote = s_[i_++];
      const auto end = s_.find(quote, i_);
      if (end == std::string::npos) fail("unterminated attribute " + key);
      if (e->attributes.count(key)) fail("duplicate attribute " + key);
      e->attributes[key] = decode(s_.substr(i_, end - i_));
      i_ = end + 1;
    }
    for (;;) {
      const auto next = s_.find('<', i_);
      if (next == std::string::npos) fail("unclosed <" + e->name + ">");
      e->text += decode(s_.substr(i_, next - i_));
      i_ = next;
      if (s_.compare(i_, 4, "<!--") == 0) {
        skip_misc();
        continue;
      }
      if (s_.compare(i_, 2, "</") == 0) {
        i_ += 2;
        const std::string closing = name();
        if (closing != e->name) fail("</" + closing + "> closes <" + e->name + ">");
        skip_space();
        if (i_ >= s_.size() || s_[i_] != '>') fail("malformed closing tag");
        ++i_;
        return e;
      }
      e->children.push_back(element());
    }
  }

  const std::string& s_;
  std::size_t i_ = 0;
};

}  // namespace

std::unique_ptr<XmlElement> parse_xml(const std::string& document) { return Parser(document).document(); }

}  // namespace xfb::test
