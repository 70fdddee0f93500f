// The public C++ API (include/sluice/sluice.hpp): string options parsed into the internal
// structs, and thin wrappers over cache::ModelCache.
#include "sluice/sluice.hpp"

#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "api/cache_impl.h"
#include "cache/model_cache.h"
#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "models/anima/lllite.h"
#include "models/anima/semantic_connector.h"
#include "models/lora.h"
#include "offload/device/cpu_device.h"
#include "offload/device/device.h"
#include "offload/engine/engine.h"
#include "offload/layer/output_observer.h"
#include "offload/engine/vram_budget.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/hardware.h"
#include "runtime/host_memory_limit.h"
#include "runtime/logging.h"
#include "runtime/nonfinite.h"
#include "runtime/size_parse.h"

#ifndef SLUICE_VERSION_STRING
#error "SLUICE_VERSION_STRING must be defined by the build (sluice_runtime's public definition)"
#endif

namespace sluice {

namespace detail {

struct ModelEntry {
  std::shared_ptr<cache::ModelCache> cache;
  std::shared_ptr<cache::Entry> entry;
  ModelInfo info;
};

struct LoraState;
struct LLLiteState;

// Note [LoRA lifetime] (sluice.hpp): the LoRAs made from a lock are removed when it ends.
struct LockToken {
  std::shared_ptr<ModelEntry> model;
  cache::Lock lock;
  std::mutex loras_mutex;
  std::vector<std::weak_ptr<LoraState>> loras;  // made from this lock (removed ones expire or are inactive)
  std::vector<std::weak_ptr<LLLiteState>> lllites;  // likewise (guarded by loras_mutex)
};

struct LoraState {
  std::shared_ptr<ModelEntry> model;
  cache::Lock lock;  // a patched model stays locked (never evicted or reloaded without its LoRA)
  std::mutex mutex;  // guards scope: the handle and the lock's end may remove it from two threads
  std::unique_ptr<LoraScope> scope;
  int64_t patched = 0;
};

// An LLLite bound through a lock: the same lifetime as a LoRA's.
struct LLLiteState {
  std::shared_ptr<ModelEntry> model;
  cache::Lock lock;
  std::mutex mutex;  // guards scope
  std::unique_ptr<anima::LLLiteScope> scope;
  std::string source;
  int64_t modules = 0, bound = 0;
  uint64_t bytes = 0;
};

// The LLLites bound to each cached model, for its stats JSON (several handles may name one model).
std::mutex lllite_registry_mutex;
std::map<const cache::Entry*, std::vector<std::weak_ptr<LLLiteState>>> lllite_registry;

}  // namespace detail

namespace {

ModelInfo make_info(const cache::ModelCache& c, const std::shared_ptr<cache::Entry>& e) {
  const anima::AnimaConfig cfg = c.entry_config(e);
  ModelInfo i;
  i.name = e->name;
  i.source = e->request.spec.source;
  i.storage_dtype = dtype_name(e->request.dtypes.storage);
  i.compute_dtype = dtype_name(e->request.dtypes.compute);
  i.compute_reason = e->request.spec.compute_reason.empty() ? "requested" : e->request.spec.compute_reason;
  i.in_channels = cfg.in_channels;
  i.out_channels = cfg.out_channels;
  i.context_dim = cfg.crossattn_emb_channels;
  i.patch_spatial = cfg.patch_spatial;
  i.patch_temporal = cfg.patch_temporal;
  i.num_blocks = cfg.num_blocks;
  i.has_adapter = cfg.adapter.enabled;
  if (cfg.adapter.enabled) {
    i.adapter_source_dim = cfg.adapter.source_dim;
    i.adapter_vocab_size = cfg.adapter.vocab_size;
    i.adapter_output_tokens = cfg.adapter.output_tokens;
  }
  i.has_connector = cfg.connector.enabled;
  if (cfg.connector.enabled) {
    i.connector_layers = static_cast<int64_t>(cfg.connector.layer_indices.size());
    i.connector_source_dim = cfg.connector.source_dim;
  }
  i.config_json = anima::config_to_json(cfg).dump();
  return i;
}

const std::shared_ptr<detail::ModelEntry>& need(const std::shared_ptr<detail::ModelEntry>& m) {
  if (!m) throw InvalidArgument("empty sluice::Model handle");
  return m;
}

const std::shared_ptr<detail::LockToken>& need(const std::shared_ptr<detail::LockToken>& t) {
  if (!t) throw InvalidArgument("empty sluice::LockedModel (unlocked or moved from)");
  return t;
}

void require_floating(const char* what, const at::Tensor& t) {
  if (!t.defined()) throw InvalidArgument(std::string("input '") + what + "' is undefined");
  if (!at::isFloatingType(t.scalar_type())) {
    throw InvalidArgument(std::string("input '") + what + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
                          ", expected a floating-point dtype");
  }
}

// Note [non-finite values]: "<op>: input 'x' has 3 non-finite values (first at [...]: nan)"
// for the first input holding any; one host read for all of them when they are finite.
void require_finite_inputs(const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> inputs) {
  std::vector<at::Tensor> all;
  for (const auto& [name, t] : inputs)
    if (t != nullptr) all.push_back(*t);
  if (all_finite(all)) return;
  for (const auto& [name, t] : inputs)
    if (t != nullptr) require_finite(*t, std::string(op) + ": input '" + name + "'");
}

// The DiT forward and the adapter's, on inputs moved to the model's device and dtype.
at::Tensor run_dit(anima::AnimaModelImpl& m, offload::StreamingEngine& engine, const at::Tensor& x,
                   const at::Tensor& timesteps, const at::Tensor& context, const ForwardOptions& options = {}) {
  const at::Device dev = engine.device().device();
  const at::ScalarType dt = m.compute_dtype();
  anima::CrossAttnMask mask;  // Note [cross-attention mask]: the model checks it and moves it to the device
  if (options.cross_attn_mask) {
    mask.mask = *options.cross_attn_mask;
    if (!mask.mask.defined()) throw InvalidArgument("input 'cross_attn_mask' is undefined");
  }
  mask.blocks = options.mask_blocks;
  return m.forward(x.to(dev, dt), timesteps.to(dev), context.to(dev, dt), mask);
}

// The LLM adapter (and a semantic connector, when `connector` is given) on the engine's
// device, the inputs moved there in the compute dtype.
at::Tensor run_adapter(anima::AnimaModelImpl& m, offload::StreamingEngine& engine, const at::Tensor& qwen_hidden,
                       const at::Tensor& t5_ids, const std::optional<at::Tensor>& t5_weights,
                       const anima::ConnectorInputs* connector = nullptr) {
  const at::Device dev = engine.device().device();
  const at::ScalarType dt = m.compute_dtype();
  std::optional<at::Tensor> w;
  if (t5_weights) w = t5_weights->to(dev, dt);
  return m.encode_text(qwen_hidden.to(dev, dt), t5_ids.to(dev, at::kLong), w, connector);
}

// Removes the LoRA of `st` (its sidecars go, the share shrinks back: Note [sidecar share])
// and ends its lock; nothing when it is removed already. Serialized with forwards of the
// model (lora.h: patching during a forward is unsafe).
void end_lora(detail::LoraState& st) {
  std::lock_guard<std::mutex> g(st.mutex);
  if (!st.scope) return;
  st.model->cache->patch(st.lock, [&](anima::AnimaModelImpl&, offload::SidecarPlacer&) { st.scope.reset(); });
  st.lock.unlock();
}

// Unbinds the LLLite of `st` and ends its lock, as end_lora.
void end_lllite(detail::LLLiteState& st) {
  std::lock_guard<std::mutex> g(st.mutex);
  if (!st.scope) return;
  st.model->cache->patch(st.lock, [&](anima::AnimaModelImpl&, offload::SidecarPlacer&) { st.scope.reset(); });
  st.lock.unlock();
}

// Note [layer output observer]: runs `fn` as one forward of `kind` with a finite check of
// every observed output, and records what it found in the engine's stats.
std::optional<NonFiniteReport> locate(detail::LockToken& t, const char* kind,
                                      const std::function<at::Tensor(anima::AnimaModelImpl&, offload::StreamingEngine&)>& fn) {
  NonFiniteReport rec;
  rec.kind = kind;
  t.model->cache->run(t.lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode inference;
    std::unordered_map<const torch::nn::Module*, std::string> names;
    for (const auto& item : m.named_modules(/*name_prefix=*/"", /*include_self=*/false))
      names.emplace(item.value().get(), item.key());
    at::Tensor out;
    {
      offload::ObserveOutputs observe([&](const torch::nn::Module& module, const at::Tensor& output) {
        if (!rec.module.empty()) return;  // only the first: no more waits after it
        if (const auto v = find_nonfinite(output)) {
          const auto it = names.find(&module);
          rec.module = it != names.end() ? it->second : module.name();
          rec.nonfinite_values = v->count;
          rec.values = v->numel;
        }
      });
      offload::ForwardScope scope(engine, kind);
      out = fn(m, engine);
    }
    rec.output_values = out.numel();
    if (const auto v = find_nonfinite(out)) rec.output_nonfinite_values = v->count;
    rec.forward_index = engine.record_nonfinite(rec);
  });
  if (rec.module.empty() && rec.output_nonfinite_values == 0) return std::nullopt;
  return rec;
}

}  // namespace

