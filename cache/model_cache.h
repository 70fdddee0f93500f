#pragma once
// ModelCache: several models in RAM (storage dtype, fp8 by default) under a RAM limit, and
// on one device under one budget that all of them share. The public API
// (include/sluice/sluice.hpp, api/) is a thin layer over this class, and this class ties
// the parts that hold the cache's concepts, each over one shared CacheState and the one
// cache mutex:
//   cache/cache_state.h    the options, the entries and the cache-wide fields (data only)
//   cache/cache_locking.h  the cache mutex, the waits of its protocol, the entries'
//                          published snapshots, Lock (Note [cache locking])
//   cache/ram_tier.h       where models come from, their estimates and reads, the entries
//                          under the RAM limit and their eviction
//   cache/device_shares.h  the vram budget, the working memory and each model's share of
//                          the rest (Note [working memory default])
//   cache/sidecar_share.h  the share LoRA sidecars take (Note [sidecar share])
//   cache/cache_queries.h  stats, stats JSON, entry state, trace, timeline (Note [stats parts])
// ModelCache owns them and makes its operations (load, lock, drop, the residency changes,
// run, patch) out of their steps; the code outside cache/ includes this header. Comments
// elsewhere that place one of those Notes "in cache/model_cache.h" mean the part named
// above, where it moved when the cache was split.
//
// Note [cache tiers]
// ~~~~~~~~~~~~~~~~~~
// RAM tier: a model is read (or generated) once and kept on the host. When the RAM limit
// would be passed, unlocked models are evicted least-recently-used first; a model whose
// handle is locked again afterwards is read again (a miss). A model being read counts with
// its estimated bytes from before the read starts. Locked models are never evicted: when
// only they (and models being read) are left, the limit is exceeded with one warning.
// Device tier: each model in RAM that is attached to the device owns a StreamingEngine
// whose budget is the model's *share*. The cache keeps
//     sum of shares <= vram budget - working memory
// and each engine keeps its own device bytes within its share (its ledger refuses any
// allocation beyond), so the device total never passes the budget minus working memory.
// The backend's ledger is also given that total as a hard limit, as a backstop. A model
// being locked (or loaded) gets its wanted share (everything resident, or what
// max_resident allows, or the target the user set with partial_load/unload): first from
// the free part of the budget, then by partially unloading other unlocked models, least
// recently used first and only as much as needed, and only then by taking whole unlocked
// models off the device (their RAM copy stays). Models in use are never unloaded by the
// cache. Weights never move device->host: unloading only drops device copies.
//
// Note [adopted models]
// ~~~~~~~~~~~~~~~~~~~~~
// Besides the Anima models it reads, the cache holds models a host made and hands to it
// with adopt(): a torch module offloaded in place (Python's sluice.offload, whose layers
// are an offload::ForeignModel, Note [foreign layers]). Such an entry shares the device
// budget with every other model as any entry does (its share, its residency changes, its
// stats, trace and timeline), and it counts under the RAM limit, but the cache cannot read
// it again: it is in RAM from adopt() until it is dropped, never evicted (other models
// are evicted to make room for it), and reading it is never a hit or a miss. Its forwards
// are the host's own code, which calls the model's layers one by one: the host locks the
// entry, brackets the forward with begin_run() and end_run() (the engine is the forward's
// alone in between, as inside run()), and calls the engine's begin_forward/end_forward
// itself. run() and patch(), which hand over an Anima model, refuse an adopted entry.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/cache_locking.h"
#include "cache/cache_queries.h"
#include "cache/cache_state.h"
#include "cache/device_shares.h"
#include "cache/ram_tier.h"
#include "cache/sidecar_share.h"
#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "offload/device/device.h"
#include "offload/engine/engine.h"
#include "offload/report/stats.h"
#include "offload/engine/vram_budget.h"
#include "runtime/dtype_policy.h"

namespace sluice {
class LoraScope;
}

namespace sluice::cache {

class ModelCache : public std::enable_shared_from_this<ModelCache> {
 public:
  // Use create(): locks keep the cache alive through shared_from_this().
  static std::shared_ptr<ModelCache> create(CacheOptions options);
  ~ModelCache();
  ModelCache(const ModelCache&) = delete;
  ModelCache& operator=(const ModelCache&) = delete;

  // The entry for spec's source; loads it (a miss) unless it is in RAM with the same
  // settings (a hit). Other settings replace the cached model (Note [cache tiers]). The
  // model is put on the device as for a lock when the budget allows; ResourceError names
  // the minimum budget when the model cannot run under it at all.
  std::shared_ptr<Entry> load(const LoadSpec& spec);
  // A new entry for `module`, a model the host made (Note [adopted models]); put on the
  // device as load() does. ResourceError names the minimum budget when it cannot run under
  // the budget at all (nothing is kept then).
  std::shared_ptr<Entry> adopt(std::shared_ptr<torch::nn::Module> module, const std::string& name,
                               const DtypePair& dtypes, std::optional<double> max_resident);
  // Locks `entry` (see Lock). Reloads it when evicted. Throws InvalidArgument after drop(),
  // ResourceError when locked models hold the budget it needs.
  Lock lock(const std::shared_ptr<Entry>& entry);
  // Drops now, or at the last unlock.
  void drop(const std::shared_ptr<Entry>& entry);

