// The C API (include/sluice/sluice.h) over the C++ API: every entry point runs its body
// through guarded(), which turns each exception into a status code plus a thread-local
// message, so nothing C++ crosses the boundary.
#include "sluice/sluice.h"

#include <ATen/ATen.h>
#include <ATen/DLConvertor.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#include "runtime/error.h"
#include "sluice/sluice.hpp"

struct sluice_cache {
  sluice::ModelCache cache;
  explicit sluice_cache(sluice::RuntimeOptions o) : cache(std::move(o)) {}
};
struct sluice_model {
  sluice::Model model;
};
struct sluice_locked {
  sluice::LockedModel locked;
};
struct sluice_lora {
  sluice::LoraHandle handle;
};
struct sluice_lllite {
  sluice::LLLiteHandle handle;
};

namespace {

thread_local std::string last_error;

// One line: C hosts print it as is.
void set_error(std::string message) {
  for (char& c : message)
    if (c == '\n' || c == '\r') c = ' ';
  last_error = std::move(message);
}

template <typename F>
sluice_status guarded(F&& body) noexcept {
  try {
    last_error.clear();
    body();
    return SLUICE_OK;
  } catch (const sluice::InvalidArgument& e) {
    set_error(e.what());
    return SLUICE_ERROR_INVALID_ARGUMENT;
  } catch (const sluice::FileError& e) {
    set_error(e.what());
    return SLUICE_ERROR_FILE;
  } catch (const sluice::CheckpointError& e) {
    set_error(e.what());
    return SLUICE_ERROR_CHECKPOINT;
  } catch (const sluice::ResourceError& e) {
    set_error(e.what());
    return SLUICE_ERROR_RESOURCE;
  } catch (const c10::Error& e) {
    // torch's own argument checks (shape mismatches deep in an op) are caller mistakes.
    set_error(e.what_without_backtrace());
    return SLUICE_ERROR_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_error("out of memory");
    return SLUICE_ERROR_RESOURCE;
  } catch (const std::exception& e) {
    set_error(e.what());
    return SLUICE_ERROR_INTERNAL;
  } catch (...) {
    set_error("unknown error");
    return SLUICE_ERROR_INTERNAL;
  }
}

template <typename T>
T& need(T* handle, const char* what) {
  if (handle == nullptr) throw sluice::InvalidArgument(std::string(what) + " is NULL");
  return *handle;
}

void need_out(const void* out, const char* what) {
  if (out == nullptr) throw sluice::InvalidArgument(std::string("output pointer '") + what + "' is NULL");
}

std::string str(const char* s) { return s == nullptr ? std::string() : std::string(s); }

char* dup_string(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p == nullptr) throw std::bad_alloc();
  std::memcpy(p, s.c_str(), s.size() + 1);
  return p;
}

// A borrowed view of a caller's DLPack tensor: the caller keeps ownership (no deleter call).
at::Tensor borrow(const DLManagedTensor* t, const char* name) {
  if (t == nullptr) throw sluice::InvalidArgument(std::string("tensor '") + name + "' is NULL");
  return at::fromDLPack(const_cast<DLManagedTensor*>(t), [](void*) {});
}

// Reads a struct field only when the caller's struct (struct_size) is new enough to have it.
#define SLUICE_HAS_FIELD(opts, field) \
  ((opts)->struct_size >= offsetof(std::remove_pointer_t<decltype(opts)>, field) + sizeof((opts)->field))

sluice::RuntimeOptions runtime_options(const sluice_cache_options* o) {
  sluice::RuntimeOptions r;
  if (o == nullptr) return r;
  if (o->struct_size == 0) throw sluice::InvalidArgument("sluice_cache_options.struct_size is 0 (call sluice_cache_options_init)");
  if (SLUICE_HAS_FIELD(o, device) && o->device && *o->device) r.device = o->device;
  if (SLUICE_HAS_FIELD(o, vram_budget)) r.vram_budget = str(o->vram_budget);
  if (SLUICE_HAS_FIELD(o, working_memory)) r.working_memory = str(o->working_memory);
  if (SLUICE_HAS_FIELD(o, resolution) && o->resolution > 0) r.resolution = o->resolution;
  if (SLUICE_HAS_FIELD(o, ram_limit)) r.ram_limit = str(o->ram_limit);
  if (SLUICE_HAS_FIELD(o, prefetch)) r.prefetch = o->prefetch == SLUICE_PREFETCH_AUTO ? "auto" : std::to_string(o->prefetch);
  if (SLUICE_HAS_FIELD(o, pin_memory) && o->pin_memory && *o->pin_memory) r.pin_memory = o->pin_memory;
  if (SLUICE_HAS_FIELD(o, policy) && o->policy && *o->policy) r.policy = o->policy;
  if (SLUICE_HAS_FIELD(o, timing)) r.timing = o->timing != 0;
  if (SLUICE_HAS_FIELD(o, trace)) r.trace = o->trace != 0;
  if (SLUICE_HAS_FIELD(o, device_memory)) r.device_memory = o->device_memory;
  if (SLUICE_HAS_FIELD(o, vram_headroom)) r.vram_headroom = str(o->vram_headroom);
  if (SLUICE_HAS_FIELD(o, pin_memory_limit)) r.pin_memory_limit = str(o->pin_memory_limit);
  if (SLUICE_HAS_FIELD(o, load_threads)) r.load_threads = o->load_threads;
  return r;
}

