/* sluice's C API: a C boundary over the C++ API (sluice/sluice.hpp) for hosts that are not
 * C++ (C programs, FFI from other languages).
 *
 *   sluice_cache_options o;  sluice_cache_options_init(&o);
 *   o.device = "cpu";  o.vram_budget = "50%";
 *   sluice_cache* cache;     if (sluice_cache_create(&o, &cache) != SLUICE_OK) puts(sluice_last_error());
 *   sluice_model* model;     sluice_load(cache, "anima.safetensors", NULL, &model);
 *   sluice_locked* m;        sluice_lock(model, &m);                  (never evicted while locked)
 *   DLManagedTensor* v;      sluice_forward(m, x, timesteps, context, &v);
 *   ...                      v->deleter(v);  sluice_unlock(m);  sluice_model_release(model);
 *                            sluice_cache_destroy(cache);
 *
 * Rules:
 *  - Every call that can fail returns a sluice_status. On failure the out-parameters are
 *    untouched and sluice_last_error() returns a one-line message naming the file, flag or
 *    tensor at fault. The message is thread-local and valid until the thread's next sluice
 *    call. No C++ exception ever crosses this boundary.
 *  - Handles are opaque. A sluice_model stays valid after its cache is destroyed (calls on
 *    it may then fail with SLUICE_ERROR_INVALID_ARGUMENT if the model was dropped).
 *  - Tensors cross as DLPack (DLManagedTensor). Inputs are borrowed: the caller keeps
 *    ownership and calls their deleter itself; sluice reads them zero-copy where the
 *    device and dtype already match. Outputs are new DLManagedTensors the caller owns and
 *    releases with their deleter.
 *  - Strings returned through char** are malloc'ed; free them with sluice_free_string().
 *
 * ABI: SLUICE_C_ABI_VERSION is bumped whenever an existing function, enum value or struct
 * field changes meaning or layout. Within one ABI version, functions and status codes are
 * only added, and option structs only grow at their end: each starts with struct_size,
 * which *_init() sets, so a library can tell which fields an older caller knows. Callers
 * must call the matching *_init() before setting fields. sluice_abi_version() reports the
 * library's version; a host should refuse a different one.
 */
#ifndef SLUICE_SLUICE_H
#define SLUICE_SLUICE_H

#include <stddef.h>
#include <stdint.h>

#include <ATen/dlpack.h> /* DLPack: DLManagedTensor (the header is plain C; torch ships it) */

