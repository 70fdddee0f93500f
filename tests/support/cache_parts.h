#pragma once
// The model cache's parts (cache/model_cache.h names them) without ModelCache around them,
// for the tests of one part: the state, the locking, the device shares and the RAM tier,
// wired as ModelCache wires them, on the test device (tests/support/device_env.h). A test
// drives the part it is about directly, holding the cache mutex where the part expects it
// held.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "cache/cache_locking.h"
#include "cache/cache_state.h"
#include "cache/device_shares.h"
#include "cache/ram_tier.h"
#include "offload/device/pinned_arena.h"
#include "tests/support/device_env.h"

namespace sluice::testing {

struct CacheParts {
  cache::CacheState state;
  cache::CacheLocking locking{state};
  cache::DeviceShares shares{state, locking};
  cache::RamTier ram{state, locking, shares};

  // `o.device` null: the test device. The RAM limit is o.ram_limit (none: unlimited), the
  // budget o.vram_budget.
  explicit CacheParts(cache::CacheOptions o) : state(std::move(o)) {
    state.device = state.options.device ? state.options.device : test_device_or_cpu();
    state.ram_limit = state.options.ram_limit.value_or(0);
    state.pin_arena = std::make_shared<offload::PinnedArena>(offload::default_pin_memory_limit());
    shares.set_budget(state.options.vram_budget, /*measured=*/false);
  }
  ~CacheParts() {
    for (auto& e : state.entries) {
      if (e->engine && e->attached) e->engine->detach();
    }
  }

  // The entry of `spec`, read into RAM (not on the device).
  std::shared_ptr<cache::Entry> loaded(const cache::LoadSpec& spec) {
    bool created = false;
    auto e = ram.entry_for(spec, created);
    cache::Guard g(locking.mutex());
    ram.ensure_loaded(e, g, /*count_hit=*/false);
    return e;
  }

  // The entry of `spec`, read and put on the device with the share it wants.
  std::shared_ptr<cache::Entry> attached(const cache::LoadSpec& spec) {
    auto e = loaded(spec);
    cache::Guard g(locking.mutex());
    shares.ensure_device(*e, g, /*required=*/true);
    return e;
  }
};

// A budget roomy for a few tiny models: 512 MiB, 1 MiB of it working memory.
inline cache::CacheOptions roomy_cache_options(std::optional<uint64_t> ram_limit = std::nullopt) {
  cache::CacheOptions o;
  o.vram_budget = uint64_t{512} << 20;
  o.working_memory = uint64_t{1} << 20;
  o.ram_limit = ram_limit;
  return o;
}

inline cache::LoadSpec cache_spec(const std::string& preset = "anima-tiny", uint64_t seed = 1) {
  cache::LoadSpec s;
  s.source = preset;
  s.seed = seed;
  s.storage.storage = at::kFloat8_e4m3fn;
  s.storage.compute = at::kBFloat16;
  return s;
}

}  // namespace sluice::testing