sluice::LoadOptions load_options(const sluice_load_options* o) {
  sluice::LoadOptions l;
  if (o == nullptr) return l;
  if (o->struct_size == 0) throw sluice::InvalidArgument("sluice_load_options.struct_size is 0 (call sluice_load_options_init)");
  if (SLUICE_HAS_FIELD(o, storage) && o->storage && *o->storage) l.storage = o->storage;
  if (SLUICE_HAS_FIELD(o, compute) && o->compute && *o->compute) l.compute = o->compute;
  if (SLUICE_HAS_FIELD(o, n_extra_skips) && o->n_extra_skips > 0) {
    if (o->extra_skips == nullptr) throw sluice::InvalidArgument("sluice_load_options.extra_skips is NULL but n_extra_skips > 0");
    for (size_t i = 0; i < o->n_extra_skips; ++i) {
      if (o->extra_skips[i] == nullptr)
        throw sluice::InvalidArgument("sluice_load_options.extra_skips[" + std::to_string(i) + "] is NULL");
      l.extra_skips.emplace_back(o->extra_skips[i]);
    }
  }
  if (SLUICE_HAS_FIELD(o, use_default_skips)) l.use_default_skips = o->use_default_skips != 0;
  if (SLUICE_HAS_FIELD(o, use_model_skips)) l.use_model_skips = o->use_model_skips != 0;
  if (SLUICE_HAS_FIELD(o, max_resident) && o->max_resident >= 0) l.max_resident = o->max_resident;
  if (SLUICE_HAS_FIELD(o, config)) l.config = str(o->config);
  if (SLUICE_HAS_FIELD(o, seed)) l.seed = o->seed;
  if (SLUICE_HAS_FIELD(o, name)) l.name = str(o->name);
  return l;
}

void set_delta(int64_t* out, int64_t v) {
  if (out != nullptr) *out = v;
}

}  // namespace

