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

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string file_stem(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t dot = base.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? base : base.substr(0, dot);
}

// Absolute path without symlinks, or `path` itself when it cannot be resolved (the load
// then reports the missing file).
std::string canonical(const std::string& path) {
  char* r = ::realpath(path.c_str(), nullptr);
  if (!r) return path;
  std::string out(r);
  std::free(r);
  return out;
}

std::string percent(uint64_t part, uint64_t whole) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << (whole ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 100.0) << "%";
  return o.str();
}

// The config a generated or loaded model uses.
anima::AnimaConfig config_of(const LoadSpec& spec) {
  if (spec.config) return *spec.config;
  switch (source_kind(spec.source)) {
    case SourceKind::preset:
    case SourceKind::json_config: return anima::config_from_name_or_file(spec.source);
    case SourceKind::checkpoint: break;
  }
  const auto file = safetensors::File::open(spec.source);
  const anima::CheckpointProbe probe = anima::probe_checkpoint(*file);
  if (!probe.has_dit) throw CheckpointError("'" + spec.source + "' is not an Anima checkpoint: " + probe.reason);
  return probe.inferred;
}

// Reads or generates the model of `spec` on the host, in its storage dtypes.
anima::AnimaModel read_model(const LoadSpec& spec, const DtypePair& dtypes, const std::string& name, int threads) {
  Fp8Options storage = spec.storage;
  storage.storage = dtypes.storage;
  storage.compute = dtypes.compute;
  if (source_kind(spec.source) == SourceKind::checkpoint) {
    anima::LoadOptions o;
    o.config = spec.config;
    o.device = at::kCPU;
    o.storage = storage;
    o.threads = threads;
    return anima::load_anima(spec.source, o);
  }
  anima::AnimaConfig config = config_of(spec);
  anima::AnimaModel model(config, anima::BuildOptions{dtypes.compute, at::kCPU});
  auto params = model->named_parameters(/*recurse=*/true);
  auto weights = anima::random_weights(config, spec.seed, dtypes.compute);
  for (auto& [key, t] : weights) {
    at::Tensor* p = params.find(key);
    TORCH_INTERNAL_ASSERT(p, "generated tensor '", key, "' is not a parameter of the model");
    p->set_data(to_host_owned(t, dtypes.compute));
    t = at::Tensor();  // one copy at a time
  }
  offload::apply_storage(*model, name, storage, anima::declared_fp8_skips());
  return model;
}

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

uint64_t default_working_memory(uint64_t budget, int64_t resolution) {
  const double scale = std::pow(static_cast<double>(std::max<int64_t>(resolution, 1)) / 1024.0, 2.0);
  const uint64_t sized = std::max<uint64_t>(256 * kMiB, static_cast<uint64_t>(static_cast<double>(kGiB) * scale));
  return std::min(sized, budget / 4);
}

uint64_t default_ram_limit() {
  const uint64_t ram = offload::physical_ram_bytes();
  const uint64_t half = ram / 2 > 2 * kGiB ? ram / 2 - 2 * kGiB : 0;
  return std::max<uint64_t>(4 * kGiB, half);
}

SourceKind source_kind(const std::string& source) {
  for (const auto& p : anima::preset_names()) {
    if (p == source) return SourceKind::preset;
  }
  return ends_with(source, ".json") ? SourceKind::json_config : SourceKind::checkpoint;
}

uint64_t estimate_model_bytes(const LoadSpec& spec, at::Device device) {
  const DtypePair dt = resolve_dtypes(spec.storage.storage, spec.storage.compute, device);
  const anima::AnimaConfig config = config_of(spec);
  anima::AnimaModel meta(config, anima::BuildOptions{dt.compute, at::kMeta});
  const SkipList skips = SkipList::from_options(spec.storage, anima::declared_fp8_skips());
  // Note [layerwise storage] (offload/storage.h): unskipped managed layers are stored in
  // the storage dtype, everything else stays as built.
  uint64_t bytes = 0;
  std::unordered_set<const c10::TensorImpl*> managed;
  for (const auto& [name, layer] : offload::managed_layers(*meta)) {
    const at::ScalarType t = skips.matches(name) ? dt.compute : dt.storage;
    int64_t n = layer->stored_weight().numel();
    managed.insert(layer->stored_weight().unsafeGetTensorImpl());
    if (layer->has_bias()) {
      n += layer->stored_bias().numel();
      managed.insert(layer->stored_bias().unsafeGetTensorImpl());
    }
    bytes += static_cast<uint64_t>(n) * c10::elementSize(t);
  }
  for (const auto& p : meta->named_parameters(true)) {
    if (!managed.count(p.value().unsafeGetTensorImpl())) bytes += p.value().nbytes();
  }
  for (const auto& b : meta->named_buffers(true)) bytes += b.value().nbytes();
  return bytes;
}

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

