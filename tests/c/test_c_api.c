/* The C API as a C host sees it: compiled as C (not C++), it loads a generated model, runs
 * a forward under a 50% residency cap in CPU-as-device mode, reads the stats, compares the
 * output bit for bit with a fully resident run, checks that a LoRA ends with the lock it was
 * applied through, runs a forward with a regional-prompting mask (sluice_forward_masked), encodes
 * text through a semantic connector (sluice_encode_text_semantic), and
 * checks the errors for a missing file, a bad budget, a wrong tensor shape, a NaN input, a
 * bad mask and a NULL handle. Exit status 0 = every check passed. */
#define _POSIX_C_SOURCE 200809L /* mkstemp, fdopen */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unistd.h> /* getpid */

#include "sluice/sluice.h"

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

/* Stops the test when a call that the rest depends on fails. */
#define REQUIRE_OK(call)                                                                     \
  do {                                                                                       \
    sluice_status s_ = (call);                                                               \
    if (s_ != SLUICE_OK) {                                                                   \
      fprintf(stderr, "%s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #call, (int)s_, sluice_last_error()); \
      exit(1);                                                                               \
    }                                                                                        \
  } while (0)

/* A float32 CPU tensor the test owns, exposed as DLPack. */
typedef struct {
  DLManagedTensor managed;
  int64_t shape[5];
  float* data;
} OwnedTensor;

static void owned_deleter(DLManagedTensor* self) {
  OwnedTensor* t = (OwnedTensor*)self->manager_ctx;
  free(t->data);
  free(t);
}

static OwnedTensor* make_tensor(int ndim, const int64_t* shape, uint32_t seed) {
  OwnedTensor* t = (OwnedTensor*)calloc(1, sizeof(OwnedTensor));
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    t->shape[i] = shape[i];
    n *= shape[i];
  }
  t->data = (float*)malloc((size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; ++i) { /* a fixed pseudo-random sequence in [-1, 1) */
    seed = seed * 1664525u + 1013904223u;
    t->data[i] = (float)((seed >> 8) & 0xFFFF) / 32768.0f - 1.0f;
  }
  t->managed.dl_tensor.data = t->data;
  t->managed.dl_tensor.device.device_type = kDLCPU;
  t->managed.dl_tensor.device.device_id = 0;
  t->managed.dl_tensor.ndim = ndim;
  t->managed.dl_tensor.dtype.code = kDLFloat;
  t->managed.dl_tensor.dtype.bits = 32;
  t->managed.dl_tensor.dtype.lanes = 1;
  t->managed.dl_tensor.shape = t->shape;
  t->managed.dl_tensor.strides = NULL; /* compact row-major */
  t->managed.dl_tensor.byte_offset = 0;
  t->managed.manager_ctx = t;
  t->managed.deleter = owned_deleter;
  return t;
}

static void release(OwnedTensor* t) { t->managed.deleter(&t->managed); }

/* The integer after "\"key\":" in a JSON text (enough for the flat numbers read here). */
static long long json_int(const char* json, const char* key) {
  char pattern[128];
  snprintf(pattern, sizeof pattern, "\"%s\":", key);
  const char* p = strstr(json, pattern);
  if (p == NULL) {
    fprintf(stderr, "no key %s in %s\n", key, json);
    exit(1);
  }
  return strtoll(p + strlen(pattern), NULL, 10);
}

static size_t numel(const DLTensor* t) {
  size_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= (size_t)t->shape[i];
  return n;
}

/* A cache on the CPU device, told it has 256 MiB: the budget is 128 MiB, 16 MiB of it
 * working memory. */
static sluice_cache* make_cache(void) {
  sluice_cache_options o;
  sluice_cache_options_init(&o);
  o.device = "cpu";
  o.vram_budget = "50%";
  o.device_memory = 256ull << 20;
  o.working_memory = "16MiB";
  sluice_cache* cache = NULL;
  REQUIRE_OK(sluice_cache_create(&o, &cache));
  return cache;
}

/* anima-tiny (seed 11) under `max_resident` (< 0: the budget decides), with the sizes its
 * inputs and a LoRA need. */
typedef struct {
  sluice_model* model;
  int64_t channels, ctx_dim, width;
} TinyModel;

static TinyModel load_tiny(sluice_cache* cache, double max_resident) {
  sluice_load_options lo;
  sluice_load_options_init(&lo);
  lo.seed = 11;
  lo.max_resident = max_resident;
  TinyModel m = {NULL, 0, 0, 0};
  REQUIRE_OK(sluice_load(cache, "anima-tiny", &lo, &m.model));
  char* info = NULL;
  REQUIRE_OK(sluice_model_info_json(m.model, &info));
  m.channels = json_int(info, "in_channels");
  m.ctx_dim = json_int(info, "crossattn_emb_channels");
  m.width = json_int(info, "model_channels");
  sluice_free_string(info);
  return m;
}

/* One forward of anima-tiny under `max_resident`; returns the velocity and the model's
 * stats JSON through the out-parameters. */
static DLManagedTensor* run_forward(double max_resident, char** stats_json) {
  sluice_cache* cache = make_cache();
  const TinyModel tiny = load_tiny(cache, max_resident);
  sluice_model* model = tiny.model;
  const int64_t channels = tiny.channels, ctx_dim = tiny.ctx_dim;

  const int64_t xs[5] = {1, channels, 1, 8, 8}, ts[1] = {1}, cs[3] = {1, 4, ctx_dim};
  OwnedTensor* x = make_tensor(5, xs, 1);
  OwnedTensor* t = make_tensor(1, ts, 2);
  t->data[0] = 0.5f;
  OwnedTensor* ctx = make_tensor(3, cs, 3);

  sluice_locked* lock = NULL;
  REQUIRE_OK(sluice_lock(model, &lock));
  DLManagedTensor* v = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &v));

  /* A wrong shape is refused, names the tensor, and leaves the model usable. */
  const int64_t bad_shape[5] = {1, channels + 1, 1, 8, 8};
  OwnedTensor* bad = make_tensor(5, bad_shape, 4);
  DLManagedTensor* untouched = NULL;
  CHECK(sluice_forward(lock, &bad->managed, &t->managed, &ctx->managed, &untouched) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(untouched == NULL);
  CHECK(strstr(sluice_last_error(), "x") != NULL);
  CHECK(strchr(sluice_last_error(), '\n') == NULL);
  release(bad);
  /* So is a NaN input, named with its first position. */
  OwnedTensor* nan_ctx = make_tensor(3, cs, 5);
  nan_ctx->data[5] = NAN;
  CHECK(sluice_forward(lock, &x->managed, &t->managed, &nan_ctx->managed, &untouched) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(untouched == NULL);
  CHECK(strstr(sluice_last_error(), "forward: input 'context' has 1 non-finite value (first at [0, 0, 5]: nan)") != NULL);
  release(nan_ctx);
  DLManagedTensor* again = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &again));
  /* The stream contract: the host waits before reading outputs through their pointers. */
  REQUIRE_OK(sluice_synchronize(lock));
  CHECK(again->dl_tensor.ndim == v->dl_tensor.ndim);
  CHECK(memcmp(again->dl_tensor.data, v->dl_tensor.data, numel(&v->dl_tensor) * (v->dl_tensor.dtype.bits / 8)) == 0);
  again->deleter(again);

  sluice_unlock(lock);
  REQUIRE_OK(sluice_model_stats_json(model, stats_json));
  release(x);
  release(t);
  release(ctx);
  sluice_model_release(model);
  sluice_cache_destroy(cache);
  return v;
}

/* Writes a rank-4 float32 LoRA on blocks.<block>.self_attn.q_proj of a `width`-wide model as a
 * safetensors file (8-byte header length, JSON header, data) at a new temporary path; the
 * same values whatever the block. */
static void write_lora_at(int64_t width, int block, char* path) {
  enum { rank = 4 };
  const size_t n = (size_t)(rank * width);
  float* data = (float*)malloc(2 * n * sizeof(float));
  uint32_t seed = 7;
  for (size_t i = 0; i < 2 * n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    data[i] = (float)((seed >> 8) & 0xFFFF) / 65536.0f - 0.5f;
  }
  char header[512];
  int len = snprintf(header, sizeof header,
                     "{\"blocks.%d.self_attn.q_proj.lora_A.weight\":{\"dtype\":\"F32\",\"shape\":[%d,%lld],"
                     "\"data_offsets\":[0,%zu]},\"blocks.%d.self_attn.q_proj.lora_B.weight\":{\"dtype\":\"F32\","
                     "\"shape\":[%lld,%d],\"data_offsets\":[%zu,%zu]}}",
                     block, rank, (long long)width, n * sizeof(float), block, (long long)width, rank, n * sizeof(float),
                     2 * n * sizeof(float));
  while (len % 8 != 0) header[len++] = ' '; /* the data starts 8-byte aligned */
  strcpy(path, "/tmp/sluice_c_api_lora_XXXXXX");
  const int fd = mkstemp(path);
  if (fd < 0) {
    fprintf(stderr, "mkstemp failed\n");
    exit(1);
  }
  FILE* f = fdopen(fd, "wb");
  unsigned char size[8];
  for (int i = 0; i < 8; ++i) size[i] = (unsigned char)(((uint64_t)len >> (8 * i)) & 0xFF);
  fwrite(size, 1, 8, f);
  fwrite(header, 1, (size_t)len, f);
  fwrite(data, sizeof(float), 2 * n, f);
  fclose(f);
  free(data);
}

static void write_lora(int64_t width, char* path) { write_lora_at(width, 0, path); }

/* Note [LoRA lifetime]: a LoRA applied through a lock is removed by sluice_unlock of that lock
 * (its handle stays valid, inactive); the next lock's forward is the unpatched model's, bit
 * for bit, and the sidecars' device bytes are given back. */
/* A byte tensor (uint8, or bool with the same bytes) the test owns, [L, S], as DLPack. */
typedef struct {
  DLManagedTensor managed;
  int64_t shape[2];
  uint8_t* data;
} OwnedMask;

static void mask_deleter(DLManagedTensor* self) {
  OwnedMask* m = (OwnedMask*)self->manager_ctx;
  free(m->data);
  free(m);
}

/* Row i, column j is True where (i + j) % 3 != 0 (every row has a True). */
static OwnedMask* make_mask(int64_t L, int64_t S, uint8_t code) {
  OwnedMask* m = (OwnedMask*)calloc(1, sizeof(OwnedMask));
  m->shape[0] = L;
  m->shape[1] = S;
  m->data = (uint8_t*)malloc((size_t)(L * S));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < S; ++j) m->data[i * S + j] = (uint8_t)((i + j) % 3 != 0);
  m->managed.dl_tensor.data = m->data;
  m->managed.dl_tensor.device.device_type = kDLCPU;
  m->managed.dl_tensor.ndim = 2;
  m->managed.dl_tensor.dtype.code = code; /* kDLUInt or kDLBool */
  m->managed.dl_tensor.dtype.bits = 8;
  m->managed.dl_tensor.dtype.lanes = 1;
  m->managed.dl_tensor.shape = m->shape;
  m->managed.manager_ctx = m;
  m->managed.deleter = mask_deleter;
  return m;
}