#ifdef __cplusplus
extern "C" {
#endif

#define SLUICE_C_ABI_VERSION 1
/* sluice_cache_options.prefetch: no bound in layers, only the staging ring's bytes. */
#define SLUICE_PREFETCH_AUTO 0xFFFFFFFFu

typedef enum sluice_status {
  SLUICE_OK = 0,
  SLUICE_ERROR_INVALID_ARGUMENT = 1, /* a bad value: flag, budget string, tensor shape/dtype, null handle */
  SLUICE_ERROR_FILE = 2,             /* a file that cannot be opened, read or parsed */
  SLUICE_ERROR_CHECKPOINT = 3,       /* a checkpoint whose keys or shapes do not match the model */
  SLUICE_ERROR_RESOURCE = 4,         /* budget too small, out of memory, device missing */
  SLUICE_ERROR_INTERNAL = 5          /* anything else (a bug: please report the message) */
} sluice_status;

typedef struct sluice_cache sluice_cache; /* a ModelCache: models in RAM, one device, one budget */
typedef struct sluice_model sluice_model; /* a handle on one cached model */
typedef struct sluice_locked sluice_locked; /* a locked model: in use, never evicted while held */
typedef struct sluice_lora sluice_lora;   /* a LoRA applied to a locked model */
typedef struct sluice_lllite sluice_lllite; /* a ControlNet-LLLite bound to a locked model */

/* The library version ("0.1.0") and the C ABI version it implements. */
const char* sluice_version(void);
int sluice_abi_version(void);

/* The calling thread's last error message ("" when none). */
const char* sluice_last_error(void);

/* Frees a string returned by sluice (NULL is fine). */
void sluice_free_string(char* s);

/* Options of sluice_cache_create. Strings are copied; NULL or "" means the default.
 * Sizes use sluice's size syntax: bytes ("123456"), units ("6GiB", "512MiB"), or "50%". */
typedef struct sluice_cache_options {
  size_t struct_size;        /* set by sluice_cache_options_init */
  const char* device;        /* "cpu" (CPU plays the device), "cuda", "cuda:N"; default "cpu" */
  const char* vram_budget;   /* device bytes for all models, working memory included ("50%" of total,
                                "auto": free memory minus vram_headroom); default: all */
  const char* working_memory; /* part of the budget kept for activations; default: sized for resolution */
  int64_t resolution;        /* image side the default working memory is sized for; default 1024 */
  const char* ram_limit;     /* host bytes for cached models, LRU eviction; "0": unlimited; default
                                min(L, max(4GiB, 50% of L - 2GiB)), L the host memory limit (the smallest of
                                RAM, the cgroup memory limit and what MemAvailable allows) */
  uint32_t prefetch;         /* most streamed layers copied ahead of compute, 0..65536, or
                                SLUICE_PREFETCH_AUTO (the default): as far as the ring's bytes allow */
  const char* pin_memory;    /* "auto" | "on" | "off"; default "auto" */
  const char* policy;        /* "balanced" | "spread" | "front-first"; default "balanced" */
  int timing;                /* nonzero: device-timed per-forward stats; default 1 */
  int trace;                 /* nonzero: record spans for sluice_model_write_trace; default 0 */
  uint64_t device_memory;    /* device memory to assume for percentages; 0: ask the device */
  const char* vram_headroom; /* vram_budget "auto" only: memory left free ("10%" of total); default max(512MiB, 5%) */
  const char* pin_memory_limit; /* page-locked host bytes for all models ("25%" of RAM); streamed layers past it
                                   stay pageable; default min(50% of L, L - 4GiB), L as for ram_limit */
  int load_threads;          /* threads that read (and cast) a checkpoint; 0 (default): every core */
} sluice_cache_options;

/* Options of sluice_load; NULL means all defaults. */
typedef struct sluice_load_options {
  size_t struct_size;        /* set by sluice_load_options_init */
  const char* storage;       /* stored dtype: "float8_e4m3fn" (default), "bfloat16" (no fp8), ... */
  const char* compute;       /* "auto" (default: bf16 where the device computes it natively, else fp32; the
                                reason is in the stats JSON's model.compute), "bfloat16", "float16", "float32" */
  const char* const* extra_skips; /* more skip patterns (kept in the compute dtype) */
  size_t n_extra_skips;
  int use_default_skips;     /* nonzero (default): include the default skip patterns */
  int use_model_skips;       /* nonzero (default): include the model's declared patterns */
  double max_resident;       /* resident fraction 0..1 of the streamable weights; < 0 (default): budget decides */
  const char* config;        /* preset name or JSON file overriding the inferred config */
  uint64_t seed;             /* seed of a generated (preset) model; default 0 */
  const char* name;          /* name in logs and stats; default: preset name or file stem */
} sluice_load_options;

void sluice_cache_options_init(sluice_cache_options* options);
void sluice_load_options_init(sluice_load_options* options);

/* Cache. */
sluice_status sluice_cache_create(const sluice_cache_options* options, sluice_cache** out);
void sluice_cache_destroy(sluice_cache* cache); /* NULL is fine; models stay valid */
/* New budget for all models ("50%", "6GiB", bytes). */
sluice_status sluice_cache_set_vram_budget(sluice_cache* cache, const char* budget);
/* Cache statistics as JSON (hits, misses, loads, evictions, ram, vram ..., models_held: every
 * model the cache holds {id, name, source, ..., device_bytes, allocated_bytes}, and
 * vram_unattributed_bytes: vram.current = models_allocated_bytes + vram_unattributed_bytes);
 * *out to free. */
sluice_status sluice_cache_stats_json(sluice_cache* cache, char** out);

/* Models: a preset name ("anima-small"), a JSON config, or a .safetensors checkpoint. */
sluice_status sluice_load(sluice_cache* cache, const char* path_or_preset, const sluice_load_options* options,
                          sluice_model** out);
void sluice_model_release(sluice_model* model); /* releases the handle, not the cached model */
sluice_status sluice_drop(sluice_cache* cache, sluice_model* model); /* removes it from the cache */
/* The model's --stats-json document (model, budget, device, forwards[], cache); *out to free. */
sluice_status sluice_model_stats_json(sluice_model* model, char** out);
/* The model's config as JSON; *out to free. */
sluice_status sluice_model_info_json(sluice_model* model, char** out);
sluice_status sluice_model_write_trace(sluice_model* model, const char* path);
/* Residency changes; *delta_bytes (may be NULL) receives the change in device bytes. */
sluice_status sluice_partial_load(sluice_model* model, uint64_t bytes, int64_t* delta_bytes);
sluice_status sluice_partial_unload(sluice_model* model, uint64_t bytes, int64_t* delta_bytes);
sluice_status sluice_full_load(sluice_model* model, int64_t* delta_bytes);
sluice_status sluice_full_unload(sluice_model* model, int64_t* delta_bytes);

/* Locking: the model is loaded if evicted and kept in use until sluice_unlock. */
sluice_status sluice_lock(sluice_model* model, sluice_locked** out);
void sluice_unlock(sluice_locked* lock); /* removes the LoRAs applied through it first; NULL is fine */

/* DiT velocity: x [B,C,T,H,W], timesteps [B], context [B,S,D] (any float dtype, any device)
 * -> *out [B,C_out,T,H,W] in the compute dtype on the model's device. A NaN or Inf in an
 * input is SLUICE_ERROR_INVALID_ARGUMENT naming it ("forward: input 'x' has 3 non-finite
 * values (first at [0, 2, 0, 5, 7]: nan)"); so is one in sluice_encode_text's inputs. */
sluice_status sluice_forward(sluice_locked* lock, const DLManagedTensor* x, const DLManagedTensor* timesteps,
                             const DLManagedTensor* context, DLManagedTensor** out);
/* sluice_forward with regional prompting (README, "Regional prompting"): cross_attn_mask is
 * bool (kDLBool) or uint8 (nonzero: True), [L, S] or [B, L, S], True where the image token
 * attends to the context token; L = T' * ceil(H/2) * ceil(W/2) image tokens of x (T' = T for
 * patch_temporal 1), S = context tokens. It applies on the num_mask_blocks block indices in
 * mask_blocks; NULL or 0 of them: the even blocks (0, 2, ...). NULL cross_attn_mask: exactly
 * sluice_forward. A row with no True gives that token no cross-attention (zero). A mask of
 * another dtype or shape, or a block out of range, is SLUICE_ERROR_INVALID_ARGUMENT naming it. */
sluice_status sluice_forward_masked(sluice_locked* lock, const DLManagedTensor* x, const DLManagedTensor* timesteps,
                                    const DLManagedTensor* context, const DLManagedTensor* cross_attn_mask,
                                    const int64_t* mask_blocks, size_t num_mask_blocks, DLManagedTensor** out);
/* Streams (GPU). sluice_forward and sluice_encode_text run on the calling thread's current
 * stream of the model's device (torch's current stream: a host may set its own).
 *  - Borrowed inputs are read on that stream: they must be ready on it (written on it, or
 *    waited for with an event), and stay allocated until that stream has finished the
 *    call's work (freeing them through torch on the same stream is stream-ordered and safe).
 *  - Returned outputs are written on that stream: later work on it may use them at once;
 *    another stream must wait for them (an event recorded after the call), and the host
 *    must call sluice_synchronize before reading their bytes through the DLPack pointer.
 *  - Device memory sluice itself frees (staging slots, scratch, evicted layers) is safe
 *    against every stream that used it; nothing here needs the host's help.
 * On the CPU device everything is done when the call returns. */
/* Blocks until everything sluice enqueued for this model (its copies and the calling
 * thread's current stream) is done. */
sluice_status sluice_synchronize(sluice_locked* lock);

/* LLM adapter: qwen_hidden [B,S,Dq], t5_ids [B,S_t] (integers), t5_weights [B,S_t] or NULL
 * -> *out context [B, output_tokens, D]. */
sluice_status sluice_encode_text(sluice_locked* lock, const DLManagedTensor* qwen_hidden, const DLManagedTensor* t5_ids,
                                 const DLManagedTensor* t5_weights, DLManagedTensor** out);
/* The same through Anima-3.8B v1.1's semantic connector (README "Anima-3.8B v1.1's semantic
 * connector"): qwen35_hidden [layers, B, S', W] (the Qwen3.5 layers 7, 15, 23, 31 stacked),
 * qwen35_mask [B, S'] (non-zero: a valid token) or NULL (all valid), timesteps [B] (the sigma
 * the DiT gets at this step: the context depends on it, so encode again every step).
 * SLUICE_ERROR_INVALID_ARGUMENT naming the input for a model without a connector, a wrong
 * layer count or width, a mask of another shape. */
sluice_status sluice_encode_text_semantic(sluice_locked* lock, const DLManagedTensor* qwen_hidden,
                                          const DLManagedTensor* t5_ids, const DLManagedTensor* t5_weights,
                                          const DLManagedTensor* qwen35_hidden, const DLManagedTensor* qwen35_mask,
                                          const DLManagedTensor* timesteps, DLManagedTensor** out);

/* LoRA sidecars on a locked model (the stored weights are never modified). The model's device
 * share grows by their bytes from the free budget (only what it cannot give streams more of its
 * layers); SLUICE_ERROR_RESOURCE, naming the model, the LoRA and the bytes missing, when the
 * budget cannot hold them at all.
 * Lifetime (Note [LoRA lifetime] in sluice.hpp): a LoRA is removed by sluice_lora_remove or by
 * sluice_unlock of the lock it was applied through, whichever comes first; removed, forwards give
 * the unpatched model's outputs bit for bit and its device bytes are given back. After
 * sluice_unlock the handle stays valid but inactive (sluice_lora_active returns 0): still release
 * it with sluice_lora_remove, which then only frees it. */
sluice_status sluice_lora_apply(sluice_locked* lock, const char* path, double scale, sluice_lora** out);
/* The same, with where the blocks of a LoRA trained on a shallower Anima go (README, "The
 * depth-expanded Anima-2.9B and Anima-3.8B, and adapters trained on a shallower model"):
 * block_layout "measured" (also NULL: sluice_lora_apply's behaviour) sends them to the blocks it
 * was trained on, with one INFO log line; "as-is" applies them by index; anything else is
 * SLUICE_ERROR_INVALID_ARGUMENT naming it. A LoRA for a deeper model is SLUICE_ERROR_CHECKPOINT
 * naming the file, its highest block and the model's depth. */
sluice_status sluice_lora_apply_ex(sluice_locked* lock, const char* path, double scale, const char* block_layout,
                                   sluice_lora** out);
void sluice_lora_remove(sluice_lora* lora); /* removes (if still active) and frees the handle; NULL is fine */
int sluice_lora_active(const sluice_lora* lora); /* 1 while applied, 0 once removed by its unlock (or NULL) */

/* ControlNet-LLLite (README, "ControlNet-LLLite"; LockedModel::apply_lllite in sluice.hpp): a
 * v2 named-key file bound with its control image cond_image ([3,H,W] or [1,3,H,W], RGB in
 * [0,1], any size, float, any device; borrowed for the call) at `weight`. An inpaint adapter
 * (4 input channels) needs `mask` ([H,W], [1,H,W] or [1,1,H,W], 1 = inpaint); an RGB one takes
 * NULL. block_layout: as sluice_lora_apply_ex's (NULL: "measured"). Its weights are charged
 * like a LoRA's sidecars; its lifetime is a LoRA's (released by sluice_lllite_remove, unbound
 * at the latest by sluice_unlock). Errors, one line each: SLUICE_ERROR_FILE / _CHECKPOINT
 * naming the file and what does not fit; SLUICE_ERROR_INVALID_ARGUMENT for a bad image, mask
 * or weight. */
sluice_status sluice_lllite_apply(sluice_locked* lock, const char* path, const DLManagedTensor* cond_image,
                                  double weight, const DLManagedTensor* mask, const char* block_layout,
                                  sluice_lllite** out);
/* The weight of later forwards (0: exact passthrough), e.g. per step for a step range;
 * SLUICE_ERROR_INVALID_ARGUMENT when not finite or no longer bound. */
sluice_status sluice_lllite_set_weight(sluice_lllite* lllite, double weight);
void sluice_lllite_remove(sluice_lllite* lllite); /* unbinds (if still bound) and frees the handle; NULL is fine */
int sluice_lllite_active(const sluice_lllite* lllite); /* 1 while bound, 0 once unbound by its unlock (or NULL) */

#ifdef __cplusplus
}
#endif

#endif /* SLUICE_SLUICE_H */