offload::EngineOptions ModelCache::engine_options(const Entry& e) const {
  offload::EngineOptions o;
  o.device = state_.device;
  o.budget_bytes = e.share;
  o.working_memory_bytes = 0;  // the cache keeps the working memory out of every share
  o.grow_working_memory = false;  // and grows it itself from the engines' measurements
  o.max_resident = e.max_resident;
  o.prefetch_depth = state_.options.prefetch;
  o.policy = state_.options.policy;
  o.pin = state_.options.pin;
  o.pin_arena = state_.pin_arena;
  o.timing = state_.options.timing;
  o.trace = state_.options.trace;
  o.log_attach = false;
  return o;
}

void ModelCache::refresh_needs(Entry& e) {
  e.needs = offload::StreamingEngine::needs(*e.model, engine_options(e));
  e.needs.minimum += e.sidecar_bytes;
  e.needs.full += e.sidecar_bytes;
  e.needs.wanted += e.sidecar_bytes;
}

void ModelCache::shift_sidecars(Entry& e, int64_t delta) {
  const int64_t now = static_cast<int64_t>(e.sidecar_bytes) + delta;
  TORCH_INTERNAL_ASSERT(now >= 0, "sidecar bytes of '", e.name, "' below zero");
  e.sidecar_bytes = static_cast<uint64_t>(now);
  const auto shift = [delta](uint64_t v) { return static_cast<uint64_t>(std::max<int64_t>(static_cast<int64_t>(v) + delta, 0)); };
  if (e.target) e.target = shift(*e.target);  // the residency asked for, beside the sidecars
  if (!e.model) return;
  e.needs.minimum = shift(e.needs.minimum);
  e.needs.full = shift(e.needs.full);
  e.needs.wanted = shift(e.needs.wanted);
}

// ---------------------------------------------------------------------------------------
// sidecars (Note [sidecar share])

// The placer ModelCache::patch hands out, one per entry. Its calls come from a LoraScope
// inside patch() (this thread holds the cache mutex, the entry is idle); a release from
// anywhere else takes the cache mutex and waits for the entry's forward itself.
class EntrySidecars final : public offload::SidecarPlacer {
 public:
  EntrySidecars(ModelCache& cache, Entry& entry) : cache_(cache), entry_(entry) {}

  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what) override {
    TORCH_CHECK(patching_.load() == std::this_thread::get_id(), what, ": sidecars of model '", entry_.name,
                "' are placed through ModelCache::patch only");
    return cache_.place_sidecars(entry_, host, dtypes, what);
  }

  void sidecars_released(uint64_t bytes) noexcept override {
    if (patching_.load() == std::this_thread::get_id()) {
      cache_.release_sidecars(entry_, bytes);
      return;
    }
    try {
      Guard g(cache_.locking_.mutex());
      cache_.locking_.wait_idle(entry_, g);
      cache_.release_sidecars(entry_, bytes);
    } catch (const std::exception& e) {
      log::error("releasing sidecars of model '" + entry_.name + "' failed: " + e.what());
    }
  }

  std::atomic<std::thread::id> patching_{};  // the thread inside patch() for this entry

 private:
  ModelCache& cache_;
  Entry& entry_;
};

void ModelCache::patch(const Lock& lock,
                       const std::function<void(anima::AnimaModelImpl&, offload::SidecarPlacer&)>& fn) {
  TORCH_CHECK(lock, "patch: the lock is empty");
  Entry& e = lock.entry();
  Guard g(locking_.mutex());
  locking_.wait_idle(e, g);  // locked: it stays in RAM and on the device meanwhile
  TORCH_INTERNAL_ASSERT(e.model && e.attached && e.engine, "locked model '", e.name, "' is not on the device");
  if (!e.placer) e.placer = std::make_unique<EntrySidecars>(*this, e);
  auto& placer = static_cast<EntrySidecars&>(*e.placer);
  struct Patching {
    EntrySidecars& p;
    ~Patching() { p.patching_.store(std::thread::id()); }
  } patching{placer};
  placer.patching_.store(std::this_thread::get_id());
  fn(*e.model, placer);
}

