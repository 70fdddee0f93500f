#include "offload/staging_ring.h"

#include <c10/util/Exception.h>

#include "runtime/logging.h"

namespace sluice::offload {

StagingRing::StagingRing(DeviceBackend& device, std::shared_ptr<MemoryLedger> budget, uint32_t slots,
                         uint64_t slot_bytes)
    : device_(device), budget_(std::move(budget)), slot_bytes_(slot_bytes) {
  TORCH_CHECK(slots >= 1 && slot_bytes > 0, "StagingRing: need at least one slot of nonzero size");
  slots_.reserve(slots);
  for (uint32_t i = 0; i < slots; ++i) slots_.push_back(make_slot());
}

// Slots may still be written by queued copies and read by queued compute: their uses are
// recorded (fill, StreamingEngine::release), so the allocator keeps them until those finish.
StagingRing::~StagingRing() = default;

StagingSlot StagingRing::make_slot() {
  StagingSlot s;
  s.buffer = device_.allocate({static_cast<int64_t>(slot_bytes_)}, at::kByte, MemoryKind::ring, "staging slot",
                              budget_);
  s.leases = std::make_shared<std::atomic<int>>(0);
  s.copy_done = device_.create_event();
  s.compute_done = device_.create_event();
  return s;
}

int StagingRing::find(int64_t layer, uint64_t epoch) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].layer == layer && slots_[i].epoch == epoch) return static_cast<int>(i);
  }
  return -1;
}

int StagingRing::pick(uint64_t epoch, bool keep_unconsumed) {
  for (size_t k = 0; k < slots_.size(); ++k) {
    const size_t i = (next_ + k) % slots_.size();
    const StagingSlot& s = slots_[i];
    if (s.leases->load() > 0) continue;
    if (keep_unconsumed && s.layer >= 0 && !s.consumed && s.epoch >= epoch) continue;
    next_ = (i + 1) % slots_.size();
    return static_cast<int>(i);
  }
  return -1;
}

void StagingRing::grow() { slots_.push_back(make_slot()); }

void StagingRing::fill(int index, int64_t layer, uint64_t epoch, const std::vector<SlotPart>& parts, DeviceEvent* start,
                       DeviceEvent* end, BounceRing* bounce) {
  StagingSlot& s = slots_.at(static_cast<size_t>(index));
  TORCH_INTERNAL_ASSERT(s.leases->load() == 0, "staging slot ", index, " picked while in use");
  // Until every part is enqueued the slot holds nothing usable: if an enqueue throws, no
  // find() may hand out its half-overwritten bytes as the layer it held before.
  s.layer = -1;
  s.consumed = true;
  device_.wait(StreamKind::copy, *s.compute_done);  // FENCE(F2): the slot's last reader is done
  if (start) device_.record(*start, StreamKind::copy);
  for (const auto& part : parts) {
    const uint64_t n = part.host.nbytes();
    TORCH_INTERNAL_ASSERT(part.offset + n <= slot_bytes_, "slot part out of bounds");
    at::Tensor dst = s.buffer.narrow(0, static_cast<int64_t>(part.offset), static_cast<int64_t>(n));
    at::Tensor src = part.host.reshape({-1}).view(at::kByte);
    auto leases = s.leases;
    auto violations = violations_;
    auto check = [leases, violations] {
      if (leases->load() > 0) violations->fetch_add(1);
    };
    if (bounce && !device_.is_pinned(src)) {
      bounce->copy(dst, src, check);
    } else {
      device_.copy_to_device(dst, src, check);
    }
    device_.record_use(dst, StreamKind::copy);  // FENCE(F4): a free of the ring waits for this copy
  }
  device_.record(*s.copy_done, StreamKind::copy);
  if (end) device_.record(*end, StreamKind::copy);
  s.layer = layer;
  s.epoch = epoch;
  s.consumed = false;
}

at::Tensor StagingRing::view(int index, uint64_t offset, at::ScalarType dtype, at::IntArrayRef sizes) const {
  const StagingSlot& s = slots_.at(static_cast<size_t>(index));
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const uint64_t n = static_cast<uint64_t>(numel) * c10::elementSize(dtype);
  TORCH_INTERNAL_ASSERT(offset % c10::elementSize(dtype) == 0 && offset + n <= slot_bytes_, "bad slot view");
  return s.buffer.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(n)).view(dtype).view(sizes);
}

void StagingRing::begin_use(int index) { slots_.at(static_cast<size_t>(index)).leases->fetch_add(1); }

void StagingRing::end_use(int index) noexcept {
  StagingSlot& s = slots_[static_cast<size_t>(index)];
  s.leases->fetch_sub(1);
  try {
    device_.record(*s.compute_done, StreamKind::compute);  // FENCE(F3): the next fill waits for this reader
  } catch (const std::exception& e) {
    // Cannot order the slot's reuse after this reader: wait for everything instead.
    log::error(std::string("staging ring: recording a release failed: ") + e.what());
    try {
      device_.synchronize();
    } catch (...) {
    }
  }
}

void StagingRing::invalidate() {
  for (auto& s : slots_) {
    s.layer = -1;
    s.consumed = true;
  }
}

}  // namespace sluice::offload
