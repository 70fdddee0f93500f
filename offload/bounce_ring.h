#pragma once
// BounceRing: asynchronous copies from pageable host memory.
//
// Note [bounce ring]
// ~~~~~~~~~~~~~~~~~~
// A GPU copies asynchronously only from page-locked memory. From pageable memory,
// cudaMemcpyAsync (hipMemcpyAsync) first stages the bytes itself and returns only when the
// copy stream got to them; the copy stream waits on compute before it overwrites a staging
// slot, so the host ends up waiting for compute at every streamed layer and nothing
// overlaps. That is the case whenever streamed layers are not pinned: --pin-memory off
// (the ROCm advice), the layers past the pinned arena's limit (--pin-memory-limit,
// pinned_arena.h), or pinning failed.
// The bounce ring keeps the copy stream asynchronous anyway: a few page-locked slots
// (host memory, never the device budget). A copy is cut into slot-sized pieces; for each
// piece the host waits until the slot's previous copy has read it (its event), memcpys the
// piece in, and enqueues the slot -> device copy on the copy stream. The host only waits
// when every slot is still in flight, i.e. for the bus, never for compute.
// If even the slots cannot be pinned, the engine says so once and copies synchronously:
// correct, without overlap, and counted in the stats (sync_copies).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "offload/device.h"

namespace sluice::offload {

class BounceRing {
 public:
  // Pins `slots` slots of `slot_bytes` through `device`. When pinning fails (or the fault
  // point host.pin.bounce fires) the ring has no slots and copy() is synchronous.
  BounceRing(DeviceBackend& device, uint32_t slots, uint64_t slot_bytes);

  bool pinned() const { return !slots_.empty(); }
  uint64_t bytes() const { return slot_bytes_ * slots_.size(); }  // page-locked host bytes held

  // Enqueues a copy of pageable host `src` into device `dst` (same bytes, both
  // contiguous) on the copy stream; `before` as in DeviceBackend::copy_to_device, for the
  // first piece. Returns once every piece is in a slot (or, without slots, once the copy
  // is done). `src` may be freed or changed when it returns.
  void copy(const at::Tensor& dst, const at::Tensor& src, const std::function<void()>& before = {});

  uint64_t copies() const { return copies_; }            // pieces copied through a slot
  uint64_t sync_copies() const { return sync_copies_; }  // copies made synchronously (no slots)

 private:
  struct Slot {
    at::Tensor buffer;  // page-locked uint8 [slot_bytes]
    std::unique_ptr<DeviceEvent> done;  // recorded on the copy stream after the slot's copy
  };

  DeviceBackend& device_;
  uint64_t slot_bytes_;
  std::vector<Slot> slots_;
  size_t next_ = 0;
  uint64_t copies_ = 0;
  uint64_t sync_copies_ = 0;
};

}  // namespace sluice::offload
