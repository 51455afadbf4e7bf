#pragma once
// Real numbers as every command-line value and model parameter takes them: a plain decimal
// ("0.05", "-3", "1e-4", "1E+3"), read whole. Hex ("0x10"), hex floats, spaces, a leading '+',
// inf and nan are refused. Subnormal magnitudes ("1e-320") are numbers and read to the nearest
// double (0 below the smallest subnormal); magnitudes above the largest double are refused.
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>

namespace xfb {

inline std::optional<double> parse_decimal(std::string_view text) {
  double value = 0;
  const char* end_of_text = text.data() + text.size();
  const auto [end, error] = std::from_chars(text.data(), end_of_text, value);
  if (text.empty() || end != end_of_text) return std::nullopt;
  if (error == std::errc::result_out_of_range) {
    // from_chars reports underflow like overflow and leaves value alone; the syntax is valid, so
    // strtod (the "C" locale: the program never sets one) gives the rounded magnitude.
    const std::string copy(text);
    value = std::strtod(copy.c_str(), nullptr);
  } else if (error != std::errc()) {
    return std::nullopt;
  }
  if (!std::isfinite(value)) return std::nullopt;
  return value;
}

}  // namespace xfb