/* sluice_forward_masked (regional prompting): NULL mask = sluice_forward bit for bit, a mask
 * changes the output, uint8 and bool masks agree, the refusals name the mask and the block. */
static void regional_prompting(void) {
  sluice_cache* cache = make_cache();
  const TinyModel tiny = load_tiny(cache, 0.5);
  const int64_t xs[5] = {1, tiny.channels, 1, 8, 8}, ts[1] = {1}, cs[3] = {1, 6, tiny.ctx_dim};
  const int64_t L = 16, S = 6; /* L = 1 * ceil(8/2) * ceil(8/2) */
  OwnedTensor* x = make_tensor(5, xs, 21);
  OwnedTensor* t = make_tensor(1, ts, 22);
  t->data[0] = 0.6f;
  OwnedTensor* ctx = make_tensor(3, cs, 23);
  sluice_locked* lock = NULL;
  REQUIRE_OK(sluice_lock(tiny.model, &lock));
  DLManagedTensor *plain = NULL, *unmasked = NULL, *as_u8 = NULL, *as_bool = NULL, *untouched = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &plain));
  REQUIRE_OK(sluice_forward_masked(lock, &x->managed, &t->managed, &ctx->managed, NULL, NULL, 0, &unmasked));
  const size_t bytes = numel(&plain->dl_tensor) * (plain->dl_tensor.dtype.bits / 8);
  CHECK(memcmp(plain->dl_tensor.data, unmasked->dl_tensor.data, bytes) == 0);
  OwnedMask* u8 = make_mask(L, S, kDLUInt);
  OwnedMask* b = make_mask(L, S, kDLBool);
  const int64_t all_blocks[2] = {0, 1};
  REQUIRE_OK(sluice_forward_masked(lock, &x->managed, &t->managed, &ctx->managed, &u8->managed, all_blocks, 2, &as_u8));
  REQUIRE_OK(sluice_forward_masked(lock, &x->managed, &t->managed, &ctx->managed, &b->managed, all_blocks, 2, &as_bool));
  CHECK(memcmp(as_u8->dl_tensor.data, as_bool->dl_tensor.data, bytes) == 0);
  CHECK(memcmp(as_u8->dl_tensor.data, plain->dl_tensor.data, bytes) != 0);
  const int64_t bad_block[1] = {2};
  CHECK(sluice_forward_masked(lock, &x->managed, &t->managed, &ctx->managed, &b->managed, bad_block, 1, &untouched) ==
        SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strcmp(sluice_last_error(), "mask_blocks has block 2, the model has 2 blocks (0..1)") == 0);
  OwnedTensor* float_mask = make_tensor(2, u8->shape, 24);
  CHECK(sluice_forward_masked(lock, &x->managed, &t->managed, &ctx->managed, &float_mask->managed, NULL, 0,
                              &untouched) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(sluice_last_error(), "cross_attn_mask has dtype Float, expected Bool") != NULL);
  OwnedMask* short_mask = make_mask(L - 1, S, kDLBool);
  CHECK(sluice_forward_masked(lock, &x->managed, &t->managed, &ctx->managed, &short_mask->managed, NULL, 0,
                              &untouched) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(sluice_last_error(), "cross_attn_mask has shape [15, 6], expected [L, S] = [16, 6]") != NULL);
  CHECK(untouched == NULL);
  plain->deleter(plain);
  unmasked->deleter(unmasked);
  as_u8->deleter(as_u8);
  as_bool->deleter(as_bool);
  u8->managed.deleter(&u8->managed);
  b->managed.deleter(&b->managed);
  short_mask->managed.deleter(&short_mask->managed);
  release(float_mask);
  release(x);
  release(t);
  release(ctx);
  sluice_unlock(lock);
  sluice_model_release(tiny.model);
  sluice_cache_destroy(cache);
}

