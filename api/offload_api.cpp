// sluice::OffloadedModel (include/sluice/offload.hpp): a ForeignModel (offload/
// foreign_model.h, Note [foreign layers]) adopted into a model cache (Note [adopted models]
// in cache/model_cache.h), the host's or one of its own.
#include "sluice/offload.hpp"

#include <ATen/core/grad_mode.h>
#include <atomic>
#include <mutex>
#include <optional>
#include <thread>

#include "api/cache_impl.h"
#include "cache/model_cache.h"
#include "offload/engine/engine.h"
#include "offload/layer/foreign_model.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "sluice/sluice.hpp"

namespace sluice {

namespace detail {
struct OffloadState {
  std::unique_ptr<offload::ForeignModel> model;
  OffloadOptions options;  // begin()'s, for finish()
  bool finished = false;   // in the cache (finish() done)
  std::shared_ptr<CacheImpl> cache;
  bool own_cache = false;  // made for this model alone (no ModelCache given)
  std::shared_ptr<cache::Entry> entry;
  std::atomic<bool> removed{false};
  // One thread's forward at a time: held from the outermost begin_forward to its
  // end_forward, and once more by each nested pair (a recursive mutex, locked and unlocked
  // on the forward's thread).
  std::recursive_mutex forward_mutex;
  std::atomic<std::thread::id> owner{};  // the thread whose forward runs; none between forwards
  // The outermost forward's: its lock on the entry and the engine begin_run gave it.
  int depth = 0;
  std::optional<cache::Lock> lock;
  offload::StreamingEngine* engine = nullptr;
};
}  // namespace detail

namespace {

// The options that are the cache's: with a ModelCache given, each must keep its default.
void require_cache_defaults(const OffloadOptions& o) {
  const OffloadOptions d;
  const auto check = [](bool same, const char* field) {
    if (!same) {
      throw InvalidArgument(std::string("offload: '") + field +
                            "' is the ModelCache's when the model goes into one; set it on the cache");
    }
  };
#define SLUICE_CHECK_DEFAULT(type, name, default_value) check(o.name == d.name, #name);
  SLUICE_OFFLOAD_CACHE_FIELDS(SLUICE_CHECK_DEFAULT)
#undef SLUICE_CHECK_DEFAULT
}

// i as an index into the model's layers; the model names the index it has no layer for.
size_t layer_index(int64_t i) {
  if (i < 0) throw InvalidArgument("offload: no layer " + std::to_string(i));
  return static_cast<size_t>(i);
}

}  // namespace

OffloadedModel::OffloadedModel(const OffloadOptions& o) : state_(std::make_unique<detail::OffloadState>()) {
  RuntimeOptions r;
#define SLUICE_TO_RUNTIME(type, name, default_value) r.name = o.name;  // the cache's fields, named as RuntimeOptions's
  SLUICE_OFFLOAD_CACHE_FIELDS(SLUICE_TO_RUNTIME)
#undef SLUICE_TO_RUNTIME
  r.ram_limit = "0";  // the host's model, in RAM already: nothing to evict for it
  ModelCache own(r);
  state_->cache = own.impl_;
  state_->own_cache = true;
  begin(o);
}

OffloadedModel::OffloadedModel(ModelCache& cache, const OffloadOptions& o)
    : state_(std::make_unique<detail::OffloadState>()) {
  require_cache_defaults(o);
  state_->cache = cache.impl_;
  begin(o);
}

OffloadedModel::OffloadedModel(std::vector<OffloadLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                               const OffloadOptions& o)
    : OffloadedModel(o) {
  for (auto& l : layers) add_layer(std::move(l));
  finish(std::move(extras));
}

OffloadedModel::OffloadedModel(std::vector<OffloadLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                               ModelCache& cache, const OffloadOptions& o)
    : OffloadedModel(cache, o) {
  for (auto& l : layers) add_layer(std::move(l));
  finish(std::move(extras));
}

void OffloadedModel::begin(const OffloadOptions& o) {
  offload::check_max_resident(o.max_resident);
  cache::ModelCache& c = *state_->cache->cache;
  offload::ForeignOptions fo;
  fo.storage = parse_storage_dtype(o.storage);
  fo.compute = parse_compute_dtype(o.compute);
  fo.skip = o.skip;
  if (is_fp8(fo.storage) && !device_supports_fp8_storage(c.device().device(), fo.storage)) {
    throw InvalidArgument("storage: " + dtype_name(fo.storage) + " is not supported on " + c.device().name());
  }
  state_->options = o;
  state_->model = std::make_unique<offload::ForeignModel>(fo);
}

int64_t OffloadedModel::add_layer(OffloadLayer l) {
  if (state_->finished || state_->removed) {
    throw InvalidArgument("offload: add_layer after finish(); a model's layers are all given before it runs");
  }
  const offload::LayerKind kind = l.kind == OffloadLayerKind::linear      ? offload::LayerKind::linear
                                  : l.kind == OffloadLayerKind::embedding ? offload::LayerKind::embedding
                                                                          : offload::LayerKind::other;
  std::optional<at::ScalarType> compute;
  if (!l.compute.empty()) compute = parse_compute_dtype(l.compute);
  state_->model->add_layer({std::move(l.name), std::move(l.weight), std::move(l.bias), kind, compute});
  return static_cast<int64_t>(state_->model->size()) - 1;
}

void OffloadedModel::finish(std::vector<std::pair<std::string, at::Tensor>> extras) {
  if (state_->finished || state_->removed) throw InvalidArgument("offload: finish() twice");
  detail::OffloadState& s = *state_;
  s.model->add_extras(std::move(extras));
  cache::ModelCache& c = *s.cache->cache;
  const OffloadOptions& o = s.options;
  s.entry = c.adopt(s.model->module_ptr(), o.name.empty() ? "offloaded model" : o.name,
                    DtypePair{parse_storage_dtype(o.storage), parse_compute_dtype(o.compute)}, o.max_resident);
  s.finished = true;
}

OffloadedModel::~OffloadedModel() {
  if (!state_ || !state_->entry || state_->removed || !state_->finished) return;
  try {
    detail::OffloadState& s = *state_;
    if (s.lock && s.owner.load() == std::this_thread::get_id()) {
      // A host destroying the model in the middle of its own forward: that forward ends,
      // aborted, at every level it nested, and its turn is given back (a mutex must not be
      // destroyed locked). Another thread's forward cannot be ended from here: destroying
      // a model that another thread runs is the host's error, as for any C++ object.
      for (; s.depth > 0; --s.depth) {
        s.engine->end_forward_noexcept(true);
        s.forward_mutex.unlock();
      }
      s.owner.store(std::thread::id());
      s.cache->cache->end_run(*s.lock, /*aborted=*/true);
      s.lock.reset();
    }
    state_->cache->cache->drop(state_->entry);
  } catch (const std::exception& e) {
    log::warn(std::string("offload: removing the model at its destruction: ") + e.what());
  }
}

size_t OffloadedModel::layers() const { return state_->model->size(); }

at::ScalarType OffloadedModel::stored_dtype(int64_t i) const { return state_->model->stored_dtype(layer_index(i)); }

std::pair<at::Tensor, std::optional<at::Tensor>> OffloadedModel::stored_layer(int64_t i) const {
  if (!removed()) throw InvalidArgument("offload: a layer's stored tensors are read after remove()");
  offload::StoredLayer s = state_->model->host_copy(layer_index(i));
  return {std::move(s.weight), std::move(s.bias)};
}

void OffloadedModel::release_layer(int64_t i) {
  if (!removed()) throw InvalidArgument("offload: a layer's stored tensors are freed after remove()");
  state_->model->release_host(layer_index(i));
  return_freed_host_memory();  // the layer's pages back to the system before the host takes the next
}

bool OffloadedModel::removed() const { return state_->removed; }

void OffloadedModel::require_finished() const {
  if (!state_->finished) throw InvalidArgument("offload: the model is still being built; call finish() first");
}

void OffloadedModel::require_attached() const {
  if (removed()) throw InvalidArgument("offload: the model was removed; offload it again to run it through sluice");
  if (!state_->finished) throw InvalidArgument("offload: the model is still being built; call finish() first");
}

at::Tensor OffloadedModel::in_forward(int64_t i, const std::function<at::Tensor(size_t)>& fn) {
  require_attached();
  const size_t index = layer_index(i);
  // Inference only: a weight leased for one layer must not live on in an autograd graph
  // (it is a staging slot or scratch that the next layer reuses).
  at::NoGradGuard no_grad;
  if (state_->owner.load() == std::this_thread::get_id()) return fn(index);
  // Called outside the model's forward (a host calling one of its layers directly): a
  // forward of its own, so that the layer's weights come from the engine, on the device.
  begin_forward("layer");
  at::Tensor y;
  try {
    y = fn(index);
  } catch (...) {
    end_forward(true);
    throw;
  }
  end_forward(false);
  return y;
}

at::Tensor OffloadedModel::linear(int64_t i, const at::Tensor& x) {
  return in_forward(i, [&](size_t k) { return state_->model->linear(k, x); });
}

at::Tensor OffloadedModel::embedding(int64_t i, const at::Tensor& ids) {
  return in_forward(i, [&](size_t k) { return state_->model->embedding(k, ids); });
}

at::Tensor OffloadedModel::call(int64_t i, const LayerFn& fn) {
  return in_forward(i, [&](size_t k) { return state_->model->with_weights(k, fn); });
}

void OffloadedModel::begin_forward(const std::string& kind) {
  require_attached();
  detail::OffloadState& s = *state_;
  std::unique_lock<std::recursive_mutex> turn(s.forward_mutex);  // another thread's forward ends first
  require_attached();  // removed while this one waited
  if (s.depth > 0) {
    s.engine->begin_forward(kind);
    s.depth += 1;
    turn.release();  // held until the matching end_forward
    return;
  }
  cache::ModelCache& c = *s.cache->cache;
  cache::Lock lock = c.lock(s.entry);  // its share first (Note [cache tiers])
  offload::StreamingEngine& engine = c.begin_run(lock);
  try {
    engine.begin_forward(kind);
  } catch (...) {
    c.end_run(lock, /*aborted=*/true);
    throw;
  }
  s.lock.emplace(std::move(lock));
  s.engine = &engine;
  s.depth = 1;
  s.owner.store(std::this_thread::get_id());
  turn.release();
}

void OffloadedModel::end_forward(bool aborted) {
  detail::OffloadState& s = *state_;
  if (s.depth == 0 || s.owner.load() != std::this_thread::get_id()) {
    throw InvalidArgument("offload: end_forward without a begin_forward on this thread");
  }
  std::unique_lock<std::recursive_mutex> turn(s.forward_mutex, std::adopt_lock);  // begin_forward's
  s.depth -= 1;
  if (s.depth > 0) {
    s.engine->end_forward(aborted);
    return;
  }
  s.owner.store(std::thread::id());
  // The outermost forward: the engine, the run and the lock end together, whatever throws.
  std::optional<cache::Lock> lock = std::move(s.lock);
  s.lock.reset();
  offload::StreamingEngine* engine = s.engine;
  s.engine = nullptr;
  try {
    engine->end_forward(aborted);
  } catch (...) {
    s.cache->cache->end_run(*lock, /*aborted=*/true);
    throw;
  }
  s.cache->cache->end_run(*lock, aborted);
}

std::string OffloadedModel::stats_json(int indent) const {
  require_finished();
  return state_->cache->cache->model_stats_json(state_->entry, indent);
}

void OffloadedModel::write_trace(const std::string& path) const {
  require_finished();
  state_->cache->cache->write_trace(state_->entry, path);
}

void OffloadedModel::write_timeline_svg(const std::string& path) const {
  require_finished();
  state_->cache->cache->write_timeline_svg(state_->entry, path);
}

void OffloadedModel::set_vram_budget(const std::string& text) {
  require_attached();
  if (!state_->own_cache) {
    throw InvalidArgument("offload: the model is in a ModelCache; set the budget with the cache's set_vram_budget");
  }
  state_->cache->set_vram_budget(text);
}

void OffloadedModel::remove() {
  if (removed()) throw InvalidArgument("offload: the model was already removed");
  std::lock_guard<std::recursive_mutex> turn(state_->forward_mutex);
  if (state_->depth > 0) throw InvalidArgument("offload: remove() during the model's forward; remove it after");
  if (state_->finished) state_->cache->cache->drop(state_->entry);  // before finish(): in no cache yet
  state_->removed = true;
}

}  // namespace sluice