std::string version() { return SLUICE_VERSION_STRING; }

// The public levels are the runtime's own (runtime/logging.h), in the same order.
static_assert(static_cast<int>(LogLevel::off) == static_cast<int>(log::Level::off));

void set_log_level(LogLevel level) { log::set_level(static_cast<log::Level>(level)); }

LogLevel log_level() { return static_cast<LogLevel>(log::level()); }

void set_log_sink(LogSink sink) {
  if (!sink) {
    log::set_sink(nullptr);
    return;
  }
  log::set_sink([sink = std::move(sink)](log::Level l, const std::string& m) { sink(static_cast<LogLevel>(l), m); });
}

// ---------------------------------------------------------------------------------------
// ModelCache

ModelCache::ModelCache(RuntimeOptions options) : impl_(std::make_shared<detail::CacheImpl>()) {
  impl_->options = options;
  const RuntimeOptions& o = impl_->options;
  if (!(o.cpu_copy_gbps >= 0.0) || !(o.cpu_copy_latency_us >= 0.0)) {
    throw InvalidArgument("cpu_copy_gbps and cpu_copy_latency_us must not be negative");
  }
  if (o.load_threads < 0 || o.load_threads > 4096) {
    throw InvalidArgument("load_threads must be 0 (every core) .. 4096, got " + std::to_string(o.load_threads));
  }
  apply_cpu_onednn_env();  // Note [native bf16]: SLUICE_CPU_ONEDNN=off
  std::shared_ptr<offload::DeviceBackend> device;
  if (o.device == "cpu") {
    offload::CpuDeviceOptions c;
    c.total_memory = o.device_memory;
    c.copy_bytes_per_second = o.cpu_copy_gbps * 1e9;
    c.copy_latency_us = o.cpu_copy_latency_us;
    device = offload::make_cpu_device(c);
  } else {
    device = offload::make_device(o.device, o.device_memory, "device");
  }
  cache::CacheOptions c;
  c.device = device;
  const offload::ResolvedVramBudget budget =
      offload::resolve_vram_budget(*device, o.vram_budget, o.vram_headroom, "vram_budget", "vram_headroom");
  c.vram_budget = budget.bytes;
  c.vram_budget_source = budget.how;
  if (!o.working_memory.empty()) {
    const uint64_t budget = c.vram_budget ? c.vram_budget : device->total_memory();
    c.working_memory = parse_size(o.working_memory, budget ? std::optional<uint64_t>(budget) : std::nullopt,
                                  "working_memory");
  }
  c.resolution = o.resolution;
  // A percentage is of the host's memory as the process's container sees it: min(physical
  // RAM, cgroup limit) (Note [host memory limit]).
  const auto ram_percent_of = [] {
    const uint64_t ram = host_memory_limit().capacity_bytes();
    return ram ? std::optional<uint64_t>(ram) : std::nullopt;
  };
  if (!o.ram_limit.empty()) c.ram_limit = parse_size(o.ram_limit, ram_percent_of(), "ram_limit");
  c.prefetch = offload::parse_prefetch(o.prefetch, "prefetch");
  c.pin = offload::parse_pin_mode(o.pin_memory, "pin_memory");
  if (!o.pin_memory_limit.empty()) {
    c.pin_memory_limit = parse_size(o.pin_memory_limit, ram_percent_of(), "pin_memory_limit");
  }
  c.policy = offload::parse_residency_policy(o.policy, "policy");
  c.timing = o.timing;
  c.trace = o.trace;
  c.load_threads = o.load_threads;
  impl_->cache = cache::ModelCache::create(std::move(c));
  detail::CacheImpl::log_budget(budget);
}

