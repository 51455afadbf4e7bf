#include "apps/report/svg.hpp"

#include <cmath>
#include <cstdio>

#include "taxonomy/cards.hpp"

namespace xfb::svg {

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string num(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", std::fabs(value) < 5e-3 ? 0.0 : value);
  std::string s = text;
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

std::string class_colour(const std::string& class_name) {
  if (class_name == "exact") return "#404040";
  if (class_name == "fixed_patterns") return "#1f77b4";
  if (class_name == "learnable_patterns") return "#2ca02c";
  if (class_name == "memory") return "#9467bd";
  if (class_name == "low_rank") return "#ff7f0e";
  if (class_name == "kernels") return "#d62728";
  if (class_name == "recurrence") return "#8c564b";
  if (class_name == "downsampling") return "#17becf";
  return "#999999";
}

std::string class_title(const std::string& class_name) {
  ModelClass c;
  if (!parse_class(class_name, c)) return class_name;
  std::string title = class_name;
  for (auto& ch : title)
    if (ch == '_') ch = ' ';
  if (c == ModelClass::Exact) return "exact baselines";
  return title + " (" + class_letter(c) + ")";
}

std::string open_document(double width, double height, const std::string& title) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + num(width) +
         "\" height=\"" + num(height) + "\" viewBox=\"0 0 " + num(width) + " " + num(height) + "\">\n<title>" +
         escape(title) +
         "</title>\n<style>text{font-family:'DejaVu Sans',Helvetica,Arial,sans-serif;fill:#222}"
         ".tick{font-size:12px}.axis-title{font-size:13px}.title{font-size:15px;font-weight:bold}"
         ".legend{font-size:12px}.note{font-size:11px;fill:#666}</style>\n<rect width=\"100%\" height=\"100%\" "
         "fill=\"white\"/>\n";
}

}  // namespace xfb::svg
