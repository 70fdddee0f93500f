#pragma once
// The state the parts of the model cache share: the options it was made with, one Entry
// per model it holds, and the cache-wide fields (the RAM accounting, the device budget and
// working memory, the counters). It is data only. The parts are classes over it, each
// changing the fields of its concept: the RAM tier (cache/ram_tier.h), the device budget
// and shares (cache/device_shares.h), the sidecars' share (cache/sidecar_share.h), the
// queries (cache/cache_queries.h); cache/model_cache.h ties them. Everything below that is
// not fixed at creation is guarded by the one cache mutex, which cache/cache_locking.h
// holds together with the waits of its protocol (Note [cache locking]).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <torch/nn/module.h>

#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "offload/device/device.h"
#include "offload/engine/engine.h"
#include "offload/device/pinned_arena.h"
#include "offload/report/stats.h"
#include "runtime/dtype_policy.h"
#include "runtime/host_memory_limit.h"
#include "cache/load_request.h"

namespace sluice::cache {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

struct CacheOptions {
  std::shared_ptr<offload::DeviceBackend> device;  // the device; null: a CPU device
  uint64_t vram_budget = 0;                        // device bytes for all models, working memory included; 0: all device memory
  std::string vram_budget_source;                  // how it was resolved ("auto: free ... = ..."); empty for a size or all memory
  std::optional<uint64_t> working_memory;          // kept free for activations; none: default_working_memory(budget, resolution)
  int64_t resolution = 1024;                       // image side the default working memory is sized for
  std::optional<uint64_t> ram_limit;               // host bytes for models; 0: unlimited; none: default_ram_limit()
                                                   // (of the host memory limit, Note [host memory limit])
  uint32_t prefetch = offload::kPrefetchAuto;      // most streamed layers copied ahead (auto: the ring's bytes decide)
  offload::PinMode pin = offload::PinMode::auto_;  // pinned host copies of streamed layers
  std::optional<uint64_t> pin_memory_limit;        // page-locked host bytes of all models together;
                                                   // none: offload::default_pin_memory_limit() (Note [pinned arena])
  offload::ResidencyPolicy policy = offload::ResidencyPolicy::balanced;  // residency plan policy
  bool timing = true;                              // per-forward device timings
  bool trace = false;                              // per-layer trace spans
  int load_threads = 0;                            // checkpoint read workers (runtime/fused_read.h); 0: every core
  // Called outside the cache mutex as a model's read (or generation) starts, with its name;
  // an exception from it fails the read. Tests use it to hold reads so that misses overlap.
  std::function<void(const std::string&)> before_read;
  // Called outside the cache mutex when a load found no entry for its model and is about
  // to add one (RamTier::entry_for), with the model's name; another load of the same model
  // may add it first. Tests use it to make two loads of one model race.
  std::function<void(const std::string&)> before_insert;
};

// One cached model. Fields are guarded by the cache mutex unless noted; see Note [cache
// locking].
struct Entry {
  // Fixed at creation.
  bool is_adopted = false;    // made by ModelCache::adopt (Note [adopted models]), not read from a source
  uint64_t id = 0;            // unique in its cache (1, 2, ... in creation order): two entries may share a key
  std::string name;
  // The load it was made by, resolved once (cache/load_request.h): the spec, its source
  // kind, dtypes for the device, skip list, key (identity: source, + seed for generated
  // models), loading settings (a load with other settings reloads) and config (the one
  // the model was read with, once read). An adopted
  // model has its name, source ("offload:<name>"), dtypes and key only.
  LoadRequest request;
  uint64_t estimate = 0;      // estimate_model_bytes()

