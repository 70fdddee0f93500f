#include "cache/ram_tier.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <unordered_set>

#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "runtime/size_parse.h"
#include "runtime/skip_patterns.h"

namespace sluice::cache {

namespace {

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

}  // namespace

uint64_t default_ram_limit(uint64_t host_limit_bytes) {
  const uint64_t l = host_limit_bytes;
  const uint64_t half = l / 2 > 2 * kGiB ? l / 2 - 2 * kGiB : 0;
  const uint64_t invoke = std::max<uint64_t>(4 * kGiB, half);
  return l ? std::min(l, invoke) : invoke;
}

RamLimit default_ram_limit(const HostMemoryLimit& host) {
  return {default_ram_limit(host.bytes),
          "default min(L, max(4GiB, L / 2 - 2GiB)) of the host memory limit L = " + host.describe()};
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
  // Note [layerwise storage] (offload/layer/storage.h): unskipped managed layers are stored in
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
// entries (cache mutex held, except entry_for)

std::shared_ptr<Entry> RamTier::entry_for(const LoadSpec& spec, bool& created) {
  const SourceKind kind = source_kind(spec.source);
  if (spec.max_resident && !(*spec.max_resident >= 0.0 && *spec.max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*spec.max_resident));
  }
  const DtypePair dtypes = resolve_dtypes(spec.storage.storage, spec.storage.compute, s_.device->device());
  const SkipList skips = SkipList::from_options(spec.storage, anima::declared_fp8_skips());

  std::string key = kind == SourceKind::preset ? "preset:" + spec.source : "file:" + canonical(spec.source);
  if (kind != SourceKind::checkpoint) key += "#seed=" + std::to_string(spec.seed);
  std::ostringstream settings;
  settings << "storage=" << dtype_name(dtypes.storage) << " compute=" << dtype_name(dtypes.compute) << " skips=[";
  for (const auto& p : skips.patterns()) settings << p << ";";
  settings << "] config=" << (spec.config ? anima::config_to_json(*spec.config).dump() : "");

  Guard g(locking_.mutex());
  std::shared_ptr<Entry> e;
  for (auto& p : s_.entries) {
    if (p->key == key && !p->dropped) e = p;
  }
  if (e && e->settings != settings.str()) {
    log::info("Reloading model '" + e->name + "': loading settings changed (" + e->settings + " -> " +
              settings.str() + ")");
    mark_dropped(e);
    e.reset();
  }
  created = !e;
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
    const uint64_t estimate = estimate_model_bytes(spec, s_.device->device());  // reads a file header
    if (s_.options.before_insert) s_.options.before_insert(e->name);
    g.lock();
    e->estimate = estimate;
    std::shared_ptr<Entry> raced;  // another thread created it meanwhile
    for (auto& p : s_.entries) {
      if (p->key == key && !p->dropped && p->settings == e->settings) raced = p;
    }
    if (raced) {
      // That thread made it: this call only found it. ModelCache::load drops an entry it
      // created when the budget cannot hold the model, and must not drop that thread's.
      e = raced;
      created = false;
    } else {
      e->id = ++s_.next_id;
      s_.entries.push_back(e);
    }
  }
  return e;
}

void RamTier::ensure_loaded(const std::shared_ptr<Entry>& ep, Guard& g, bool count_hit) {
  Entry& e = *ep;
  locking_.wait_loaded(e, g);
  if (e.dropped) throw InvalidArgument("model '" + e.name + "' was dropped from the cache; load it again");
  if (e.in_ram()) {
    if (count_hit) ++s_.hits;
    return;
  }
  ++s_.misses;
  e.loading = true;
  make_room(e.estimate, &e);
  s_.ram_reserved += e.estimate;  // until the read ends: other misses make room for it too
  g.unlock();
  anima::AnimaModel model(nullptr);
  double secs = 0;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    if (s_.options.before_read) s_.options.before_read(e.name);
    model = read_model(e.spec, e.dtypes, e.name, s_.options.load_threads);
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } catch (...) {
    g.lock();
    s_.ram_reserved -= e.estimate;
    e.loading = false;
    locking_.loaded();
    throw;
  }
  g.lock();
  s_.ram_reserved -= e.estimate;
  e.model = model;
  e.config = model->config();
  e.loading = false;
  e.loaded_once = true;
  locking_.loaded();
  try {
    shares_.refresh_needs(e);
  } catch (...) {
    e.model = anima::AnimaModel(nullptr);
    throw;
  }
  e.ram_bytes = e.needs.model_bytes;
  e.load_seconds = secs;
  e.announced = false;
  s_.ram.increase(static_cast<int64_t>(e.ram_bytes));
  ++s_.loads;
  if (e.ram_bytes != e.estimate) {
    log::debug("model '" + e.name + "' takes " + std::to_string(e.ram_bytes) + " bytes in RAM, estimated " +
               std::to_string(e.estimate));
  }
  if (e.dropped) {  // dropped while it was being read
    evict(e);
    throw InvalidArgument("model '" + e.name + "' was dropped from the cache; load it again");
  }
  make_room(0, &e);
}

