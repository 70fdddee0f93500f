#include "offload/device/strict_tracking.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "offload/device/cpu_device.h"

namespace sluice::offload {

namespace {

using Queue = HazardTracker::Queue;

// The strict device's pinned host block: known to its hazard tracker until freed.
struct PinnedBlock {
  void* p;
  std::shared_ptr<HazardTracker> tracker;
};

void free_pinned_block(void* ctx) {
  auto* b = static_cast<PinnedBlock*>(ctx);
  b->tracker->remove_block(b->p);
  std::free(b->p);
  delete b;
}

struct StrictBlock {
  std::shared_ptr<CpuPool> pool;
  std::shared_ptr<HazardTracker> tracker;
  void* p;
  size_t n;
};

void strict_free(void* ctx) {
  auto* b = static_cast<StrictBlock*>(ctx);
  const bool by_copy = b->tracker->recorded_queues(b->p).count(HazardTracker::kCopy) > 0;
  b->tracker->remove_block(b->p);
  b->pool->give(b->p, b->n, by_copy ? b->pool->fence_now() : 0);
  delete b;
}

Queue compute_queue() { return HazardTracker::compute(CpuComputeStreamGuard::current()); }

}  // namespace

StrictTracking::StrictTracking(HazardTracker::Policy policy, std::shared_ptr<const CopyProgress> progress)
    : tracker_(std::make_shared<HazardTracker>(policy)), pool_(std::make_shared<CpuPool>(std::move(progress))) {}

Queue StrictTracking::queue_of(StreamKind stream) {
  return stream == StreamKind::copy ? HazardTracker::kCopy : compute_queue();
}

c10::DataPtr StrictTracking::allocate(size_t nbytes, const std::string& what) {
  void* p = pool_->take(nbytes);
  tracker_->add_block(p, nbytes, what, compute_queue());
  return c10::DataPtr(p, new StrictBlock{pool_, tracker_, p, nbytes}, &strict_free, c10::Device(c10::kCPU));
}

// A block the hazard tracker knows as pinned host memory, so that is_pinned() tells it
// apart from pageable memory as a GPU's driver would.
c10::DataPtr StrictTracking::allocate_pinned(size_t bytes) {
  void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
  if (!p) return {};
  tracker_->add_block(p, bytes, "pinned host memory", HazardTracker::kHost);
  auto* ctx = new PinnedBlock{p, tracker_};
  return c10::DataPtr(p, ctx, &free_pinned_block, c10::Device(c10::kCPU));
}

bool StrictTracking::is_pinned(const at::Tensor& src) const {
  if (src.numel() == 0) return true;
  return tracker_->owner_of(src.data_ptr()) == HazardTracker::kHost;
}

void StrictTracking::record_stream(const c10::DataPtr& raw, StreamKind stream) {
  tracker_->record_use(raw.get(), queue_of(stream));
}

void StrictTracking::copy(const void* dst, const at::Tensor& src) {
  const std::string op = "host->device copy of " + std::to_string(src.nbytes()) + " bytes";
  tracker_->access(dst, HazardTracker::kCopy, Access::write, op);
  if (src.numel() > 0 && tracker_->owner_of(src.data_ptr())) {
    tracker_->access(src.data_ptr(), HazardTracker::kCopy, Access::read, op);
    tracker_->record_use(src.data_ptr(), HazardTracker::kCopy);
  }
}

HazardTracker::VClock StrictTracking::record(StreamKind stream) { return tracker_->record(queue_of(stream)); }

void StrictTracking::wait(StreamKind stream, const HazardTracker::VClock& clock) {
  tracker_->merge(queue_of(stream), clock);
}

void StrictTracking::synchronize() {
  tracker_->host_waits_for(HazardTracker::kCopy);
  tracker_->host_waits_for(compute_queue());
}

void StrictTracking::begin_access(const at::Tensor& t, StreamKind stream, Access a, const std::string& op) {
  if (t.defined() && t.numel() > 0) tracker_->begin(t.data_ptr(), queue_of(stream), a, op);
}

void StrictTracking::end_access(const at::Tensor& t, StreamKind stream) {
  if (t.defined() && t.numel() > 0) tracker_->end(t.data_ptr(), queue_of(stream));
}

void StrictTracking::host_access(const at::Tensor& t, Access a, const std::string& op) {
  if (t.defined() && t.numel() > 0) tracker_->access(t.data_ptr(), HazardTracker::kHost, a, op);
}

}  // namespace sluice::offload