std::vector<at::Tensor> ModelCache::place_sidecars(Entry& e, const std::vector<at::Tensor>& host,
                                                   const std::vector<at::ScalarType>& dtypes, const std::string& what) {
  TORCH_INTERNAL_ASSERT(e.attached && e.engine && !e.running, "sidecars of '", e.name,
                        "' placed off the device or during its forward");
  uint64_t bytes = 0;
  for (size_t i = 0; i < host.size() && i < dtypes.size(); ++i) {
    bytes += static_cast<uint64_t>(host[i].numel()) * c10::elementSize(dtypes[i]);
  }
  // The most the share can become: its free part of the limit and every other unlocked
  // model's share (make_device_room takes them, partially and then whole).
  const uint64_t free = limit() - std::min(limit(), reserved());
  uint64_t others = 0;
  for (const auto& p : state_.entries) {
    if (p.get() != &e && p->attached && p->locks == 0) others += p->share;
  }
  const uint64_t most = e.share + free + others;
  const uint64_t minimum = e.engine->minimum_budget();  // with the sidecars placed so far (no working memory in a share)
  if (minimum + bytes > most) {
    std::ostringstream msg;
    msg << what << " needs " << format_mib(bytes) << " of device memory for its sidecars (" << bytes
        << " bytes), but model '" << e.name << "' can have at most " << format_mib(most - std::min(most, minimum))
        << " beside its minimum of " << format_mib(minimum) << " on " << state_.device->name() << ": its share of "
        << format_mib(e.share) << ", " << format_mib(free) << " free and " << format_mib(others)
        << " held by unlocked models, of the " << format_mib(limit()) << " that the vram budget ("
        << format_mib(state_.budget) << ") leaves beside the working memory; " << format_mib(minimum + bytes - most)
        << " missing (raise the vram budget or unlock other models)";
    throw ResourceError(msg.str());
  }
  const uint64_t before = e.share;
  shift_sidecars(e, static_cast<int64_t>(bytes));
  std::vector<at::Tensor> out;
  try {
    // Grow by the sidecars' bytes, no further than the model now wants.
    const uint64_t want = wanted_share(e);
    uint64_t grow = want > e.share ? std::min(want - e.share, bytes) : 0;
    uint64_t room = limit() - std::min(limit(), reserved());
    if (room < grow) {
      make_device_room(grow - room, &e);
      room = limit() - std::min(limit(), reserved());
    }
    grow = std::min(grow, room);
    out = e.engine->place_sidecars(host, dtypes, what, grow);  // one replan: budget and sidecars
    e.share += grow;
  } catch (...) {
    shift_sidecars(e, -static_cast<int64_t>(bytes));
    throw;
  }
  count_pinned_ram(e);
  locking_.publish(e);
  log::info(what + " on '" + e.name + "': sidecars " + format_mib(bytes) + ", share " + format_mib(before) + " -> " +
            format_mib(e.share) + " of " + format_mib(limit()) + "; residency " + e.engine->plan().residency_map());
  return out;
}

void ModelCache::release_sidecars(Entry& e, uint64_t bytes) noexcept {
  try {
    shift_sidecars(e, -static_cast<int64_t>(std::min(bytes, e.sidecar_bytes)));
    if (!e.engine) return;
    // Back to what the model wants without them: the bytes the share grew for them.
    const uint64_t want = e.attached ? wanted_share(e) : 0;
    const uint64_t shrink = e.attached && e.share > want ? std::min(e.share - want, bytes) : 0;
    const uint64_t shrunk = e.engine->sidecars_released(bytes, shrink);
    if (!e.attached) return;
    e.share -= std::min(e.share, shrunk);
    count_pinned_ram(e);
    locking_.publish(e);
  } catch (const std::exception& ex) {
    log::error("releasing sidecars of model '" + e.name + "' failed: " + ex.what());
  }
}

uint64_t ModelCache::reserved() const {
  uint64_t sum = 0;
  for (const auto& e : state_.entries) {
    if (e->attached) sum += e->share;
  }
  return sum;
}

uint64_t ModelCache::wanted_share(const Entry& e) const {
  uint64_t want = e.needs.wanted;
  if (e.target) want = std::clamp(*e.target, e.needs.minimum, std::max(e.needs.minimum, e.needs.wanted));
  return std::min(want, limit());
}

