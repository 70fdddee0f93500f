#include "cache/model_cache.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"
#include "offload/cpu_device.h"
#include "offload/layer.h"
#include "offload/storage.h"
#include "offload/timeline_step.h"
#include "offload/timeline_svg.h"
#include "runtime/error.h"
#include "runtime/hardware.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "runtime/size_parse.h"
#include "runtime/skip_patterns.h"

namespace sluice::cache {

namespace {

nlohmann::json stat_json(const offload::Stat& s) {
  return {{"current", s.current}, {"peak", s.peak}, {"allocated", s.allocated}, {"freed", s.freed}};
}

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
nlohmann::json cache_json(const CacheStats& s) {
  nlohmann::json models = nlohmann::json::array();
  for (const auto& m : s.models_held) {
    models.push_back({{"id", m.id},
                      {"name", m.name},
                      {"source", m.source},
                      {"in_ram", m.in_ram},
                      {"on_device", m.on_device},
                      {"dropped", m.dropped},
                      {"locks", m.locks},
                      {"share_bytes", m.share},
                      {"device_bytes", m.device_bytes},
                      {"allocated_bytes", m.allocated_bytes}});
  }
  return {{"device", s.device},
          {"hits", s.hits},
          {"misses", s.misses},
          {"loads", s.loads},
          {"evictions", s.evictions},
          {"device_unloads", s.device_unloads},
          {"device_drops", s.device_drops},
          {"models", s.models},
          {"locked", s.locked},
          {"ram_limit_bytes", s.ram_limit},
          {"ram", stat_json(s.ram)},
          {"ram_reserved_bytes", s.ram_reserved},
          {"pin_limit_bytes", s.pin_limit},
          {"pinned", stat_json(s.pinned)},
          {"pinned_bytes", s.pinned.current},
          {"pinned_used_bytes", s.pinned_used},
          {"vram_budget_bytes", s.vram_budget},
          {"working_memory_bytes", s.working_memory},
          {"measured_working_memory_bytes", s.measured_working_memory},
          {"vram_limit_bytes", s.vram_limit},
          {"vram", stat_json(s.vram)},
          {"vram_reserved_bytes", s.vram_reserved},
          {"models_device_bytes", s.models_device_bytes},
          {"models_allocated_bytes", s.models_allocated_bytes},
          {"vram_unattributed_bytes", s.vram_unattributed},
          {"models_held", models}};
}

}  // namespace

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
  state_.ram_limit = o.ram_limit ? *o.ram_limit : default_ram_limit();
  state_.pin_arena = std::make_shared<offload::PinnedArena>(o.pin_memory_limit ? *o.pin_memory_limit
                                                                               : offload::default_pin_memory_limit());
  set_vram_budget(o.vram_budget);
}

