#include "offload/engine/forward_buffers.h"

#include <algorithm>

namespace sluice::offload {

void ForwardBuffers::begin_model(std::shared_ptr<MemoryLedger> budget, uint64_t scratch_bytes) {
  budget_ = std::move(budget);
  scratch_bytes_ = scratch_bytes;
  if (scratch_bytes_) {
    scratch_.push_back({device_.allocate({static_cast<int64_t>(scratch_bytes_)}, at::kByte, MemoryKind::scratch,
                                         "upcast scratch", budget_),
                        false});
  }
}

void ForwardBuffers::end_model() noexcept {
  retire_ring();
  scratch_.clear();
  scratch_bytes_ = 0;
  budget_.reset();
}

void ForwardBuffers::make_ring(uint64_t capacity, const std::vector<LayerRecord>& layers) {
  retire_ring();
  auto ring = std::make_unique<StagingRing>(device_, budget_, capacity);
  // The first slots now, in execution order: an allocation failure surfaces here.
  std::vector<uint64_t> sizes;
  for (const auto& r : layers) {
    if (!r.resident) sizes.push_back(r.slot_bytes);
  }
  ring->prepare(sizes);
  ring_ = std::move(ring);
}

bool ForwardBuffers::retire_ring() noexcept {
  if (!ring_) return false;
  ring_->invalidate();
  violations_ += ring_->violations();
  wasted_copies_ += ring_->wasted_copies();
  wasted_bytes_ += ring_->wasted_bytes();
  ring_.reset();
  return true;
}

uint64_t ForwardBuffers::unmade_ring_bytes() const {
  return ring_ ? ring_->capacity() - std::min(ring_->capacity(), ring_->bytes()) : 0;
}

int ForwardBuffers::take_scratch(uint64_t bytes, bool& beyond_plan) {
  for (size_t i = 0; i < scratch_.size(); ++i) {
    if (!scratch_[i].in_use && scratch_[i].buffer.nbytes() >= bytes) {
      scratch_[i].in_use = true;
      return static_cast<int>(i);
    }
  }
  // More leases open at once than planned for (one): another buffer, budget permitting;
  // later plans reserve it (Note [device extras]).
  beyond_plan = true;
  scratch_.push_back({device_.allocate({static_cast<int64_t>(scratch_bytes_)}, at::kByte, MemoryKind::scratch,
                                       "upcast scratch for a nested lease", budget_),
                      true});
  return static_cast<int>(scratch_.size()) - 1;
}

void ForwardBuffers::trim_scratch() {
  while (scratch_.size() > 1) scratch_.pop_back();
}

uint64_t ForwardBuffers::beyond_plan_bytes() const {
  uint64_t beyond = ring_ ? ring_->overflow_bytes() : 0;
  for (size_t i = 1; i < scratch_.size(); ++i) beyond += scratch_[i].buffer.nbytes();
  return beyond;
}

}  // namespace sluice::offload
