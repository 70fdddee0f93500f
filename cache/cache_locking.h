#pragma once
// The locking of the model cache: the one cache mutex over CacheState and every Entry
// (cache/cache_state.h), the waits of its protocol, the entries' published snapshots, and
// Lock, a model's RAII lock. Several threads use one cache at once: forwards of different
// models run side by side while queries, lock() and residency changes come in beside them;
// a forward must not wait for another model's forward, nor a query for any. Every wait of the protocol (for a
// model's forward, for every forward, for another thread's read of a model, and a
// forward's wait for its turn) is a member of CacheLocking, the only code that touches the
// condition variables, so the protocol reads in one place; the other parts take the mutex
// through mutex() and wait only through these members.
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
#include <condition_variable>
#include <memory>
#include <mutex>

#include "cache/cache_state.h"

namespace sluice::cache {

using Guard = std::unique_lock<std::mutex>;

// The cache mutex, the waits of Note [cache locking] and the published snapshots.
class CacheLocking {
 public:
  explicit CacheLocking(CacheState& state) : s_(state) {}
  CacheLocking(const CacheLocking&) = delete;
  CacheLocking& operator=(const CacheLocking&) = delete;

  // The one cache mutex: it guards CacheState and the entries' fields.
  std::mutex& mutex() const { return mutex_; }

  // Waits, releasing the cache mutex, until no forward uses the engine of `e` (pinned or
  // locked by the caller); the caller reads the cache state again afterwards.
  void wait_idle(Entry& e, Guard& g);
  // Waits, releasing the cache mutex, until no forward of any model runs, holding back new
  // forwards of every model meanwhile (a budget change resizes them all).
  void wait_all_idle(Guard& g);
  // Waits, releasing the cache mutex, while another thread reads `e` (Entry::loading);
  // loaded() wakes the waiters when a read ends.
  void wait_loaded(Entry& e, Guard& g);
  void loaded();

  // A forward's turn on the locked entry `e` (ModelCache::run): takes the cache mutex,
  // waits until no forward uses `e`, no operation waits for one and no budget change
  // waits, and marks `e` running. end_forward marks it idle and wakes the waiters.
  void begin_forward(Entry& e);
  void end_forward(Entry& e);

  // Copies the engine-side state of `e` into its snapshot; the caller uses the engine.
  // `settle`: wait for the device to finish the last forward so that its timings are in,
  // and render the trace. A forward's own publish does not settle: on a GPU that would be
  // a host wait per forward, and the trace would be rendered again at every forward.
  // Queries settle the snapshot themselves when no forward is running.
  void publish(Entry& e, bool settle = true) const;
  // A query's refresh (cache mutex held): settles the snapshot of an idle entry.
  void refresh_published(Entry& e) const;

 private:
  CacheState& s_;
  mutable std::mutex mutex_;
  std::condition_variable loaded_;
  std::condition_variable idle_;  // a forward ended, or an operation stopped waiting for one
  int budget_waiters_ = 0;        // set_vram_budget calls waiting for forwards; new forwards wait for them
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

}  // namespace sluice::cache
