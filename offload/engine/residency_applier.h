#pragma once
// ResidencyApplier: moves the layers of an attached model between host and device as a
// ResidencyPlan (residency_plan.h) says: device copies for resident layers, the host copies
// (pinned in the pinned arena when allowed, pinned_arena.h) for streamed ones.
// ModelResidency (model_residency.h) owns the records and the staging ring; it calls
// apply() at attach and at every residency change, and the engine reads pinned() and
// residency_h2d() for its stats.
//
// Note [residency applier]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// What it owns: the host<->device residency moves of a vector of LayerRecords
// (layer_record.h) — allocating resident copies on the device through
// DeviceBackend::allocate under the model's budget ledger (MemoryKind::resident), the
// host->device copies, re-pointing each layer's stored tensors — the pinning of streamed
// layers' host copies in the pinned arena (Note [pinned arena]), and the counters of both
// (pinned, residency_h2d).
// Weights never go device->host: a layer made streamed is pointed back at its host copy,
// and its device copy is dropped. Host copies never go back to pageable memory either: a
// pinned copy replaces the pageable one for as long as the model is in RAM (resident or
// streamed, attached or not), so re-attaching or promoting a layer copies nothing on the
// host, and neither does a detach.
// Ordering rules:
//  - The caller synchronizes and drops its staging ring before apply() (a failed prefetch
//    is reported there, and no slot of the old ring is read afterwards).
//  - Layers leaving the device go first, so that their bytes are free for the promoted ones.
//  - Each resident copy's use by the copy stream is recorded, so that freeing it later (a
//    demotion, a detach) waits for the copy even when nothing synchronized. Today apply()'s
//    synchronize (F7) always comes first, so this is a second guard, not a fence of its own
//    (scripts/fence_mutations.sh lists it so).
//  - apply() synchronizes after the copies and before returning (FENCE(F7)): no compute
//    reads a resident layer before its copy is done, and a failed copy throws DeviceError
//    there, before anything reads it.
//  - The ring for the layers that stream is made through the caller's RingFn after FENCE(F7),
//    then streamed layers are pinned (pin_host).
// Failures (Note [engine faults] in engine.h):
//  - ResourceError making a layer resident: the layers that made it stay resident, the
//    rest stream; Applied::degraded holds the error. The ring is then sized for what
//    streams (ring_slots x the largest streamed slot); while it does not fit, the last
//    promoted layers are given back. The caller replans its plan from the records
//    (plan_from_layers) and warns once.
//  - Anything else (a failed copy, a ring that does not fit even with no promotion): the
//    layers this call promoted are made streamed again and the error is rethrown; layers
//    it demoted stay streamed.
//  - Pinning that fails: pageable memory from then on, one warning for the lifetime of the
//    applier. A layer that would pass the arena's limit stays pageable, and so do the rest
//    (the engine copies them through its bounce ring); one warning naming the model, the
//    limit and the bytes pinned and left pageable. Later applies try again (another
//    model may have left RAM).
// Not thread-safe.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/layer_record.h"
#include "offload/device/pinned_arena.h"
#include "offload/plan/residency_plan.h"
#include "offload/report/stats.h"

namespace sluice::offload {

struct ResidencyApplierOptions {
  bool pin = false;                     // pin the host copies of streamed layers
  std::shared_ptr<PinnedArena> arena;   // where they are pinned (its limit applies); null: a private
                                        // arena limited by default_pin_memory_limit()
  uint32_t ring_slots = 3;              // a degraded plan's ring holds this many of the largest streamed slot
};

class ResidencyApplier {
 public:
  ResidencyApplier(DeviceBackend& device, ResidencyApplierOptions options);

  // The model whose records are applied from now on: its name (in warnings) and the ledger
  // its device copies are charged to.
  void begin_model(std::string model_name, std::shared_ptr<MemoryLedger> budget);
  // The model is detached (its records go; their pinned host copies stay with the model):
  // drops the ledger and resets pinned() and pinned_bytes().
  void end_model() noexcept;

  // Makes the ring for the layers streamed now, of `capacity` bytes (ResourceError when it
  // does not fit). Called once per apply(), more in the degraded case.
  using RingFn = std::function<void(uint64_t capacity)>;
  struct Applied {
    std::vector<size_t> promoted;  // indices this call made resident, in order
    std::string degraded;          // why fewer layers than planned are resident; empty: as planned
    bool is_degraded() const { return !degraded.empty(); }
  };
  // Makes `layers` resident as `plan.resident` says and the ring through `make_ring`
  // (plan.ring_bytes when as planned; none when 0). See Note [residency applier].
  Applied apply(std::vector<LayerRecord>& layers, const ResidencyPlan& plan, const RingFn& make_ring);

  // The single moves. make_resident: device copies of `r` (ResourceError when they do not
  // fit: nothing changed), copies enqueued, `r` re-pointed at them; the caller synchronizes
  // before they are read. make_streamed: `r` back on its host copies.
  void make_resident(LayerRecord& r);
  void make_streamed(LayerRecord& r);
  // Counts the layers whose host copies are in the arena already (pinned by an earlier
  // attach), then, when pinning is on, moves the host copies of the streamed layers that
  // are not into the arena, in order, as far as its limit allows (Note [pinned arena]).
  // A moved layer's pageable copy is dropped (freed unless someone else holds it).
  void pin_host(std::vector<LayerRecord>& layers);

  const Stat& pinned() const { return pinned_; }                 // stored bytes of this model's layers in the arena
  uint64_t pinned_bytes() const { return pinned_bytes_; }        // page-locked bytes (chunks) holding them
  const Stat& residency_h2d() const { return residency_h2d_; }   // stored bytes made resident (allocated) / given back (freed)
  bool pinning() const { return want_pin_; }                     // false once pinning failed
  const PinnedArena& arena() const { return *options_.arena; }

 private:
  DeviceBackend& device_;
  ResidencyApplierOptions options_;
  std::string model_name_;
  std::shared_ptr<MemoryLedger> budget_;
  void adopt(LayerRecord& r);  // counts `r` as pinned (its host copies are in the arena)

  bool want_pin_ = false;
  bool pin_warned_ = false;    // pinning failed (said once)
  bool limit_warned_ = false;  // the arena's limit was reached (said once)
  Stat pinned_;
  uint64_t pinned_bytes_ = 0;
  std::unordered_map<const void*, uint64_t> chunks_;  // the arena chunks this model's layers use
  Stat residency_h2d_;
};

// Largest slot of the layers streamed now (0: none streams).
uint64_t streamed_slot_bytes(const std::vector<LayerRecord>& layers);
// `plan`'s residency, byte totals and ring from the layers as they are (`extra_bytes`: the
// parameters outside the layers, resident); its predictions are dropped.
void plan_from_layers(ResidencyPlan& plan, const std::vector<LayerRecord>& layers, uint64_t extra_bytes,
                      uint32_t ring_slots);

}  // namespace sluice::offload