  // Residency of one model (Model API). Each returns the change in device bytes.
  int64_t partial_load(const std::shared_ptr<Entry>& entry, uint64_t bytes);
  int64_t partial_unload(const std::shared_ptr<Entry>& entry, uint64_t bytes);
  int64_t full_load(const std::shared_ptr<Entry>& entry);
  int64_t full_unload(const std::shared_ptr<Entry>& entry);
  void set_max_resident(const std::shared_ptr<Entry>& entry, std::optional<double> fraction);
  // Runs fn(model, placer) on the entry `lock` locks as a residency change (Note [cache
  // locking]: its running forward is waited for and its new ones wait, the cache mutex is
  // held). `placer` places sidecars (a LoraScope given it) as Note [sidecar share] says, and
  // gives their room back when they are released; release them inside patch() too (a
  // release elsewhere takes the cache mutex and waits for the model's forward itself).
  void patch(const Lock& lock, const std::function<void(anima::AnimaModelImpl&, offload::SidecarPlacer&)>& fn);

  // New budget in bytes (0: all device memory), and how it was resolved (parse_budget's
  // `how`: CacheStats::vram_budget_source). See ModelCache::set_vram_budget in the public
  // header for the rules.
  void set_vram_budget(uint64_t budget, const std::string& source = {});
  // Resolves a budget string ("6GiB", "50%", "auto", "" = 0: all) on this device now, with
  // `headroom` for "auto" (offload/engine/vram_budget.h, Note [vram budget]).
  offload::ResolvedVramBudget parse_budget(const std::string& text, const std::string& headroom,
                                           const std::string& flag, const std::string& headroom_flag) const;

  // Runs fn(model, engine) as the only user of the entry's engine (waiting for another
  // forward of the same model), then publishes the entry's stats; `lock` must lock the entry.
  void run(const Lock& lock, const std::function<void(anima::AnimaModelImpl&, offload::StreamingEngine&)>& fn);
  // run() in two halves, for a forward that the host drives call by call (Note [adopted
  // models]): begin_run() waits until the engine is the caller's alone and returns it;
  // end_run() publishes the entry's stats, frees the engine for others and, unless
  // `aborted`, grows the working memory to what the forward measured. Every begin_run()
  // needs its end_run(), on the same lock.
  offload::StreamingEngine& begin_run(const Lock& lock);
  void end_run(const Lock& lock, bool aborted);

  CacheStats stats() const;
  // The counters as JSON, with models_held (every model the cache holds) and the named
  // remainders that make each device total the sum of its parts (Note [stats parts] in
  // cache/cache_queries.h).
  std::string stats_json(int indent = 2) const;
  // Every model the cache holds (loaded at least once, not yet dropped from it; a dropped
  // model stays until its last lock ends), in creation order.
  std::vector<std::shared_ptr<Entry>> entries() const;
  // The engine's stats of `entry` as last published (Note [cache locking]); a default
  // record naming the model when it never ran.
  offload::EngineStats engine_stats(const std::shared_ptr<Entry>& entry) const;
  // EngineStats::to_json of the entry, with budget.{budget_bytes,working_memory_bytes}
  // set to the cache's, budget.share_bytes, and a "cache" object (CacheStats).
  std::string model_stats_json(const std::shared_ptr<Entry>& entry, int indent = 2) const;
  void write_trace(const std::shared_ptr<Entry>& entry, const std::string& path) const;
  // The SVG timeline of one steady-state forward of `entry` (Note [timeline svg] in
  // offload/report/timeline_svg.h), from the published trace and stats: InvalidArgument when
  // tracing is off or no complete DiT forward was traced, FileError naming `path`.
  void write_timeline_svg(const std::shared_ptr<Entry>& entry, const std::string& path) const;
  // Snapshot of an entry's state; the engine-side fields as last published.
  using EntryState = cache::EntryState;
  EntryState entry_state(const std::shared_ptr<Entry>& entry) const;
  // The config of a model that has been loaded once.
  anima::AnimaConfig entry_config(const std::shared_ptr<Entry>& entry) const;

  offload::DeviceBackend& device() const { return *state_.device; }
  uint64_t vram_budget() const;
  uint64_t working_memory() const;
  const CacheOptions& options() const { return state_.options; }

 private:
  explicit ModelCache(CacheOptions options);
  friend class Lock;

  void unlock(Entry& e);
  // Runs op on a pinned entry (locks + 1, loaded first) with the cache mutex held, then
  // unpins; returns the change in the entry's device bytes. `count_hit`: a hit is counted.
  int64_t with_pinned(const std::shared_ptr<Entry>& e, bool count_hit, const std::function<void(Entry&, Guard&)>& op);

  CacheState state_;
  CacheLocking locking_{state_};
  DeviceShares shares_{state_, locking_};
  RamTier ram_{state_, locking_, shares_};
  SidecarShare sidecars_{state_, locking_, shares_};
  CacheQueries queries_{state_, locking_, shares_};
};

}  // namespace sluice::cache