std::shared_ptr<Entry> RamTier::adopt(std::shared_ptr<torch::nn::Module> module, const std::string& name,
                                     const DtypePair& dtypes, std::optional<double> max_resident) {
  if (!module) throw InvalidArgument("adopt: no module");
  if (max_resident && !(*max_resident >= 0.0 && *max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*max_resident));
  }
  auto e = std::make_shared<Entry>();
  e->name = name;
  e->spec.name = name;
  e->spec.source = "offload:" + name;
  e->spec.max_resident = max_resident;
  e->dtypes = dtypes;
  e->max_resident = max_resident;
  e->adopted = std::move(module);
  e->is_adopted = true;
  e->loaded_once = true;
  Guard g(locking_.mutex());
  e->id = ++s_.next_id;
  e->key = "adopted:" + std::to_string(e->id);  // never found by a load
  shares_.refresh_needs(*e);
  e->ram_bytes = e->needs.model_bytes;
  e->estimate = e->ram_bytes;
  make_room(e->ram_bytes, nullptr);
  s_.ram.increase(static_cast<int64_t>(e->ram_bytes));
  s_.entries.push_back(e);
  touch(*e);
  return e;
}

void RamTier::make_room(uint64_t bytes, const Entry* exclude) {
  if (s_.ram_limit == 0) return;
  // Reservations of models being read count as taken (Note [cache locking]).
  while (static_cast<uint64_t>(s_.ram.current) + s_.ram_reserved + bytes > s_.ram_limit) {
    Entry* victim = nullptr;
    for (auto& p : s_.entries) {
      // An adopted model cannot be read again: it stays until it is dropped.
      if (p.get() == exclude || !p->model || p->locks > 0 || p->loading) continue;
      if (!victim || p->last_used < victim->last_used) victim = p.get();
    }
    if (!victim) {
      if (!s_.ram_warned) {
        log::warn("RAM limit " + format_mib(s_.ram_limit) +
                  (s_.ram_limit_source.empty() ? "" : " (" + s_.ram_limit_source + ")") +
                  " exceeded: models in use hold " +
                  format_mib(static_cast<uint64_t>(s_.ram.current)) + ", models being read " +
                  format_mib(s_.ram_reserved) + ", and " + format_mib(bytes) + " more are needed");
        s_.ram_warned = true;
      }
      return;
    }
    evict(*victim);
  }
}

void RamTier::evict(Entry& e) {
  TORCH_INTERNAL_ASSERT(e.locks == 0 && !e.loading, "evicting a model in use");
  if (e.in_ram()) {
    shares_.detach(e);
    e.model = anima::AnimaModel(nullptr);
    e.adopted.reset();
    s_.ram.decrease(static_cast<int64_t>(e.ram_bytes));
    e.ram_bytes = 0;
    e.announced = false;
    if (e.is_adopted) {
      // Its host's module, given back (Note [adopted models]): nothing was evicted.
      log::info("Removed offloaded model '" + e.name + "' from the cache");
    } else {
      ++s_.evictions;
      log::info("Evicted model '" + e.name + "' from RAM" + (e.dropped ? " (dropped)" : ""));
    }
  }
  if (e.dropped) {
    s_.entries.remove_if([&](const std::shared_ptr<Entry>& p) { return p.get() == &e; });
  }
}

void RamTier::mark_dropped(const std::shared_ptr<Entry>& e) {
  if (e->dropped) return;
  e->dropped = true;
  if (e->locks == 0 && !e->loading) {
    evict(*e);
  } else {
    log::info("Model '" + e->name + "' is in use: it is dropped when its last lock ends");
  }
}

}  // namespace sluice::cache
