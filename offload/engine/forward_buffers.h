#pragma once
// ForwardBuffers: the device buffers a residency plan sizes for its forwards beside the
// resident weights: the staging ring that streamed layers are copied into (Note [staging
// ring] in staging_ring.h) and the upcast scratch that every layer's weights are upcast
// into for its forward. Both are charged to the model's budget ledger. The residency part
// (model_residency.h) makes and drops them as plans change; a forward (forward_pass.h)
// takes slots and scratch from them and gives them back at each release.
//
// Note [upcast scratch]
// ~~~~~~~~~~~~~~~~~~~~~
// One scratch buffer of the largest layer's upcast output is planned (ResidencyPlan's
// scratch_bytes): a forward holds one layer's upcast weights at a time. A lease taken while
// another is open (a module holding two layers' weights at once) needs a second buffer; it
// is made when needed, of that lease's size, budget permitting, counted as held beyond the
// plan (Note [device extras] in model_budget.h: later plans reserve it), and dropped at the
// next plan change that finds it free. A lease names its buffer by index, so one it still
// holds then stays where it is, and a dropped one below it leaves an empty place that the
// next buffer made fills. Slots beyond the ring's capacity (StagingRing::overflow) count the
// same way.
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/layer_record.h"
#include "offload/device/staging_ring.h"

namespace sluice::offload {

class ForwardBuffers {
 public:
  explicit ForwardBuffers(DeviceBackend& device) : device_(device) {}

  // The model's ledger and its planned scratch (0 bytes: none; ResourceError if it does not fit).
  void begin_model(std::shared_ptr<MemoryLedger> budget, uint64_t scratch_bytes);
  // Drops the ring (its counters kept) and every scratch buffer.
  void end_model() noexcept;

  StagingRing* ring() { return ring_.get(); }
  const StagingRing* ring() const { return ring_.get(); }
  // A new ring of `capacity` with its first slots made for the streamed layers of `layers`,
  // in execution order (ResourceError if it does not fit). Drops the old ring first.
  void make_ring(uint64_t capacity, const std::vector<LayerRecord>& layers);
  // Drops the ring, counting its unread copies as wasted. False when there was none.
  bool retire_ring() noexcept;
  // Ring bytes reserved but not made into slots yet (device_bytes() counts the capacity).
  uint64_t unmade_ring_bytes() const;

  // A free scratch buffer of at least `bytes`, else a new one of `bytes` (Note [upcast
  // scratch]), and then `beyond_plan` is set, once it is made: ResourceError, the flag
  // untouched, when it does not fit.
  int take_scratch(uint64_t bytes, bool& beyond_plan);
  const at::Tensor& scratch(int i) const { return scratch_[static_cast<size_t>(i)].buffer; }
  void give_back_scratch(int i) { scratch_[static_cast<size_t>(i)].in_use = false; }
  // Drops the free buffers beyond the planned one (a plan change); one a lease still holds
  // stays, at its index, until a later trim finds it given back.
  void trim_scratch();
  // Device bytes held beyond the plan now: overflow slots and extra scratch buffers.
  uint64_t beyond_plan_bytes() const;

  // Over every ring this model had: slots overwritten while in use, and unread copies.
  uint64_t violations() const { return violations_ + (ring_ ? ring_->violations() : 0); }
  uint64_t wasted_copies() const { return wasted_copies_ + (ring_ ? ring_->wasted_copies() : 0); }
  uint64_t wasted_bytes() const { return wasted_bytes_ + (ring_ ? ring_->wasted_bytes() : 0); }

 private:
  struct Scratch {
    at::Tensor buffer;  // undefined: a place trim_scratch emptied
    bool in_use = false;
  };

  DeviceBackend& device_;
  std::shared_ptr<MemoryLedger> budget_;
  uint64_t scratch_bytes_ = 0;
  std::unique_ptr<StagingRing> ring_;
  std::vector<Scratch> scratch_;
  uint64_t violations_ = 0, wasted_copies_ = 0, wasted_bytes_ = 0;  // from rings already dropped
};

}  // namespace sluice::offload
