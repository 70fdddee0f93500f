#pragma once
// CpuPool: the strict CPU device's caching allocator (Note [strict device] in
// cpu_device.h). A freed block is reused by the next allocation of the same size at once,
// poisoned (filled with 0xFF); a block freed with a fence (its use by the copy stream was
// recorded) waits until the copy worker has run every job enqueued before its free
// (CopyProgress, copy_worker.h), and is poisoned only when it is handed out again. It
// keeps a GPU caching allocator's counters: bytes handed out (current, peak) and held
// (reserved, the cache included). What a block holds is the hazard tracker's business
// (strict_tracking.h), not the pool's.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "offload/device/copy_worker.h"
#include "offload/device/device_allocator.h"

namespace sluice::offload {

class CpuPool {
 public:
  static constexpr uint64_t kMaxCached = uint64_t{256} << 20;

  explicit CpuPool(std::shared_ptr<const CopyProgress> progress) : progress_(std::move(progress)) {}
  ~CpuPool();
  CpuPool(const CpuPool&) = delete;
  CpuPool& operator=(const CpuPool&) = delete;

  // A block of `n` bytes (64-byte aligned): a cached one of that size whose fence has
  // passed, else a new one. Throws c10::Error when out of memory.
  void* take(size_t n);
  // Gives back block `p` of `n` bytes. `fence`: 0 (poisoned and reusable at once), or the
  // copy jobs enqueued at the free (fence_now()), which must all have run before reuse.
  void give(void* p, size_t n, uint64_t fence);
  // The fence of a block freed now that the copy stream used.
  uint64_t fence_now() const { return progress_->enqueued.load(); }
  // Hands cached blocks back to the OS (release_cached_memory), except those still
  // waiting for the copy stream.
  void trim();

  DeviceAllocator::AllocatorStats stats() const;
  void reset_peak();

 private:
  std::shared_ptr<const CopyProgress> progress_;
  mutable std::mutex mutex_;
  std::multimap<size_t, std::pair<void*, uint64_t>> free_;  // size -> (block, fence)
  uint64_t cached_ = 0;
  // Allocator statistics: bytes handed out (current, peak) and held (reserved).
  int64_t current_ = 0, peak_ = 0, reserved_ = 0;
};

}  // namespace sluice::offload
