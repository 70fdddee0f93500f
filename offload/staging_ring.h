#pragma once
// Device staging slots for streamed layers. Each slot holds one layer's stored bytes
// (fp8 stays fp8 across the bus; the upcast happens on the device afterwards), packed:
// weight, bias, scale at kSlotAlignment-aligned offsets.
//
// Note [staging ring sizing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Slots = prefetch depth + 1 by default. While streamed layer p computes it occupies one
// slot (its upcast, or the matmul itself when no upcast is needed, reads it); a
// prefetch depth of D keeps the copies of the next D streamed layers in flight or ready,
// one slot each. With fewer slots the copy for p+D would have to wait for p's compute to
// free a slot, so the effective depth drops to D-1; more slots than D+1 would never be
// filled by a depth-D prefetcher. Every slot is as large as the largest streamed layer
// and is charged to the budget, where the same bytes could keep layers resident instead,
// and residency buys more than depth (stable-diffusion.cpp measured prefetch deeper than
// one barely helping). Depth 2 (3 slots) is the default: one copy running while the next
// layer is ready absorbs the jitter of a small layer followed by a large one.
//
// Ordering (both ways, with events):
//  - compute waits on a slot's copy_done before reading it (the engine does this);
//  - the copy stream waits on a slot's compute_done, recorded at every release, before
//    overwriting it;
//  - on the host, a slot with open leases is never picked for a copy at all, so the event
//    it waits on always covers its latest reader;
//  - every copy's use of a slot is recorded on the copy stream (Note [stream-safe frees]),
//    so dropping the ring never waits for, nor races with, copies still in flight.
// The CPU device runs copies on a host thread; there each copy checks, just before it
// writes, that the slot has no open lease, and counts violations (tests assert zero).
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "offload/bounce_ring.h"
#include "offload/device.h"

namespace sluice::offload {

constexpr uint64_t kSlotAlignment = 256;

inline uint64_t align_up(uint64_t n, uint64_t a = kSlotAlignment) { return (n + a - 1) / a * a; }

struct StagingSlot {
  at::Tensor buffer;                          // uint8 [slot_bytes] on the device
  int64_t layer = -1;                         // layer id it holds (-1: none)
  uint64_t epoch = 0;                         // the forward its copy belongs to
  bool consumed = true;                       // acquired since its copy was issued
  std::shared_ptr<std::atomic<int>> leases;   // open leases reading it
  std::unique_ptr<DeviceEvent> copy_done;     // recorded on the copy stream after each fill
  std::unique_ptr<DeviceEvent> compute_done;  // recorded on the compute stream at each release
};

// One host tensor to copy into a slot at a byte offset.
struct SlotPart {
  at::Tensor host;  // contiguous
  uint64_t offset = 0;
};

class StagingRing {
 public:
  // Allocates `slots` slots of `slot_bytes` (ring memory, charged to `budget`).
  StagingRing(DeviceBackend& device, std::shared_ptr<MemoryLedger> budget, uint32_t slots, uint64_t slot_bytes);
  ~StagingRing();

  size_t size() const { return slots_.size(); }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t bytes() const { return slot_bytes_ * slots_.size(); }
  StagingSlot& slot(size_t i) { return slots_.at(i); }
  const StagingSlot& slot(size_t i) const { return slots_.at(i); }

  // Index of the slot holding `layer` for forward `epoch`, or -1.
  int find(int64_t layer, uint64_t epoch) const;

  // Next slot that may be overwritten, round robin: never one with open leases; when
  // `keep_unconsumed`, never one whose copy is for forward >= `epoch` and not yet read.
  // -1 if none.
  int pick(uint64_t epoch, bool keep_unconsumed);

  // Adds one slot (budget permitting; throws ResourceError otherwise).
  void grow();

  // Enqueues on the copy stream: wait for the slot's last reader, record `start` (if
  // given), copy every part, record the slot's copy_done and `end` (if given). Parts in
  // pageable memory go through `bounce` when given (Note [bounce ring]).
  // If enqueuing throws (DeviceError), the slot is left empty (layer -1).
  void fill(int slot, int64_t layer, uint64_t epoch, const std::vector<SlotPart>& parts, DeviceEvent* start,
            DeviceEvent* end, BounceRing* bounce = nullptr);

  // A typed view of `numel` elements at byte `offset` of a slot.
  at::Tensor view(int slot, uint64_t offset, at::ScalarType dtype, at::IntArrayRef sizes) const;

  // Opens/closes a lease on a slot; close records compute_done on the compute stream.
  void begin_use(int slot);
  void end_use(int slot) noexcept;

  // Forgets what every slot holds (contents stay; nothing is in use).
  void invalidate();

  // Copies that started writing into a slot with an open lease (CPU device only).
  uint64_t violations() const { return violations_->load(); }

 private:
  StagingSlot make_slot();

  DeviceBackend& device_;
  std::shared_ptr<MemoryLedger> budget_;
  uint64_t slot_bytes_;
  std::vector<StagingSlot> slots_;
  size_t next_ = 0;
  std::shared_ptr<std::atomic<uint64_t>> violations_ = std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace sluice::offload
