#include "cache/model_cache.h"

#include <c10/util/Exception.h>

#include <string>

#include "offload/device/cpu_device.h"
#include "runtime/error.h"

namespace sluice::cache {

// ---------------------------------------------------------------------------------------
// construction

std::shared_ptr<ModelCache> ModelCache::create(CacheOptions options) {
  return std::shared_ptr<ModelCache>(new ModelCache(std::move(options)));
}

ModelCache::ModelCache(CacheOptions options) : state_(std::move(options)) {
  const CacheOptions& o = state_.options;
  state_.device = o.device ? o.device : std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device());
  offload::parse_prefetch(offload::prefetch_name(o.prefetch), "prefetch");  // in range
  if (o.resolution <= 0) {
    throw InvalidArgument("resolution must be positive, got " + std::to_string(o.resolution));
  }
  // Note [host memory limit]: read once, here; the defaults below come from it.
  state_.host_limit = host_memory_limit();
  if (o.ram_limit) {
    state_.ram_limit = *o.ram_limit;
  } else {
    const RamLimit r = default_ram_limit(state_.host_limit);
    state_.ram_limit = r.bytes;
    state_.ram_limit_source = r.source;
  }
  state_.pin_arena = o.pin_memory_limit
                         ? std::make_shared<offload::PinnedArena>(*o.pin_memory_limit)
                         : std::make_shared<offload::PinnedArena>(offload::default_pin_memory_limit(state_.host_limit));
  set_vram_budget(o.vram_budget, o.vram_budget_source);
}

ModelCache::~ModelCache() {
  // Locks keep the cache alive, so nothing is locked here; engines detach in their
  // destructors, before the models they manage go.
  for (auto& e : state_.entries) {
    if (e->engine && e->attached) e->engine->detach();
  }
}

// ---------------------------------------------------------------------------------------
// public operations

std::shared_ptr<Entry> ModelCache::load(const LoadSpec& spec) {
  bool created = false;
  std::shared_ptr<Entry> e = ram_.entry_for(spec, created);
  with_pinned(e, /*count_hit=*/true, [&](Entry& en, Guard& gg) {
    if (!created && spec.max_resident && spec.max_resident != en.max_resident) {
      shares_.apply_max_resident(en, spec.max_resident);
    }
    try {
      shares_.ensure_device(en, gg, /*required=*/false);
    } catch (const ResourceError&) {
      // The budget cannot hold this model at all: do not keep it (evicted as it is unpinned).
      // Only the load that made the entry drops it: an entry this load found (also one
      // another thread added while this load estimated it) was returned to another caller.
      if (created) en.dropped = true;
      throw;
    }
  });
  return e;
}

int64_t ModelCache::with_pinned(const std::shared_ptr<Entry>& ep, bool count_hit,
                                const std::function<void(Entry&, Guard&)>& op) {
  Guard g(locking_.mutex());
  ram_.ensure_loaded(ep, g, count_hit);
  Entry& e = *ep;
  e.locks += 1;
  ram_.touch(e);
  locking_.wait_idle(e, g);  // pinned: it stays in RAM meanwhile
  const uint64_t before = shares_.device_bytes_of(e);
  try {
    op(e, g);
  } catch (...) {
    e.locks -= 1;
    if (e.locks == 0 && e.dropped) ram_.evict(e);
    throw;
  }
  const uint64_t after = shares_.device_bytes_of(e);
  e.locks -= 1;
  if (e.locks == 0) {
    if (e.dropped) {
      ram_.evict(e);
    } else {
      ram_.make_room(0, &e);  // just used: others go first
    }
  }
  return static_cast<int64_t>(after) - static_cast<int64_t>(before);
}

std::shared_ptr<Entry> ModelCache::adopt(std::shared_ptr<torch::nn::Module> module, const std::string& name,
                                         const DtypePair& dtypes, std::optional<double> max_resident) {
  std::shared_ptr<Entry> e = ram_.adopt(std::move(module), name, dtypes, max_resident);
  with_pinned(e, /*count_hit=*/false, [&](Entry& en, Guard& gg) {
    try {
      shares_.ensure_device(en, gg, /*required=*/false);
    } catch (const ResourceError&) {
      en.dropped = true;  // evicted as it is unpinned
      throw;
    }
  });
  return e;
}

Lock ModelCache::lock(const std::shared_ptr<Entry>& ep) {
  Guard g(locking_.mutex());
  ram_.ensure_loaded(ep, g, /*count_hit=*/true);
  Entry& e = *ep;
  e.locks += 1;
  ram_.touch(e);
  if (e.locks == 1 || !e.attached) {
    try {
      shares_.ensure_device(e, g, /*required=*/true);
    } catch (...) {
      e.locks -= 1;
      if (e.locks == 0 && e.dropped) ram_.evict(e);
      throw;
    }
  }
  return Lock(shared_from_this(), ep);
}

void ModelCache::unlock(Entry& e) {
  Guard g(locking_.mutex());
  TORCH_INTERNAL_ASSERT(e.locks > 0, "unlock of '", e.name, "' without a lock");
  e.locks -= 1;
  if (e.locks > 0) return;
  if (e.dropped) {
    ram_.evict(e);
  } else {
    ram_.make_room(0, nullptr);
  }
}