std::string ModelCache::budget_error(const Entry& e) const {
  // The smallest budget B with B - working_memory(B) >= minimum.
  const uint64_t m = e.needs.minimum;
  uint64_t need;
  if (state_.options.working_memory) {
    need = m + *state_.options.working_memory;
  } else {
    // B - default_working_memory(B) never decreases as B grows: bisect.
    uint64_t lo = m, hi = m + default_working_memory(UINT64_MAX / 4, state_.options.resolution);
    while (lo < hi) {
      const uint64_t mid = lo + (hi - lo) / 2;
      if (mid - default_working_memory(mid, state_.options.resolution) >= m) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    need = lo;
  }
  std::ostringstream msg;
  msg << "vram budget " << format_mib(state_.budget) << " is too small for model '" << e.name << "' on " << state_.device->name()
      << ": the minimum that would work is " << format_mib(need) << " (" << need << " bytes: " << format_mib(m)
      << " for always-resident layers, upcast scratch and the staging ring, plus working memory)";
  return msg.str();
}

// ---------------------------------------------------------------------------------------
// device tier (cache mutex held, the entry not running: Note [cache locking])

void ModelCache::attach(Entry& e, uint64_t share) {
  TORCH_INTERNAL_ASSERT(!e.running, "attach of '", e.name, "' during its forward");
  const auto t0 = std::chrono::steady_clock::now();
  if (!e.engine) e.engine = std::make_unique<offload::StreamingEngine>(engine_options(e));
  e.engine->set_max_resident(e.max_resident);
  e.engine->attach(*e.model, e.name, share);
  e.attached = true;
  e.share = share;
  count_pinned_ram(e);
  locking_.publish(e);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const offload::ResidencyPlan& plan = e.engine->plan();
  std::ostringstream line;
  line.setf(std::ios::fixed);
  if (!e.announced) {
    line.precision(2);
    // InvokeAI's wording first (frontends parse it), then the split.
    line << "Loaded model '" << e.name << "' onto " << state_.device->name() << " in " << e.load_seconds + secs
         << "s. Total model size: " << format_mib(e.needs.model_bytes) << ", VRAM: " << format_mib(plan.resident_bytes)
         << " (" << percent(plan.resident_bytes, e.needs.model_bytes) << "); host load (read or generate, cast) "
         << e.load_seconds << "s, attach " << secs << "s; compute " << dtype_name(e.dtypes.compute) << " ("
         << (e.spec.compute_reason.empty() ? "requested" : e.spec.compute_reason) << ")";
    log::info(line.str());
    e.announced = true;
  } else {
    line.precision(2);
    line << "Model '" << e.name << "' back onto " << state_.device->name() << " in " << secs
         << "s, VRAM: " << format_mib(plan.resident_bytes) << " (" << percent(plan.resident_bytes, e.needs.model_bytes)
         << ")";
    log::info(line.str());
  }
  std::ostringstream map;
  map << "Residency of '" << e.name << "' (" << offload::residency_policy_name(plan.policy)
      << "): " << plan.residency_map() << "; ring " << format_mib(plan.ring_bytes) << " (largest slot "
      << format_mib(plan.slot_bytes) << ")"
      << ", share " << format_mib(share) << " of " << format_mib(limit()) << " (budget " << format_mib(state_.budget)
      << ", working memory " << format_mib(state_.working_memory) << ")";
  log::info(map.str());
}

void ModelCache::detach(Entry& e) {
  if (!e.attached) return;
  TORCH_INTERNAL_ASSERT(!e.running, "detach of '", e.name, "' during its forward");
  e.engine->detach();
  e.attached = false;
  e.share = 0;
  locking_.publish(e);
}

void ModelCache::resize(Entry& e, uint64_t share) {
  TORCH_INTERNAL_ASSERT(e.attached, "resize of a detached model");
  if (share == e.share) return;
  TORCH_INTERNAL_ASSERT(!e.running, "resize of '", e.name, "' during its forward");
  e.engine->set_budget(share, /*release_freed=*/false);  // Note [releasing cached memory]: the cache decides
  e.share = share;
  count_pinned_ram(e);
  locking_.publish(e);
  log::debug("Residency of '" + e.name + "': " + e.engine->plan().residency_map() + ", share " + format_mib(share));
}

// Pinned host copies replace the pageable ones (Note [pinned arena]): the model then takes
// its bytes plus the arena's alignment padding of its pinned layers. A detach changes
// nothing (the pinned copies stay with the model until it leaves RAM). Run lock held.
void ModelCache::count_pinned_ram(Entry& e) {
  const uint64_t host = e.needs.model_bytes + e.engine->pinned_padding_bytes();
  if (host > e.ram_bytes) state_.ram.increase(static_cast<int64_t>(host - e.ram_bytes));
  if (host < e.ram_bytes) state_.ram.decrease(static_cast<int64_t>(e.ram_bytes - host));
  e.ram_bytes = host;
}

uint64_t ModelCache::device_bytes_of(Entry& e) {
  if (!e.attached) return 0;
  TORCH_INTERNAL_ASSERT(!e.running, "device bytes of '", e.name, "' read during its forward");
  return e.engine->device_bytes();
}

void ModelCache::make_device_room(uint64_t bytes, const Entry* exclude) {
  std::vector<Entry*> victims;
  for (auto& p : state_.entries) {
    if (p.get() != exclude && p->attached && p->locks == 0) victims.push_back(p.get());
  }
  std::sort(victims.begin(), victims.end(), [](Entry* a, Entry* b) { return a->last_used < b->last_used; });
  uint64_t left = bytes;
  // Partial unloads first, least recently used first, each only as much as still needed.
  for (Entry* v : victims) {
    if (left == 0) return;
    const uint64_t can = v->share > v->needs.minimum ? v->share - v->needs.minimum : 0;
    const uint64_t take = std::min(can, left);
    if (take == 0) continue;
    resize(*v, v->share - take);
    left -= take;
    ++state_.device_unloads;
  }
  // Then whole models off the device (their RAM copy stays).
  for (Entry* v : victims) {
    if (left == 0) return;
    const uint64_t freed = v->share;
    detach(*v);
    left -= std::min(left, freed);
    ++state_.device_drops;
    log::info("Model '" + v->name + "' taken off " + state_.device->name() + " to make room (" + format_mib(freed) + ")");
  }
}

void ModelCache::ensure_device(Entry& e, Guard& g, bool required) {
  TORCH_INTERNAL_ASSERT(e.model, "ensure_device: model not in RAM");
  if (e.needs.minimum > limit()) throw ResourceError(budget_error(e));
  const uint64_t desired = wanted_share(e);
  const uint64_t have = e.attached ? e.share : 0;
  if (e.attached && have >= desired) return;
  const uint64_t need = desired - have;
  uint64_t free = limit() - std::min(limit(), reserved());
  if (free < need) make_device_room(need - free, &e);
  free = limit() - std::min(limit(), reserved());
  const uint64_t grant = have + std::min(need, free);
  if (!e.attached) {
    if (grant < e.needs.minimum) {
      std::ostringstream msg;
      msg << "cannot put model '" << e.name << "' on " << state_.device->name() << ": it needs at least "
          << format_mib(e.needs.minimum) << " of device memory, but models in use hold "
          << format_mib(reserved()) << " of the " << format_mib(limit()) << " that the budget ("
          << format_mib(state_.budget) << ") leaves beside the working memory; unlock them or raise the budget";
      if (required) throw ResourceError(msg.str());
      log::info(msg.str() + " (it stays in RAM until it is locked)");
      return;
    }
    attach(e, grant);
  } else if (grant > have) {
    resize(e, grant);
  }
}

// ---------------------------------------------------------------------------------------
// RAM tier (cache mutex held)

void ModelCache::evict(Entry& e) {
  TORCH_INTERNAL_ASSERT(e.locks == 0 && !e.loading, "evicting a model in use");
  if (e.model) {
    detach(e);
    e.model = anima::AnimaModel(nullptr);
    state_.ram.decrease(static_cast<int64_t>(e.ram_bytes));
    e.ram_bytes = 0;
    e.announced = false;
    ++state_.evictions;
    log::info("Evicted model '" + e.name + "' from RAM" + (e.dropped ? " (dropped)" : ""));
  }
  if (e.dropped) {
    state_.entries.remove_if([&](const std::shared_ptr<Entry>& p) { return p.get() == &e; });
  }
}

void ModelCache::make_ram_room(uint64_t bytes, const Entry* exclude) {
  if (state_.ram_limit == 0) return;
  // Reservations of models being read count as taken (Note [cache locking]).
  while (static_cast<uint64_t>(state_.ram.current) + state_.ram_reserved + bytes > state_.ram_limit) {
    Entry* victim = nullptr;
    for (auto& p : state_.entries) {
      if (p.get() == exclude || !p->model || p->locks > 0 || p->loading) continue;
      if (!victim || p->last_used < victim->last_used) victim = p.get();
    }
    if (!victim) {
      if (!state_.ram_warned) {
        log::warn("RAM limit " + format_mib(state_.ram_limit) + " exceeded: models in use hold " +
                  format_mib(static_cast<uint64_t>(state_.ram.current)) + ", models being read " +
                  format_mib(state_.ram_reserved) + ", and " + format_mib(bytes) + " more are needed");
        state_.ram_warned = true;
      }
      return;
    }
    evict(*victim);
  }
}

void ModelCache::ensure_loaded(const std::shared_ptr<Entry>& ep, Guard& g, bool count_hit) {
  Entry& e = *ep;
  locking_.wait_loaded(e, g);
  if (e.dropped) throw InvalidArgument("model '" + e.name + "' was dropped from the cache; load it again");
  if (e.model) {
    if (count_hit) ++state_.hits;
    return;
  }
  ++state_.misses;
  e.loading = true;
  make_ram_room(e.estimate, &e);
  state_.ram_reserved += e.estimate;  // until the read ends: other misses make room for it too
  g.unlock();
  anima::AnimaModel model(nullptr);
  double secs = 0;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    if (state_.options.before_read) state_.options.before_read(e.name);
    model = read_model(e.spec, e.dtypes, e.name, state_.options.load_threads);
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } catch (...) {
    g.lock();
    state_.ram_reserved -= e.estimate;
    e.loading = false;
    locking_.loaded();
    throw;
  }
  g.lock();
  state_.ram_reserved -= e.estimate;
  e.model = model;
  e.config = model->config();
  e.loading = false;
  e.loaded_once = true;
  locking_.loaded();
  try {
    refresh_needs(e);
  } catch (...) {
    e.model = anima::AnimaModel(nullptr);
    throw;
  }
  e.ram_bytes = e.needs.model_bytes;
  e.load_seconds = secs;
  e.announced = false;
  state_.ram.increase(static_cast<int64_t>(e.ram_bytes));
  ++state_.loads;
  if (e.ram_bytes != e.estimate) {
    log::debug("model '" + e.name + "' takes " + std::to_string(e.ram_bytes) + " bytes in RAM, estimated " +
               std::to_string(e.estimate));
  }
  if (e.dropped) {  // dropped while it was being read
    evict(e);
    throw InvalidArgument("model '" + e.name + "' was dropped from the cache; load it again");
  }
  make_ram_room(0, &e);
}