ModelCache::~ModelCache() = default;

const RuntimeOptions& ModelCache::options() const { return impl_->options; }

Model ModelCache::load(const std::string& path_or_preset, const LoadOptions& options) {
  if (path_or_preset.empty()) throw InvalidArgument("load: empty model path or preset name");
  anima::require_preset_or_path(path_or_preset);  // "unknown preset 'anima-nope' (known: ...)"
  cache::LoadSpec spec;
  spec.source = path_or_preset;
  spec.name = options.name;
  spec.storage.storage = parse_storage_dtype(options.storage);
  const ComputeChoice compute =
      choose_compute_dtype(options.compute, impl_->cache->device().device(), anima::fp16_verdict());
  spec.storage.compute = compute.dtype;
  spec.compute_reason = compute.reason;
  spec.storage.extra_skip_patterns = options.extra_skips;
  spec.storage.use_default_skips = options.use_default_skips;
  spec.storage.use_model_skips = options.use_model_skips;
  if (!options.config.empty()) spec.config = anima::config_from_name_or_file(options.config);
  spec.seed = options.seed;
  spec.max_resident = options.max_resident;
  auto entry = impl_->cache->load(spec);
  auto m = std::make_shared<detail::ModelEntry>();
  m->cache = impl_->cache;
  m->entry = entry;
  m->info = make_info(*impl_->cache, entry);
  return Model(std::move(m));
}

