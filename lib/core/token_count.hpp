#pragma once
// Token counts as users write them: digits with an optional binary suffix, K (×1024) or M (×1024²),
// either case — "16384", "16K", "16k" and "1M" are lengths; the tables print 16K for 16384.
#include <charconv>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace xfb {

// The count `text` spells, or nullopt when it is not digits plus at most one suffix, or the value
// exceeds int64. Sign, spaces and fractions ("1.5K") are refused.
inline std::optional<std::int64_t> parse_token_count(std::string_view text) {
  std::int64_t scale = 1;
  if (!text.empty()) {
    const char last = text.back();
    if (last == 'K' || last == 'k') scale = 1024;
    if (last == 'M' || last == 'm') scale = 1024 * 1024;
    if (scale > 1) text.remove_suffix(1);
  }
  if (text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  if (value > std::numeric_limits<std::int64_t>::max() / scale) return std::nullopt;
  return value * scale;
}

}  // namespace xfb