ModelCache::~ModelCache() {
  // Locks keep the cache alive, so nothing is locked here; engines detach in their
  // destructors, before the models they manage go.
  for (auto& e : state_.entries) {
    if (e->engine && e->attached) e->engine->detach();
  }
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

void ModelCache::patch(const Lock& lock,
                       const std::function<void(anima::AnimaModelImpl&, offload::SidecarPlacer&)>& fn) {
  TORCH_CHECK(lock, "patch: the lock is empty");
  sidecars_.patch(lock.entry(), fn);
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

void ModelCache::set_vram_budget(uint64_t budget_request) { shares_.set_budget(budget_request, /*measured=*/false); }

void ModelCache::run(const Lock& lock, const std::function<void(anima::AnimaModelImpl&, offload::StreamingEngine&)>& fn) {
  TORCH_CHECK(lock, "run: the lock is empty");
  Entry& e = lock.entry();
  locking_.begin_forward(e);
  // The engine is ours until `running` is cleared, however fn ends (Note [cache locking]).
  std::optional<uint64_t> measured;
  {
    struct Idle {
      CacheLocking& locking;
      Entry& e;
      ~Idle() { locking.end_forward(e); }
    } idle{locking_, e};
    try {
      fn(*e.model, *e.engine);
    } catch (...) {
      locking_.publish(e, /*settle=*/false);  // an aborted forward is counted too
      throw;
    }
    locking_.publish(e, /*settle=*/false);
    measured = e.engine->measured_working_memory();
  }
  // Note [measured working memory]: the engines measure, the cache keeps the working memory.
  if (measured) shares_.grow_working_memory(*measured, e.name, e.engine->last_forward_kind());
}

// ---------------------------------------------------------------------------------------
// stats

CacheStats ModelCache::stats_locked() const {
  CacheStats s;
  s.device = state_.device->name();
  s.hits = state_.hits;
  s.misses = state_.misses;
  s.loads = state_.loads;
  s.evictions = state_.evictions;
  s.device_unloads = state_.device_unloads;
  s.device_drops = state_.device_drops;
  for (const auto& e : state_.entries) {
    if (!e->model) continue;
    s.models += 1;
    if (e->locks > 0) s.locked += 1;
  }
  s.ram_limit = state_.ram_limit;
  s.ram = state_.ram;
  s.ram_reserved = state_.ram_reserved;
  s.pin_limit = state_.pin_arena->limit();
  s.pinned = state_.pin_arena->pinned();
  s.pinned_used = state_.pin_arena->used_bytes();
  s.vram_budget = state_.budget;
  s.working_memory = state_.working_memory;
  s.measured_working_memory = state_.measured_working;
  s.vram_limit = shares_.limit();
  s.vram = state_.device->memory_stats().total;
  s.vram_reserved = shares_.reserved();
  for (const auto& e : state_.entries) {
    if (!e->loaded_once) continue;
    CacheStats::ModelPart m;
    m.id = e->id;
    m.name = e->name;
    m.source = e->spec.source;
    m.in_ram = static_cast<bool>(e->model);
    m.on_device = e->attached;
    m.dropped = e->dropped;
    m.locks = e->locks;
    m.share = e->attached ? e->share : 0;
    if (e->attached) {
      std::lock_guard<std::mutex> p(e->published_mutex);
      m.device_bytes = e->published.device_bytes;
      m.allocated_bytes = e->published.device_allocated;
    }
    s.models_device_bytes += m.device_bytes;
    s.models_allocated_bytes += m.allocated_bytes;
    s.models_held.push_back(std::move(m));
  }
  s.vram_unattributed = s.vram.current - static_cast<int64_t>(s.models_allocated_bytes);
  return s;
}

std::vector<std::shared_ptr<Entry>> ModelCache::entries() const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  std::vector<std::shared_ptr<Entry>> out;
  for (const auto& e : state_.entries) {
    if (e->loaded_once) out.push_back(e);
  }
  return out;
}

CacheStats ModelCache::stats() const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return stats_locked();
}

std::string ModelCache::stats_json(int indent) const { return cache_json(stats()).dump(indent); }

offload::EngineStats ModelCache::engine_stats(const std::shared_ptr<Entry>& e) const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  locking_.refresh_published(*e);
  offload::EngineStats s;
  {
    std::lock_guard<std::mutex> p(e->published_mutex);
    if (e->published.stats) s = *e->published.stats;
  }
  s.model_name = e->name;
  s.device = state_.device->name();
  offload::set_allocator_stats(s, *state_.device);
  if (!e->attached) s.model_total_bytes = e->model ? e->needs.model_bytes : 0;
  return s;
}

std::string ModelCache::model_stats_json(const std::shared_ptr<Entry>& e, int indent) const {
  offload::EngineStats s = engine_stats(e);
  nlohmann::json j = nlohmann::json::parse(s.to_json(-1));
  std::lock_guard<std::mutex> g(locking_.mutex());
  j["budget"]["budget_bytes"] = state_.budget;
  j["budget"]["working_memory_bytes"] = state_.working_memory;
  j["budget"]["share_bytes"] = e->attached ? e->share : 0;
  {
    const EntryState st = entry_state_locked(e);
    j["model"]["streamed_bytes_by_forward"] = {{"dit", st.streamed_dit}, {"adapter", st.streamed_adapter}};
  }
  j["model"]["id"] = e->id;  // two models may share a name (Note [stats parts])
  j["model"]["source"] = e->spec.source;
  j["model"]["dropped"] = e->dropped;
  j["model"]["in_ram"] = static_cast<bool>(e->model);
  j["model"]["on_device"] = e->attached;
  j["model"]["storage_dtype"] = dtype_name(e->dtypes.storage);
  j["model"]["compute_dtype"] = dtype_name(e->dtypes.compute);
  j["model"]["compute"] = {{"dtype", dtype_name(e->dtypes.compute)},
                           {"automatic", e->spec.compute_reason.rfind("auto:", 0) == 0},
                           {"reason", e->spec.compute_reason.empty() ? "requested" : e->spec.compute_reason}};
  j["hardware"] = hardware_summary(state_.device->device());
  const CacheStats cs = stats_locked();
  {
    // Note [stats parts]: the allocator's device-wide count, split.
    uint64_t own = 0, others = 0;
    for (const auto& m : cs.models_held) (m.id == e->id ? own : others) += m.allocated_bytes;
    nlohmann::json& d = j["device"];
    d["allocated_bytes"] = own;
    d["other_models_bytes"] = others;
    d["unattributed_bytes"] = s.allocator_stats_available
                                  ? nlohmann::json(s.allocator_current_bytes - static_cast<int64_t>(own + others))
                                  : nlohmann::json();
  }
  j["cache"] = cache_json(cs);
  return j.dump(indent);
}