  anima::AnimaModel model{nullptr};                  // null while not in RAM (and for an adopted model)
  // A model the host made and handed to the cache (ModelCache::adopt: a torch module
  // offloaded in place, Note [adopted models] in cache/model_cache.h). Set from creation
  // until the entry leaves the cache; the cache never reads, evicts or runs it itself.
  std::shared_ptr<torch::nn::Module> adopted;
  std::unique_ptr<offload::StreamingEngine> engine;  // created at first attach, kept for its stats
  offload::WeightNeeds needs;                        // valid while in RAM; sidecars included
  uint64_t sidecar_bytes = 0;                        // LoRA sidecars its engine placed (device bytes)
  std::unique_ptr<offload::SidecarPlacer> placer;    // ModelCache::patch's placer (Note [sidecar share]), made once
  std::optional<double> max_resident;                // current cap
  std::optional<uint64_t> target;                    // share the user asked for; none: needs.wanted
  bool attached = false;
  bool loading = false;
  bool dropped = false;       // drop() or replaced: evicted when unlocked, never loaded again
  bool announced = false;     // "Loaded model" logged for the current RAM copy
  bool loaded_once = false;   // read or generated at least once (listed by ModelCache::entries)
  double load_seconds = 0;    // reading/generating the current RAM copy
  int locks = 0;
  uint64_t ram_bytes = 0;     // host bytes while in RAM
  uint64_t share = 0;         // engine budget while attached
  uint64_t last_used = 0;     // LRU tick

  bool running = false;       // a forward uses the engine and model (Note [cache locking])
  int run_waiters = 0;        // cache operations waiting for that forward; new forwards wait for them

  // Engine-side state for queries (Note [cache locking]), guarded by `published_mutex`.
  struct Published {
    std::optional<offload::EngineStats> stats;  // none before the engine exists
    uint64_t device_bytes = 0, device_allocated = 0, streamed_dit = 0, streamed_adapter = 0;
    // An adopted model's streamed bytes by its host's top-level module (Note [adopted models]).
    std::map<std::string, uint64_t> streamed_by_part;
    std::string residency;
    std::string trace_json;  // with CacheOptions::trace
  };
  std::mutex published_mutex;
  Published published;

  // In RAM: an Anima model read or generated, or an adopted model.
  bool in_ram() const { return static_cast<bool>(model) || static_cast<bool>(adopted); }
  // The module the engine manages: the Anima model or the adopted one (null when neither).
  torch::nn::Module* module() const { return model ? model.ptr().get() : adopted.get(); }
};

// The cache-wide fields. `options`, `device` and `pin_arena` are set as the cache is made;
// the rest is guarded by the cache mutex.
struct CacheState {
  explicit CacheState(CacheOptions o) : options(std::move(o)) {}

  CacheOptions options;
  std::shared_ptr<offload::DeviceBackend> device;
  std::shared_ptr<offload::PinnedArena> pin_arena;  // every engine's pinned host copies, under one limit
  HostMemoryLimit host_limit;  // read at creation: the defaults of ram_limit and the pin arena's limit come from it

  std::list<std::shared_ptr<Entry>> entries;  // every model the cache holds, in creation order
  uint64_t next_id = 0;                       // the last Entry::id given
  uint64_t tick = 0;                          // the LRU clock (Entry::last_used)

  // The RAM tier (cache/ram_tier.h).
  uint64_t ram_limit = 0;
  std::string ram_limit_source;  // how the default was derived (default_ram_limit()); empty when given
  bool ram_warned = false;
  offload::Stat ram;
  uint64_t ram_reserved = 0;  // see CacheStats::ram_reserved_bytes
  uint64_t hits = 0, misses = 0, loads = 0, evictions = 0;

  // The device budget and its shares (cache/device_shares.h).
  uint64_t budget = 0;
  std::string budget_source;  // CacheStats::vram_budget_source
  uint64_t working_memory = 0;
  uint64_t measured_working = 0;  // the most any engine measured (Note [measured working memory])
  uint64_t grown_working = 0;     // the working memory the measurements ask for (0: none)
  bool working_warned = false;
  uint64_t working_refused = 0;   // a measurement the budget had no room for
  uint64_t device_unloads = 0, device_drops = 0;
};

}  // namespace sluice::cache
