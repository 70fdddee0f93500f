#include "offload/device/staging_ring.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "runtime/logging.h"

namespace sluice::offload {

StagingRing::StagingRing(DeviceBackend& device, std::shared_ptr<MemoryLedger> budget, uint64_t capacity_bytes)
    : device_(device), budget_(std::move(budget)), capacity_(capacity_bytes) {
  TORCH_CHECK(capacity_bytes > 0, "StagingRing: the capacity must be nonzero");
  if (budget_) budget_->charge(MemoryKind::ring, capacity_, "staging ring");
  slots_ledger_ = std::make_shared<MemoryLedger>("staging ring", capacity_);
}

// Slots may still be written by queued copies and read by queued compute: their uses are
// recorded (fill, StreamingEngine::end_lease), so the allocator keeps them until those finish.
StagingRing::~StagingRing() {
  slots_.clear();
  if (budget_) budget_->release(MemoryKind::ring, capacity_);
}

void StagingRing::prepare(const std::vector<uint64_t>& sizes) {
  for (uint64_t b : sizes) {
    const uint64_t want = align_up(std::max<uint64_t>(b, 1));
    if (held_ + want > capacity_) break;
    make_slot(want, false);
  }
}

size_t StagingRing::live_slots() const {
  size_t n = 0;
  for (const auto& s : slots_) n += s.buffer.defined() ? 1 : 0;
  return n;
}

uint64_t StagingRing::bytes() const {
  uint64_t n = 0;
  for (const auto& s : slots_) n += s.bytes();
  return n;
}

int StagingRing::make_slot(uint64_t bytes, bool overflow) {
  size_t i = 0;
  while (i < slots_.size() && slots_[i].buffer.defined()) ++i;
  if (i == slots_.size()) {
    StagingSlot s;
    s.leases = std::make_shared<std::atomic<int>>(0);
    s.copy_done = device_.create_event();
    s.compute_done = device_.create_event();
    slots_.push_back(std::move(s));
  }
  StagingSlot& s = slots_[i];
  // Slots within the capacity live in the ring's reservation, counted by the ring's own
  // ledger until the device has really freed them (a freed slot may still be read by
  // queued work: Note [stream-safe frees]), so the device never holds more than the
  // reservation. Only overflow is charged to the budget.
  s.buffer = device_.allocate({static_cast<int64_t>(bytes)}, at::kByte, MemoryKind::ring,
                              overflow ? "staging slot beyond the ring" : "staging slot",
                              overflow ? budget_ : slots_ledger_);
  s.layer = -1;
  s.consumed = true;
  s.overflow = overflow;
  if (!overflow) held_ += bytes;
  return static_cast<int>(i);
}

void StagingRing::forget(StagingSlot& s) {
  if (s.layer >= 0 && !s.consumed) {
    wasted_copies_ += 1;
    wasted_bytes_ += s.copy_bytes;
  }
  s.layer = -1;
  s.occurrence = 0;
  s.consumed = true;
}

void StagingRing::release(StagingSlot& s) {
  forget(s);
  if (!s.overflow) held_ -= s.bytes();
  s.buffer = at::Tensor();  // the allocator waits for the uses recorded on it
  s.overflow = false;
}

int StagingRing::find(int64_t layer, uint64_t epoch, uint32_t occurrence) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    const StagingSlot& s = slots_[i];
    if (s.layer == layer && s.epoch == epoch && s.occurrence == occurrence && s.buffer.defined()) return static_cast<int>(i);
  }
  return -1;
}

int StagingRing::pick(uint64_t bytes, uint64_t epoch, bool keep_unconsumed) {
  const uint64_t want = align_up(std::max<uint64_t>(bytes, 1));
  auto is_free = [&](const StagingSlot& s) {
    if (!s.buffer.defined() || s.leases->load() > 0) return false;
    return !(keep_unconsumed && s.layer >= 0 && !s.consumed && s.epoch >= epoch);
  };
  for (auto& s : slots_) {
    if (s.overflow && s.buffer.defined() && s.leases->load() == 0) release(s);  // released overflow slots go
  }
  // 1. A free slot of exactly this size, least recently filled.
  int best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const StagingSlot& s = slots_[i];
    if (s.overflow || !is_free(s) || s.bytes() != want) continue;
    if (best < 0 || s.stamp < slots_[static_cast<size_t>(best)].stamp) best = static_cast<int>(i);
  }
  if (best >= 0) return best;
  // 2. Room for a new one (once the slots freed before are really gone).
  if (held_ + want <= capacity_ && slots_ledger_->current() + want <= capacity_) return make_slot(want, false);
  // 3. The smallest free slot that is larger.
  for (size_t i = 0; i < slots_.size(); ++i) {
    const StagingSlot& s = slots_[i];
    if (s.overflow || !is_free(s) || s.bytes() < want) continue;
    if (best < 0 || s.bytes() < slots_[static_cast<size_t>(best)].bytes()) best = static_cast<int>(i);
  }
  if (best >= 0) return best;
  // 4. Free slots of other sizes make room, least recently filled first.
  std::vector<size_t> victims;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (!slots_[i].overflow && is_free(slots_[i])) victims.push_back(i);
  }
  std::sort(victims.begin(), victims.end(), [&](size_t a, size_t b) { return slots_[a].stamp < slots_[b].stamp; });
  uint64_t freed = 0;
  size_t k = 0;
  while (k < victims.size() && held_ - freed + want > capacity_) freed += slots_[victims[k++]].bytes();
  if (held_ - freed + want > capacity_) return -1;
  for (size_t j = 0; j < k; ++j) release(slots_[victims[j]]);
  if (slots_ledger_->current() + want > capacity_) return -1;  // the freed slots are still in use on the device
  return make_slot(want, false);
}