void ModelCache::mark_dropped(const std::shared_ptr<Entry>& e) {
  if (e->dropped) return;
  e->dropped = true;
  if (e->locks == 0 && !e->loading) {
    evict(*e);
  } else {
    log::info("Model '" + e->name + "' is in use: it is dropped when its last lock ends");
  }
}

// ---------------------------------------------------------------------------------------
// public operations

std::shared_ptr<Entry> ModelCache::load(const LoadSpec& spec) {
  const SourceKind kind = source_kind(spec.source);
  if (spec.max_resident && !(*spec.max_resident >= 0.0 && *spec.max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*spec.max_resident));
  }
  const DtypePair dtypes = resolve_dtypes(spec.storage.storage, spec.storage.compute, state_.device->device());
  const SkipList skips = SkipList::from_options(spec.storage, anima::declared_fp8_skips());

  std::string key = kind == SourceKind::preset ? "preset:" + spec.source : "file:" + canonical(spec.source);
  if (kind != SourceKind::checkpoint) key += "#seed=" + std::to_string(spec.seed);
  std::ostringstream settings;
  settings << "storage=" << dtype_name(dtypes.storage) << " compute=" << dtype_name(dtypes.compute) << " skips=[";
  for (const auto& p : skips.patterns()) settings << p << ";";
  settings << "] config=" << (spec.config ? anima::config_to_json(*spec.config).dump() : "");

  Guard g(locking_.mutex());
  std::shared_ptr<Entry> e;
  for (auto& p : state_.entries) {
    if (p->key == key && !p->dropped) e = p;
  }
  if (e && e->settings != settings.str()) {
    log::info("Reloading model '" + e->name + "': loading settings changed (" + e->settings + " -> " +
              settings.str() + ")");
    mark_dropped(e);
    e.reset();
  }
  const bool created = !e;
  if (created) {
    e = std::make_shared<Entry>();
    e->key = key;
    e->settings = settings.str();
    e->spec = spec;
    e->dtypes = dtypes;
    e->max_resident = spec.max_resident;
    if (!spec.name.empty()) {
      e->name = spec.name;
    } else if (spec.config) {
      e->name = spec.config->name;
    } else {
      e->name = kind == SourceKind::checkpoint ? file_stem(spec.source) : spec.source;
      if (kind == SourceKind::json_config) e->name = config_of(spec).name;
    }
    g.unlock();
    const uint64_t estimate = estimate_model_bytes(spec, state_.device->device());  // reads a file header
    g.lock();
    e->estimate = estimate;
    std::shared_ptr<Entry> raced;  // another thread created it meanwhile
    for (auto& p : state_.entries) {
      if (p->key == key && !p->dropped && p->settings == e->settings) raced = p;
    }
    if (raced) {
      e = raced;
    } else {
      e->id = ++state_.next_id;
      state_.entries.push_back(e);
    }
  }
  g.unlock();
  with_pinned(e, /*count_hit=*/true, [&](Entry& en, Guard& gg) {
    if (!created && spec.max_resident && spec.max_resident != en.max_resident) {
      apply_max_resident(en, spec.max_resident);
    }
    try {
      ensure_device(en, gg, /*required=*/false);
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
  ensure_loaded(ep, g, count_hit);
  Entry& e = *ep;
  e.locks += 1;
  touch(e);
  locking_.wait_idle(e, g);  // pinned: it stays in RAM meanwhile
  const uint64_t before = device_bytes_of(e);
  try {
    op(e, g);
  } catch (...) {
    e.locks -= 1;
    if (e.locks == 0 && e.dropped) evict(e);
    throw;
  }
  const uint64_t after = device_bytes_of(e);
  e.locks -= 1;
  if (e.locks == 0) {
    if (e.dropped) {
      evict(e);
    } else {
      make_ram_room(0, &e);  // just used: others go first
    }
  }
  return static_cast<int64_t>(after) - static_cast<int64_t>(before);
}

Lock ModelCache::lock(const std::shared_ptr<Entry>& ep) {
  Guard g(locking_.mutex());
  ensure_loaded(ep, g, /*count_hit=*/true);
  Entry& e = *ep;
  e.locks += 1;
  touch(e);
  if (e.locks == 1 || !e.attached) {
    try {
      ensure_device(e, g, /*required=*/true);
    } catch (...) {
      e.locks -= 1;
      if (e.locks == 0 && e.dropped) evict(e);
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
    evict(e);
  } else {
    make_ram_room(0, nullptr);
  }
}

void ModelCache::drop(const std::shared_ptr<Entry>& e) {
  Guard g(locking_.mutex());
  mark_dropped(e);
}

int64_t ModelCache::partial_load(const std::shared_ptr<Entry>& ep, uint64_t bytes) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard& g) {
    const uint64_t have = e.attached ? e.share : 0;
    const uint64_t room = std::max(e.needs.minimum, e.needs.wanted);
    e.target = bytes >= room - std::min(room, have) ? room : have + bytes;
    ensure_device(e, g, /*required=*/true);
  });
}

