#pragma once
// DeviceAllocator: the allocator part of the device interface (DeviceBackend, device.h),
// as c10 keeps allocation (Allocator.h, CachingDeviceAllocator.h) apart from streams and
// events (DeviceGuardImplInterface.h): the device's memory as the driver and the
// allocator see it, accounted device allocation, page-locked host memory, and the record
// of a stream's use of an allocation (c10 puts recordStream on the allocator too). The
// streams that use the memory are the other part, DeviceStreams (device_streams.h).
//
// Note [device accounting]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Every byte the runtime allocates on the device goes through DeviceAllocator::allocate().
// The tensor it returns owns its memory through a context that, when the last reference
// goes, gives the bytes back to the ledgers that were charged: the backend's own (all
// users of the device) and optionally a caller's (the engine's, whose limit is its budget
// minus working memory). A charge that would pass a ledger's limit throws ResourceError
// before anything is allocated, so a limit can never be exceeded, not even briefly.
// Counted are requested bytes, not the allocator's rounding.
#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "offload/device/device_streams.h"
#include "offload/device/memory_stats.h"

namespace sluice::offload {

// Byte counts by kind with an optional hard limit. Thread-safe: memory may be freed from
// any thread (e.g. the CPU device's copy worker dropping the last reference).
class MemoryLedger {
 public:
  explicit MemoryLedger(std::string name, std::optional<uint64_t> limit = std::nullopt);

  // Adds `bytes` of `kind`; throws ResourceError naming `what` if the limit would be passed.
  void charge(MemoryKind kind, uint64_t bytes, const std::string& what);
  void release(MemoryKind kind, uint64_t bytes) noexcept;

  void set_limit(std::optional<uint64_t> limit);
  std::optional<uint64_t> limit() const;
  uint64_t current() const;
  DeviceMemoryStats stats() const;
  void reset_peak();

 private:
  std::string name_;
  mutable std::mutex mutex_;
  std::optional<uint64_t> limit_;
  DeviceMemoryStats stats_;
};

// Test hook: return true to make an allocation of `bytes` fail as if the device were full.
using AllocationFault = std::function<bool(uint64_t bytes, MemoryKind kind)>;

class DeviceAllocator {
 public:
  DeviceAllocator();
  virtual ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // Where device tensors live ("cpu" for the CPU device).
  virtual c10::Device device() const = 0;
  // "cpu", "cuda:0".
  std::string name() const { return device().str(); }
  // Device memory in bytes (the 100% of a "--vram-budget 50%"): memory_info().total_bytes.
  uint64_t total_memory() const { return static_cast<uint64_t>(std::max<int64_t>(memory_info().total_bytes, 0)); }
  // Free and total device memory now, as the driver sees it (all processes); both 0 when
  // unknown. "--vram-budget auto" starts from free_bytes.
  struct DeviceMemoryInfo {
    int64_t free_bytes = 0;
    int64_t total_bytes = 0;
  };
  virtual DeviceMemoryInfo memory_info() const = 0;
  // The device allocator's own counters for this device (all its users, not only the
  // ledger's requested bytes): allocated now, allocated at most since the process started
  // (or the allocator's last peak reset), and reserved (held from the driver, cache
  // included). available=false where the backend has no such allocator.
  struct AllocatorStats {
    bool available = false;
    int64_t current_bytes = 0, peak_bytes = 0, reserved_bytes = 0;
  };
  virtual AllocatorStats allocator_stats() const { return {}; }
  // Resets allocator_stats().peak_bytes to the current bytes (where available).
  virtual void reset_allocator_peak() {}
  // Hands memory the allocator caches but nothing uses back to the driver (emptyCache), so
  // that other processes can use it; allocator_stats().reserved_bytes falls.
  //
  // Note [releasing cached memory]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // emptyCache synchronizes the whole device and empties the cache that every model's
  // forwards in this process allocate from, so it is called only where memory must leave
  // the process: a detach (StreamingEngine::detach, the model cache taking a model off the
  // device) and a budget cut (StreamingEngine::set_budget lower, ModelCache::set_vram_budget
  // lower), and before "--vram-budget auto" reads the free memory. A residency change that
  // only shrinks the plan (partial_unload, set_max_resident, a plan from measurements,
  // room made for another model of the same cache) leaves its freed blocks cached: the
  // next allocation in this process reuses them without a device synchronize.
  virtual void release_cached_memory() {}
  // Whether allocate_pinned() really page-locks memory (false: the plain CPU device, whose
  // copies are asynchronous from any host memory; pin() then returns its input).
  virtual bool pins_memory() const = 0;