void ModelCache::drop(const Model& model) {
  const auto& m = need(model.entry_);
  if (m->cache != impl_->cache) throw InvalidArgument("drop: model '" + m->info.name + "' belongs to another cache");
  impl_->cache->drop(m->entry);
}

void ModelCache::set_vram_budget(const std::string& budget) { impl_->set_vram_budget(budget); }

CacheStats ModelCache::stats() const { return impl_->cache->stats(); }

std::vector<Model> ModelCache::models() const {
  std::vector<Model> out;
  for (const auto& e : impl_->cache->entries()) {
    if (e->is_adopted) continue;  // an offloaded torch module: its OffloadedModel is its handle
    auto m = std::make_shared<detail::ModelEntry>();
    m->cache = impl_->cache;
    m->entry = e;
    m->info = make_info(*impl_->cache, e);
    out.push_back(Model(std::move(m)));
  }
  return out;
}

std::string ModelCache::stats_json(int indent) const { return impl_->cache->stats_json(indent); }

// ---------------------------------------------------------------------------------------
// Model

const std::string& Model::name() const { return need(entry_)->info.name; }

ModelInfo Model::info() const { return need(entry_)->info; }

LockedModel Model::lock() {
  const auto& m = need(entry_);
  auto token = std::make_shared<detail::LockToken>();
  token->model = m;
  token->lock = m->cache->lock(m->entry);
  return LockedModel(std::move(token));
}

int64_t Model::partial_load(uint64_t bytes) {
  const auto& m = need(entry_);
  return m->cache->partial_load(m->entry, bytes);
}

int64_t Model::partial_unload(uint64_t bytes) {
  const auto& m = need(entry_);
  return m->cache->partial_unload(m->entry, bytes);
}

int64_t Model::full_load() {
  const auto& m = need(entry_);
  return m->cache->full_load(m->entry);
}

int64_t Model::full_unload() {
  const auto& m = need(entry_);
  return m->cache->full_unload(m->entry);
}

void Model::set_max_resident(std::optional<double> fraction) {
  const auto& m = need(entry_);
  m->cache->set_max_resident(m->entry, fraction);
}

