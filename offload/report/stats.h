#pragma once
// What the streaming engine reports: each forward's record, the residency plan's figures and
// the engine's totals, with their JSON. The device-memory counters these carry live in the
// device layer (offload/device/memory_stats.h).
//
// Tested by (through the stats JSON of the engine, `sluice run --stats-json`, the API and the
// bindings; one case calls EngineStats::to_json directly): tests/offload/engine/test_engine.cpp ("engine: stats
// JSON carries the documented fields", "engine: the balanced plan is made from measurements and
// reports its prediction"), tests/cli/test_run.cpp ("run: the stats JSON has the documented fields and
// each forward streams the non-resident bytes"), tests/api/test_api.cpp ("api: a preset loads and runs
// and its stats JSON has the documented fields", "api: locate_nonfinite re-runs a forward with a
// per-layer check and names the first overflowing layer"), tests/offload/engine/test_vram_budget.cpp ("vram budget: stats json:
// the device reports the ledger peak and the allocator's numbers only where it has them"),
// tests/python/test_bindings.py (test_stats_and_dtypes).
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "offload/device/memory_stats.h"

namespace sluice::offload {

// One forward between begin_forward() and end_forward(), and what a forward re-run with a
// per-layer check found (Note [non-finite values] in runtime/nonfinite.h;
// sluice::LockedModel::locate_nonfinite): the public records, each declared by one list of
// its fields (Note [field lists] in sluice/stats.hpp), so the API hands them on as they are.
using ForwardRecord = ForwardStats;
using NonFiniteRecord = NonFiniteReport;

// The residency plan's prediction for one forward kind, beside what was measured.
struct PlanKindStats {
  std::string kind;
  double predicted_step_ms = 0;  // Note [cost model]
  double floor_ms = 0;           // max(compute, streamed bytes / copy rate)
  double compute_ms = 0;
  double copy_ms = 0;
  double measured_step_ms = 0;   // median wall_ms of this kind's forwards under the plan (0: none yet)
  uint64_t measured_forwards = 0;
};

// How the current residency was planned (Note [balanced plan]).
struct PlanStats {
  std::string policy;             // balanced, spread, front_first
  bool from_measurements = false; // planned with measured compute times and copy rate
  double copy_gbps = 0;           // the copy rate the plan assumed
  uint64_t ring_bytes = 0;        // the staging ring's capacity
  uint64_t measured_plans = 0;    // plans made from measurements since attach
  bool recomputed = false;        // a measured step was more than 15% off its prediction, so the plan was made again
  std::string step_kind;          // the most frequent kind: what predicted/measured_step_ms describe
  std::vector<PlanKindStats> kinds;
  const PlanKindStats* step() const;
};

// Everything the engine reports. See StreamingEngine::stats().
struct EngineStats {
  std::string model_name;
  std::string device;             // "cpu", "cuda:0"
  uint64_t model_total_bytes = 0;     // stored bytes of every parameter and buffer
  uint64_t model_resident_bytes = 0;  // of which on the device (required + resident layers)
  std::string residency;              // residency map, see ResidencyPlan::residency_map()
  std::string residency_grid;         // per layer, see ResidencyPlan::residency_grid()
  uint64_t budget_bytes = 0;          // device budget
  uint64_t working_memory_bytes = 0;  // part of the budget left for activations (grown by measurements)
  // Note [measured working memory]: the most device memory a first forward of a kind used
  // beyond what sluice's ledger holds (allocator peak minus ledger), over the kinds measured;
  // measured_working_memory false until a forward was measured.
  bool measured_working_memory = false;
  uint64_t measured_working_memory_bytes = 0;
  uint64_t working_memory_grown = 0;  // times the measurement grew the working memory (each a replan)
  uint64_t layers = 0;                // managed layers
  uint64_t resident_layers = 0;
  uint64_t streamed_layers = 0;
  uint64_t ring_slots = 0;           // staging slots allocated now
  uint64_t slot_bytes = 0;           // the largest streamed layer's slot
  uint64_t ring_capacity_bytes = 0;  // the staging ring's byte capacity, charged to the budget (Note [staging ring])
  uint64_t ring_slot_bytes = 0;      // device bytes of the slots made now, within the capacity (overflow included)
  uint64_t wasted_prefetch_copies = 0;  // copies dropped before any forward read them
  uint64_t wasted_prefetch_bytes = 0;
  uint64_t mismatched_forwards = 0;     // forwards that streamed more or less than their streamed layers hold
  PlanStats plan;
  DeviceMemoryStats device_memory;  // what the engine holds on the device; peaks since attach or the last residency change
  // The device allocator's own counters (DeviceBackend::allocator_stats()): the whole
  // device, every user, what it allocated now and at most (since the process started) and
  // what it reserves from the driver. Not available on every backend (the CPU device).
  bool allocator_stats_available = false;
  int64_t allocator_current_bytes = 0, allocator_peak_bytes = 0, allocator_reserved_bytes = 0;
  Stat pinned;                      // stored bytes of the layers whose host copies are pinned (Note [pinned arena])
  uint64_t pinned_bytes = 0;        // page-locked bytes holding them: the arena chunks (pinned.current plus alignment)
  uint64_t pin_limit_bytes = 0;     // the pinned arena's limit (all models sharing it)
  Stat residency_h2d;               // bytes copied/dropped by attach and residency changes
  uint64_t forwards = 0;
  uint64_t slot_violations = 0;     // copies that started on a slot still in use (must be 0; detected on the CPU device only)
  // Copies from pageable host memory (Note [bounce ring]).
  uint64_t bounce_bytes = 0;        // pinned host bytes of the bounce ring (0: none made)
  uint64_t bounce_copies = 0;       // pieces copied through it
  uint64_t sync_copies = 0;         // copies made synchronously because the bounce ring could not be pinned
  uint64_t bounce_waits = 0;        // pieces that waited for a slot still in flight (Note [bounce ring sizing])
  uint64_t bounce_limit_bytes = 0;  // what the bounce ring may grow to
  std::vector<ForwardRecord> forward_records;  // the most recent forwards, oldest first
  uint64_t nonfinite_reruns = 0;               // forwards re-run with a per-layer check (Note [non-finite values])
  std::optional<NonFiniteRecord> nonfinite;    // the latest one's finding

  // JSON text with the fields the CLI's --stats prints: model.{name,total_bytes,
  // resident_bytes,residency}, budget.{budget_bytes,working_memory_bytes,
  // measured_working_memory_bytes (null until measured),working_memory_grown},
  // device.{name,ledger_peak_bytes (peak_bytes: the same, older name),current_bytes,by_kind,
  // weight_bytes,ring_bytes,scratch_bytes,lora_bytes (current, by use),
  // allocator_stats ("available"|"unavailable"),allocator_{current,peak,reserved}_bytes
  // (null when unavailable)}, plan.{policy,predicted_step_ms,floor_ms,measured_step_ms,...},
  // prefetch.{wasted_copies,wasted_bytes,mismatched_forwards}, pinned, pinned_bytes,
  // pinned_used_bytes (pinned.current), pin_limit_bytes, forwards[], nonfinite.{reruns,
  // last (null before a re-run: {forward,kind,module (null when none),nonfinite_values,
  // values,output_nonfinite_values,output_values})}.
  std::string to_json(int indent = 2) const;
  // The same document as a value, for a caller that adds to it (cache/cache_queries.cpp).
  nlohmann::json to_json_value() const;
};

}  // namespace sluice::offload