static void lora_ends_with_its_lock(void) {
  sluice_cache* cache = make_cache();
  const TinyModel tiny = load_tiny(cache, -1.0);
  sluice_model* model = tiny.model;
  const int64_t channels = tiny.channels, ctx_dim = tiny.ctx_dim, width = tiny.width;
  char path[64];
  write_lora(width, path);

  const int64_t xs[5] = {1, channels, 1, 8, 8}, ts[1] = {1}, cs[3] = {1, 4, ctx_dim};
  OwnedTensor* x = make_tensor(5, xs, 21);
  OwnedTensor* t = make_tensor(1, ts, 22);
  t->data[0] = 0.5f;
  OwnedTensor* ctx = make_tensor(3, cs, 23);

  sluice_locked* lock = NULL;
  REQUIRE_OK(sluice_lock(model, &lock));
  DLManagedTensor* base = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &base));
  const size_t bytes = numel(&base->dl_tensor) * (base->dl_tensor.dtype.bits / 8);
  sluice_lora* lora = NULL;
  REQUIRE_OK(sluice_lora_apply(lock, path, 1.0, &lora));
  CHECK(sluice_lora_active(lora) == 1);
  DLManagedTensor* patched = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &patched));
  CHECK(memcmp(patched->dl_tensor.data, base->dl_tensor.data, bytes) != 0);
  char* stats = NULL;
  REQUIRE_OK(sluice_model_stats_json(model, &stats));
  CHECK(json_int(stats, "lora_bytes") > 0);
  sluice_free_string(stats);

  sluice_unlock(lock); /* the LoRA was not removed: the unlock removes it */
  CHECK(sluice_lora_active(lora) == 0);
  REQUIRE_OK(sluice_model_stats_json(model, &stats));
  CHECK(json_int(stats, "lora_bytes") == 0);
  sluice_free_string(stats);
  REQUIRE_OK(sluice_lock(model, &lock));
  DLManagedTensor* after = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &after));
  CHECK(memcmp(after->dl_tensor.data, base->dl_tensor.data, bytes) == 0);
  sluice_unlock(lock);
  sluice_lora_remove(lora); /* inactive: only frees the handle */
  CHECK(sluice_lora_active(NULL) == 0);

  base->deleter(base);
  patched->deleter(patched);
  after->deleter(after);
  release(x);
  release(t);
  release(ctx);
  remove(path);
  sluice_model_release(model);
  sluice_cache_destroy(cache);
}

