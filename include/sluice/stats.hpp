#pragma once
// sluice's reported records: counters, a forward's figures, a non-finite finding, the model
// cache's totals. Each is declared by one list of its fields (Note [field lists]); sluice.hpp
// includes this header, and every layer of sluice reports in these types, so a record is
// never copied field by field on its way to the public API. Plain data only: no torch, no
// other header of sluice.
//
// Note [field lists]
// ~~~~~~~~~~~~~~~~~~
// A record's fields are written once, as SLUICE_<RECORD>_FIELDS(F): one F(type, name) per
// field, its comment beside it. That list declares the struct here (SLUICE_DECLARE_FIELD:
// every field value-initialised: 0, false, empty) and writes its JSON object, one key per
// field named as the field (the stats JSON of a model and of the cache,
// which the C API and Python hand on). A
// field added to a list is in the struct and the JSON at once; a key older than the field's
// name, or a value the JSON writes differently, is named where that record's JSON is
// written. New fields go at the end of a list.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#define SLUICE_DECLARE_FIELD(type, name) type name{};
// An option's field (sluice.hpp's option structs), with its default.
#define SLUICE_DECLARE_OPTION(type, name, default_value) type name = default_value;

namespace sluice {

// Current, peak and accumulated values of one quantity (bytes), like c10's DeviceStats.
#define SLUICE_COUNTER_FIELDS(F)                                      \
  F(int64_t, current)   /* now */                                     \
  F(int64_t, peak)      /* most since creation or the last peak reset */ \
  F(int64_t, allocated) /* accumulated increases */                   \
  F(int64_t, freed)     /* accumulated decreases */
struct Counter {
  SLUICE_COUNTER_FIELDS(SLUICE_DECLARE_FIELD)
};

// One forward (or encode_text) of a model: Model::stats().forward_records, the stats JSON's
// forwards[].
#define SLUICE_FORWARD_STATS_FIELDS(F)                                                             \
  F(uint64_t, index)          /* 0-based count of the model's forwards */                         \
  F(std::string, kind)        /* "dit" (forward), "adapter" (encode_text); a host's own kinds */  \
  F(uint64_t, bytes_streamed) /* stored bytes copied host->device for it */                       \
  F(uint64_t, bytes_loaded)   /* stored bytes made resident since the forward before it (an   */  \
                              /* attach, a reload after other models took the device, a       */  \
                              /* residency change) */                                            \
  F(uint64_t, planned_bytes)  /* stored bytes of the streamed layers it used under the plan it */ \
                              /* ran with; differs from bytes_streamed only when a copy was    */ \
                              /* repeated or dropped (the stats JSON's mismatched_forwards)    */ \
  F(uint64_t, copies)         /* layer copies issued for it */                                    \
  F(uint64_t, demand_copies)  /* of which issued when the layer was asked for (not prefetched) */ \
  F(uint64_t, stalls)         /* acquires that waited for their copy (see stalls_timed) */        \
  F(bool, stalls_timed)       /* stalls measured by compute-stream events (else a host-side    */ \
                              /* query, which overcounts on a GPU) */                            \
  F(double, h2d_gbps)         /* achieved host->device rate (1e9 B/s) */                          \
  F(double, stall_ms)         /* compute waiting on copies */                                     \
  F(double, upcast_ms)        /* storage -> compute dtype conversions */                          \
  F(double, wall_ms)          /* begin to end of the forward on the device */                     \
  F(bool, diverged)           /* a layer was asked for out of the recorded order */               \
  F(bool, aborted)            /* ended by an exception */
struct ForwardStats {
  SLUICE_FORWARD_STATS_FIELDS(SLUICE_DECLARE_FIELD)
};

// Where a forward's values first went non-finite: what LockedModel::locate_nonfinite found
// by running the forward again with a check after each layer (the stats JSON's
// nonfinite.last, where forward_index is "forward" and an empty module is null).
#define SLUICE_NONFINITE_REPORT_FIELDS(F)                                                            \
  F(std::string, kind)                /* "dit" (forward) or "adapter" (encode_text) */              \
  F(std::string, module)              /* the first module, in execution order, whose output held */ \
                                      /* a NaN or Inf: a layer ("blocks.5.mlp.layer2") or, when  */ \
                                      /* no layer's did, a block ("blocks.5"), the timestep norm */ \
                                      /* or the final layer; empty: none did */                     \
  F(int64_t, nonfinite_values)        /* in that module's output */                                 \
  F(int64_t, values)                  /* that output's elements */                                  \
  F(int64_t, output_nonfinite_values) /* in the re-run forward's output */                          \
  F(int64_t, output_values)                                                                         \
  F(uint64_t, forward_index)          /* the re-run's ForwardStats::index */
struct NonFiniteReport {
  SLUICE_NONFINITE_REPORT_FIELDS(SLUICE_DECLARE_FIELD)
};

// One model the cache holds (CacheStats::models_held): the parts of the cache's device totals.
#define SLUICE_HELD_MODEL_FIELDS(F)                                                                \
  F(uint64_t, id)              /* unique in its cache (two models may share a name) */            \
  F(std::string, name)                                                                            \
  F(std::string, source)       /* the path or preset it was loaded from; an offloaded module's */ \
                               /* host name */                                                    \
  F(bool, in_ram)              /* loaded (false after eviction) */                                \
  F(bool, on_device)           /* attached to the device */                                       \
  F(bool, dropped)             /* dropped, still locked */                                        \
  F(int64_t, locks)            /* open locks */                                                   \
  F(uint64_t, share_bytes)     /* its share of vram_limit_bytes (0 off the device) */             \
  F(uint64_t, device_bytes)    /* what its ledger holds now: its stats JSON's */                  \
                               /* device.current_bytes (its staging ring at its capacity) */      \
  F(uint64_t, allocated_bytes) /* of which allocated on the device now (the ring's slots made) */
struct HeldModel {
  SLUICE_HELD_MODEL_FIELDS(SLUICE_DECLARE_FIELD)
};

// Whole-cache counters: ModelCache::stats(), ModelCache::stats_json() (and a model's stats
// JSON's "cache"). Every device total is the sum of named parts: vram.current =
// models_allocated_bytes + vram_unattributed_bytes, vram_reserved_bytes = the sum of
// models_held's share_bytes.
#define SLUICE_CACHE_STATS_FIELDS(F)                                                                 \
  F(std::string, device)                   /* "cpu", "cuda:0" */                                    \
  F(uint64_t, hits)                        /* load()/lock() that found the model in RAM */          \
  F(uint64_t, misses)                      /* load()/lock() that had to read or generate it */      \
  F(uint64_t, loads)                       /* models read from disk or generated */                 \
  F(uint64_t, evictions)                   /* models removed from RAM (RAM limit, drop, reload) */  \
  F(uint64_t, device_unloads)              /* partial unloads of a model to make room for another */ \
  F(uint64_t, device_drops)                /* models taken off the device entirely to make room */  \
  F(uint64_t, models)                      /* models in RAM now */                                  \
  F(uint64_t, locked)                      /* of which locked (in use) */                           \
  /* The host memory limit the defaults of ram_limit and pin_memory_limit came from, read when */  \
  /* the cache was made: the smallest of physical RAM, the cgroup memory limit of the process's */ \
  /* own cgroup (a container's; v2 memory.max, v1 memory.limit_in_bytes, its ancestors' too) */    \
  /* and what MemAvailable allows. "RAM" in a percentage means min(physical RAM, cgroup limit). */ \
  F(uint64_t, host_memory_limit_bytes)                                                              \
  F(std::string, host_memory_limit_source) /* "physical RAM", "cgroup v2 memory.max (/sys/...)", */ \
                                           /* "cgroup v1 memory.limit_in_bytes (...)", */           \
                                           /* "MemAvailable (/proc/meminfo)" */                     \
  F(uint64_t, ram_limit_bytes)             /* 0: unlimited */                                       \
  F(std::string, ram_limit_source)         /* how the default was derived from the host memory */   \
                                           /* limit; empty: given ("given" in the JSON) */          \
  F(Counter, ram)                          /* host bytes of cached models' weights (pinned ones */  \
                                           /* included) */                                          \
  F(uint64_t, pin_limit_bytes)             /* page-locked host bytes all models may hold */         \
  F(std::string, pin_limit_source)         /* as ram_limit_source */                                \
  F(Counter, pinned)                       /* page-locked host bytes they hold (the pinned */       \
                                           /* arena's chunks) */                                    \
  F(uint64_t, pinned_used_bytes)           /* of which weights (the rest: alignment padding) */     \
  F(uint64_t, vram_budget_bytes)           /* the device budget */                                  \
  F(std::string, vram_budget_source)       /* how it was resolved ("auto: free 22.2GiB - ..."); */  \
                                           /* empty for a size or all memory */                     \
  F(uint64_t, working_memory_bytes)        /* part of it kept for activations (grown by */          \
                                           /* measurements) */                                      \
  F(uint64_t, vram_limit_bytes)            /* budget - working memory: what models may hold */      \
  F(Counter, vram)                         /* device bytes all models hold (weights, staging */     \
                                           /* rings, upcast scratch, LoRA sidecars); peak since */  \
                                           /* the last budget change */                             \
  F(uint64_t, vram_reserved_bytes)         /* sum of the models' device shares (>= vram.current) */ \
  F(uint64_t, models_device_bytes)         /* sum of models_held's device_bytes */                  \
  F(uint64_t, models_allocated_bytes)      /* sum of models_held's allocated_bytes */               \
  F(int64_t, vram_unattributed_bytes)      /* held by no model: slots of a staging ring a model */  \
                                           /* dropped that queued work may still read; 0 */         \
                                           /* between forwards */                                   \
  F(uint64_t, ram_reserved_bytes)          /* estimated bytes of models being read, counted */      \
                                           /* against the RAM limit */                              \
  F(uint64_t, measured_working_memory_bytes) /* the most a first forward of a kind of any model */  \
                                             /* used beyond the ledger (0: none measured) */        \
  F(std::vector<HeldModel>, models_held)   /* every model the cache holds (offloaded torch */       \
                                           /* modules and dropped ones still locked too), in */     \
                                           /* load order */
struct CacheStats {
  SLUICE_CACHE_STATS_FIELDS(SLUICE_DECLARE_FIELD)
};

}  // namespace sluice
