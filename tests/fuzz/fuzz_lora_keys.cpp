// libFuzzer target: map_lora_key (models/lora_keys.h). Input: the key, then the model's
// module names, one per line. map_lora_key must never throw, and a match it calls
// `known` must name one of the modules. block_index / with_block_index on its module must
// not throw either, and a dotted block index rewritten to N reads back as N.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "models/lora_keys.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> lines;
  size_t start = 0;
  while (start <= text.size() && lines.size() < 64) {
    const size_t nl = text.find('\n', start);
    lines.push_back(text.substr(start, nl == std::string::npos ? std::string::npos : nl - start));
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  const std::string key = lines.empty() ? std::string() : lines.front();
  const std::vector<std::string> modules(lines.size() > 1 ? lines.begin() + 1 : lines.end(), lines.end());
  std::optional<sluice::LoraKeyMatch> m;
  try {
    m = sluice::map_lora_key(key, modules);
  } catch (...) {
    std::abort();  // documented never to throw
  }
  if (!m) return 0;
  if (m->known && std::find(modules.begin(), modules.end(), m->module) == modules.end()) std::abort();
  // A recognised key has a LoRA suffix, and the module (cut from its stem, or a module name
  // that the stem flattens or strips to) is always shorter than the key.
  if (m->module.size() >= key.size()) std::abort();
  try {
    if (const auto b = sluice::block_index(m->module)) {
      if (*b < 0) std::abort();
      const std::string moved = sluice::with_block_index(m->module, *b + 1);
      if (m->module.rfind("blocks.", 0) == 0 && sluice::block_index(moved) != *b + 1) std::abort();
    }
  } catch (...) {
    std::abort();
  }
  return 0;
}
