#pragma once
// StrictTracking: what the strict CPU device (Note [strict device] in cpu_device.h) adds
// to the plain one, as glue between its operations and its hazard tracker
// (hazard_tracker.h): which tracker queue a stream is for the calling thread, the blocks
// the tracker knows (device memory from the caching pool, cpu_pool.h, and pinned host
// memory), and what each allocation, free, copy, event record, wait, synchronize and
// declared access tells the tracker. The tracker decides what is a hazard; this only
// reports to it. The plain device (cpu_device.cpp) holds one when strict.
#include <ATen/ATen.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <memory>
#include <string>

#include "offload/device/copy_worker.h"
#include "offload/device/cpu_pool.h"
#include "offload/device/device_allocator.h"
#include "offload/device/device_streams.h"
#include "offload/device/hazard_tracker.h"

namespace sluice::offload {

class StrictTracking {
 public:
  // `progress`: the copy worker's, whose jobs a block freed after a copy-stream use waits for.
  StrictTracking(HazardTracker::Policy policy, std::shared_ptr<const CopyProgress> progress);

  HazardTracker* tracker() const { return tracker_.get(); }
  // For events, which outlive nothing but themselves (a query that reads done is a host wait).
  const std::shared_ptr<HazardTracker>& shared_tracker() const { return tracker_; }

  // The tracker's queue for `stream` on the calling thread (its compute stream is
  // CpuComputeStreamGuard's).
  static HazardTracker::Queue queue_of(StreamKind stream);

  // The allocator part.
  // Device memory of `nbytes` from the pool, known to the tracker as `what`, allocated on
  // the calling thread's compute stream. Its free checks the block and gives it back to
  // the pool, fenced behind the copy worker's jobs when the copy stream's use of it was
  // recorded.
  c10::DataPtr allocate(size_t nbytes, const std::string& what);
  // Aligned host memory the tracker knows as pinned host memory (the host's); a null
  // DataPtr when out of memory.
  c10::DataPtr allocate_pinned(size_t bytes);
  // Whether `src` is pinned host memory (allocate_pinned()); an empty tensor counts as pinned.
  bool is_pinned(const at::Tensor& src) const;
  // DeviceAllocator::record_use() of the raw block.
  void record_stream(const c10::DataPtr& raw, StreamKind stream);
  DeviceAllocator::AllocatorStats allocator_stats() const { return pool_->stats(); }
  void reset_allocator_peak() { pool_->reset_peak(); }
  void release_cached_memory() { pool_->trim(); }

  // The streams part.
  // A host->device copy from `src` into device memory at `dst` enqueued on the copy
  // stream now: it writes `dst`, and reads `src` where the tracker knows it (pinned host
  // memory, whose free then waits for the copy).
  void copy(const void* dst, const at::Tensor& src);
  // An event record on `stream`: the clock the event carries.
  HazardTracker::VClock record(StreamKind stream);
  // `stream` waits for an event recorded with `clock`.
  void wait(StreamKind stream, const HazardTracker::VClock& clock);
  // The host waited for both streams of the calling thread (a device synchronize).
  void synchronize();
  // The access hooks (DeviceStreams::begin_access and the rest); undefined and empty
  // tensors are ignored.
  void begin_access(const at::Tensor& t, StreamKind stream, Access a, const std::string& op);
  void end_access(const at::Tensor& t, StreamKind stream);
  void host_access(const at::Tensor& t, Access a, const std::string& op);

 private:
  std::shared_ptr<HazardTracker> tracker_;
  std::shared_ptr<CpuPool> pool_;
};

}  // namespace sluice::offload
