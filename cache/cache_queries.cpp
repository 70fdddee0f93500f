#include "cache/cache_queries.h"

#include <nlohmann/json.hpp>

#include <optional>

#include "offload/report/timeline_step.h"
#include "offload/report/timeline_svg.h"
#include "runtime/error.h"
#include "runtime/hardware.h"
#include "runtime/record_json.h"

namespace sluice::cache {

namespace {

// The host_memory_limit object of the stats JSON (Note [host memory limit]): the limit the
// defaults came from, where it came from, and the sources it is the smallest of.
nlohmann::json host_limit_json(const HostMemoryLimit& h) {
  const auto opt = [](const std::optional<uint64_t>& v) { return v ? nlohmann::json(*v) : nlohmann::json(); };
  return {{"bytes", h.bytes},
          {"source", h.source},
          {"physical_bytes", h.physical_bytes},
          {"cgroup_bytes", opt(h.cgroup_bytes)},
          {"cgroup_source", h.cgroup_bytes ? nlohmann::json(h.cgroup_source) : nlohmann::json()},
          {"mem_available_bytes", opt(h.mem_available_bytes)},
          {"sluice_host_bytes", h.sluice_host_bytes}};
}

std::string source_or_given(const std::string& s) { return s.empty() ? "given" : s; }

// The cache object of the stats JSON: the CacheStats record (one key per field, Note [field
// lists] in sluice/stats.hpp) with the named parts of Note [stats parts], and what it writes
// differently: the host memory limit in detail (its sources), a default's source "given"
// where the value was given, and pinned_bytes, the older name of pinned.current.
nlohmann::json cache_json(const CacheStats& s, const HostMemoryLimit& host_limit) {
  nlohmann::json j = s;
  j["host_memory_limit"] = host_limit_json(host_limit);
  j["ram_limit_source"] = source_or_given(s.ram_limit_source);
  j["pin_limit_source"] = source_or_given(s.pin_limit_source);
  j["pinned_bytes"] = s.pinned.current;
  return j;
}

}  // namespace

CacheStats CacheQueries::stats_locked() const {
  CacheStats s;
  s.device = s_.device->name();
  s.hits = s_.hits;
  s.misses = s_.misses;
  s.loads = s_.loads;
  s.evictions = s_.evictions;
  s.device_unloads = s_.device_unloads;
  s.device_drops = s_.device_drops;
  for (const auto& e : s_.entries) {
    if (!e->in_ram()) continue;
    s.models += 1;
    if (e->locks > 0) s.locked += 1;
  }
  s.host_memory_limit_bytes = s_.host_limit.bytes;
  s.host_memory_limit_source = s_.host_limit.source;
  s.ram_limit_bytes = s_.ram_limit;
  s.ram_limit_source = s_.ram_limit_source;
  s.ram = s_.ram;
  s.ram_reserved_bytes = s_.ram_reserved;
  s.pin_limit_bytes = s_.pin_arena->limit();
  s.pin_limit_source = s_.pin_arena->limit_source();
  s.pinned = s_.pin_arena->pinned();
  s.pinned_used_bytes = s_.pin_arena->used_bytes();
  s.vram_budget_bytes = s_.budget;
  s.vram_budget_source = s_.budget_source;
  s.working_memory_bytes = s_.working_memory;
  s.measured_working_memory_bytes = s_.measured_working;
  s.vram_limit_bytes = shares_.limit();
  s.vram = s_.device->memory_stats().total;
  s.vram_reserved_bytes = shares_.reserved();
  for (const auto& e : s_.entries) {
    if (!e->loaded_once) continue;
    HeldModel m;
    m.id = e->id;
    m.name = e->name;
    m.source = e->request.spec.source;
    m.in_ram = e->in_ram();
    m.on_device = e->attached;
    m.dropped = e->dropped;
    m.locks = e->locks;
    m.share_bytes = e->attached ? e->share : 0;
    if (e->attached) {
      std::lock_guard<std::mutex> p(e->published_mutex);
      m.device_bytes = e->published.device_bytes;
      m.allocated_bytes = e->published.device_allocated;
    }
    s.models_device_bytes += m.device_bytes;
    s.models_allocated_bytes += m.allocated_bytes;
    s.models_held.push_back(std::move(m));
  }
  s.vram_unattributed_bytes = s.vram.current - static_cast<int64_t>(s.models_allocated_bytes);
  return s;
}

std::vector<std::shared_ptr<Entry>> CacheQueries::entries() const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  std::vector<std::shared_ptr<Entry>> out;
  for (const auto& e : s_.entries) {
    if (e->loaded_once) out.push_back(e);
  }
  return out;
}