ModelStats Model::stats() const {
  const auto& m = need(entry_);
  const offload::EngineStats es = m->cache->engine_stats(m->entry);
  const cache::ModelCache::EntryState st = m->cache->entry_state(m->entry);
  ModelStats s;
  s.id = m->entry->id;
  s.name = m->info.name;
  s.source = m->info.source;
  s.device = es.device;
  s.in_ram = st.in_ram;
  s.on_device = st.attached;
  s.locks = static_cast<uint64_t>(st.locks);
  s.total_bytes = st.in_ram ? st.ram_bytes : es.model_total_bytes;
  if (st.attached) {
    s.resident_bytes = es.model_resident_bytes;
    s.streamed_bytes = es.model_total_bytes - std::min(es.model_total_bytes, es.model_resident_bytes);
    s.residency = es.residency;
    s.residency_grid = es.residency_grid;
    s.layers = es.layers;
    s.resident_layers = es.resident_layers;
    s.streamed_layers = es.streamed_layers;
    s.device_peak_bytes = static_cast<uint64_t>(es.device_memory.total.peak);
  }
  s.streamed_dit_bytes = st.streamed_dit;
  s.streamed_adapter_bytes = st.streamed_adapter;
  s.share_bytes = st.share;
  s.device_bytes = st.device_bytes;
  s.allocated_bytes = st.device_allocated;
  s.minimum_bytes = st.minimum;
  s.forwards = es.forwards;
  s.forward_records = es.forward_records;
  s.nonfinite_reruns = es.nonfinite_reruns;
  s.nonfinite = es.nonfinite;
  return s;
}

std::string Model::stats_json(int indent) const {
  const auto& m = need(entry_);
  std::string json = m->cache->model_stats_json(m->entry, indent);
  // The LLLite adapters bound now (README, "ControlNet-LLLite"): source, bytes, modules, layers bound.
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  {
    std::lock_guard<std::mutex> g(detail::lllite_registry_mutex);
    const auto it = detail::lllite_registry.find(m->entry.get());
    if (it != detail::lllite_registry.end()) {
      for (const auto& w : it->second) {
        const auto st = w.lock();
        if (!st) continue;
        std::lock_guard<std::mutex> sg(st->mutex);
        if (!st->scope) continue;
        list.push_back({{"source", st->source}, {"device_bytes", st->bytes}, {"modules", st->modules},
                        {"layers_bound", st->bound}, {"weight", st->scope->weight()}});
      }
    }
  }
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(json);
  j["lllite"] = std::move(list);
  return j.dump(indent);
}

void Model::write_trace(const std::string& path) const {
  const auto& m = need(entry_);
  m->cache->write_trace(m->entry, path);
}

void Model::write_timeline_svg(const std::string& path) const {
  const auto& m = need(entry_);
  m->cache->write_timeline_svg(m->entry, path);
}

std::string Model::residency_map() const {
  const auto& m = need(entry_);
  return m->cache->entry_state(m->entry).residency;
}

// ---------------------------------------------------------------------------------------
// LockedModel

LockedModel::LockedModel(std::shared_ptr<detail::LockToken> token) : token_(std::move(token)) {}

LockedModel& LockedModel::operator=(LockedModel&& other) noexcept {
  if (this != &other) {
    unlock();
    token_ = std::move(other.token_);
  }
  return *this;
}

LockedModel::~LockedModel() { unlock(); }

void LockedModel::unlock() {
  if (!token_) return;
  const std::shared_ptr<detail::LockToken> t = std::move(token_);
  // Note [LoRA lifetime]: its LoRAs go first, whatever handles on them still live.
  std::vector<std::weak_ptr<detail::LoraState>> loras;
  {
    std::lock_guard<std::mutex> g(t->loras_mutex);
    loras.swap(t->loras);
  }
  std::vector<std::weak_ptr<detail::LLLiteState>> lllites;
  {
    std::lock_guard<std::mutex> g(t->loras_mutex);
    lllites.swap(t->lllites);
  }
  for (auto it = lllites.rbegin(); it != lllites.rend(); ++it) {
    const std::shared_ptr<detail::LLLiteState> st = it->lock();
    if (!st) continue;
    try {
      end_lllite(*st);
    } catch (const std::exception& e) {
      log::error("model '" + t->model->info.name + "': removing an LLLite as its lock ended failed: " + e.what());
    }
  }
  for (auto it = loras.rbegin(); it != loras.rend(); ++it) {  // the latest first
    const std::shared_ptr<detail::LoraState> st = it->lock();
    if (!st) continue;
    try {
      end_lora(*st);
    } catch (const std::exception& e) {
      log::error("model '" + t->model->info.name + "': removing a LoRA as its lock ended failed: " + e.what());
    }
  }
  t->lock.unlock();
}

