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
  size_t place = scratch_.size();  // where a new buffer goes: the first place a trim emptied, else the end
  for (size_t i = 0; i < scratch_.size(); ++i) {
    const Scratch& s = scratch_[i];
    if (!s.buffer.defined()) {
      place = std::min(place, i);
    } else if (!s.in_use && s.buffer.nbytes() >= bytes) {
      scratch_[i].in_use = true;
      return static_cast<int>(i);
    }
  }
  // More leases open at once than planned for (one): another buffer, of this lease's size
  // (a smaller layer than the largest needs less than the planned one), budget permitting;
  // later plans reserve it (Note [device extras]). The flag only once it is made: a failed
  // allocation made nothing beyond the plan.
  at::Tensor buffer = device_.allocate({static_cast<int64_t>(bytes)}, at::kByte, MemoryKind::scratch,
                                       "upcast scratch for a nested lease", budget_);
  beyond_plan = true;
  if (place == scratch_.size()) scratch_.emplace_back();
  scratch_[place] = {std::move(buffer), true};
  return static_cast<int>(place);
}

void ForwardBuffers::trim_scratch() {
  // Note [upcast scratch]: a buffer a lease still holds stays where it is (the lease has its
  // index); the free ones beyond the planned buffer go, leaving their places empty, and the
  // empty places at the end are removed.
  for (size_t i = 1; i < scratch_.size(); ++i) {
    if (!scratch_[i].in_use) scratch_[i].buffer = at::Tensor();
  }
  while (scratch_.size() > 1 && !scratch_.back().buffer.defined()) scratch_.pop_back();
}

uint64_t ForwardBuffers::beyond_plan_bytes() const {
  uint64_t beyond = ring_ ? ring_->overflow_bytes() : 0;
  for (size_t i = 1; i < scratch_.size(); ++i) {
    if (scratch_[i].buffer.defined()) beyond += scratch_[i].buffer.nbytes();
  }
  return beyond;
}

}  // namespace sluice::offload