  // Uninitialized contiguous tensor on the device, accounted as `kind` in this backend's
  // ledger and in `budget` when given. Throws ResourceError (naming `what`) when a limit
  // would be passed, the device is out of memory, the fault hook fires or the fault point
  // device.alloc.<resident|params|ring|scratch|lora> fires (runtime/fault_injection.h).
  // See Note [device accounting].
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, MemoryKind kind, const std::string& what,
                      const std::shared_ptr<MemoryLedger>& budget = nullptr);
  // Everything allocate() handed out and not yet freed, on this backend.
  DeviceMemoryStats memory_stats() const { return ledger_->stats(); }
  // Hard limit on what allocate() may hand out on this backend in total, over all budgets
  // (nullopt: the device's own memory is the only limit). The model cache sets it to the
  // shared budget minus working memory.
  void set_memory_limit(std::optional<uint64_t> limit) { ledger_->set_limit(limit); }
  // Resets the backend's peak to its current use.
  void reset_memory_peak() { ledger_->reset_peak(); }
  void set_allocation_fault(AllocationFault fault);

  // Exactly `bytes` of page-locked host memory (at least 64-byte aligned; a GPU's driver
  // gives whole pages), freed by the DataPtr's deleter on any thread; a null DataPtr when
  // it cannot be had. Never through ATen's caching pinned allocator, which rounds up to a
  // power of two and keeps freed blocks locked (Note [pinned arena], pinned_arena.h). On the
  // plain CPU device: ordinary aligned host memory (pins_memory() false); on the strict one,
  // memory its hazard tracker knows as pinned host memory.
  virtual c10::DataPtr allocate_pinned(size_t bytes) = 0;
  // A page-locked copy of host tensor `src` in memory from allocate_pinned(), or an
  // undefined tensor when pinning fails. Where pins_memory() is false returns `src` itself.
  at::Tensor pin(const at::Tensor& src);
  // Whether a copy from host tensor `src` runs asynchronously: page-locked memory on a GPU.
  // A copy from pageable memory blocks the host until the copy stream drains (the engine
  // then copies through a pinned bounce ring, bounce_ring.h). Always true on the plain CPU
  // device, whose copy stream is a thread.
  virtual bool is_pinned(const at::Tensor& src) const = 0;

  // Note [stream-safe frees]
  // ~~~~~~~~~~~~~~~~~~~~~~~~
  // A caching allocator hands a freed block to the next allocation on the block's own
  // stream at once: that is safe against work of that stream only. A block another stream
  // used (the copy stream writing a slot, a forward the host ran on its own stream) must
  // have that use recorded before it is freed; the allocator then keeps the block until
  // the recorded streams have finished what they had enqueued at the free (CUDA's and
  // HIP's recordStream). The engine records every such use; nothing relies on a
  // synchronize of whichever stream happens to be current at the free.

  // Records that the work `stream` has enqueued so far uses the allocation holding `t`
  // (a tensor allocate() returned, or a view of one): freeing it waits for that work.
  // No-op for tensors allocate() did not make.
  void record_use(const at::Tensor& t, StreamKind stream);

 protected:
  // Raw device bytes for allocate()'s `what`; may throw (c10::Error on out of memory).
  virtual c10::DataPtr raw_allocate(size_t nbytes, const std::string& what) = 0;
  // record_use() for the raw allocation behind a tensor.
  virtual void record_stream(const c10::DataPtr& raw, StreamKind stream) = 0;

 private:
  std::shared_ptr<MemoryLedger> ledger_;
  std::mutex fault_mutex_;
  AllocationFault fault_;
};

}  // namespace sluice::offload
