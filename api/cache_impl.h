#pragma once
// The state behind the public sluice::ModelCache (include/sluice/sluice.hpp): its options,
// the cache itself, and how its budget was resolved. api/sluice_api.cpp makes it;
// api/offload_api.cpp adopts offloaded models into it.
#include <memory>
#include <string>

#include "cache/model_cache.h"
#include "offload/engine/vram_budget.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"
#include "sluice/sluice.hpp"

namespace sluice::detail {

class CacheImpl {
 public:
  RuntimeOptions options;
  std::shared_ptr<cache::ModelCache> cache;
  // One INFO line saying how a budget was resolved, where it needed resolving ("auto", a
  // percentage); the cache keeps the same words (CacheStats::vram_budget_source).
  static void log_budget(const offload::ResolvedVramBudget& r) {
    if (!r.how.empty()) log::info("vram budget " + format_bytes(r.bytes) + " (" + r.how + ")");
  }
  // A new budget for all models (RuntimeOptions::vram_budget forms; "auto" with
  // options.vram_headroom): ModelCache::set_vram_budget, and OffloadedModel's for its own cache.
  void set_vram_budget(const std::string& text) {
    const bool automatic = offload::is_auto_vram_budget(text);
    const offload::ResolvedVramBudget r =
        cache->parse_budget(text, automatic ? options.vram_headroom : std::string(), "vram_budget", "vram_headroom");
    cache->set_vram_budget(r.bytes, r.how);
    log_budget(r);
  }
};

}  // namespace sluice::detail
