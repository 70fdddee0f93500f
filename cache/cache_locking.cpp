#include "cache/cache_locking.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "cache/model_cache.h"
#include "runtime/logging.h"

namespace sluice::cache {

// ---------------------------------------------------------------------------------------
// waits (Note [cache locking])

void CacheLocking::wait_idle(Entry& e, Guard& g) {
  if (!e.running) return;
  e.run_waiters += 1;
  idle_.wait(g, [&] { return !e.running; });
  e.run_waiters -= 1;
  if (e.run_waiters == 0) idle_.notify_all();  // forwards held back for us may start once we unlock
}

void CacheLocking::wait_all_idle(Guard& g) {
  budget_waiters_ += 1;
  idle_.wait(g, [&] {
    return std::none_of(s_.entries.begin(), s_.entries.end(), [](const std::shared_ptr<Entry>& e) { return e->running; });
  });
  budget_waiters_ -= 1;
  if (budget_waiters_ == 0) idle_.notify_all();
}

void CacheLocking::wait_loaded(Entry& e, Guard& g) {
  loaded_.wait(g, [&] { return !e.loading; });
}

void CacheLocking::loaded() { loaded_.notify_all(); }

void CacheLocking::begin_forward(Entry& e) {
  Guard g(mutex_);
  idle_.wait(g, [&] { return !e.running && e.run_waiters == 0 && budget_waiters_ == 0; });
  // Locked entries are in RAM and attached (Note [cache tiers]).
  TORCH_INTERNAL_ASSERT(e.in_ram() && e.attached && e.engine, "locked model '", e.name, "' is not on the device");
  e.running = true;
}

void CacheLocking::end_forward(Entry& e) {
  {
    Guard g(mutex_);
    e.running = false;
  }
  idle_.notify_all();
}

// ---------------------------------------------------------------------------------------
// published snapshots

void CacheLocking::publish(Entry& e, bool settle) const {
  Entry::Published p;
  try {
    if (e.engine) {
      p.stats = e.engine->stats(/*wait=*/settle);
      if (s_.options.trace && settle) {
        p.trace_json = e.engine->trace().to_json();
      } else {
        std::lock_guard<std::mutex> g(e.published_mutex);
        p.trace_json = e.published.trace_json;
      }
    }
  } catch (const std::exception& ex) {
    // Resolving timings surfaced a device error; the engine raises it again at its next use.
    log::warn("stats of model '" + e.name + "' not updated: " + ex.what());
    std::lock_guard<std::mutex> g(e.published_mutex);
    p.stats = e.published.stats;
    p.trace_json = e.published.trace_json;
  }
  if (e.attached) {
    p.device_bytes = e.engine->device_bytes();
    p.device_allocated = e.engine->residency().device_allocated_bytes();
    const offload::ResidencyPlan& plan = e.engine->plan();
    p.residency = plan.residency_map();
    for (size_t i = 0; i < plan.layers.size(); ++i) {
      if (plan.resident[i]) continue;
      const std::string& name = plan.layers[i].name;
      if (e.is_adopted) {
        // A torch module of the host's: its own top-level children, not Anima's parts.
        p.streamed_by_part[name.substr(0, name.find('.'))] += plan.layers[i].stored_bytes;
      } else {
        // The semantic connector runs inside encode_text, between the adapter's blocks.
        const bool text = name.rfind("llm_adapter.", 0) == 0 || name.rfind("anima_v2_connector.", 0) == 0;
        (text ? p.streamed_adapter : p.streamed_dit) += plan.layers[i].stored_bytes;
      }
    }
  }
  std::lock_guard<std::mutex> g(e.published_mutex);
  e.published = std::move(p);
}

void CacheLocking::refresh_published(Entry& e) const {
  // Not running and the cache mutex held: nobody else uses the engine now. Settling waits
  // for the device to finish the last forward (device time, not a running forward).
  if (!e.running && e.engine) publish(e, /*settle=*/true);
}

// ---------------------------------------------------------------------------------------
// Lock

Lock::Lock(std::shared_ptr<ModelCache> cache, std::shared_ptr<Entry> entry)
    : cache_(std::move(cache)), entry_(std::move(entry)) {}

Lock::Lock(Lock&& other) noexcept : cache_(std::move(other.cache_)), entry_(std::move(other.entry_)) {}

Lock& Lock::operator=(Lock&& other) noexcept {
  if (this != &other) {
    unlock();
    cache_ = std::move(other.cache_);
    entry_ = std::move(other.entry_);
  }
  return *this;
}

Lock::~Lock() { unlock(); }

void Lock::unlock() {
  if (!entry_) return;
  cache_->unlock(*entry_);
  entry_.reset();
  cache_.reset();
}

}  // namespace sluice::cache
