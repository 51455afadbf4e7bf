#pragma once
// Small helpers for the SVG files the project writes itself (plots, the taxonomy diagram).
#include <cstddef>
#include <string>

namespace xfb::svg {

// Escapes &, <, >, " and ' for XML text and attribute values.
std::string escape(const std::string& text);
// A coordinate or length with two decimals, no trailing zeros: "12.5", "3".
std::string num(double value);
// The colour of a survey class ("fixed_patterns", …; "exact" for the baselines); grey if unknown.
std::string class_colour(const std::string& class_name);
// Series colours of a plot: a qualitative palette of kPaletteSize colours for a white background,
// ordered so that any first k are as far apart as the palette allows; index wraps around.
inline constexpr std::size_t kPaletteSize = 36;
std::string series_colour(std::size_t index);
// The marker of a survey class: an SVG path around the origin (radius about 5), one shape per class
// and filled, so one marker can be told from another by shape alone; a cross if unknown.
std::string class_marker(const std::string& class_name);
// A human class title: "fixed patterns (FP)".
std::string class_title(const std::string& class_name);
// The document header (XML declaration, <svg> with size and viewBox, a style block, white
// background); close with "</svg>\n".
std::string open_document(double width, double height, const std::string& title);

}  // namespace xfb::svg