int StagingRing::overflow(uint64_t bytes) { return make_slot(align_up(std::max<uint64_t>(bytes, 1)), true); }

void StagingRing::fill(int index, int64_t layer, uint64_t epoch, const std::vector<SlotPart>& parts, DeviceEvent* start,
                       DeviceEvent* end, BounceRing* bounce) {
  StagingSlot& s = slots_.at(static_cast<size_t>(index));
  TORCH_INTERNAL_ASSERT(s.buffer.defined() && s.leases->load() == 0, "staging slot ", index, " picked while in use");
  // Until every part is enqueued the slot holds nothing usable: if an enqueue throws, no
  // find() may hand out its half-overwritten bytes as the layer it held before.
  forget(s);
  const uint64_t slot_bytes = s.bytes();
  uint64_t copy_bytes = 0;
  device_.wait(StreamKind::copy, *s.compute_done);  // FENCE(F2): the slot's last reader is done
  if (start) device_.record(*start, StreamKind::copy);
  bool pageable = false;
  for (const auto& part : parts) pageable = pageable || (bounce && !device_.is_pinned(part.host));
  if (pageable) {
    // All parts gathered through the bounce ring (Note [bounce ring]).
    std::vector<BounceRing::Part> gathered;
    for (const auto& part : parts) {
      TORCH_INTERNAL_ASSERT(part.offset + part.host.nbytes() <= slot_bytes, "slot part out of bounds");
      copy_bytes += part.host.nbytes();
      gathered.push_back({part.host.reshape({-1}).view(at::kByte), part.offset});
    }
    auto leases = s.leases;
    auto violations = violations_;
    bounce->copy(s.buffer, gathered, [leases, violations] {
      if (leases->load() > 0) violations->fetch_add(1);
    });
    device_.record_use(s.buffer, StreamKind::copy);  // FENCE(F4): a free of the ring waits for this copy
  }
  for (const auto& part : pageable ? std::vector<SlotPart>{} : parts) {
    const uint64_t n = part.host.nbytes();
    TORCH_INTERNAL_ASSERT(part.offset + n <= slot_bytes, "slot part out of bounds");
    copy_bytes += n;
    at::Tensor dst = s.buffer.narrow(0, static_cast<int64_t>(part.offset), static_cast<int64_t>(n));
    at::Tensor src = part.host.reshape({-1}).view(at::kByte);
    auto leases = s.leases;
    auto violations = violations_;
    auto check = [leases, violations] {
      if (leases->load() > 0) violations->fetch_add(1);
    };
    device_.copy_to_device(dst, src, check);
    device_.record_use(dst, StreamKind::copy);  // FENCE(F4): a free of the ring waits for this copy
  }
  device_.record(*s.copy_done, StreamKind::copy);
  if (end) device_.record(*end, StreamKind::copy);
  s.layer = layer;
  s.epoch = epoch;
  s.copy_bytes = copy_bytes;
  s.stamp = ++stamp_;
  s.consumed = false;
}

at::Tensor StagingRing::view(int index, uint64_t offset, at::ScalarType dtype, at::IntArrayRef sizes) const {
  const StagingSlot& s = slots_.at(static_cast<size_t>(index));
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const uint64_t n = static_cast<uint64_t>(numel) * c10::elementSize(dtype);
  TORCH_INTERNAL_ASSERT(offset % c10::elementSize(dtype) == 0 && offset + n <= s.bytes(), "bad slot view");
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
  for (auto& s : slots_) forget(s);
}

void StagingRing::drop_unread(uint64_t epoch) {
  for (auto& s : slots_) {
    if (!s.consumed && s.epoch == epoch) forget(s);
  }
}

}  // namespace sluice::offload
