#include "apps/bench/selection.hpp"

#include <fnmatch.h>

#include <algorithm>
#include <sstream>

#include "lib/core/errors.hpp"
#include "lib/core/token_count.hpp"
#include "taxonomy/registry.hpp"

namespace xfb {
namespace {

std::string trimmed(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

bool is_glob(const std::string& term) { return term.find_first_of("*?[") != std::string::npos; }

// The registry names one term selects (see parse_model_selection); `option` names the flag.
std::vector<std::string> select_term(const std::string& term, const std::string& option) {
  std::vector<std::string> names;
  if (term.empty()) throw InputError(option + " has an empty entry");
  if (term == "all" || term == "implemented") {
    for (const auto& model : registry())
      if (model.implemented()) names.push_back(model.name);
  } else if (term.rfind("class:", 0) == 0) {
    ModelClass wanted;
    const std::string name = trimmed(term.substr(6));
    if (!parse_class(name, wanted)) throw InputError("unknown class '" + name + "' in " + option);
    for (const auto& model : registry())
      if (model.implemented() && model.has_class(wanted)) names.push_back(model.name);
  } else if (is_glob(term)) {
    for (const auto& model : registry())
      if (model.implemented() && fnmatch(term.c_str(), model.name.c_str(), 0) == 0) names.push_back(model.name);
  } else {
    if (find_model(term) == nullptr) throw InputError("unknown model '" + term + "' in " + option);
    names.push_back(term);
  }
  if (names.empty()) throw InputError(option + " '" + term + "' selects no implemented model");
  return names;
}

std::vector<std::string> select_terms(const std::string& text, const std::string& option) {
  std::vector<std::string> names;
  for (const auto& term : comma_items(text))
    for (auto& name : select_term(term, option))
      if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(std::move(name));
  return names;
}

std::int64_t parse_length(const std::string& text, const std::string& what) {
  const auto value = parse_token_count(text);
  if (!value) throw InputError(what + ": '" + text + "' is not a token count (digits, or with K or M: 4096, 4K)");
  if (*value <= 0) throw InputError(what + ": " + text + " must be positive");
  return *value;
}

}  // namespace

std::vector<std::string> comma_items(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string part;
  while (std::getline(in, part, ',')) parts.push_back(trimmed(part));
  if (parts.empty() || text.back() == ',') parts.emplace_back();
  return parts;
}

std::vector<std::string> parse_model_selection(const std::string& text, const std::string& exclude) {
  std::vector<std::string> names = select_terms(text, "--models");
  if (!trimmed(exclude).empty()) {
    const auto excluded = select_terms(exclude, "--exclude");
    std::erase_if(names, [&](const std::string& name) {
      return std::find(excluded.begin(), excluded.end(), name) != excluded.end();
    });
    if (names.empty()) throw InputError("--exclude removes every model --models selects");
  }
  return names;
}

std::vector<std::int64_t> parse_seq_lens(const std::string& text) {
  std::vector<std::int64_t> lens;
  std::vector<std::string> range;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ':');) range.push_back(trimmed(part));
  if (range.size() == 3) {
    const std::int64_t lo = parse_length(range[0], "--seq-lens"), hi = parse_length(range[1], "--seq-lens");
    const std::string& step = range[2];
    if (step.size() < 2 || (step[0] != 'x' && step[0] != '+'))
      throw InputError("--seq-lens step must be xK (geometric) or +K (arithmetic), got '" + step + "'");
    const std::int64_t k = parse_length(step.substr(1), "--seq-lens step");
    if (step[0] == 'x' && k < 2) throw InputError("--seq-lens geometric step must be at least x2");
    if (lo > hi) throw InputError("--seq-lens range is empty");
    const bool geometric = step[0] == 'x';
    if (!geometric && (hi - lo) / k >= kMaxSeqLens)
      throw InputError("--seq-lens " + text + " has more than " + std::to_string(kMaxSeqLens) + " lengths");
    for (std::int64_t n = lo;; n = geometric ? n * k : n + k) {
      lens.push_back(n);
      if (geometric ? n > hi / k : n > hi - k) break;  // the next length would pass hi (and never overflows)
    }
    return lens;
  }
  if (range.size() != 1) throw InputError("--seq-lens expects a,b,c or lo:hi:xK, got '" + text + "'");
  const auto items = comma_items(text);
  if (static_cast<std::int64_t>(items.size()) > kMaxSeqLens)
    throw InputError("--seq-lens has more than " + std::to_string(kMaxSeqLens) + " lengths");
  for (const auto& item : items) {
    if (item.empty()) throw InputError("--seq-lens has an empty entry");
    lens.push_back(parse_length(item, "--seq-lens"));
  }
  return lens;
}

}  // namespace xfb
