#pragma once
// The RAM tier of the model cache (Note [cache tiers] in cache/model_cache.h): models on the
// host, under one RAM limit. Reading a checkpoint (or generating a model) takes seconds and
// gigabytes, so a model is read once and kept, and the cache must know what one will take
// before reading it: this part holds where models come from (presets, .json configs,
// checkpoints) and their estimated bytes, the entries and their identity (a load with the
// same source and settings finds its entry, other settings replace it), the read itself,
// outside the cache mutex with its bytes reserved first and other threads waiting for it
// (Note [cache locking]), and eviction: unlocked models least recently used first, locked
// ones never. Its member functions run with the cache mutex held, except entry_for, which
// takes it.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "cache/cache_locking.h"
#include "cache/cache_state.h"
#include "cache/device_shares.h"
#include "cache/load_request.h"

namespace sluice::cache {

// InvokeAI's rule, max(4 GiB, 50% of L - 2 GiB), where L is the host memory limit (Note
// [host memory limit] in runtime/host_memory_limit.h: the smallest of physical RAM, the
// cgroup's limit and what MemAvailable allows), and never more than L itself: the 4 GiB
// floor is for small machines, not for containers limited below it. 4 GiB when L is unknown (0).
uint64_t default_ram_limit(uint64_t host_limit_bytes);
// The default for `host` and how it was derived, for logs and stats ("default min(L,
// max(4GiB, L / 2 - 2GiB)) of the host memory limit L = 3.0GiB from cgroup v2 memory.max (...)").
struct RamLimit {
  uint64_t bytes = 0;
  std::string source;
};
RamLimit default_ram_limit(const HostMemoryLimit& host);

// Host bytes the model of `request` will take once loaded (every parameter and buffer in
// its stored dtype), computed on a shape-only model; resolves the request's config first
// (LoadRequest::resolve_config: may read a file).
uint64_t estimate_model_bytes(LoadRequest& request);
// The same for a spec not resolved yet; `device` decides fp8 support.
uint64_t estimate_model_bytes(const LoadSpec& spec, at::Device device);

class RamTier {
 public:
  RamTier(CacheState& state, CacheLocking& locking, DeviceShares& shares)
      : s_(state), locking_(locking), shares_(shares) {}
  RamTier(const RamTier&) = delete;
  RamTier& operator=(const RamTier&) = delete;

  // The entry for spec's source and loading settings (not read yet when new). The spec is
  // resolved once here (LoadRequest) and kept on a new entry. An entry of the same source
  // with other settings is dropped (Note [cache tiers]). `created`: this
  // call made the entry and added it to the cache; false when it found one, also when
  // another thread added the same one while this call estimated it (that one is returned).
  // Takes the cache mutex, and releases it while it estimates a new model's bytes (that
  // reads a file header).
  std::shared_ptr<Entry> entry_for(const LoadSpec& spec, bool& created);
  // Reads `e` into RAM unless it is there (a miss; a hit is counted when `count_hit`),
  // releasing the cache mutex for the read; threads asking for it meanwhile wait. Throws
  // InvalidArgument for a dropped entry.
  void ensure_loaded(const std::shared_ptr<Entry>& e, Guard& g, bool count_hit);
  // Evicts unlocked models but `exclude`, least recently used first, until `bytes` more fit
  // under the RAM limit beside the reads in progress; warns once when only models in use
  // are left.
  void make_room(uint64_t bytes, const Entry* exclude);
  // Takes `e` (unlocked) off the device and out of RAM; a dropped entry leaves the cache.
  void evict(Entry& e);
  // Drops `e` now, or at its last unlock.
  void mark_dropped(const std::shared_ptr<Entry>& e);
  // A new entry for a model the host made (Note [adopted models] in cache/model_cache.h),
  // in RAM from now on, under the RAM limit (other models are evicted to make room for it;
  // it never is). InvalidArgument for a null module.
  std::shared_ptr<Entry> adopt(std::shared_ptr<torch::nn::Module> module, const std::string& name,
                               const DtypePair& dtypes, std::optional<double> max_resident);
  // `e` is the most recently used.
  void touch(Entry& e) { e.last_used = ++s_.tick; }

 private:
  CacheState& s_;
  CacheLocking& locking_;
  DeviceShares& shares_;
};

}  // namespace sluice::cache