const ModelInfo& LockedModel::info() const { return need(token_)->model->info; }

Model LockedModel::model() const { return Model(need(token_)->model); }

at::Tensor LockedModel::forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context) {
  return forward(x, timesteps, context, LayerProgress());
}

at::Tensor LockedModel::forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
                                const LayerProgress& progress) {
  ForwardOptions options;
  options.progress = progress;
  return forward(x, timesteps, context, options);
}

at::Tensor LockedModel::forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
                                const ForwardOptions& options) {
  const LayerProgress& progress = options.progress;
  const auto& t = need(token_);
  require_floating("x", x);
  require_floating("context", context);
  if (!timesteps.defined()) throw InvalidArgument("input 'timesteps' is undefined");
  require_finite_inputs("forward", {{"x", &x}, {"timesteps", &timesteps}, {"context", &context}});
  at::Tensor out;
  t->model->cache->run(t->lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode inference;
    struct ProgressScope {  // the callback lives only as long as this forward
      offload::StreamingEngine& e;
      ~ProgressScope() { e.set_layer_progress({}); }
    } progress_scope{engine};
    if (progress) engine.set_layer_progress(progress);
    {
      offload::ForwardScope scope(engine, "dit");
      out = run_dit(m, engine, x, timesteps, context, options);
    }
    // An Interrupted from the callback after the last layer: the forward stops all the same.
    if (const std::exception_ptr stop = engine.take_interrupt()) std::rethrow_exception(stop);
  });
  return out;
}

std::optional<NonFiniteReport> LockedModel::locate_nonfinite(const at::Tensor& x, const at::Tensor& timesteps,
                                                             const at::Tensor& context) {
  return locate_nonfinite(x, timesteps, context, ForwardOptions{});
}

std::optional<NonFiniteReport> LockedModel::locate_nonfinite(const at::Tensor& x, const at::Tensor& timesteps,
                                                             const at::Tensor& context, const ForwardOptions& options) {
  const auto& t = need(token_);
  require_floating("x", x);
  require_floating("context", context);
  if (!timesteps.defined()) throw InvalidArgument("input 'timesteps' is undefined");
  require_finite_inputs("locate_nonfinite", {{"x", &x}, {"timesteps", &timesteps}, {"context", &context}});
  return locate(*t, "dit", [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    return run_dit(m, engine, x, timesteps, context, options);
  });
}

void LockedModel::synchronize() {
  const auto& t = need(token_);
  t->model->cache->run(t->lock, [](anima::AnimaModelImpl&, offload::StreamingEngine& engine) {
    engine.device().synchronize();
  });
}

at::Tensor LockedModel::encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                    const std::optional<at::Tensor>& t5_weights) {
  return encode_text(qwen_hidden, t5_ids, t5_weights, SemanticInputs{});
}

// encode_text's inputs checked for `call` (one InvalidArgument naming the input at fault),
// and the connector's inputs as the model takes them (models/anima/semantic_connector.h
// checks their shapes against the connector).
static anima::ConnectorInputs check_text_inputs(const char* call, const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                                const std::optional<at::Tensor>& t5_weights,
                                                const SemanticInputs& semantic) {
  anima::ConnectorInputs connector;
  connector.hidden = semantic.qwen35_hidden;
  connector.mask = semantic.qwen35_mask;
  connector.timesteps = semantic.timesteps;
  for (size_t i = 0; i < connector.hidden.size(); ++i) {
    const std::string name = "qwen35_hidden[" + std::to_string(i) + "]";
    if (connector.hidden[i].defined()) require_floating(name.c_str(), connector.hidden[i]);
    if (connector.hidden[i].defined()) require_finite_inputs(call, {{name.c_str(), &connector.hidden[i]}});
  }
  if (connector.timesteps.defined() && connector.timesteps.is_floating_point()) {
    require_finite_inputs(call, {{"timesteps", &connector.timesteps}});
  }
  require_floating("qwen_hidden", qwen_hidden);
  if (!t5_ids.defined()) throw InvalidArgument("input 't5_ids' is undefined");
  if (at::isFloatingType(t5_ids.scalar_type()) || at::isComplexType(t5_ids.scalar_type()) ||
      t5_ids.scalar_type() == at::kBool) {
    throw InvalidArgument("input 't5_ids' has dtype " + std::string(c10::toString(t5_ids.scalar_type())) +
                          ", expected an integer dtype");
  }
  if (t5_weights) require_floating("t5_weights", *t5_weights);
  require_finite_inputs(call, {{"qwen_hidden", &qwen_hidden}, {"t5_weights", t5_weights ? &*t5_weights : nullptr}});
  return connector;
}

