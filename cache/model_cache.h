#pragma once
// ModelCache: several models in RAM (storage dtype, fp8 by default) under a RAM limit, and
// on one device under one budget that all of them share. The public API
// (include/sluice/sluice.hpp, api/) is a thin layer over this class.
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
// Note [cache locking]
// ~~~~~~~~~~~~~~~~~~~~
// One cache mutex guards the entries, shares, lock counts and counters. An entry's engine
// and model are single-threaded: either a forward uses them (ModelCache::run marks the
// entry `running` under the cache mutex, then works without it) or a holder of the cache
// mutex does while the entry is not running. The cache mutex is never held while waiting
// for a forward:
//  - the cache changes unlocked models freely: nothing runs without a lock;
//  - lock() changes only the model it locks, and only when no other lock holds it (then
//    nothing runs it) or it is not attached (a running model is attached);
//  - residency changes of a model (partial_load ... set_max_resident, load()'s device step)
//    pin it, then wait for its running forward on a condition variable, which releases the
//    cache mutex, and hold back its new forwards meanwhile (a stream of forwards cannot
//    starve them); lock() and forwards of other models go on.
//  - set_vram_budget waits so for every running forward, holding back new forwards of all
//    models until it has resized them.
// A forward takes the cache mutex only to mark its entry running and idle again: it may
// wait briefly for another model's attach or a budget change, never for another model's
// forward.
// Queries (stats, model stats, entry state, trace) read the cache-side fields under the
// cache mutex and the engine-side ones from the entry's published snapshot, under the
// entry's own small mutex that is held only to copy it. Whoever uses the engine publishes
// it: the forward at its end (engine stats() resolves its timings, which may wait for the
// device, without the cache mutex), the cache after each attach, detach and residency
// change. So queries never wait for a forward; during one they see the state from before.
// Reading a model from disk happens outside the cache mutex, its estimated bytes reserved
// in the RAM accounting first, so that concurrent misses evict for each other (or exceed
// the limit with the one warning) instead of each passing it unseen. Other threads asking
// for the same model wait for it on a condition variable.
//
// Note [sidecar share]
// ~~~~~~~~~~~~~~~~~~~~
// LoRA sidecars live on the device beside the weights, inside the model's share (Note
// [device extras] in offload/engine.h). A model's share is sized for its weights, so when
// sidecars of B bytes are placed (ModelCache::patch), the share first grows by B, as a
// lock's share does: from the free part of the budget, then by partially unloading other
// unlocked models, then by taking whole ones off the device; the engine grows its budget
// and places the sidecars in one replan, so the resident layers stay as they were. Only
// what the budget cannot give (the share never grows past what the model wants, nor past
// the limit) comes out of the model's own residency: more layers stream. A budget that
// cannot hold the sidecars even with every streamable layer streamed refuses them, before
// anything changes, with one line naming the model, the LoRA and the bytes missing. The
// model's minimum, wanted and full shares and its residency target include the sidecars
// while they live (so set_vram_budget, full_load, partial_load and set_max_resident size
// the share with them), and when they go the share shrinks back to what the model then
// wants: the bytes it grew for them go back to the budget, the rest back to resident layers.
#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "offload/device.h"
#include "offload/engine.h"
#include "offload/stats.h"
#include "offload/vram_budget.h"
#include "runtime/dtype_policy.h"

namespace sluice {
class LoraScope;
}