extern "C" {

const char* sluice_version(void) {
  static const std::string v = sluice::version();
  return v.c_str();
}

int sluice_abi_version(void) { return SLUICE_C_ABI_VERSION; }

const char* sluice_last_error(void) { return last_error.c_str(); }

void sluice_free_string(char* s) { std::free(s); }

void sluice_cache_options_init(sluice_cache_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  const sluice::RuntimeOptions d;
  o->resolution = d.resolution;
  o->prefetch = SLUICE_PREFETCH_AUTO;  // d.prefetch is "auto"
  o->timing = d.timing ? 1 : 0;
  o->trace = d.trace ? 1 : 0;
  o->device_memory = d.device_memory;
}

void sluice_load_options_init(sluice_load_options* o) {
  if (o == nullptr) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  const sluice::LoadOptions d;
  o->use_default_skips = d.use_default_skips ? 1 : 0;
  o->use_model_skips = d.use_model_skips ? 1 : 0;
  o->max_resident = -1.0;
  o->seed = d.seed;
}

sluice_status sluice_cache_create(const sluice_cache_options* options, sluice_cache** out) {
  return guarded([&] {
    need_out(out, "out");
    *out = new sluice_cache(runtime_options(options));
  });
}

void sluice_cache_destroy(sluice_cache* cache) {
  (void)guarded([&] { delete cache; });
}

sluice_status sluice_cache_set_vram_budget(sluice_cache* cache, const char* budget) {
  return guarded([&] { need(cache, "cache").cache.set_vram_budget(str(budget)); });
}

sluice_status sluice_cache_stats_json(sluice_cache* cache, char** out) {
  return guarded([&] {
    need_out(out, "out");
    *out = dup_string(need(cache, "cache").cache.stats_json());
  });
}

sluice_status sluice_load(sluice_cache* cache, const char* path_or_preset, const sluice_load_options* options,
                          sluice_model** out) {
  return guarded([&] {
    need_out(out, "out");
    if (path_or_preset == nullptr || *path_or_preset == '\0')
      throw sluice::InvalidArgument("sluice_load: path_or_preset is empty");
    sluice::Model m = need(cache, "cache").cache.load(path_or_preset, load_options(options));
    *out = new sluice_model{std::move(m)};
  });
}

void sluice_model_release(sluice_model* model) {
  (void)guarded([&] { delete model; });
}

sluice_status sluice_drop(sluice_cache* cache, sluice_model* model) {
  return guarded([&] { need(cache, "cache").cache.drop(need(model, "model").model); });
}

sluice_status sluice_model_stats_json(sluice_model* model, char** out) {
  return guarded([&] {
    need_out(out, "out");
    *out = dup_string(need(model, "model").model.stats_json());
  });
}

sluice_status sluice_model_info_json(sluice_model* model, char** out) {
  return guarded([&] {
    need_out(out, "out");
    *out = dup_string(need(model, "model").model.info().config_json);
  });
}

sluice_status sluice_model_write_trace(sluice_model* model, const char* path) {
  return guarded([&] { need(model, "model").model.write_trace(str(path)); });
}

sluice_status sluice_partial_load(sluice_model* model, uint64_t bytes, int64_t* delta_bytes) {
  return guarded([&] { set_delta(delta_bytes, need(model, "model").model.partial_load(bytes)); });
}

sluice_status sluice_partial_unload(sluice_model* model, uint64_t bytes, int64_t* delta_bytes) {
  return guarded([&] { set_delta(delta_bytes, need(model, "model").model.partial_unload(bytes)); });
}

sluice_status sluice_full_load(sluice_model* model, int64_t* delta_bytes) {
  return guarded([&] { set_delta(delta_bytes, need(model, "model").model.full_load()); });
}

sluice_status sluice_full_unload(sluice_model* model, int64_t* delta_bytes) {
  return guarded([&] { set_delta(delta_bytes, need(model, "model").model.full_unload()); });
}

sluice_status sluice_lock(sluice_model* model, sluice_locked** out) {
  return guarded([&] {
    need_out(out, "out");
    sluice::LockedModel l = need(model, "model").model.lock();
    *out = new sluice_locked{std::move(l)};
  });
}

void sluice_unlock(sluice_locked* lock) {
  (void)guarded([&] { delete lock; });
}

sluice_status sluice_forward(sluice_locked* lock, const DLManagedTensor* x, const DLManagedTensor* timesteps,
                             const DLManagedTensor* context, DLManagedTensor** out) {
  return guarded([&] {
    need_out(out, "out");
    sluice::LockedModel& m = need(lock, "lock").locked;
    const at::Tensor v = m.forward(borrow(x, "x"), borrow(timesteps, "timesteps"), borrow(context, "context"));
    *out = at::toDLPack(v);
  });
}

sluice_status sluice_forward_masked(sluice_locked* lock, const DLManagedTensor* x, const DLManagedTensor* timesteps,
                                    const DLManagedTensor* context, const DLManagedTensor* cross_attn_mask,
                                    const int64_t* mask_blocks, size_t num_mask_blocks, DLManagedTensor** out) {
  return guarded([&] {
    need_out(out, "out");
    sluice::LockedModel& m = need(lock, "lock").locked;
    sluice::ForwardOptions options;
    if (cross_attn_mask != nullptr) {
      const at::Tensor mask = borrow(cross_attn_mask, "cross_attn_mask");
      // uint8 is C's usual boolean buffer: nonzero is True. Any other dtype is refused by the model, named.
      options.cross_attn_mask = mask.scalar_type() == at::kByte ? mask.ne(0) : mask;
    }
    if (num_mask_blocks > 0) {
      if (mask_blocks == nullptr) throw sluice::InvalidArgument("mask_blocks is NULL but num_mask_blocks is not 0");
      options.mask_blocks.assign(mask_blocks, mask_blocks + num_mask_blocks);
    }
    const at::Tensor v = m.forward(borrow(x, "x"), borrow(timesteps, "timesteps"), borrow(context, "context"), options);
    *out = at::toDLPack(v);
  });
}

sluice_status sluice_synchronize(sluice_locked* lock) {
  return guarded([&] { need(lock, "lock").locked.synchronize(); });
}

sluice_status sluice_encode_text(sluice_locked* lock, const DLManagedTensor* qwen_hidden, const DLManagedTensor* t5_ids,
                                 const DLManagedTensor* t5_weights, DLManagedTensor** out) {
  return guarded([&] {
    need_out(out, "out");
    sluice::LockedModel& m = need(lock, "lock").locked;
    std::optional<at::Tensor> w;
    if (t5_weights != nullptr) w = borrow(t5_weights, "t5_weights");
    const at::Tensor ctx = m.encode_text(borrow(qwen_hidden, "qwen_hidden"), borrow(t5_ids, "t5_ids"), w);
    *out = at::toDLPack(ctx);
  });
}

sluice_status sluice_encode_text_semantic(sluice_locked* lock, const DLManagedTensor* qwen_hidden,
                                          const DLManagedTensor* t5_ids, const DLManagedTensor* t5_weights,
                                          const DLManagedTensor* qwen35_hidden, const DLManagedTensor* qwen35_mask,
                                          const DLManagedTensor* timesteps, DLManagedTensor** out) {
  return guarded([&] {
    need_out(out, "out");
    sluice::LockedModel& m = need(lock, "lock").locked;
    std::optional<at::Tensor> w;
    if (t5_weights != nullptr) w = borrow(t5_weights, "t5_weights");
    sluice::SemanticInputs semantic;
    semantic.qwen35_hidden = {borrow(qwen35_hidden, "qwen35_hidden")};
    if (qwen35_mask != nullptr) semantic.qwen35_mask = borrow(qwen35_mask, "qwen35_mask");
    semantic.timesteps = borrow(timesteps, "timesteps");
    const at::Tensor ctx = m.encode_text(borrow(qwen_hidden, "qwen_hidden"), borrow(t5_ids, "t5_ids"), w, semantic);
    *out = at::toDLPack(ctx);
  });
}

sluice_status sluice_lora_apply(sluice_locked* lock, const char* path, double scale, sluice_lora** out) {
  return guarded([&] {
    need_out(out, "out");
    sluice::LoraHandle h = need(lock, "lock").locked.apply_lora(str(path), scale);
    *out = new sluice_lora{std::move(h)};
  });
}

sluice_status sluice_lora_apply_ex(sluice_locked* lock, const char* path, double scale, const char* block_layout,
                                   sluice_lora** out) {
  return guarded([&] {
    need_out(out, "out");
    const sluice::BlockLayout layout =
        block_layout == nullptr ? sluice::BlockLayout::measured : sluice::parse_block_layout(block_layout);
    sluice::LoraHandle h = need(lock, "lock").locked.apply_lora(str(path), scale, layout);
    *out = new sluice_lora{std::move(h)};
  });
}

void sluice_lora_remove(sluice_lora* lora) {
  (void)guarded([&] { delete lora; });
}

int sluice_lora_active(const sluice_lora* lora) { return lora != nullptr && lora->handle.active() ? 1 : 0; }

sluice_status sluice_lllite_apply(sluice_locked* lock, const char* path, const DLManagedTensor* cond_image,
                                  double weight, const DLManagedTensor* mask, const char* block_layout,
                                  sluice_lllite** out) {
  return guarded([&] {
    need_out(out, "out");
    const sluice::BlockLayout layout =
        block_layout == nullptr ? sluice::BlockLayout::measured : sluice::parse_block_layout(block_layout);
    std::optional<at::Tensor> m;
    if (mask != nullptr) m = borrow(mask, "mask");
    sluice::LLLiteHandle h =
        need(lock, "lock").locked.apply_lllite(str(path), borrow(cond_image, "cond_image"), weight, m, layout);
    *out = new sluice_lllite{std::move(h)};
  });
}

sluice_status sluice_lllite_set_weight(sluice_lllite* lllite, double weight) {
  return guarded([&] { need(lllite, "lllite").handle.set_weight(weight); });
}

void sluice_lllite_remove(sluice_lllite* lllite) {
  (void)guarded([&] { delete lllite; });
}

int sluice_lllite_active(const sluice_lllite* lllite) {
  return lllite != nullptr && lllite->handle.active() ? 1 : 0;
}

}  // extern "C"
