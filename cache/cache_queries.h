#pragma once
// The queries of the model cache: its counters and device totals (CacheStats) and their
// JSON, the models it holds, one model's state, engine stats, stats JSON, trace and
// timeline. Frontends poll these while forwards run (a progress bar, a memory readout), so
// none of them may wait for a forward: each reads the cache-side fields under the cache
// mutex and the engine-side ones from the entry's published snapshot (Note [cache locking]
// in cache/cache_locking.h), settling the snapshot itself when the model is idle. And a
// reader of the numbers must be able to account for every device byte, so each total comes
// with its parts (Note [stats parts]).
//
// Note [stats parts]
// ~~~~~~~~~~~~~~~~~~
// Every device total in the stats JSON is the sum of its parts, and where a total counts
// something that no part holds, a named field says how much:
//  - cache: vram.current (every byte the device handed out to sluice) =
//    models_allocated_bytes (the sum over models_held, every model the cache holds, dropped
//    ones still locked included) + vram_unattributed_bytes (slots of a staging ring a model
//    dropped that queued work may still read; 0 between forwards). vram_reserved_bytes =
//    the sum of the models' share_bytes. A model's device_bytes (its ledger: its stats
//    JSON's device.current_bytes) counts its staging ring at its capacity, a reservation;
//    allocated_bytes counts the slots made so far, so the difference is
//    models_device_bytes - models_allocated_bytes.
//  - model: device.allocator_current_bytes is the device allocator's count for the whole
//    device = device.allocated_bytes (this model) + device.other_models_bytes (the cache's
//    other models) + device.unattributed_bytes (what the allocator holds that no model's
//    ledger counts: on a GPU the forward's activations, its outputs and any other tensor of
//    the process, and the allocator's rounding; on the CPU device, which counts only
//    sluice's allocations, the ring slots above: 0 between forwards). Null where the
//    allocator's counters are unavailable.
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cache/cache_locking.h"
#include "cache/cache_state.h"
#include "cache/device_shares.h"
#include "models/anima/config.h"
#include "offload/report/stats.h"
#include "runtime/host_memory_limit.h"
#include "sluice/stats.hpp"

namespace sluice::cache {

// The cache's counters are the public record (sluice/stats.hpp: one list of fields gives the
// struct and its JSON, Note [field lists]).
using CacheStats = ::sluice::CacheStats;

// Snapshot of an entry's state; the engine-side fields as last published.
struct EntryState {
  bool in_ram = false, attached = false, dropped = false;
  int locks = 0;
  uint64_t ram_bytes = 0, share = 0, device_bytes = 0, minimum = 0, wanted = 0, full = 0;
  uint64_t device_allocated = 0;  // of device_bytes, allocated now (the ring's slots, not its reservation)
  uint64_t streamed_dit = 0;      // stored bytes of streamed DiT layers: what a DiT forward streams
  uint64_t streamed_adapter = 0;  // of streamed llm_adapter layers: what encode_text streams
  std::map<std::string, uint64_t> streamed_by_part;  // an adopted model's, by its top-level modules
  std::string residency;
};

// The queries ModelCache answers; each takes the cache mutex (never while a forward holds
// it: Note [cache locking]). Their contracts are on ModelCache's members of the same names.
class CacheQueries {
 public:
  CacheQueries(const CacheState& state, const CacheLocking& locking, const DeviceShares& shares)
      : s_(state), locking_(locking), shares_(shares) {}
  CacheQueries(const CacheQueries&) = delete;
  CacheQueries& operator=(const CacheQueries&) = delete;

  CacheStats stats() const;
  std::string stats_json(int indent) const;
  std::vector<std::shared_ptr<Entry>> entries() const;
  offload::EngineStats engine_stats(const std::shared_ptr<Entry>& e) const;
  std::string model_stats_json(const std::shared_ptr<Entry>& e, int indent) const;
  void write_trace(const std::shared_ptr<Entry>& e, const std::string& path) const;
  void write_timeline_svg(const std::shared_ptr<Entry>& e, const std::string& path) const;
  EntryState entry_state(const std::shared_ptr<Entry>& e) const;
  anima::AnimaConfig entry_config(const std::shared_ptr<Entry>& e) const;

 private:
  CacheStats stats_locked() const;
  EntryState entry_state_locked(const std::shared_ptr<Entry>& e) const;

  const CacheState& s_;
  const CacheLocking& locking_;
  const DeviceShares& shares_;
};

}  // namespace sluice::cache
