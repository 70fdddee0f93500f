#pragma once
// The device tier of the model cache (Note [cache tiers] in cache/model_cache.h): one vram
// budget that every model shares, the working memory kept out of it for activations, and
// each attached model's share of the rest. The models compete for one device, so whatever
// one gets is taken from the free part of the budget or from the others; this part decides
// how much each model wants, the least it can run in and what the user asked for
// (partial_load, full_load, max_resident), who gives room, least recently used first and
// partially before whole, what a budget change or a grown working memory does to every
// share, and the error that names the budget a model would need. It puts models on the
// device and takes them off (attach, detach, resize) and publishes each change (Note
// [cache locking]). Every member function runs with the cache mutex held and the entries
// it changes idle, except set_budget and grow_working_memory, which take the mutex and wait
// for the forwards themselves.
//
// Note [working memory default]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Activations of an anima-2b forward at 1024x1024 (4096 tokens, CFG batch 2, bf16) peak at
// a few hundred MiB (the 8192-wide MLP hidden state is 128 MiB, q/k/v 96 MiB) plus the
// allocator's slack; 1 GiB covers that. Activations grow with the token count, so the
// default is 1 GiB x (resolution / 1024)^2, at least 256 MiB, and never more than a quarter
// of the budget (so that small budgets for small models stay usable).
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "cache/cache_locking.h"
#include "cache/cache_state.h"
#include "offload/engine/engine.h"

namespace sluice::cache {

uint64_t default_working_memory(uint64_t budget, int64_t resolution);

// The smallest vram budget B that leaves `minimum` beside the working memory (B - working
// memory >= minimum): with `options.working_memory`, minimum plus it; with the default
// (which grows with B), found by bisection.
uint64_t minimum_vram_budget(uint64_t minimum, const CacheOptions& options);

class DeviceShares {
 public:
  DeviceShares(CacheState& state, CacheLocking& locking) : s_(state), locking_(locking) {}
  DeviceShares(const DeviceShares&) = delete;
  DeviceShares& operator=(const DeviceShares&) = delete;

  // What the shares may sum to: the budget minus the working memory.
  uint64_t limit() const { return s_.budget - s_.working_memory; }
  // The sum of the attached models' shares.
  uint64_t reserved() const;
  // The part of the limit no share holds.
  uint64_t unreserved() const { return limit() - std::min(limit(), reserved()); }
  // The share `e` asks for: its target (clamped to its minimum and what it wants) or what
  // it wants, no more than the limit.
  uint64_t wanted_share(const Entry& e) const;
  // The error for a model whose minimum the budget cannot hold, naming minimum_vram_budget.
  std::string budget_error(const Entry& e) const;

  offload::EngineOptions engine_options(const Entry& e) const;
  // e.needs from its model and engine options, its sidecars included (Note [sidecar share]).
  void refresh_needs(Entry& e);
  uint64_t device_bytes_of(Entry& e);

  void attach(Entry& e, uint64_t share);
  void detach(Entry& e);
  void resize(Entry& e, uint64_t share);
  void count_pinned_ram(Entry& e);  // e.ram_bytes (and the RAM total) after pinning changed its host copies
  // Frees `bytes` of the limit from the unlocked attached models but `exclude`: partial
  // unloads first, least recently used first, then whole models off the device.
  void make_room(uint64_t bytes, const Entry* exclude);
  // Puts `e` (in RAM) on the device with its wanted share, or grows its share towards it,
  // making room as Note [cache tiers] says. When the least it can run in cannot be had,
  // ResourceError if `required`, else it stays off the device with one INFO line.
  void ensure_device(Entry& e, Guard& g, bool required);
  void apply_max_resident(Entry& e, std::optional<double> fraction);

  // Residency of one pinned, idle model (ModelCache's Model API).
  void partial_load(Entry& e, uint64_t bytes, Guard& g);
  void partial_unload(Entry& e, uint64_t bytes);
  void full_load(Entry& e, Guard& g);
  void full_unload(Entry& e);

  // A new budget in bytes (0: all device memory), resolved as `source` says (kept for the
  // stats once the budget is in force). `measured`: from grow_working_memory (no budget log
  // line, the allocator's cache is kept, the source stays).
  void set_budget(uint64_t budget_request, bool measured, const std::string& source = {});
  // Note [measured working memory] (offload/engine/model_budget.h), for the cache: after a forward whose
  // engine measured more working memory than the cache keeps, the working memory grows to
  // the measurement plus an eighth and the shares are fitted under the new limit (as for a
  // budget change, without emptying the allocator's cache: the activations use it), with
  // one INFO line. A budget too small for it keeps its working memory and warns once.
  void grow_working_memory(uint64_t used, const std::string& model, const std::string& kind);

 private:
  CacheState& s_;
  CacheLocking& locking_;
};

}  // namespace sluice::cache
