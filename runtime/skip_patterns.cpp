#include "runtime/skip_patterns.h"

#include <algorithm>
#include <cctype>

#include "runtime/error.h"

namespace sluice {
namespace {

std::vector<std::string> split_dots(std::string_view s) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (true) {
    const size_t dot = s.find('.', start);
    parts.emplace_back(s.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
    if (dot == std::string_view::npos) break;
    start = dot + 1;
  }
  return parts;
}

bool is_plain_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
}

}  // namespace

const std::vector<std::string>& default_skip_patterns() {
  static const std::vector<std::string> patterns = {"pos_embed", "patch_embed", "\\w*norm\\w*", "^proj_in$",
                                                    "^proj_out$"};
  return patterns;
}

bool is_regex_pattern(std::string_view pattern) {
  return !std::all_of(pattern.begin(), pattern.end(), is_plain_char);
}

SkipList::SkipList(const std::vector<std::string>& patterns) {
  for (const auto& p : patterns) add(p);
}

void SkipList::add(const std::string& pattern) {
  if (pattern.empty()) throw InvalidArgument("skip pattern must not be empty");
  for (const auto& e : entries_) {
    if (e.pattern == pattern) return;
  }
  Entry entry;
  entry.pattern = pattern;
  if (is_regex_pattern(pattern)) {
    try {
      entry.regex.emplace(pattern, std::regex::ECMAScript | std::regex::optimize);
    } catch (const std::regex_error& e) {
      throw InvalidArgument("skip pattern '" + pattern + "' is not a valid regex: " + e.what());
    }
  } else {
    entry.components = split_dots(pattern);
    for (const auto& c : entry.components) {
      if (c.empty()) throw InvalidArgument("skip pattern '" + pattern + "' has an empty dotted component");
    }
  }
  entries_.push_back(std::move(entry));
}

SkipList SkipList::from_options(const Fp8Options& options, const std::vector<std::string>& model_patterns) {
  SkipList list;
  if (options.use_default_skips) {
    for (const auto& p : default_skip_patterns()) list.add(p);
  }
  if (options.use_model_skips) {
    for (const auto& p : model_patterns) list.add(p);
  }
  for (const auto& p : options.extra_skip_patterns) list.add(p);
  return list;
}

std::optional<std::string> SkipList::matches(std::string_view module_name) const {
  if (entries_.empty()) return std::nullopt;
  const std::vector<std::string> parts = split_dots(module_name);
  const std::string name(module_name);
  for (const auto& e : entries_) {
    if (e.regex) {
      if (std::regex_search(name, *e.regex)) return e.pattern;
      continue;
    }
    const size_t k = e.components.size();
    for (size_t i = 0; i + k <= parts.size(); ++i) {
      if (std::equal(e.components.begin(), e.components.end(), parts.begin() + static_cast<std::ptrdiff_t>(i))) {
        return e.pattern;
      }
    }
  }
  return std::nullopt;
}

std::vector<std::string> SkipList::patterns() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& e : entries_) out.push_back(e.pattern);
  return out;
}

}  // namespace sluice