int64_t ModelCache::partial_unload(const std::shared_ptr<Entry>& ep, uint64_t bytes) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard&) {
    const uint64_t now = device_bytes_of(e);
    e.target = std::max(e.needs.minimum, now > bytes ? now - bytes : 0);
    if (e.attached && *e.target < e.share) resize(e, *e.target);
  });
}

int64_t ModelCache::full_load(const std::shared_ptr<Entry>& ep) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard& g) {
    if (e.needs.full > limit()) {
      throw ResourceError("full_load: model '" + e.name + "' needs " + format_mib(e.needs.full) +
                          " of device memory to be fully resident; the budget " + format_mib(state_.budget) +
                          " leaves " + format_mib(limit()) + " beside the working memory");
    }
    if (e.max_resident) {
      e.max_resident.reset();
      if (e.attached) {
        e.engine->set_max_resident(std::nullopt);
        locking_.publish(e);
      }
      refresh_needs(e);
    }
    e.target = e.needs.full;
    ensure_device(e, g, /*required=*/true);
    if (e.share < e.needs.full) {
      throw ResourceError("full_load: model '" + e.name + "' needs " + format_mib(e.needs.full) +
                          " of device memory to be fully resident; models in use hold " +
                          format_mib(reserved() - e.share) + " of " + format_mib(limit()));
    }
  });
}