at::Tensor LockedModel::encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                    const std::optional<at::Tensor>& t5_weights, const SemanticInputs& semantic) {
  const auto& t = need(token_);
  const anima::ConnectorInputs connector = check_text_inputs("encode_text", qwen_hidden, t5_ids, t5_weights, semantic);
  at::Tensor out;
  t->model->cache->run(t->lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode inference;
    offload::ForwardScope scope(engine, "adapter");
    out = run_adapter(m, engine, qwen_hidden, t5_ids, t5_weights, connector.given() ? &connector : nullptr);
  });
  return out;
}

std::optional<NonFiniteReport> LockedModel::locate_nonfinite_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                                                  const std::optional<at::Tensor>& t5_weights) {
  return locate_nonfinite_text(qwen_hidden, t5_ids, t5_weights, SemanticInputs{});
}

std::optional<NonFiniteReport> LockedModel::locate_nonfinite_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                                                  const std::optional<at::Tensor>& t5_weights,
                                                                  const SemanticInputs& semantic) {
  const auto& t = need(token_);
  const anima::ConnectorInputs connector =
      check_text_inputs("locate_nonfinite_text", qwen_hidden, t5_ids, t5_weights, semantic);
  return locate(*t, "adapter", [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    return run_adapter(m, engine, qwen_hidden, t5_ids, t5_weights, connector.given() ? &connector : nullptr);
  });
}

BlockLayout parse_block_layout(const std::string& value, const std::string& what) {
  if (value == "measured") return BlockLayout::measured;
  if (value == "as-is") return BlockLayout::as_is;
  throw InvalidArgument(what + " '" + value + "' is not one of: measured, as-is");
}

LoraHandle LockedModel::apply_lora(const std::string& path, double scale, BlockLayout layout) {
  const auto& t = need(token_);
  auto st = std::make_shared<detail::LoraState>();
  st->model = t->model;
  st->lock = t->model->cache->lock(t->model->entry);
  std::optional<LoraAdapter> adapter;
  // Read and mapped onto the model's layers without the cache mutex.
  t->model->cache->run(st->lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine&) {
    adapter = load_lora(path, m, layout == BlockLayout::measured);
  });
  // Placed as a residency change: the share grows for the sidecars (Note [sidecar share]).
  t->model->cache->patch(st->lock, [&](anima::AnimaModelImpl& m, offload::SidecarPlacer& placer) {
    st->scope = std::make_unique<LoraScope>(m, *adapter, scale, std::nullopt, &placer);
    st->patched = st->scope->patched_layers();
  });
  {
    std::lock_guard<std::mutex> g(t->loras_mutex);
    auto& v = t->loras;
    v.erase(std::remove_if(v.begin(), v.end(), [](const std::weak_ptr<detail::LoraState>& w) { return w.expired(); }),
            v.end());
    v.push_back(st);
  }
  return LoraHandle(std::move(st));
}

