#include "offload/device/bounce_ring.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "runtime/fault_injection.h"

namespace sluice::offload {

BounceRing::BounceRing(DeviceBackend& device, uint32_t slots, uint64_t slot_bytes)
    : device_(device), slot_bytes_(slot_bytes), limit_(slots) {
  TORCH_CHECK(slots >= 1 && slot_bytes > 0, "BounceRing: need at least one slot of nonzero size");
  if (fault::triggered("host.pin.bounce")) return;
  for (uint32_t i = 0; i < slots; ++i) {
    at::Tensor pinned = device_.pin(at::empty({static_cast<int64_t>(slot_bytes)}, at::kByte));
    if (!pinned.defined() || !device_.is_pinned(pinned)) {
      slots_.clear();
      return;
    }
    slots_.push_back({std::move(pinned), device_.create_event()});
  }
}

// The next slot in turn is the oldest in flight. If its copy is not done, a new slot goes
// before it (while the limit allows) rather than the host waiting (Note [bounce ring sizing]).
BounceRing::Slot& BounceRing::take_slot() {
  if (!slots_[next_].done->query() && slots_.size() < limit_) {
    at::Tensor pinned = device_.pin(at::empty({static_cast<int64_t>(slot_bytes_)}, at::kByte));
    if (pinned.defined() && device_.is_pinned(pinned)) {
      slots_.insert(slots_.begin() + static_cast<std::ptrdiff_t>(next_), Slot{std::move(pinned), device_.create_event()});
    } else {
      limit_ = slots_.size();  // pinning more failed: wait from now on
    }
  }
  Slot& s = slots_[next_];
  next_ = (next_ + 1) % slots_.size();
  if (!s.done->query()) ++waits_;
  s.done->synchronize();  // FENCE(F8): the slot's previous copy has read it
  return s;
}

void BounceRing::copy(const at::Tensor& dst, const at::Tensor& src, const std::function<void()>& before) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes(),
              "BounceRing::copy: contiguous tensors of the same size expected");
  copy(dst, {Part{src, 0}}, before);
}

void BounceRing::copy(const at::Tensor& dst, const std::vector<Part>& parts, const std::function<void()>& before) {
  TORCH_CHECK(dst.is_contiguous(), "BounceRing::copy: a contiguous destination expected");
  const at::Tensor to = dst.reshape({-1}).view(at::kByte);
  uint64_t end = 0;
  for (const auto& p : parts) {
    TORCH_CHECK(p.host.is_contiguous(), "BounceRing::copy: contiguous parts expected");
    end = std::max<uint64_t>(end, p.offset + p.host.nbytes());
  }
  TORCH_CHECK(end <= to.nbytes(), "BounceRing::copy: a part ends past the destination");
  if (slots_.empty()) {
    bool first = true;
    for (const auto& p : parts) {
      if (p.host.nbytes() == 0) continue;
      device_.copy_to_device(to.narrow(0, static_cast<int64_t>(p.offset), static_cast<int64_t>(p.host.nbytes())),
                             p.host.reshape({-1}).view(at::kByte), first ? before : nullptr);
      first = false;
    }
    std::unique_ptr<DeviceEvent> done = device_.create_event();
    device_.record(*done, StreamKind::copy);
    done->synchronize();
    ++sync_copies_;
    return;
  }
  for (uint64_t off = 0; off < end; off += slot_bytes_) {
    const uint64_t len = std::min<uint64_t>(slot_bytes_, end - off);
    Slot& s = take_slot();
    device_.host_access(s.buffer, Access::write, "bounce slot fill");
    auto* slot = static_cast<uint8_t*>(s.buffer.data_ptr());
    for (const auto& p : parts) {
      const uint64_t a = std::max(off, p.offset), b = std::min(off + len, p.offset + p.host.nbytes());
      if (a >= b) continue;
      std::memcpy(slot + (a - off), static_cast<const uint8_t*>(p.host.data_ptr()) + (a - p.offset),
                  static_cast<size_t>(b - a));
    }
    device_.copy_to_device(to.narrow(0, static_cast<int64_t>(off), static_cast<int64_t>(len)),
                           s.buffer.narrow(0, 0, static_cast<int64_t>(len)), off == 0 ? before : nullptr);
    device_.record(*s.done, StreamKind::copy);
    ++copies_;
  }
}

}  // namespace sluice::offload