namespace sluice::cache {

struct CacheOptions {
  std::shared_ptr<offload::DeviceBackend> device;  // the device; null: a CPU device
  uint64_t vram_budget = 0;                        // device bytes for all models, working memory included; 0: all device memory
  std::optional<uint64_t> working_memory;          // kept free for activations; none: default_working_memory(budget, resolution)
  int64_t resolution = 1024;                       // image side the default working memory is sized for
  std::optional<uint64_t> ram_limit;               // host bytes for models; 0: unlimited; none: default_ram_limit()
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
};

// Note [working memory default]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Activations of an anima-2b forward at 1024x1024 (4096 tokens, CFG batch 2, bf16) peak at
// a few hundred MiB (the 8192-wide MLP hidden state is 128 MiB, q/k/v 96 MiB) plus the
// allocator's slack; 1 GiB covers that. Activations grow with the token count, so the
// default is 1 GiB x (resolution / 1024)^2, at least 256 MiB, and never more than a quarter
// of the budget (so that small budgets for small models stay usable).
uint64_t default_working_memory(uint64_t budget, int64_t resolution);
// InvokeAI's rule: max(4 GiB, 50% of RAM - 2 GiB).
uint64_t default_ram_limit();

// Where a model comes from.
enum class SourceKind { preset, json_config, checkpoint };
// Preset name, "*.json" (a config to generate from), or a checkpoint path.
SourceKind source_kind(const std::string& source);

// What to load and how.
struct LoadSpec {
  std::string source;                       // preset name, .json config or .safetensors path
  std::string name;                         // for logs and stats; empty: preset/config name or file stem
  Fp8Options storage;                       // storage/compute dtypes and skip patterns
  std::string compute_reason;               // why storage.compute (Note [compute dtype auto]); empty: "requested"
  std::optional<anima::AnimaConfig> config; // overrides the file's inferred config / the preset's
  uint64_t seed = 0;                        // generated weights (preset and .json sources)
  std::optional<double> max_resident;       // cap on resident fraction; none: the budget decides
};

// Host bytes the model of `spec` will take once loaded (every parameter and buffer in its
// stored dtype), computed on a shape-only model. `device` decides fp8 support.
uint64_t estimate_model_bytes(const LoadSpec& spec, at::Device device);

struct CacheStats {
  // One model the cache holds, for the parts of the device totals (Note [stats parts]).
  struct ModelPart {
    uint64_t id = 0;
    std::string name, source;
    bool in_ram = false, on_device = false, dropped = false;
    int locks = 0;
    uint64_t share = 0;            // its share of vram_limit (0 off the device)
    uint64_t device_bytes = 0;     // its ledger: what its stats JSON calls device.current_bytes
    uint64_t allocated_bytes = 0;  // of which allocated now (its staging ring's reservation counts its slots made)
  };
  std::string device;
  uint64_t hits = 0, misses = 0, loads = 0, evictions = 0;
  uint64_t device_unloads = 0;  // partial unloads to make room for another model
  uint64_t device_drops = 0;    // whole models taken off the device to make room
  uint64_t models = 0;          // in RAM
  uint64_t locked = 0;          // in RAM and locked
  uint64_t ram_limit = 0;       // 0: unlimited
  offload::Stat ram;            // host bytes of models in RAM (pinned host copies included)
  uint64_t ram_reserved = 0;    // estimated bytes of models being read, counted against the RAM limit
  uint64_t pin_limit = 0;       // the pinned arena's limit (all models)
  offload::Stat pinned;         // page-locked bytes of the pinned arena (its chunks)
  uint64_t pinned_used = 0;     // of which host weights (the rest is alignment padding)
  uint64_t vram_budget = 0;
  uint64_t working_memory = 0;  // grown by measurements (Note [measured working memory] in offload/engine.h)
  uint64_t measured_working_memory = 0;  // the most a first forward of a kind of any model used beyond the ledger
  uint64_t vram_limit = 0;      // budget - working memory
  offload::Stat vram;           // the device backend's total (all models); peak since the last budget change
  uint64_t vram_reserved = 0;   // sum of shares
  std::vector<ModelPart> models_held;  // every model the cache holds, in creation order
  uint64_t models_device_bytes = 0;    // sum of their device_bytes
  uint64_t models_allocated_bytes = 0; // sum of their allocated_bytes
  // vram.current - models_allocated_bytes: bytes the device handed out that no model's
  // ledger holds now (slots of a staging ring a model dropped, which queued work may still
  // read); 0 between forwards.
  int64_t vram_unattributed = 0;
};

// One cached model. Fields are guarded by the cache mutex unless noted; see Note [cache
// locking].
struct Entry {
  // Fixed at creation.
  uint64_t id = 0;            // unique in its cache (1, 2, ... in creation order): two entries may share a key
  std::string key;            // identity: source (+ seed for generated models)
  std::string settings;       // the loading settings; a load with other settings reloads
  std::string name;
  LoadSpec spec;
  DtypePair dtypes;           // resolved for the device
  uint64_t estimate = 0;      // estimate_model_bytes()
  anima::AnimaConfig config;  // set when first loaded