CacheStats CacheQueries::stats() const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return stats_locked();
}

std::string CacheQueries::stats_json(int indent) const { return cache_json(stats(), s_.host_limit).dump(indent); }

offload::EngineStats CacheQueries::engine_stats(const std::shared_ptr<Entry>& e) const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  locking_.refresh_published(*e);
  offload::EngineStats s;
  {
    std::lock_guard<std::mutex> p(e->published_mutex);
    if (e->published.stats) s = *e->published.stats;
  }
  s.model_name = e->name;
  s.device = s_.device->name();
  offload::set_allocator_stats(s, *s_.device);
  if (!e->attached) s.model_total_bytes = e->in_ram() ? e->needs.model_bytes : 0;
  return s;
}

std::string CacheQueries::model_stats_json(const std::shared_ptr<Entry>& e, int indent) const {
  offload::EngineStats s = engine_stats(e);
  nlohmann::json j = s.to_json_value();
  std::lock_guard<std::mutex> g(locking_.mutex());
  j["budget"]["budget_bytes"] = s_.budget;
  j["budget"]["working_memory_bytes"] = s_.working_memory;
  j["budget"]["share_bytes"] = e->attached ? e->share : 0;
  {
    const EntryState st = entry_state_locked(e);
    if (e->is_adopted) {
      j["model"]["streamed_bytes_by_part"] = st.streamed_by_part;  // the host module's top-level children
    } else {
      j["model"]["streamed_bytes_by_forward"] = {{"dit", st.streamed_dit}, {"adapter", st.streamed_adapter}};
    }
  }
  j["model"]["id"] = e->id;  // two models may share a name (Note [stats parts])
  j["model"]["source"] = e->request.spec.source;
  j["model"]["dropped"] = e->dropped;
  j["model"]["in_ram"] = e->in_ram();
  j["model"]["on_device"] = e->attached;
  j["model"]["storage_dtype"] = dtype_name(e->request.dtypes.storage);
  j["model"]["compute_dtype"] = dtype_name(e->request.dtypes.compute);
  j["model"]["compute"] = {{"dtype", dtype_name(e->request.dtypes.compute)},
                           {"automatic", e->request.spec.compute_reason.rfind("auto:", 0) == 0},
                           {"reason", e->request.spec.compute_reason.empty() ? "requested" : e->request.spec.compute_reason}};
  j["hardware"] = hardware_summary(s_.device->device());
  j["host_memory_limit"] = host_limit_json(s_.host_limit);
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
  j["cache"] = cache_json(cs, s_.host_limit);
  return j.dump(indent);
}

void CacheQueries::write_trace(const std::shared_ptr<Entry>& e, const std::string& path) const {
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

void CacheQueries::write_timeline_svg(const std::shared_ptr<Entry>& e, const std::string& path) const {
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
  if (!s_.options.trace) {
    throw InvalidArgument("timeline of model '" + e->name + "' for '" + path +
                          "': tracing is off (RuntimeOptions::trace, or sluice run --timeline)");
  }
  if (json.empty()) {
    throw InvalidArgument("timeline of model '" + e->name + "' for '" + path + "': no forward has been traced");
  }
  offload::TimelineStep step;
  try {
    // An Anima model's step is its DiT forward; an adopted model's (Note [adopted models]),
    // whose host names its forwards, the kind its forwards mostly are.
    std::string kind = "dit";
    if (e->is_adopted && stats && !stats->plan.step_kind.empty()) kind = stats->plan.step_kind;
    step = offload::timeline_step_from_trace(json, kind);
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

anima::AnimaConfig CacheQueries::entry_config(const std::shared_ptr<Entry>& e) const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return e->request.config.value_or(anima::AnimaConfig{});  // an adopted model has none
}

EntryState CacheQueries::entry_state(const std::shared_ptr<Entry>& e) const {
  std::lock_guard<std::mutex> g(locking_.mutex());
  return entry_state_locked(e);
}

EntryState CacheQueries::entry_state_locked(const std::shared_ptr<Entry>& e) const {
  EntryState s;
  s.in_ram = e->in_ram();
  s.attached = e->attached;
  s.dropped = e->dropped;
  s.locks = e->locks;
  s.ram_bytes = e->ram_bytes;
  s.share = e->attached ? e->share : 0;
  if (e->in_ram()) {
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
    s.streamed_by_part = e->published.streamed_by_part;
  }
  return s;
}

}  // namespace sluice::cache
