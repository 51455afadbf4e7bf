#pragma once
// What a sweep or ab runs: the models (--models, --exclude) and the sequence lengths (--seq-lens).
#include <cstdint>
#include <string>
#include <vector>

namespace xfb {

// The items of a comma list, each trimmed of spaces and tabs; empty items are kept (the callers
// refuse them with their option's name), and an empty text gives one empty item.
std::vector<std::string> comma_items(const std::string& text);

// --models: a comma list of terms, each trimmed of spaces:
//   all | implemented   every implemented model
//   class:<class>       the implemented models of a class, by name or letters (class:FP, class:kernels)
//   a glob (* ? [..])   the implemented models whose name matches, e.g. *former
//   a name              that registered model
// `exclude` (--exclude) takes the same terms and removes what they select. The result keeps the
// order of the terms, each term's models in registry order, without repeats. InputError for an
// empty term, an unknown name or class, a term that selects nothing, or an empty result.
std::vector<std::string> parse_model_selection(const std::string& text, const std::string& exclude = "");

inline constexpr std::int64_t kMaxSeqLens = 10'000;  // lengths one --seq-lens may give

// --seq-lens: `256,512,1K` or `256:16K:x2` (geometric) or `1000:4000:+1000` (arithmetic); every
// length and step is a token count (lib/core/token_count.hpp: 1K = 1024), spaces around items
// trimmed; at most kMaxSeqLens lengths (InputError beyond, before any is listed).
std::vector<std::int64_t> parse_seq_lens(const std::string& text);

}  // namespace xfb