int64_t ModelCache::full_unload(const std::shared_ptr<Entry>& ep) {
  return with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard&) {
    e.target = e.needs.minimum;
    if (e.attached) resize(e, e.needs.minimum);
  });
}

void ModelCache::set_max_resident(const std::shared_ptr<Entry>& ep, std::optional<double> fraction) {
  if (fraction && !(*fraction >= 0.0 && *fraction <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*fraction));
  }
  with_pinned(ep, /*count_hit=*/false, [&](Entry& e, Guard&) { apply_max_resident(e, fraction); });
}

void ModelCache::apply_max_resident(Entry& e, std::optional<double> fraction) {
  {
    offload::EngineOptions o = engine_options(e);
    o.max_resident = fraction;
    offload::WeightNeeds n = offload::StreamingEngine::needs(*e.model, o);
    n.minimum += e.sidecar_bytes;  // as refresh_needs: the sidecars placed (Note [sidecar share])
    n.full += e.sidecar_bytes;
    n.wanted += e.sidecar_bytes;
    if (e.attached && e.share < n.minimum) {
      // A lower cap can raise the minimum (the ring may have to hold a larger layer): grow
      // the share first, under the old cap.
      if (n.minimum > limit()) throw ResourceError(budget_error(e));
      const uint64_t need = n.minimum - e.share;
      uint64_t free = limit() - std::min(limit(), reserved());
      if (free < need) make_device_room(need - free, &e);
      free = limit() - std::min(limit(), reserved());
      if (free < need) {
        throw ResourceError("set_max_resident: model '" + e.name + "' needs " + format_mib(n.minimum) +
                            " of device memory under that cap; models in use hold the rest of the budget");
      }
      resize(e, n.minimum);
    }
    if (e.attached) {
      e.engine->set_max_resident(fraction);
      count_pinned_ram(e);
      locking_.publish(e);
    } else if (e.engine) {
      e.engine->set_max_resident(fraction);  // kept for the next attach
    }
    e.max_resident = fraction;
    e.needs = n;
    e.target.reset();
    if (!e.attached) return;
    const uint64_t want = wanted_share(e);
    if (e.share > want) {
      resize(e, want);
    } else if (e.share < want) {
      const uint64_t free = limit() - std::min(limit(), reserved());
      if (free > 0) resize(e, e.share + std::min(free, want - e.share));
    }
  }
}

void ModelCache::set_vram_budget(uint64_t budget_request) { set_vram_budget_locked(budget_request, false); }