LLLiteHandle LockedModel::apply_lllite(const std::string& path, const at::Tensor& cond_image, double weight,
                                       const std::optional<at::Tensor>& mask, BlockLayout layout) {
  const auto& t = need(token_);
  if (!std::isfinite(weight)) throw InvalidArgument("LLLite '" + path + "': weight " + std::to_string(weight) + " is not finite");
  const anima::LLLiteAdapter adapter = anima::load_lllite(path);
  anima::check_lllite_inputs(adapter, cond_image, mask);
  if (cond_image.defined()) {
    require_finite_inputs("apply_lllite", {{"cond_image", &cond_image}, {"mask", mask ? &*mask : nullptr}});
  }
  auto st = std::make_shared<detail::LLLiteState>();
  st->model = t->model;
  st->source = path;
  st->lock = t->model->cache->lock(t->model->entry);
  // Placed as a residency change, as a LoRA's sidecars (Note [sidecar share]).
  t->model->cache->patch(st->lock, [&](anima::AnimaModelImpl& m, offload::SidecarPlacer& placer) {
    st->scope = std::make_unique<anima::LLLiteScope>(m, adapter, cond_image, weight, mask, layout == BlockLayout::measured,
                                                      std::nullopt, &placer);
    st->modules = st->scope->modules();
    st->bound = st->scope->bound_layers();
    st->bytes = st->scope->device_bytes();
  });
  {
    std::lock_guard<std::mutex> g(t->loras_mutex);
    auto& v = t->lllites;
    v.erase(std::remove_if(v.begin(), v.end(), [](const auto& w) { return w.expired(); }), v.end());
    v.push_back(st);
  }
  {
    std::lock_guard<std::mutex> g(detail::lllite_registry_mutex);
    auto& v = detail::lllite_registry[t->model->entry.get()];
    v.erase(std::remove_if(v.begin(), v.end(), [](const auto& w) { return w.expired(); }), v.end());
    v.push_back(st);
  }
  return LLLiteHandle(std::move(st));
}

// ---------------------------------------------------------------------------------------
// LLLiteHandle

LLLiteHandle& LLLiteHandle::operator=(LLLiteHandle&& other) noexcept {
  if (this != &other) {
    try {
      remove();
    } catch (const std::exception& e) {
      log::error(std::string("removing an LLLite failed: ") + e.what());
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

LLLiteHandle::~LLLiteHandle() {
  try {
    remove();
  } catch (const std::exception& e) {
    log::error(std::string("removing an LLLite failed: ") + e.what());
  }
}

bool LLLiteHandle::active() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> g(state_->mutex);
  return state_->scope != nullptr;
}

void LLLiteHandle::set_weight(double weight) {
  if (!state_) throw InvalidArgument("empty sluice::LLLiteHandle");
  std::lock_guard<std::mutex> g(state_->mutex);
  if (!state_->scope) throw InvalidArgument("LLLite '" + state_->source + "' is no longer bound (removed, or its lock ended)");
  state_->scope->set_weight(weight);
}

double LLLiteHandle::weight() const {
  if (!state_) throw InvalidArgument("empty sluice::LLLiteHandle");
  std::lock_guard<std::mutex> g(state_->mutex);
  return state_->scope ? state_->scope->weight() : 0.0;
}

int64_t LLLiteHandle::modules() const {
  if (!state_) throw InvalidArgument("empty sluice::LLLiteHandle");
  return state_->modules;
}

int64_t LLLiteHandle::bound_layers() const {
  if (!state_) throw InvalidArgument("empty sluice::LLLiteHandle");
  return state_->bound;
}

uint64_t LLLiteHandle::device_bytes() const {
  if (!state_) throw InvalidArgument("empty sluice::LLLiteHandle");
  return state_->bytes;
}

void LLLiteHandle::remove() {
  if (!state_) return;
  std::shared_ptr<detail::LLLiteState> st = std::move(state_);
  end_lllite(*st);
}

// ---------------------------------------------------------------------------------------
// LoraHandle

LoraHandle& LoraHandle::operator=(LoraHandle&& other) noexcept {
  if (this != &other) {
    try {
      remove();
    } catch (const std::exception& e) {
      log::error(std::string("removing a LoRA failed: ") + e.what());
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

LoraHandle::~LoraHandle() {
  try {
    remove();
  } catch (const std::exception& e) {
    log::error(std::string("removing a LoRA failed: ") + e.what());
  }
}

int64_t LoraHandle::patched_layers() const {
  if (!state_) throw InvalidArgument("empty sluice::LoraHandle");
  return state_->patched;
}

bool LoraHandle::active() const {
  if (!state_) return false;
  std::lock_guard<std::mutex> g(state_->mutex);
  return state_->scope != nullptr;
}

void LoraHandle::remove() {
  if (!state_) return;
  std::shared_ptr<detail::LoraState> st = std::move(state_);
  end_lora(*st);
}

}  // namespace sluice
