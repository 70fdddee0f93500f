#include "models/lora_keys.h"

#include <algorithm>
#include <string>
#include <utility>

namespace sluice {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

// Prefixes exporters put in front of the model's own module path.
const std::vector<std::string>& dotted_prefixes() {
  static const std::vector<std::string> p = {"model.diffusion_model.", "diffusion_model.", "transformer.", "net.",
                                             "base_model.model.", "model."};
  return p;
}
// kohya's flattened forms: prefix + module path with '.' replaced by '_'.
const std::vector<std::string>& flat_prefixes() {
  static const std::vector<std::string> p = {"lora_unet_", "lora_transformer_"};
  return p;
}

bool contains(const std::vector<std::string>& names, const std::string& n) {
  return std::find(names.begin(), names.end(), n) != names.end();
}

// Splits "<stem>.<lora suffix>" into part and stem; false when there is no LoRA suffix.
bool split_suffix(const std::string& key, LoraPart& part, std::string& stem) {
  if (ends_with(key, ".alpha")) {
    part = LoraPart::alpha;
    stem = key.substr(0, key.size() - 6);
    return true;
  }
  if (!ends_with(key, ".weight")) return false;
  const std::string s = key.substr(0, key.size() - 7);
  const std::pair<const char*, LoraPart> tails[] = {
      {".lora_down", LoraPart::down}, {".lora_up", LoraPart::up}, {".lora_A", LoraPart::down}, {".lora_B", LoraPart::up}};
  for (const auto& [tail, p] : tails) {
    if (ends_with(s, tail)) {
      part = p;
      stem = s.substr(0, s.size() - std::char_traits<char>::length(tail));
      return true;
    }
  }
  // PEFT with an adapter name: <m>.lora_A.<adapter>.weight.
  const size_t dot = s.rfind('.');
  if (dot == std::string::npos) return false;
  const std::string head = s.substr(0, dot);
  for (const auto& [tail, p] : {std::pair<const char*, LoraPart>{".lora_A", LoraPart::down}, {".lora_B", LoraPart::up}}) {
    if (ends_with(head, tail)) {
      part = p;
      stem = head.substr(0, head.size() - std::char_traits<char>::length(tail));
      return true;
    }
  }
  return false;
}

std::string flatten(const std::string& s) {
  std::string f = s;
  std::replace(f.begin(), f.end(), '.', '_');
  return f;
}

}  // namespace

std::optional<LoraKeyMatch> map_lora_key(const std::string& key, const std::vector<std::string>& module_names) {
  LoraKeyMatch m;
  std::string stem;
  if (!split_suffix(key, m.part, stem)) return std::nullopt;

  // kohya's flattened names.
  for (const auto& fp : flat_prefixes()) {
    if (!starts_with(stem, fp)) continue;
    const std::string flat = stem.substr(fp.size());
    const std::string* found = nullptr;
    int hits = 0;
    for (const auto& n : module_names) {
      if (flatten(n) == flat) {
        found = &n;
        ++hits;
      }
    }
    m.known = hits == 1;
    m.module = hits == 1 ? *found : flat;
    return m;
  }

  // Dotted names: the stem itself, then with known prefixes stripped one at a time.
  std::string s = stem;
  while (true) {
    if (contains(module_names, s)) {
      m.module = s;
      m.known = true;
      return m;
    }
    bool stripped = false;
    for (const auto& p : dotted_prefixes()) {
      if (starts_with(s, p) && s.size() > p.size()) {
        s = s.substr(p.size());
        stripped = true;
        break;
      }
    }
    if (!stripped) break;
  }
  m.module = s;
  m.known = false;
  return m;
}

namespace {

// The digits after `prefix` up to `sep`: their value and where the rest starts, or nullopt.
std::optional<std::pair<int64_t, size_t>> parse_block(const std::string& s, const std::string& prefix, char sep) {
  if (!starts_with(s, prefix)) return std::nullopt;
  size_t i = prefix.size();
  int64_t n = 0;
  const size_t first = i;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    if (i - first >= 9) return std::nullopt;  // no model has a billion blocks; keeps n from overflowing
    n = n * 10 + (s[i] - '0');
    ++i;
  }
  if (i == first || i >= s.size() || s[i] != sep) return std::nullopt;
  return std::make_pair(n, i);
}

}  // namespace

std::optional<int64_t> block_index(const std::string& module) {
  if (auto b = parse_block(module, "blocks.", '.')) return b->first;
  if (auto b = parse_block(module, "blocks_", '_')) return b->first;
  return std::nullopt;
}

std::string with_block_index(const std::string& module, int64_t block) {
  const auto b = parse_block(module, "blocks.", '.');
  if (!b) return module;
  return "blocks." + std::to_string(block) + module.substr(b->second);
}

}  // namespace sluice
