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
// The bounce ring keeps the copy stream asynchronous anyway: page-locked slots (host
// memory, never the device budget). A fill is cut into slot-sized pieces (all its parts
// gathered, so a bias or a scale takes no slot of its own); for each piece the host takes
// the next slot, memcpys the piece in, and enqueues the slot -> device copy on the copy
// stream, then records the slot's event after it.
//
// Note [bounce ring sizing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A slot is free again once its copy ran, and its copy sits in the copy stream behind the
// wait for its staging slot's last reader (FENCE(F2), staging_ring.cpp): waiting for a slot
// is waiting for that compute. With few slots that reader is the layer the host has just
// enqueued, so the host, which should run ahead queuing compute, stalls until the device
// finished the previous layer (issue 27, item 5). So:
//  - the host never blocks on a slot whose copy is not done while the ring may grow: it
//    pins a new slot instead (query(), then grow), starting from EngineOptions::bounce_slots;
//  - the ring grows at most to `limit` slots (set_limit), which the engine sets to
//        ceil(ring capacity / slot) + F + 2 * P
//    where F is the most fills the staging ring can hold unread (its capacity over the
//    smallest streamed layer's slot: each fill rounds up to a whole piece once) and P the
//    pieces of the largest streamed layer. Unread fills then hold at most
//    ceil(capacity / slot) + F pieces, so when the host does have to wait (every slot in
//    flight), at least 2 * P of the pieces in flight belong to fills compute has already
//    read, and the oldest piece, the one waited for, belongs to a fill at least two
//    streamed layers older than the last one the host enqueued: its copy sits behind the
//    compute of a layer at least two layers back. The host therefore waits on compute only
//    when the device runs more than two streamed layers behind it, never on the reader it
//    has just released. tests/offload/engine/test_streams.cpp models a device whose compute
//    runs behind the host (CpuDeviceOptions::compute_lag, Note [host waits on compute] in
//    cpu_device.h) and checks that no bounce wait waited for running compute.
// If even the slots cannot be pinned, the engine says so once and copies synchronously:
// correct, without overlap, and counted in the stats (sync_copies).
//
// Tested by (through streamed forwards of pageable layers on the CPU device, plain and
// strict): tests/offload/engine/test_streams.cpp ("streams: pageable layers stream through
// the bounce ring", "streams: without a pinned bounce ring copies are synchronous and said
// once and counted", "streams: a bounce slot's reuse never waits for compute the device is
// still running", "streams: queuing pageable layers' copies does not wait for the compute
// just queued"), tests/offload/engine/test_faults.cpp ("faults: pinning failing falls back
// to pageable memory with one warning").
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "offload/device/device.h"

namespace sluice::offload {

class BounceRing {
 public:
  // Pins `slots` slots of `slot_bytes` through `device`. When pinning fails (or the fault
  // point host.pin.bounce fires) the ring has no slots and copy() is synchronous.
  BounceRing(DeviceBackend& device, uint32_t slots, uint64_t slot_bytes);

  bool pinned() const { return !slots_.empty(); }
  uint64_t bytes() const { return slot_bytes_ * slots_.size(); }  // page-locked host bytes held
  uint64_t slot_bytes() const { return slot_bytes_; }
  // The most slots the ring grows to rather than wait for a slot (Note [bounce ring sizing]).
  void set_limit(size_t slots) { limit_ = slots; }
  size_t limit() const { return limit_; }

  // A part of a fill: host bytes (contiguous) for device bytes at `offset` of the destination.
  struct Part {
    at::Tensor host;
    uint64_t offset = 0;
  };
  // Enqueues copies of pageable host `parts` into device `dst` (contiguous bytes, each part
  // at its offset) on the copy stream, gathered into slot-sized pieces (bytes between parts
  // are copied too, unspecified); `before` as in DeviceBackend::copy_to_device, for the
  // first piece. Returns once every piece is in a slot (or, without slots, once the copies
  // are done). The parts may be freed or changed when it returns.
  void copy(const at::Tensor& dst, const std::vector<Part>& parts, const std::function<void()>& before = {});
  // One part at offset 0 (same bytes as `dst`).
  void copy(const at::Tensor& dst, const at::Tensor& src, const std::function<void()>& before = {});

  uint64_t copies() const { return copies_; }            // pieces copied through a slot
  uint64_t sync_copies() const { return sync_copies_; }  // copies made synchronously (no slots)
  uint64_t waits() const { return waits_; }              // pieces that waited for a slot in flight

 private:
  struct Slot {
    at::Tensor buffer;  // page-locked uint8 [slot_bytes]
    std::unique_ptr<DeviceEvent> done;  // recorded on the copy stream after the slot's copy
  };
  Slot& take_slot();

  DeviceBackend& device_;
  uint64_t slot_bytes_;
  std::vector<Slot> slots_;
  size_t next_ = 0;
  size_t limit_ = 0;
  uint64_t copies_ = 0;
  uint64_t sync_copies_ = 0;
  uint64_t waits_ = 0;
};

}  // namespace sluice::offload