/* README, "The depth-expanded Anima-2.9B and Anima-3.8B, and adapters trained on a shallower
 * model": on a 40-block model a LoRA on block 27 (so trained on the 28-block base) goes to block
 * 39 under block_layout "measured" (and NULL), to block 27 under "as-is"; a bad block_layout
 * and a LoRA for a deeper model are refused with one line naming them. */
static DLManagedTensor* forward_with_lora(sluice_locked* lock, const char* path, const char* layout,
                                          OwnedTensor* x, OwnedTensor* t, OwnedTensor* ctx) {
  sluice_lora* lora = NULL;
  REQUIRE_OK(sluice_lora_apply_ex(lock, path, 1.0, layout, &lora));
  DLManagedTensor* out = NULL;
  REQUIRE_OK(sluice_forward(lock, &x->managed, &t->managed, &ctx->managed, &out));
  sluice_lora_remove(lora);
  return out;
}

static void lora_block_layout(void) {
  char config[64];
  strcpy(config, "/tmp/sluice_c_api_tiny40_XXXXXX");
  const int fd = mkstemp(config);
  if (fd < 0) {
    fprintf(stderr, "mkstemp failed\n");
    exit(1);
  }
  FILE* f = fdopen(fd, "w");
  fputs("{\"preset\": \"anima-tiny\", \"num_blocks\": 40}", f);
  fclose(f);
  char json_path[80];
  snprintf(json_path, sizeof json_path, "%s.json", config);
  if (rename(config, json_path) != 0) {
    fprintf(stderr, "rename failed\n");
    exit(1);
  }

  sluice_cache* cache = make_cache();
  sluice_load_options lo;
  sluice_load_options_init(&lo);
  lo.seed = 12;
  lo.max_resident = 0.5;
  sluice_model* model = NULL;
  REQUIRE_OK(sluice_load(cache, json_path, &lo, &model));
  char* info = NULL;
  REQUIRE_OK(sluice_model_info_json(model, &info));
  /* (40 blocks: a LoRA on block 39 applies below, where anima-tiny refuses it.) */
  const int64_t channels = json_int(info, "in_channels"), ctx_dim = json_int(info, "crossattn_emb_channels");
  const int64_t width = json_int(info, "model_channels");
  sluice_free_string(info);
  char at27[64], at39[64];
  write_lora_at(width, 27, at27);
  write_lora_at(width, 39, at39);

  const int64_t xs[5] = {1, channels, 1, 8, 8}, ts[1] = {1}, cs[3] = {1, 4, ctx_dim};
  OwnedTensor* x = make_tensor(5, xs, 31);
  OwnedTensor* t = make_tensor(1, ts, 32);
  t->data[0] = 0.5f;
  OwnedTensor* ctx = make_tensor(3, cs, 33);
  sluice_locked* lock = NULL;
  REQUIRE_OK(sluice_lock(model, &lock));
  DLManagedTensor* measured = forward_with_lora(lock, at27, "measured", x, t, ctx);
  DLManagedTensor* by_default = forward_with_lora(lock, at27, NULL, x, t, ctx);
  DLManagedTensor* at_39 = forward_with_lora(lock, at39, "as-is", x, t, ctx);
  DLManagedTensor* as_is = forward_with_lora(lock, at27, "as-is", x, t, ctx);
  const size_t bytes = numel(&measured->dl_tensor) * (measured->dl_tensor.dtype.bits / 8);
  CHECK(memcmp(measured->dl_tensor.data, at_39->dl_tensor.data, bytes) == 0);
  CHECK(memcmp(by_default->dl_tensor.data, at_39->dl_tensor.data, bytes) == 0);
  CHECK(memcmp(as_is->dl_tensor.data, at_39->dl_tensor.data, bytes) != 0);

  sluice_lora* lora = NULL;
  CHECK(sluice_lora_apply_ex(lock, at27, 1.0, "sideways", &lora) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(lora == NULL);
  CHECK(strcmp(sluice_last_error(), "block_layout 'sideways' is not one of: measured, as-is") == 0);
  sluice_unlock(lock);

  /* anima-tiny has 2 blocks: a LoRA on block 39 is for a deeper model. */
  const TinyModel tiny = load_tiny(cache, -1.0);
  REQUIRE_OK(sluice_lock(tiny.model, &lock));
  CHECK(sluice_lora_apply_ex(lock, at39, 1.0, NULL, &lora) == SLUICE_ERROR_CHECKPOINT);
  CHECK(strstr(sluice_last_error(), "addresses block 39 (trained on a 40-block Anima), but this model has 2 blocks") !=
        NULL);
  CHECK(strstr(sluice_last_error(), at39) != NULL);
  CHECK(strchr(sluice_last_error(), '\n') == NULL);
  sluice_unlock(lock);

  measured->deleter(measured);
  by_default->deleter(by_default);
  at_39->deleter(at_39);
  as_is->deleter(as_is);
  release(x);
  release(t);
  release(ctx);
  remove(at27);
  remove(at39);
  remove(json_path);
  sluice_model_release(tiny.model);
  sluice_model_release(model);
  sluice_cache_destroy(cache);
}

/* An int64 CPU tensor [B, n] of ids in [0, 128), as DLPack (the T5 ids). */
typedef struct {
  DLManagedTensor managed;
  int64_t shape[2];
  int64_t* data;
} OwnedIds;

static void ids_deleter(DLManagedTensor* self) {
  OwnedIds* t = (OwnedIds*)self->manager_ctx;
  free(t->data);
  free(t);
}

static OwnedIds* make_ids(int64_t B, int64_t n) {
  OwnedIds* t = (OwnedIds*)calloc(1, sizeof(OwnedIds));
  t->shape[0] = B;
  t->shape[1] = n;
  t->data = (int64_t*)malloc((size_t)(B * n) * sizeof(int64_t));
  for (int64_t i = 0; i < B * n; ++i) t->data[i] = (i * 37 + 11) % 128;
  t->managed.dl_tensor.data = t->data;
  t->managed.dl_tensor.device.device_type = kDLCPU;
  t->managed.dl_tensor.ndim = 2;
  t->managed.dl_tensor.dtype.code = kDLInt;
  t->managed.dl_tensor.dtype.bits = 64;
  t->managed.dl_tensor.dtype.lanes = 1;
  t->managed.dl_tensor.shape = t->shape;
  t->managed.manager_ctx = t;
  t->managed.deleter = ids_deleter;
  return t;
}

/* Anima-3.8B v1.1's semantic connector (sluice_encode_text_semantic) on a small generated
 * model: the context follows the timestep and differs from the native adapter's; a wrong
 * width and a model without a connector are one-line errors. */
static void semantic_connector(void) {
  char config[96];
  snprintf(config, sizeof config, "/tmp/sluice_c_api_connector_%ld.json", (long)getpid());
  FILE* f = fopen(config, "w");
  fputs("{\"preset\": \"anima-tiny\", \"name\": \"tiny-connector\", \"connector\": {\"enabled\": true, "
        "\"num_queries\": 8, \"resampler_blocks\": 2, \"resampler_dim\": 32, \"resampler_heads\": 4, "
        "\"mlp_hidden_dim\": 48, \"source_dim\": 24}}",
        f);
  fclose(f);
  sluice_cache* cache = make_cache();
  sluice_load_options lo;
  sluice_load_options_init(&lo);
  lo.seed = 5;
  lo.storage = "float32";
  lo.compute = "float32";
  sluice_model* model = NULL;
  REQUIRE_OK(sluice_load(cache, config, &lo, &model));
  sluice_locked* lock = NULL;
  REQUIRE_OK(sluice_lock(model, &lock));
  const int64_t qs[3] = {1, 7, 32}, hs[4] = {4, 1, 6, 24}, wide_s[4] = {4, 1, 6, 25}, ts[1] = {1};
  OwnedTensor* qwen = make_tensor(3, qs, 3);
  OwnedIds* ids = make_ids(1, 5);
  OwnedTensor* hidden = make_tensor(4, hs, 4);
  OwnedTensor* wide = make_tensor(4, wide_s, 4);
  OwnedTensor* t1 = make_tensor(1, ts, 0);
  OwnedTensor* t2 = make_tensor(1, ts, 0);
  t1->data[0] = 0.3f;
  t2->data[0] = 0.7f;
  DLManagedTensor *a = NULL, *b = NULL, *a2 = NULL, *native = NULL;
  REQUIRE_OK(sluice_encode_text_semantic(lock, &qwen->managed, &ids->managed, NULL, &hidden->managed, NULL,
                                         &t1->managed, &a));
  REQUIRE_OK(sluice_encode_text_semantic(lock, &qwen->managed, &ids->managed, NULL, &hidden->managed, NULL,
                                         &t1->managed, &a2));
  REQUIRE_OK(sluice_encode_text_semantic(lock, &qwen->managed, &ids->managed, NULL, &hidden->managed, NULL,
                                         &t2->managed, &b));
  REQUIRE_OK(sluice_encode_text(lock, &qwen->managed, &ids->managed, NULL, &native));
  CHECK(a->dl_tensor.ndim == 3 && a->dl_tensor.shape[1] == 24 && a->dl_tensor.shape[2] == 32);
  const size_t bytes = numel(&a->dl_tensor) * sizeof(float);
  CHECK(memcmp(a->dl_tensor.data, a2->dl_tensor.data, bytes) == 0);     /* same t: same bits */
  CHECK(memcmp(a->dl_tensor.data, b->dl_tensor.data, bytes) != 0);      /* another t: another context */
  CHECK(memcmp(a->dl_tensor.data, native->dl_tensor.data, bytes) != 0); /* the connector adds to it */
  CHECK(sluice_encode_text_semantic(lock, &qwen->managed, &ids->managed, NULL, &wide->managed, NULL, &t1->managed,
                                    &b) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(sluice_last_error(), "width 25, the connector reads 24") != NULL);
  a->deleter(a);
  a2->deleter(a2);
  b->deleter(b);
  native->deleter(native);
  sluice_unlock(lock);
  sluice_model_release(model);

  /* anima-tiny has no connector. */
  sluice_load_options_init(&lo);
  REQUIRE_OK(sluice_load(cache, "anima-tiny", &lo, &model));
  REQUIRE_OK(sluice_lock(model, &lock));
  DLManagedTensor* none = NULL;
  CHECK(sluice_encode_text_semantic(lock, &qwen->managed, &ids->managed, NULL, &hidden->managed, NULL, &t1->managed,
                                    &none) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(sluice_last_error(), "has no semantic connector") != NULL);
  CHECK(none == NULL);
  sluice_unlock(lock);
  sluice_model_release(model);
  sluice_cache_destroy(cache);
  release(qwen);
  ids->managed.deleter(&ids->managed);
  release(hidden);
  release(wide);
  release(t1);
  release(t2);
  remove(config);
}

int main(void) {
  CHECK(sluice_abi_version() == SLUICE_C_ABI_VERSION);
  CHECK(strlen(sluice_version()) >= 5);

  /* Half the streamable weights resident, the other half streamed. */
  char* half_stats = NULL;
  DLManagedTensor* half = run_forward(0.5, &half_stats);
  CHECK(half->dl_tensor.ndim == 5);
  /* compute "auto" (lo.compute NULL): bf16 where the CPU computes it natively, else fp32;
   * the stats say which and why. */
  const int bf16 = strstr(half_stats, "\"auto: bfloat16, because") != NULL;
  CHECK(bf16 || strstr(half_stats, "\"auto: float32, because") != NULL);
  CHECK(bf16 ? (half->dl_tensor.dtype.code == kDLBfloat && half->dl_tensor.dtype.bits == 16)
             : (half->dl_tensor.dtype.code == kDLFloat && half->dl_tensor.dtype.bits == 32));
  const size_t elem = half->dl_tensor.dtype.bits / 8;
  CHECK(half->dl_tensor.device.device_type == kDLCPU);
  const long long total = json_int(half_stats, "total_bytes");
  const long long resident = json_int(half_stats, "resident_bytes");
  const long long streamed = json_int(half_stats, "bytes_streamed");
  const long long streamed_dit = json_int(half_stats, "dit"); /* model.streamed_bytes_by_forward.dit */
  const long long planned = json_int(half_stats, "planned_bytes"); /* of the first forward */
  printf("half: total %lld resident %lld streamed/forward %lld\n", total, resident, streamed);
  CHECK(total > 0);
  CHECK(resident < total);
  CHECK(streamed > 0);
  /* Bytes streamed by a DiT forward = the non-resident DiT bytes under the plan it ran
   * with (the LLM adapter's streamed layers are only read by encode_text). The plan made
   * from the first forward's measurements may stream more or less after it. */
  CHECK(streamed == planned);
  CHECK(streamed_dit > 0);
  CHECK(streamed_dit <= total - resident);
  CHECK(strstr(half_stats, "\"residency\"") != NULL);
  CHECK(strstr(half_stats, "\"hits\"") != NULL);

  /* Fully resident: the same bits. */
  char* full_stats = NULL;
  DLManagedTensor* full = run_forward(1.0, &full_stats);
  CHECK(json_int(full_stats, "bytes_streamed") == 0);
  CHECK(numel(&full->dl_tensor) == numel(&half->dl_tensor));
  CHECK(memcmp(full->dl_tensor.data, half->dl_tensor.data, numel(&half->dl_tensor) * elem) == 0);
  int finite = 1;
  for (size_t i = 0; i < numel(&half->dl_tensor); ++i) {
    /* The high 16 bits of an fp32 are a bf16: exponent all ones is inf or NaN. */
    uint16_t hi;
    memcpy(&hi, (const char*)half->dl_tensor.data + i * elem + (elem - 2), 2);
    if ((hi & 0x7F80u) == 0x7F80u) finite = 0;
  }
  CHECK(finite);
  half->deleter(half);
  full->deleter(full);
  sluice_free_string(half_stats);
  sluice_free_string(full_stats);

  lora_ends_with_its_lock();
  regional_prompting();
  semantic_connector();
  lora_block_layout();

  /* Errors. */
  sluice_cache_options o;
  sluice_cache_options_init(&o);
  o.vram_budget = "lots";
  sluice_cache* cache = NULL;
  CHECK(sluice_cache_create(&o, &cache) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(cache == NULL);
  CHECK(strstr(sluice_last_error(), "lots") != NULL);

  sluice_cache_options_init(&o);
  REQUIRE_OK(sluice_cache_create(&o, &cache));
  sluice_model* model = NULL;
  CHECK(sluice_load(cache, "/nonexistent/model.safetensors", NULL, &model) == SLUICE_ERROR_FILE);
  CHECK(model == NULL);
  CHECK(strstr(sluice_last_error(), "/nonexistent/model.safetensors") != NULL);
  CHECK(sluice_cache_set_vram_budget(cache, "-5%") == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(sluice_last_error(), "-5%") != NULL);
  CHECK(sluice_lock(NULL, NULL) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(sluice_forward(NULL, NULL, NULL, NULL, NULL) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(sluice_synchronize(NULL) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(strstr(sluice_last_error(), "lock") != NULL);
  char* json = NULL;
  REQUIRE_OK(sluice_cache_stats_json(cache, &json));
  CHECK(strstr(json, "\"misses\"") != NULL);
  sluice_free_string(json);
  sluice_cache_destroy(cache);

  if (failures == 0) printf("c api: all checks passed\n");
  return failures == 0 ? 0 : 1;
}
