#include "offload/bounce_ring.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "runtime/fault_injection.h"

namespace sluice::offload {

BounceRing::BounceRing(DeviceBackend& device, uint32_t slots, uint64_t slot_bytes)
    : device_(device), slot_bytes_(slot_bytes) {
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

void BounceRing::copy(const at::Tensor& dst, const at::Tensor& src, const std::function<void()>& before) {
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes(),
              "BounceRing::copy: contiguous tensors of the same size expected");
  if (slots_.empty()) {
    device_.copy_to_device(dst, src, before);
    std::unique_ptr<DeviceEvent> done = device_.create_event();
    device_.record(*done, StreamKind::copy);
    done->synchronize();
    ++sync_copies_;
    return;
  }
  const auto n = static_cast<int64_t>(src.nbytes());
  const at::Tensor from = src.reshape({-1}).view(at::kByte);
  const at::Tensor to = dst.reshape({-1}).view(at::kByte);
  const auto* bytes = static_cast<const uint8_t*>(from.data_ptr());
  for (int64_t off = 0; off < n; off += static_cast<int64_t>(slot_bytes_)) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(slot_bytes_), n - off);
    Slot& s = slots_[next_];
    next_ = (next_ + 1) % slots_.size();
    s.done->synchronize();  // FENCE(F8): the slot's previous copy has read it
    device_.host_access(s.buffer, Access::write, "bounce slot fill");
    std::memcpy(s.buffer.data_ptr(), bytes + off, static_cast<size_t>(len));
    device_.copy_to_device(to.narrow(0, off, len), s.buffer.narrow(0, 0, len), off == 0 ? before : nullptr);
    device_.record(*s.done, StreamKind::copy);
    ++copies_;
  }
}

}  // namespace sluice::offload
