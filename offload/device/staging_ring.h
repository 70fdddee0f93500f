#pragma once
// The staging ring: device slots for streamed layers, bounded by a byte capacity. Each
// slot holds one layer's stored bytes (fp8 stays fp8 across the bus; the upcast happens on
// the device afterwards), packed: weight, bias, scale at kSlotAlignment-aligned offsets.
//
// Note [staging ring]
// ~~~~~~~~~~~~~~~~~~~
// The ring is sized in bytes, not in slots: the plan gives it a capacity out of the budget
// (ResidencyPlan::ring_bytes, at least `ring_slots` of the largest streamed layer), and
// the prefetcher copies ahead as far as those bytes allow (Note [prefetch order]). Small
// layers therefore run far ahead, and the time that resident layers give is used for
// copies instead of being lost once a fixed number of slots is full.
//
// The capacity is charged to the budget when the ring is made (a reservation: the plan's
// accounting is exact whatever sizes the slots settle on), and the engine makes the first
// slots right away (prepare), so a device that cannot hold the ring fails at attach, not
// in the middle of a forward. Only overflow slots are charged on top.
//
// A slot is one device allocation of exactly its layer's (aligned) size, so a layer holds
// only its own bytes. A copy reuses, in this order: a free slot of exactly its size (the
// least recently filled), a new slot if the capacity has room, the smallest free slot
// that is larger, or a new slot after freeing free slots of other sizes, least recently
// filled first. After the first forward the recorded order repeats, so the ring settles
// on a set of slots and allocates nothing more. "Free" means no open lease and, when the
// caller asks, no unread copy for the current or a later forward. A demand copy that finds
// no room (more leases open at once than the ring holds, e.g. nested layers) gets an
// overflow slot beyond the capacity, budget permitting, freed once it is released.
//
// Ordering (both ways, with events):
//  - compute waits on a slot's copy_done before reading it (the engine does this);
//  - the copy stream waits on a slot's compute_done, recorded at every release, before
//    overwriting it;
//  - on the host, a slot with open leases is never picked for a copy at all, so the event
//    it waits on always covers its latest reader;
//  - every copy's use of a slot is recorded on the copy stream and every reader's use on
//    its compute stream (Note [stream-safe frees]), so freeing a slot, or the ring, never
//    waits for, nor races with, work still in flight.
// A copy that was never read (overwritten, freed, invalidated) is counted as wasted: it
// cost bus time and bytes, never correctness.
// The CPU device runs copies on a host thread; there each copy checks, just before it
// writes, that the slot has no open lease, and counts violations (tests assert zero).
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "offload/device/bounce_ring.h"
#include "offload/device/device.h"

namespace sluice::offload {

constexpr uint64_t kSlotAlignment = 256;

inline uint64_t align_up(uint64_t n, uint64_t a = kSlotAlignment) { return (n + a - 1) / a * a; }

struct StagingSlot {
  at::Tensor buffer;                          // uint8 [bytes] on the device; undefined: an empty entry
  int64_t layer = -1;                         // layer id it holds (-1: none)
  uint64_t epoch = 0;                         // the forward its copy belongs to
  uint32_t occurrence = 0;                    // which call of its layer in that forward (Note [repeated calls])
  uint64_t copy_bytes = 0;                    // stored bytes of that copy (for the waste count)
  bool consumed = true;                       // acquired since its copy was issued
  bool overflow = false;                      // beyond the capacity: freed once released
  uint64_t stamp = 0;                         // fill order, for least-recently-filled reuse
  std::shared_ptr<std::atomic<int>> leases;   // open leases reading it
  std::unique_ptr<DeviceEvent> copy_done;     // recorded on the copy stream after each fill
  std::unique_ptr<DeviceEvent> compute_done;  // recorded on the compute stream at each release
  uint64_t bytes() const { return buffer.defined() ? buffer.nbytes() : 0; }
};

// One host tensor to copy into a slot at a byte offset.
struct SlotPart {
  at::Tensor host;  // contiguous
  uint64_t offset = 0;
};

class StagingRing {
 public:
  // An empty ring of `capacity_bytes`, charged to `budget` now (ResourceError if it does
  // not fit).
  StagingRing(DeviceBackend& device, std::shared_ptr<MemoryLedger> budget, uint64_t capacity_bytes);
  ~StagingRing();
  // Makes slots of `sizes` (in order) while they fit in the capacity; throws ResourceError
  // when the device cannot allocate one.
  void prepare(const std::vector<uint64_t>& sizes);

  uint64_t capacity() const { return capacity_; }
  // Slot entries (some may be empty); indices stay valid for the ring's life.
  size_t size() const { return slots_.size(); }
  size_t live_slots() const;
  uint64_t bytes() const;  // device bytes of the slots held now, overflow included
  uint64_t overflow_bytes() const { return bytes() - held_; }  // of which beyond the capacity
  StagingSlot& slot(size_t i) { return slots_.at(i); }
  const StagingSlot& slot(size_t i) const { return slots_.at(i); }

  // Index of the slot holding `layer` for call `occurrence` (0: its first) of forward
  // `epoch`, or -1.
  int find(int64_t layer, uint64_t epoch, uint32_t occurrence = 0) const;

  // A slot of at least `bytes` that may be overwritten now, within the capacity (Note
  // [staging ring]): never one with open leases; when `keep_unconsumed`, never one whose
  // copy is for forward >= `epoch` and not yet read. -1 if there is no room. May throw
  // ResourceError when making a slot exceeds the budget.
  int pick(uint64_t bytes, uint64_t epoch, bool keep_unconsumed);
  // A new slot beyond the capacity (budget permitting; ResourceError otherwise).
  int overflow(uint64_t bytes);

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

  // Forgets what every slot holds (contents stay; nothing is in use); unread copies count
  // as wasted.
  void invalidate();
  // Forgets the unread copies made for forward `epoch` (a forward of another kind came).
  void drop_unread(uint64_t epoch);

  // Copies that started writing into a slot with an open lease (CPU device only).
  uint64_t violations() const { return violations_->load(); }
  // Copies dropped before any forward read them, and their stored bytes.
  uint64_t wasted_copies() const { return wasted_copies_; }
  uint64_t wasted_bytes() const { return wasted_bytes_; }

 private:
  int make_slot(uint64_t bytes, bool overflow);
  void forget(StagingSlot& s);  // drops its copy (counted as wasted when unread)
  void release(StagingSlot& s);  // frees its buffer

  DeviceBackend& device_;
  std::shared_ptr<MemoryLedger> budget_;
  uint64_t capacity_;
  std::shared_ptr<MemoryLedger> slots_ledger_;  // slots within the capacity, until the device frees them
  uint64_t held_ = 0;  // bytes of the slots within the capacity
  uint64_t stamp_ = 0;
  std::vector<StagingSlot> slots_;
  uint64_t wasted_copies_ = 0, wasted_bytes_ = 0;
  std::shared_ptr<std::atomic<uint64_t>> violations_ = std::make_shared<std::atomic<uint64_t>>(0);
};

}  // namespace sluice::offload
