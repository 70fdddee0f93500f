#pragma once
// EngineOptions: how a StreamingEngine (engine.h) runs one model, shared by its parts
// (model_residency.h, forward_pass.h, forward_recorder.h) and by the model cache, which
// makes one engine per model. WeightNeeds: what a model needs on the device under those
// options, known before it is attached.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "offload/device/device.h"
#include "offload/device/pinned_arena.h"
#include "offload/plan/prefetch_scheduler.h"
#include "offload/plan/residency_plan.h"

namespace sluice::offload {

// Page-locked host memory for streamed layers. auto_: on wherever the device's
// pins_memory() is true, which is every TorchDevice (CUDA and ROCm alike; see Note [pinned
// memory on ROCm] for ROCm stalls) and the strict CPU device; off on the plain CPU device.
enum class PinMode { auto_, on, off };
// "auto" | "on" | "off"; throws InvalidArgument naming `flag`.
PinMode parse_pin_mode(std::string_view text, const std::string& flag = "--pin");

struct EngineOptions {
  std::shared_ptr<DeviceBackend> device;       // where resident layers live; null: a CPU device
  uint64_t budget_bytes = 0;                   // device bytes for this model, working memory included; 0: all device memory
  uint64_t working_memory_bytes = 0;           // part of the budget left free for activations
  std::optional<double> max_resident;          // cap on resident streamable bytes, fraction 0..1; none: budget decides
  uint32_t prefetch_depth = kPrefetchAuto;     // most streamed layers copied ahead; auto: as far as the ring's bytes allow
  uint32_t ring_slots = 0;                     // the ring holds at least this many of the largest streamed layer;
                                               // 0: prefetch_depth + 1, or 3 with auto (Note [staging ring])
  ResidencyPolicy policy = ResidencyPolicy::balanced;  // see Note [residency policy] and Note [balanced plan]
  PinMode pin = PinMode::auto_;                // page-locked host copies of streamed layers
  std::shared_ptr<PinnedArena> pin_arena;      // where they are pinned, under its limit (the model cache shares one);
                                               // null: the engine's own, limited by pin_memory_limit
  std::optional<uint64_t> pin_memory_limit;    // the own arena's limit in bytes; none: default_pin_memory_limit()
  std::vector<std::string> required_patterns = {"^final_layer(\\.|$)"};  // regex search on layer names: always resident
  bool require_unconverted = false;            // true: layers stored in their compute dtype stay resident (they stream
                                               // like any other by default: the stored bytes are sent, no upcast)
  bool timing = true;                          // device-timed stall/upcast/copy stats (a few events per layer)
  bool plan_from_measurements = true;          // measure compute and copies and replan by them (Note [calibration]; needs timing)
  uint32_t bounce_slots = 4;                   // pinned bounce slots for pageable copies to start with; the ring grows
                                               // as far as Note [bounce ring sizing] says rather than wait on compute
  uint64_t bounce_slot_bytes = uint64_t{8} << 20;
  bool trace = false;                          // record per-layer spans for trace() (implies timing)
  size_t max_forward_records = 1024;           // per-forward records kept in stats()
  bool log_attach = true;                      // INFO "Loaded model ..." and residency lines at attach (the model cache logs its own)
  bool grow_working_memory = true;             // grow working_memory_bytes to what forwards measure (Note [measured
                                               // working memory]); the model cache grows its own instead

  // Device-timed events at all: timing, or a trace (which needs them).
  bool timed() const { return timing || trace; }
};

// InvalidArgument unless `max_resident` is none or a fraction 0..1.
void check_max_resident(std::optional<double> max_resident);
// `options` with ring_slots resolved (0: from prefetch_depth); InvalidArgument for a
// max_resident outside 0..1.
EngineOptions resolve_engine_options(EngineOptions options);

// Device bytes a model needs under an engine's options, known before attaching it (the
// model cache sizes its share of a shared budget with it). Working memory excluded.
struct WeightNeeds {
  uint64_t model_bytes = 0;  // stored bytes of every parameter and buffer (the host copy)
  uint64_t minimum = 0;      // smallest weight budget the model attaches under
  uint64_t full = 0;         // every layer resident (plus upcast scratch): what full_load() needs
  uint64_t wanted = 0;       // what the plan takes with no budget limit: `full`, or less under max_resident
};

}  // namespace sluice::offload
