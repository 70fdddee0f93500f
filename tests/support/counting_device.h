#pragma once
// CountingDevice: a DeviceBackend over another one (a CPU device) that counts what the
// engine asks of the allocator and can play activations, for tests of what the engine
// does with the allocator rather than with copies:
//  - release_cached_memory() calls are counted (Note [releasing cached memory]);
//  - activations(): bytes a forward's activations hold on the device now. They are what a
//    GPU's caching allocator hands to ATen ops during a forward: counted in
//    allocator_stats() (current and peak) but in no ledger, since nothing of sluice
//    allocated them (Note [measured working memory] in offload/engine/model_budget.h).
// Everything else is the inner device's: its allocations, streams, events and hazard
// checks (hazard_tracker() of the inner device still works).
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>

#include "offload/device/device.h"

namespace sluice::testing {

class CountingDevice final : public offload::DeviceBackend {
 public:
  explicit CountingDevice(std::shared_ptr<offload::DeviceBackend> inner) : inner_(std::move(inner)) {}

  offload::DeviceBackend& inner() { return *inner_; }
  int release_calls() const { return release_calls_.load(); }

  // The activations alive now grow (positive) or shrink (negative) by `bytes`.
  void activations(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    activations_ += bytes;
    activations_peak_ = std::max(activations_peak_, activations_);
  }

  c10::Device device() const override { return inner_->device(); }
  DeviceMemoryInfo memory_info() const override { return inner_->memory_info(); }
  AllocatorStats allocator_stats() const override {
    AllocatorStats a = inner_->allocator_stats();
    std::lock_guard<std::mutex> lock(mutex_);
    // The inner peak and the activations' peak may fall at different times: their sum
    // bounds the true peak from above, as a caching allocator's rounding does.
    a.current_bytes += activations_;
    a.peak_bytes += activations_peak_;
    a.reserved_bytes += activations_;
    return a;
  }
  void reset_allocator_peak() override {
    inner_->reset_allocator_peak();
    std::lock_guard<std::mutex> lock(mutex_);
    activations_peak_ = activations_;
  }
  void release_cached_memory() override {
    release_calls_.fetch_add(1);
    inner_->release_cached_memory();
  }
  bool pins_memory() const override { return inner_->pins_memory(); }
  std::unique_ptr<offload::DeviceEvent> create_event() override { return inner_->create_event(); }
  void record(offload::DeviceEvent& event, offload::StreamKind stream) override { inner_->record(event, stream); }
  void wait(offload::StreamKind stream, const offload::DeviceEvent& event) override { inner_->wait(stream, event); }
  double elapsed_ms(const offload::DeviceEvent& from, const offload::DeviceEvent& to) const override {
    return inner_->elapsed_ms(from, to);
  }
  void copy_to_device(const at::Tensor& dst, const at::Tensor& src, std::function<void()> before) override {
    inner_->copy_to_device(dst, src, std::move(before));
  }
  void synchronize() override { inner_->synchronize(); }
  c10::DataPtr allocate_pinned(size_t bytes) override { return inner_->allocate_pinned(bytes); }
  bool is_pinned(const at::Tensor& src) const override { return inner_->is_pinned(src); }
  uint64_t compute_stream_id() const override { return inner_->compute_stream_id(); }
  void begin_access(const at::Tensor& t, offload::StreamKind stream, offload::Access a, const std::string& op) override {
    inner_->begin_access(t, stream, a, op);
  }
  void end_access(const at::Tensor& t, offload::StreamKind stream) override { inner_->end_access(t, stream); }
  void host_access(const at::Tensor& t, offload::Access a, const std::string& op) override {
    inner_->host_access(t, a, op);
  }

 protected:
  c10::DataPtr raw_allocate(size_t nbytes, const std::string& what) override {
    auto* t = new at::Tensor(inner_->allocate({static_cast<int64_t>(nbytes)}, at::kByte, offload::MemoryKind::scratch, what));
    return c10::DataPtr(t->data_ptr(), t, [](void* ctx) { delete static_cast<at::Tensor*>(ctx); }, inner_->device());
  }
  void record_stream(const c10::DataPtr& raw, offload::StreamKind stream) override {
    inner_->record_use(*static_cast<at::Tensor*>(raw.get_context()), stream);
  }

 private:
  std::shared_ptr<offload::DeviceBackend> inner_;
  std::atomic<int> release_calls_{0};
  mutable std::mutex mutex_;
  int64_t activations_ = 0, activations_peak_ = 0;
};

}  // namespace sluice::testing
