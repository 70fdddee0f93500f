#pragma once
// The state behind the public sluice::ModelCache (include/sluice/sluice.hpp): its options,
// the cache itself, and how its budget was resolved. api/sluice_api.cpp makes it;
// api/offload_api.cpp adopts offloaded models into it.
#include <memory>
#include <mutex>
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
  // How the budget in force was resolved (CacheStats::vram_budget_source).
  void set_budget_source(const offload::ResolvedVramBudget& r) {
    if (!r.how.empty()) log::info("vram budget " + format_bytes(r.bytes) + " (" + r.how + ")");
    std::lock_guard<std::mutex> g(mutex);
    budget_source = r.how;
  }
  // A new budget for all models (RuntimeOptions::vram_budget forms; "auto" with
  // options.vram_headroom): ModelCache::set_vram_budget, and OffloadedModel's for its own cache.
  void set_vram_budget(const std::string& text) {
    const bool automatic = offload::is_auto_vram_budget(text);
    const offload::ResolvedVramBudget r =
        cache->parse_budget(text, automatic ? options.vram_headroom : std::string(), "vram_budget", "vram_headroom");
    cache->set_vram_budget(r.bytes);
    set_budget_source(r);
  }
  std::string budget_source_now() const {
    std::lock_guard<std::mutex> g(mutex);
    return budget_source;
  }

 private:
  mutable std::mutex mutex;
  std::string budget_source;
};

}  // namespace sluice::detail
