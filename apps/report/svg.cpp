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
  if (class_name == "sparse_models") return "#bcbd22";
  return "#999999";
}

std::string series_colour(std::size_t index) {
  // Picked greedily from OKLCH colours of lightness 0.4-0.7 at the gamut's chroma (hue in 6° steps):
  // each next colour is the one farthest (in OKLab) from those already taken, the distance being the
  // least of normal vision's and, weighted 3×, simulated protanopia's and deuteranopia's (Machado et
  // al., 2009). All 36 are ≥ 0.077 apart by that distance (≥ 0.079 for normal vision alone); the first 12 stay
  // ≥ 0.05 apart for either dichromacy. The last 8 came from tools/palette.py, which keeps the first 28.
  static const char* const palette[kPaletteSize] = {
      "#303030", "#f360b4", "#37bc40", "#217bf4", "#af2f00", "#902cab", "#007650", "#9d7c00", "#00b1cf",
      "#b17eff", "#83004e", "#004885", "#ef7a00", "#6b3900", "#5418a5", "#dc3860", "#4b4cd1", "#009390",
      "#006d8f", "#c444ac", "#9e56dc", "#005630", "#ff6170", "#b00d6b", "#00b998", "#0089c9", "#00515c",
      "#d96be3", "#7e00fb", "#e100f4", "#2500d1", "#685d00", "#96a000", "#f00092", "#009142", "#ec4200"};
  return palette[index % kPaletteSize];
}

std::string class_marker(const std::string& class_name) {
  ModelClass c;
  if (!parse_class(class_name, c))
    return "M2.4,-4.67L4.67,-2.4L2.26,0L4.67,2.4L2.4,4.67L0,2.26L-2.4,4.67L-4.67,2.4L-2.26,0L-4.67,-2.4L-2.4,-4.67L0,"
           "-2.26Z";
  switch (c) {
    case ModelClass::Exact:  // circle
      return "M-4.5,0a4.5,4.5 0 1,0 9,0a4.5,4.5 0 1,0 -9,0Z";
    case ModelClass::FixedPatterns:  // square
      return "M-4,-4h8v8h-8Z";
    case ModelClass::LearnablePatterns:  // triangle, apex up
      return "M0,-5L4.8,3.6H-4.8Z";
    case ModelClass::Memory:  // diamond
      return "M0,-5.5L5,0L0,5.5L-5,0Z";
    case ModelClass::LowRank:  // triangle, apex down
      return "M0,5L4.8,-3.6H-4.8Z";
    case ModelClass::Kernels:  // pentagon
      return "M0,-5.2L4.76,-1.61L2.94,4.21L-2.94,4.21L-4.76,-1.61Z";
    case ModelClass::Recurrence:  // plus
      return "M-1.6,-5h3.2v3.4h3.4v3.2h-3.4v3.4h-3.2v-3.4h-3.4v-3.2h3.4Z";
    case ModelClass::Downsampling:  // hexagon
      return "M5,0L2.5,4.33L-2.5,4.33L-5,0L-2.5,-4.33L2.5,-4.33Z";
    case ModelClass::Sparse:  // four-pointed star
      return "M0,-5.5L1.5,-1.5L5.5,0L1.5,1.5L0,5.5L-1.5,1.5L-5.5,0L-1.5,-1.5Z";
  }
  return "";
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
         ".subtitle{font-size:12px;fill:#555}.legend{font-size:12px}.note{font-size:11px;fill:#666}"
         ".coincide{font-size:11px;fill:#444}.coincide-tag{font-size:11px;font-weight:bold;stroke:white;stroke-width:"
         "3px;paint-order:stroke}</style>\n<rect "
         "width=\"100%\" height=\"100%\" "
         "fill=\"white\"/>\n";
}

}  // namespace xfb::svg
