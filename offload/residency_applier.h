#pragma once
// ResidencyApplier: moves the layers of an attached model between host and device as a
// ResidencyPlan (residency_plan.h) says: device copies for resident layers, the host copies
// (pinned when allowed) for streamed ones. The streaming engine (engine.h) owns the
// records, the staging ring and the forwards; it calls apply() at attach and at every
// residency change, and reads pinned() and residency_h2d() for its stats.
//
// Note [residency applier]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// What it owns: the host<->device residency moves of a vector of LayerRecords
// (layer_record.h) — allocating resident copies on the device through
// DeviceBackend::allocate under the model's budget ledger (MemoryKind::resident), the
// host->device copies, re-pointing each layer's stored tensors — the pinning of streamed
// layers' host copies under a cap, and the counters of both (pinned, residency_h2d).
// Weights never go device->host: a layer made streamed is pointed back at its host copy,
// and its device copy is dropped.
// Ordering rules:
//  - The caller synchronizes and drops its staging ring before apply() (a failed prefetch
//    is reported there, and no slot of the old ring is read afterwards).
//  - Layers leaving the device go first, so that their bytes are free for the promoted ones.
//  - Each resident copy's use by the copy stream is recorded (FENCE(F4)), so that freeing it
//    later (a demotion, a detach) waits for the copy even when nothing synchronized.
//  - apply() synchronizes after the copies and before returning (FENCE(F7)): no compute
//    reads a resident layer before its copy is done, and a failed copy throws DeviceError
//    there, before anything reads it.
//  - The ring for the layers that stream is made through the caller's RingFn after FENCE(F7),
//    then streamed layers are pinned.
// Failures (Note [engine faults] in engine.h):
//  - ResourceError making a layer resident: the layers that made it stay resident, the
//    rest stream; Applied::degraded holds the error. The ring is then sized for what
//    streams (ring_slots x the largest streamed slot); while it does not fit, the last
//    promoted layers are given back. The caller replans its plan from the records
//    (plan_from_layers) and warns once.
//  - Anything else (a failed copy, a ring that does not fit even with no promotion): the
//    layers this call promoted are made streamed again and the error is rethrown; layers
//    it demoted stay streamed.
//  - Pinning that fails or passes the cap: pageable memory from then on, one warning each
//    for the lifetime of the applier.
// Not thread-safe.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "offload/device.h"
#include "offload/layer_record.h"
#include "offload/residency_plan.h"
#include "offload/stats.h"

namespace sluice::offload {

struct ResidencyApplierOptions {
  bool pin = false;            // pin the host copies of streamed layers
  uint64_t pin_cap_bytes = 0;  // most pinned bytes (stored bytes of pinned layers)
  uint32_t ring_slots = 3;     // a degraded plan's ring holds this many of the largest streamed slot
};

class ResidencyApplier {
 public:
  ResidencyApplier(DeviceBackend& device, ResidencyApplierOptions options);

  // The model whose records are applied from now on: its name (in warnings) and the ledger
  // its device copies are charged to.
  void begin_model(std::string model_name, std::shared_ptr<MemoryLedger> budget);
  // The model is gone (every record unpinned): drops the ledger and resets pinned().
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
  // Pins `r`'s host copies when pinning is on and the cap allows; unpin_host gives them back
  // as pageable memory.
  void pin_host(LayerRecord& r);
  void unpin_host(LayerRecord& r);

  const Stat& pinned() const { return pinned_; }                 // stored bytes of pinned layers
  const Stat& residency_h2d() const { return residency_h2d_; }   // stored bytes made resident (allocated) / given back (freed)
  bool pinning() const { return want_pin_; }                     // false once pinning failed
  uint64_t pin_cap() const { return options_.pin_cap_bytes; }

 private:
  DeviceBackend& device_;
  ResidencyApplierOptions options_;
  std::string model_name_;
  std::shared_ptr<MemoryLedger> budget_;
  bool want_pin_ = false;
  bool pin_warned_ = false;
  Stat pinned_;
  Stat residency_h2d_;
};

// Largest slot of the layers streamed now (0: none streams).
uint64_t streamed_slot_bytes(const std::vector<LayerRecord>& layers);
// `plan`'s residency, byte totals and ring from the layers as they are (`extra_bytes`: the
// parameters outside the layers, resident); its predictions are dropped.
void plan_from_layers(ResidencyPlan& plan, const std::vector<LayerRecord>& layers, uint64_t extra_bytes,
                      uint32_t ring_slots);

}  // namespace sluice::offload