void ModelCache::write_trace(const std::shared_ptr<Entry>& e, const std::string& path) const {
  std::string json;
  {
    std::lock_guard<std::mutex> g(locking_.mutex());
    locking_.refresh_published(*e);
  }
  {
    std::lock_guard<std::mutex> p(e->published_mutex);
    json = e->published.trace_json;
  }
  // No engine yet, or tracing is off: an empty trace.
  offload::TraceWriter::write_json(json.empty() ? offload::TraceWriter().to_json() : json, path);
}

void ModelCache::write_timeline_svg(const std::shared_ptr<Entry>& e, const std::string& path) const {
  std::string json;
  std::optional<offload::EngineStats> stats;
  {
    std::lock_guard<std::mutex> g(locking_.mutex());
    locking_.refresh_published(*e);
  }
  {
    std::lock_guard<std::mutex> p(e->published_mutex);
    json = e->published.trace_json;
    stats = e->published.stats;
  }
  if (!state_.options.trace) {
    throw InvalidArgument("timeline of model '" + e->name + "' for '" + path +
                          "': tracing is off (RuntimeOptions::trace, or sluice run --timeline)");
  }
  if (json.empty()) {
    throw InvalidArgument("timeline of model '" + e->name + "' for '" + path + "': no forward has been traced");
  }
  offload::TimelineStep step;
  try {
    step = offload::timeline_step_from_trace(json, "dit");
  } catch (const InvalidArgument& ex) {
    throw InvalidArgument("model '" + e->name + "', '" + path + "': " + ex.what());
  }
  step.model = e->name;
  if (stats) {
    for (const auto& k : stats->plan.kinds) {
      if (k.kind != step.kind) continue;
      if (k.floor_ms > 0) step.floor_ms = k.floor_ms;
      if (k.predicted_step_ms > 0) step.predicted_step_ms = k.predicted_step_ms;
    }
  }
  offload::write_timeline_svg_file(offload::render_timeline_svg(step), path);
}

anima::AnimaConfig ModelCache::entry_config(const std::shared_ptr<Entry>& e) const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return e->config;
}

ModelCache::EntryState ModelCache::entry_state(const std::shared_ptr<Entry>& e) const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return entry_state_locked(e);
}

ModelCache::EntryState ModelCache::entry_state_locked(const std::shared_ptr<Entry>& e) const {
  EntryState s;
  s.in_ram = static_cast<bool>(e->model);
  s.attached = e->attached;
  s.dropped = e->dropped;
  s.locks = e->locks;
  s.ram_bytes = e->ram_bytes;
  s.share = e->attached ? e->share : 0;
  if (e->model) {
    s.minimum = e->needs.minimum;
    s.wanted = e->needs.wanted;
    s.full = e->needs.full;
  }
  if (e->attached) {
    std::lock_guard<std::mutex> p(e->published_mutex);
    s.device_bytes = e->published.device_bytes;
    s.device_allocated = e->published.device_allocated;
    s.residency = e->published.residency;
    s.streamed_dit = e->published.streamed_dit;
    s.streamed_adapter = e->published.streamed_adapter;
  }
  return s;
}

}  // namespace sluice::cache