void ModelCache::drop(const std::shared_ptr<Entry>& e) {
  Guard g(locking_.mutex());
  ram_.mark_dropped(e);
}

int64_t ModelCache::partial_load(const std::shared_ptr<Entry>& ep, uint64_t bytes) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard& g) { shares_.partial_load(e, bytes, g); });
}

int64_t ModelCache::partial_unload(const std::shared_ptr<Entry>& ep, uint64_t bytes) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard&) { shares_.partial_unload(e, bytes); });
}

int64_t ModelCache::full_load(const std::shared_ptr<Entry>& ep) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard& g) { shares_.full_load(e, g); });
}

int64_t ModelCache::full_unload(const std::shared_ptr<Entry>& ep) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard&) { shares_.full_unload(e); });
}

void ModelCache::set_max_resident(const std::shared_ptr<Entry>& ep, std::optional<double> fraction) {
  if (fraction && !(*fraction >= 0.0 && *fraction <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*fraction));
  }
  with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard&) { shares_.apply_max_resident(e, fraction); });
}

void ModelCache::patch(const Lock& lock,
                       const std::function<void(anima::AnimaModelImpl&, offload::SidecarPlacer&)>& fn) {
  TORCH_CHECK(lock, "patch: the lock is empty");
  sidecars_.patch(lock.entry(), fn);
}

// ---------------------------------------------------------------------------------------
// the budget

void ModelCache::set_vram_budget(uint64_t budget_request, const std::string& source) {
  shares_.set_budget(budget_request, /*measured=*/false, source);
}

offload::ResolvedVramBudget ModelCache::parse_budget(const std::string& text, const std::string& headroom,
                                                     const std::string& flag, const std::string& headroom_flag) const {
  return offload::resolve_vram_budget(*state_.device, text, headroom, flag, headroom_flag);
}

uint64_t ModelCache::vram_budget() const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return state_.budget;
}

uint64_t ModelCache::working_memory() const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return state_.working_memory;
}

// ---------------------------------------------------------------------------------------
// forwards

void ModelCache::run(const Lock& lock, const std::function<void(anima::AnimaModelImpl&, offload::StreamingEngine&)>& fn) {
  TORCH_CHECK(lock, "run: the lock is empty");
  Entry& e = lock.entry();
  if (!e.model) throw InvalidArgument("model '" + e.name + "' is an offloaded torch module: its host runs its forwards");
  offload::StreamingEngine& engine = begin_run(lock);
  // The engine is ours until end_run, however fn ends (Note [cache locking]).
  try {
    fn(*e.model, engine);
  } catch (...) {
    end_run(lock, /*aborted=*/true);  // an aborted forward is counted too
    throw;
  }
  end_run(lock, /*aborted=*/false);
}

offload::StreamingEngine& ModelCache::begin_run(const Lock& lock) {
  TORCH_CHECK(lock, "begin_run: the lock is empty");
  Entry& e = lock.entry();
  locking_.begin_forward(e);
  return *e.engine;
}

void ModelCache::end_run(const Lock& lock, bool aborted) {
  TORCH_CHECK(lock, "end_run: the lock is empty");
  Entry& e = lock.entry();
  std::optional<uint64_t> measured;
  {
    struct Idle {
      CacheLocking& locking;
      Entry& e;
      ~Idle() { locking.end_forward(e); }
    } idle{locking_, e};
    locking_.publish(e, /*settle=*/false);
    if (!aborted) measured = e.engine->budget().measured_working_memory();
  }
  // Note [measured working memory]: the engines measure, the cache keeps the working memory.
  if (measured) shares_.grow_working_memory(*measured, e.name, e.engine->last_forward_kind());
}

// ---------------------------------------------------------------------------------------
// queries (cache/cache_queries.h)

CacheStats ModelCache::stats() const { return queries_.stats(); }

std::string ModelCache::stats_json(int indent) const { return queries_.stats_json(indent); }

std::vector<std::shared_ptr<Entry>> ModelCache::entries() const { return queries_.entries(); }

offload::EngineStats ModelCache::engine_stats(const std::shared_ptr<Entry>& e) const { return queries_.engine_stats(e); }

std::string ModelCache::model_stats_json(const std::shared_ptr<Entry>& e, int indent) const {
  return queries_.model_stats_json(e, indent);
}

void ModelCache::write_trace(const std::shared_ptr<Entry>& e, const std::string& path) const {
  queries_.write_trace(e, path);
}

void ModelCache::write_timeline_svg(const std::shared_ptr<Entry>& e, const std::string& path) const {
  queries_.write_timeline_svg(e, path);
}

EntryState ModelCache::entry_state(const std::shared_ptr<Entry>& e) const { return queries_.entry_state(e); }

anima::AnimaConfig ModelCache::entry_config(const std::shared_ptr<Entry>& e) const { return queries_.entry_config(e); }

}  // namespace sluice::cache
