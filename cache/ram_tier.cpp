#include "cache/ram_tier.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
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

// Reads or generates the model of `r` on the host, in its storage dtypes.
anima::AnimaModel read_model(const LoadRequest& r, const std::string& name, int threads) {
  Fp8Options storage = r.spec.storage;
  storage.storage = r.dtypes.storage;
  storage.compute = r.dtypes.compute;
  if (r.kind == SourceKind::checkpoint) {
    anima::LoadOptions o;
    o.config = r.spec.config;
    o.device = at::kCPU;
    o.storage = storage;
    o.skips = &r.skips;
    o.threads = threads;
    return anima::load_anima(r.spec.source, o);
  }
  TORCH_INTERNAL_ASSERT(r.config, "model '", name, "': its config was not resolved before the read");
  const anima::AnimaConfig& config = *r.config;
  anima::AnimaModel model(config, anima::BuildOptions{r.dtypes.compute, at::kCPU});
  auto params = model->named_parameters(/*recurse=*/true);
  auto weights = anima::random_weights(config, r.spec.seed, r.dtypes.compute);
  for (auto& [key, t] : weights) {
    at::Tensor* p = params.find(key);
    TORCH_INTERNAL_ASSERT(p, "generated tensor '", key, "' is not a parameter of the model");
    p->set_data(to_host_owned(t, r.dtypes.compute));
    t = at::Tensor();  // one copy at a time
  }
  offload::apply_storage(*model, name, storage, r.skips);
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

uint64_t estimate_model_bytes(const LoadSpec& spec, at::Device device) {
  LoadRequest r = LoadRequest::resolve(spec, device);
  return estimate_model_bytes(r);
}

uint64_t estimate_model_bytes(LoadRequest& request) {
  const anima::AnimaConfig& config = request.resolve_config();
  const DtypePair& dt = request.dtypes;
  const SkipList& skips = request.skips;
  anima::AnimaModel meta(config, anima::BuildOptions{dt.compute, at::kMeta});
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
  // Resolved once, outside the mutex (Note [cache locking]); a new entry keeps it.
  LoadRequest request = LoadRequest::resolve(spec, s_.device->device());

  Guard g(locking_.mutex());
  std::shared_ptr<Entry> e;
  for (auto& p : s_.entries) {
    if (p->request.key == request.key && !p->dropped) e = p;
  }
  if (e && e->request.settings != request.settings) {
    log::info("Reloading model '" + e->name + "': loading settings changed (" + e->request.settings + " -> " +
              request.settings + ")");
    mark_dropped(e);
    e.reset();
  }
  created = !e;
  if (created) {
    g.unlock();
    // The config (a .json file, a checkpoint's header) and the estimate: once per new entry.
    const uint64_t estimate = estimate_model_bytes(request);
    const std::string name = request.model_name();
    if (s_.options.before_insert) s_.options.before_insert(name);
    g.lock();
    std::shared_ptr<Entry> raced;  // another thread created it meanwhile
    for (auto& p : s_.entries) {
      if (p->request.key == request.key && !p->dropped && p->request.settings == request.settings) raced = p;
    }
    if (raced) {
      // That thread made it: this call only found it. ModelCache::load drops an entry it
      // created when the budget cannot hold the model, and must not drop that thread's.
      e = raced;
      created = false;
    } else {
      e = std::make_shared<Entry>();
      e->name = name;
      e->max_resident = spec.max_resident;
      e->estimate = estimate;
      e->request = std::move(request);
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
    model = read_model(e.request, e.name, s_.options.load_threads);
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
  e.request.config = model->config();  // the config the model was read with, as the model has it
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
  e->request.spec.name = name;
  e->request.spec.source = "offload:" + name;
  e->request.spec.max_resident = max_resident;
  e->request.dtypes = dtypes;
  e->max_resident = max_resident;
  e->adopted = std::move(module);
  e->is_adopted = true;
  e->loaded_once = true;
  Guard g(locking_.mutex());
  e->id = ++s_.next_id;
  e->request.key = "adopted:" + std::to_string(e->id);  // never found by a load
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