  anima::AnimaModel model{nullptr};                  // null while not in RAM
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
    std::string residency;
    std::string trace_json;  // with CacheOptions::trace
  };
  std::mutex published_mutex;
  Published published;
};

class ModelCache;

// A lock on an entry (RAII, movable). While it lives the model is in RAM, on the device,
// and neither evicted nor unloaded by the cache.
class Lock {
 public:
  Lock() = default;
  Lock(std::shared_ptr<ModelCache> cache, std::shared_ptr<Entry> entry);
  Lock(Lock&& other) noexcept;
  Lock& operator=(Lock&& other) noexcept;
  ~Lock();
  Lock(const Lock&) = delete;
  Lock& operator=(const Lock&) = delete;

  explicit operator bool() const { return entry_ != nullptr; }
  Entry& entry() const { return *entry_; }
  const std::shared_ptr<Entry>& entry_ptr() const { return entry_; }
  ModelCache& cache() const { return *cache_; }
  void unlock();

 private:
  std::shared_ptr<ModelCache> cache_;
  std::shared_ptr<Entry> entry_;
};

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

  // New budget in bytes (0: all device memory). See ModelCache::set_vram_budget in the
  // public header for the rules.
  void set_vram_budget(uint64_t budget);
  // Note [measured working memory] (offload/engine.h), for the cache: after a forward whose
  // engine measured more working memory than the cache keeps, the working memory grows to
  // the measurement plus an eighth and the shares are fitted under the new limit (as for a
  // budget change, without emptying the allocator's cache: the activations use it), with
  // one INFO line. A budget too small for it keeps its working memory and warns once.
  // Resolves a budget string ("6GiB", "50%", "auto", "" = 0: all) on this device now, with
  // `headroom` for "auto" (offload/vram_budget.h, Note [vram budget]).
  offload::ResolvedVramBudget parse_budget(const std::string& text, const std::string& headroom,
                                           const std::string& flag, const std::string& headroom_flag) const;

  // Runs fn(model, engine) as the only user of the entry's engine (waiting for another
  // forward of the same model), then publishes the entry's stats; `lock` must lock the entry.
  void run(const Lock& lock, const std::function<void(anima::AnimaModelImpl&, offload::StreamingEngine&)>& fn);

  CacheStats stats() const;
  // The counters as JSON, with models_held (every model the cache holds) and the named
  // remainders that make each device total the sum of its parts (Note [stats parts] in the
  // .cpp).
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
  // offload/timeline_svg.h), from the published trace and stats: InvalidArgument when
  // tracing is off or no complete DiT forward was traced, FileError naming `path`.
  void write_timeline_svg(const std::shared_ptr<Entry>& entry, const std::string& path) const;
  // Snapshot of an entry's state; the engine-side fields as last published.
  struct EntryState {
    bool in_ram = false, attached = false, dropped = false;
    int locks = 0;
    uint64_t ram_bytes = 0, share = 0, device_bytes = 0, minimum = 0, wanted = 0, full = 0;
    uint64_t device_allocated = 0;  // of device_bytes, allocated now (the ring's slots, not its reservation)
    uint64_t streamed_dit = 0;      // stored bytes of streamed DiT layers: what a DiT forward streams
    uint64_t streamed_adapter = 0;  // of streamed llm_adapter layers: what encode_text streams
    std::string residency;
  };
  EntryState entry_state(const std::shared_ptr<Entry>& entry) const;
  // The config of a model that has been loaded once.
  anima::AnimaConfig entry_config(const std::shared_ptr<Entry>& entry) const;

  offload::DeviceBackend& device() const { return *device_; }
  uint64_t vram_budget() const;
  uint64_t working_memory() const;
  const CacheOptions& options() const { return options_; }

 private:
  explicit ModelCache(CacheOptions options);
  friend class Lock;
  friend class EntrySidecars;
  using Guard = std::unique_lock<std::mutex>;

  void unlock(Entry& e);
  void set_vram_budget_locked(uint64_t budget_request, bool measured);
  void grow_working_memory(uint64_t used, const std::string& model, const std::string& kind);
  void ensure_loaded(const std::shared_ptr<Entry>& e, Guard& g, bool count_hit);
  void ensure_device(Entry& e, Guard& g, bool required);
  void make_ram_room(uint64_t bytes, const Entry* exclude);
  void make_device_room(uint64_t bytes, const Entry* exclude);
  void evict(Entry& e);
  void mark_dropped(const std::shared_ptr<Entry>& e);
  void attach(Entry& e, uint64_t share);
  void detach(Entry& e);
  void resize(Entry& e, uint64_t share);
  void count_pinned_ram(Entry& e);  // e.ram_bytes (and ram_) after pinning changed its host copies
  // Note [sidecar share], for EntrySidecars (cache mutex held, `e` locked and idle).
  std::vector<at::Tensor> place_sidecars(Entry& e, const std::vector<at::Tensor>& host,
                                         const std::vector<at::ScalarType>& dtypes, const std::string& what);
  void release_sidecars(Entry& e, uint64_t bytes) noexcept;
  void shift_sidecars(Entry& e, int64_t delta);  // sidecar bytes, needs and target follow
  uint64_t device_bytes_of(Entry& e);
  // Waits, releasing the cache mutex, until no forward uses the engine of `e` (pinned or
  // locked by the caller); the caller reads the cache state again afterwards.
  void wait_idle(Entry& e, Guard& g);
  // Copies the engine-side state of `e` into its snapshot; the caller uses the engine.
  // `settle`: wait for the device to finish the last forward so that its timings are in,
  // and render the trace. A forward's own publish does not settle: on a GPU that would be
  // a host wait per forward, and the trace would be rendered again at every forward.
  // Queries settle the snapshot themselves when no forward is running.
  void publish(Entry& e, bool settle = true);
  // A query's refresh (cache mutex held): settles the snapshot of an idle entry.
  void refresh_published(Entry& e) const;
  uint64_t reserved() const;
  uint64_t limit() const { return budget_ - working_memory_; }
  uint64_t wanted_share(const Entry& e) const;
  offload::EngineOptions engine_options(const Entry& e) const;
  void refresh_needs(Entry& e);
  void apply_max_resident(Entry& e, std::optional<double> fraction);
  void touch(Entry& e) { e.last_used = ++tick_; }
  std::string budget_error(const Entry& e) const;
  CacheStats stats_locked() const;
  EntryState entry_state_locked(const std::shared_ptr<Entry>& e) const;
  // Runs op on a pinned entry (locks + 1, loaded first) with the cache mutex held, then
  // unpins; returns the change in the entry's device bytes. `count_hit`: a hit is counted.
  int64_t with_pinned(const std::shared_ptr<Entry>& e, bool count_hit, const std::function<void(Entry&, Guard&)>& op);

  CacheOptions options_;
  std::shared_ptr<offload::DeviceBackend> device_;
  std::shared_ptr<offload::PinnedArena> pin_arena_;  // every engine's pinned host copies, under one limit
  mutable std::mutex mutex_;
  std::condition_variable loaded_;
  std::condition_variable idle_;  // a forward ended, or an operation stopped waiting for one
  int budget_waiters_ = 0;        // set_vram_budget calls waiting for forwards; new forwards wait for them
  std::list<std::shared_ptr<Entry>> entries_;
  uint64_t budget_ = 0;
  uint64_t working_memory_ = 0;
  uint64_t measured_working_ = 0;  // the most any engine measured (Note [measured working memory])
  uint64_t grown_working_ = 0;     // the working memory the measurements ask for (0: none)
  bool working_warned_ = false;
  uint64_t working_refused_ = 0;   // a measurement the budget had no room for
  uint64_t ram_limit_ = 0;
  uint64_t tick_ = 0;
  bool ram_warned_ = false;
  offload::Stat ram_;
  uint64_t ram_reserved_ = 0;  // see CacheStats::ram_reserved
  uint64_t hits_ = 0, misses_ = 0, loads_ = 0, evictions_ = 0, device_unloads_ = 0, device_drops_ = 0;
  uint64_t next_id_ = 0;
};

}  // namespace sluice::cache