void ModelCache::grow_working_memory(uint64_t used, const std::string& model, const std::string& kind) {
  uint64_t budget = 0, before = 0, grown_before = 0;
  {
    Guard g(locking_.mutex());
    grown_before = state_.grown_working;
    state_.measured_working = std::max(state_.measured_working, used);
    if (used <= state_.working_memory || used <= state_.working_refused) return;
    before = state_.working_memory;
    state_.grown_working = std::max(state_.grown_working, used + used / 8);
    budget = state_.budget;
  }
  try {
    set_vram_budget_locked(budget, true);
  } catch (const ResourceError& e) {
    Guard g(locking_.mutex());
    state_.grown_working = grown_before;
    state_.working_refused = used;  // not tried again for this much
    if (!state_.working_warned) {
      state_.working_warned = true;
      log::warn("model '" + model + "': its first '" + kind + "' forward used " + format_mib(used) +
                " of device memory beyond the weights, more than the working memory of " + format_mib(before) +
                ", and the vram budget has no room to keep more: " + e.what());
    }
    return;
  }
  Guard g(locking_.mutex());
  log::info("model '" + model + "': its first '" + kind + "' forward used " + format_mib(used) +
            " of device memory beyond the weights, more than the working memory of " + format_mib(before) +
            ": working memory now " + format_mib(state_.working_memory) + " (measured plus a margin), vram limit " +
            format_mib(limit()));
}

void ModelCache::set_vram_budget_locked(uint64_t budget_request, bool measured) {
  Guard g(locking_.mutex());
  // Any attached model may be resized below: wait for every running forward first.
  locking_.wait_all_idle(g);
  const uint64_t budget = budget_request ? budget_request : state_.device->total_memory();
  if (budget == 0) {
    throw InvalidArgument("the memory of device " + state_.device->name() + " is unknown: give the vram budget in bytes");
  }
  const uint64_t wm = std::max(state_.options.working_memory ? *state_.options.working_memory
                                                       : default_working_memory(budget, state_.options.resolution),
                                state_.grown_working);
  if (budget <= wm) {
    throw ResourceError("vram budget " + format_mib(budget) + " leaves nothing beside the working memory of " +
                        format_mib(wm));
  }
  const uint64_t new_limit = budget - wm;
  uint64_t locked_min = 0;
  for (auto& e : state_.entries) {
    if (e->attached && e->locks > 0) locked_min += e->needs.minimum;
  }
  if (locked_min > new_limit) {
    throw ResourceError("vram budget " + format_mib(budget) + " is too small for the models in use: they need " +
                        format_mib(locked_min + wm) + " (" + std::to_string(locked_min + wm) +
                        " bytes, working memory included)");
  }
  const uint64_t old_budget = state_.budget, old_wm = state_.working_memory;
  state_.budget = budget;
  state_.working_memory = wm;
  uint64_t res = reserved();
  if (res > new_limit) {
    try {
      // Unlocked models first (partially, then whole), then locked ones partially.
      make_device_room(res - new_limit, nullptr);
      res = reserved();
      std::vector<Entry*> locked;
      for (auto& e : state_.entries) {
        if (e->attached && e->locks > 0) locked.push_back(e.get());
      }
      std::sort(locked.begin(), locked.end(), [](Entry* a, Entry* b) { return a->last_used < b->last_used; });
      for (Entry* e : locked) {
        if (res <= new_limit) break;
        const uint64_t take = std::min(res - new_limit, e->share - std::min(e->share, e->needs.minimum));
        if (take == 0) continue;
        resize(*e, e->share - take);  // not running: waited for above
        res -= take;
      }
    } catch (...) {
      state_.budget = old_budget;
      state_.working_memory = old_wm;
      throw;
    }
  }
  TORCH_INTERNAL_ASSERT(reserved() <= new_limit, "device shares over the new limit");
  // A budget cut: what the shrunk models freed leaves the process (Note [releasing cached
  // memory] in offload/device.h). Room made for another model stays cached for it.
  if (!measured && new_limit < old_budget - std::min(old_budget, old_wm)) state_.device->release_cached_memory();
  state_.device->set_memory_limit(new_limit);
  state_.device->reset_memory_peak();  // peaks count under the current budget
  if (!measured) {
    state_.device->reset_allocator_peak();
    log::info("vram budget " + format_mib(budget) + " on " + state_.device->name() + " (working memory " + format_mib(wm) +
              ")");
  }
  // More room: attached models grow towards what they want, most recently used first.
  std::vector<Entry*> grow;
  for (auto& e : state_.entries) {
    if (e->attached && e->model) grow.push_back(e.get());
  }
  std::sort(grow.begin(), grow.end(), [](Entry* a, Entry* b) { return a->last_used > b->last_used; });
  for (Entry* e : grow) {
    const uint64_t want = wanted_share(*e);
    if (e->share >= want) continue;
    const uint64_t free = limit() - std::min(limit(), reserved());
    if (free == 0) break;
    resize(*e, e->share + std::min(free, want - e->share));
  }
}

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
  if (measured) grow_working_memory(*measured, e.name, e.engine->last_forward_kind());
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
  s.vram_limit = limit();
  s.vram = state_.device->memory_stats().total;
  s.vram_reserved = reserved();
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
