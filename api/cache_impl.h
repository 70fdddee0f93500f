#pragma once
// The state behind the public sluice::ModelCache (include/sluice/sluice.hpp): its options,
// the cache itself, and how its budget was resolved. api/sluice_api.cpp makes it;
// api/offload_api.cpp adopts offloaded models into it.
#include <memory>
#include <mutex>
#include <string>

#include "cache/model_cache.h"
#include "offload/vram_budget.h"
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
  std::string budget_source_now() const {
    std::lock_guard<std::mutex> g(mutex);
    return budget_source;
  }

 private:
  mutable std::mutex mutex;
  std::string budget_source;
};

}  // namespace sluice::detail
