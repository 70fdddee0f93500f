#include "offload/device/torch_device.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <string>

#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"
#include "runtime/torch_compat.h"

namespace sluice::offload {

namespace {

// The driver's page-locked host allocation, resolved at run time: torch_cuda (or
// torch_hip) has loaded the runtime already, so sluice needs no CUDA or HIP at build time
// and the same binary serves both. cudaHostAlloc(void**, size_t, unsigned) and
// hipHostMalloc have the same shape; both return 0 on success.
struct HostAllocApi {
  int (*alloc)(void**, size_t, unsigned) = nullptr;
  int (*free)(void*) = nullptr;   // cudaFreeHost / hipHostFree
  int (*clear_error)() = nullptr;  // cudaGetLastError / hipGetLastError
  std::string alloc_name;
};
constexpr unsigned kHostAllocPortable = 1;  // cudaHostAllocPortable == hipHostMallocPortable: pinned for every context

const HostAllocApi& host_alloc_api() {
  static const HostAllocApi api = [] {
    HostAllocApi a;
    // hipHostAlloc: the name newer ROCm releases keep once hipHostMalloc is retired.
    const char* names[3][3] = {{"cudaHostAlloc", "cudaFreeHost", "cudaGetLastError"},
                               {"hipHostMalloc", "hipHostFree", "hipGetLastError"},
                               {"hipHostAlloc", "hipHostFree", "hipGetLastError"}};
    for (const auto& n : names) {
      void* alloc = torch_compat::find_runtime_symbol(n[0]);
      void* free = torch_compat::find_runtime_symbol(n[1]);
      if (!alloc || !free) continue;
      a.alloc = reinterpret_cast<int (*)(void**, size_t, unsigned)>(alloc);
      a.free = reinterpret_cast<int (*)(void*)>(free);
      a.clear_error = reinterpret_cast<int (*)()>(torch_compat::find_runtime_symbol(n[2]));
      a.alloc_name = n[0];
      break;
    }
    return a;
  }();
  return api;
}

// The deleter of allocate_pinned()'s memory (a free that fails leaks nothing worse than
// the failure itself: nothing to do but drop the error).
void free_pinned(void* p) {
  if (host_alloc_api().free(p) != 0 && host_alloc_api().clear_error) host_alloc_api().clear_error();
}

class TorchEvent final : public DeviceEvent {
 public:
  explicit TorchEvent(c10::DeviceType type) : event(type, c10::EventFlag::BACKEND_DEFAULT) {}
  bool query() const override { return event.query(); }
  void synchronize() const override { event.synchronize(); }
  c10::Event event;
};

c10::Event& event_of(DeviceEvent& e) {
  auto* te = dynamic_cast<TorchEvent*>(&e);
  TORCH_INTERNAL_ASSERT(te, "torch device given an event it did not create");
  return te->event;
}

const c10::Event& event_of(const DeviceEvent& e) { return event_of(const_cast<DeviceEvent&>(e)); }

// Note [lazy device init]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// torch initialises a device lazily, in the tensor factories.
// Until then CUDA's (and HIP's) caching allocator refuses to allocate ("Allocator not
// initialized for device 0: did you call init?"), getDeviceStats throws and no pointer
// reads as pinned, while getMemoryInfo, the stream pool and emptyCache work. sluice
// allocates through the allocator directly, so it initialises the device itself, first.
c10::DeviceType initialized(c10::DeviceType type) {
  at::globalContext().lazyInitDevice(type);
  return type;
}

class TorchDevice final : public DeviceBackend {
 public:
  TorchDevice(c10::Device device, const TorchDeviceOptions& options)
      : impl_(initialized(device.type())),
        device_(device.has_index() ? device : c10::Device(device.type(), impl_.getDevice().index())),
        copy_stream_(impl_.getStreamFromGlobalPool(device_, options.high_priority_copy_stream)),
        total_override_(static_cast<int64_t>(options.total_memory)) {}

  ~TorchDevice() override {
    try {
      synchronize();
    } catch (...) {
    }
  }

  // DeviceAllocator

  c10::Device device() const override { return device_; }
  // Through torch's device-generic accelerator API (CUDA and ROCm alike, nvcc or not; before
  // torch 2.10, Note [torch compat]).
  // It serves the build's one accelerator: any other device type has no numbers.
  DeviceMemoryInfo memory_info() const override {
    DeviceMemoryInfo info;
    if (is_accelerator()) {
      try {
        c10::DeviceGuard guard(device_);
        const auto [free_bytes, total_bytes] = torch_compat::memory_info(device_);
        info = {static_cast<int64_t>(free_bytes), static_cast<int64_t>(total_bytes)};
      } catch (const c10::Error& e) {
        warn_once(memory_warned_, "memory query", e);
      }
    }
    if (total_override_ > 0) {  // TorchDeviceOptions::total_memory: a smaller device
      info.total_bytes = total_override_;
      info.free_bytes = info.free_bytes > 0 ? std::min(info.free_bytes, total_override_) : total_override_;
    }
    return info;
  }

  AllocatorStats allocator_stats() const override {
    if (!is_accelerator()) return {};
    try {
      const torch_compat::AllocatorCounters s = torch_compat::device_stats(device_);
      AllocatorStats out;
      out.available = true;
      out.current_bytes = s.current_bytes;
      out.peak_bytes = s.peak_bytes;
      out.reserved_bytes = s.reserved_bytes;
      return out;
    } catch (const c10::Error& e) {
      warn_once(stats_warned_, "allocator statistics", e);
      return {};
    }
  }

  void reset_allocator_peak() override {
    if (!is_accelerator()) return;
    try {
      torch_compat::reset_peak_stats(device_);
    } catch (const c10::Error& e) {
      warn_once(stats_warned_, "allocator statistics", e);
    }
  }

  void release_cached_memory() override {
    if (!is_accelerator()) return;
    try {
      torch_compat::empty_cache(device_);
    } catch (const c10::Error& e) {
      warn_once(empty_warned_, "emptyCache", e);
    }
  }
  bool pins_memory() const override { return true; }

  // Asked of this device's type, not of whichever accelerator torch would pick.
  bool is_pinned(const at::Tensor& src) const override {
    return at::globalContext().isPinnedPtr(src.storage().data(), device_.type());
  }

  // Exact-size page-locked memory straight from the driver (Note [pinned arena]).
  // An out-of-tree backend (PrivateUse1, such as the test accelerator) has no driver call
  // sluice knows: its hooks' pinned allocator, whose exact size is that backend's contract.
  c10::DataPtr allocate_pinned(size_t bytes) override {
    if (device_.type() == c10::DeviceType::PrivateUse1) {
      try {
        return at::globalContext().getPinnedMemoryAllocator(device_.type())->allocate(std::max<size_t>(bytes, 1));
      } catch (const c10::Error& e) {
        log::debug(name() + ": pinned allocation of " + std::to_string(bytes) + " bytes failed: " +
                   e.what_without_backtrace());
        return {};
      }
    }
    const HostAllocApi& api = host_alloc_api();
    if (!api.alloc) {
      if (!pin_warned_.exchange(true)) {
        log::warn(name() + ": neither cudaHostAlloc nor hipHostMalloc is loaded in this process: host memory "
                  "cannot be page-locked, streamed layers stay in pageable memory");
      }
      return {};
    }
    c10::DeviceGuard guard(device_);
    void* p = nullptr;
    if (api.alloc(&p, std::max<size_t>(bytes, 1), kHostAllocPortable) != 0 || !p) {
      if (api.clear_error) api.clear_error();  // not sticky: keep it from torch's next error check
      log::debug(name() + ": " + api.alloc_name + " of " + std::to_string(bytes) + " bytes failed");
      return {};
    }
    return c10::DataPtr(p, p, &free_pinned, c10::Device(c10::kCPU));
  }

  // DeviceStreams (the access hooks keep their no-ops: nothing here checks them)

  uint64_t compute_stream_id() const override { return static_cast<uint64_t>(impl_.getStream(device_).id()); }

  std::unique_ptr<DeviceEvent> create_event() override { return std::make_unique<TorchEvent>(device_.type()); }

  void record(DeviceEvent& event, StreamKind stream) override { event_of(event).record(stream_of(stream)); }

  void wait(StreamKind stream, const DeviceEvent& event) override { event_of(event).block(stream_of(stream)); }

  double elapsed_ms(const DeviceEvent& from, const DeviceEvent& to) const override {
    return event_of(from).elapsedTime(event_of(to));
  }

  void copy_to_device(const at::Tensor& dst, const at::Tensor& src, std::function<void()> /*before*/) override {
    TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_to_device: tensors must be contiguous");
    TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel(),
                "copy_to_device: dtype/numel mismatch");
    // No asynchronous failure can be injected into a real stream: every copy fault point
    // fails the enqueue here, which is also where the driver reports a failing copy.
    for (const char* point : {"copy.h2d.enqueue", "copy.h2d", "copy.h2d.timeout"}) {
      if (fault::triggered(point)) {
        throw DeviceError(name() + ": host->device copy of " + std::to_string(src.nbytes()) +
                          " bytes failed (injected fault " + point + ")");
      }
    }
    c10::StreamGuard guard(copy_stream_);
    // Asynchronous from pinned memory; from pageable memory the driver stages it (still
    // correct, ordered on the copy stream).
    try {
      dst.copy_(src, /*non_blocking=*/true);
    } catch (const c10::Error& e) {
      throw DeviceError(name() + ": host->device copy of " + std::to_string(src.nbytes()) +
                        " bytes failed: " + e.what_without_backtrace());
    }
  }

  void synchronize() override {
    try {
      impl_.synchronizeStream(copy_stream_);
      impl_.synchronizeStream(impl_.getStream(device_));
    } catch (const c10::Error& e) {
      // An asynchronous failure (a copy that failed or timed out) surfaces here.
      throw DeviceError(name() + ": synchronize failed: " + e.what_without_backtrace());
    }
  }

 protected:
  // DeviceAllocator's allocation hooks.
  c10::DataPtr raw_allocate(size_t nbytes, const std::string& /*what*/) override {
    c10::DeviceGuard guard(device_);
    c10::Allocator* allocator = c10::GetAllocator(device_.type());
    TORCH_CHECK(allocator, "no allocator registered for ", device_);
    return allocator->allocate(nbytes);
  }

  // Note [stream-safe frees]: the caching allocator's own recordStream, on the raw block
  // (the tensor allocate() returns wraps it in a context the allocator does not know).
  void record_stream(const c10::DataPtr& raw, StreamKind stream) override {
    torch_compat::record_stream(raw, stream_of(stream));
  }

 private:
  c10::Stream stream_of(StreamKind kind) const {
    return kind == StreamKind::copy ? copy_stream_ : impl_.getStream(device_);
  }

  bool is_accelerator() const { return at::accelerator::getAccelerator(false) == device_.type(); }

  void warn_once(std::atomic<bool>& warned, const char* what, const c10::Error& e) const {
    if (!warned.exchange(true)) {
      log::warn(name() + ": " + what + " unavailable: " + e.what_without_backtrace());
    }
  }

  c10::impl::VirtualGuardImpl impl_;
  c10::Device device_;
  c10::Stream copy_stream_;
  int64_t total_override_;
  mutable std::atomic<bool> memory_warned_{false}, stats_warned_{false}, empty_warned_{false};
  std::atomic<bool> pin_warned_{false};
};

}  // namespace

std::unique_ptr<DeviceBackend> make_torch_device(c10::Device device, const TorchDeviceOptions& options) {
  if (device.is_cpu()) throw InvalidArgument("make_torch_device: use make_cpu_device for the CPU");
  try {
    return std::make_unique<TorchDevice>(device, options);
  } catch (const c10::Error& e) {
    // One line: torch's text goes on with debugging advice (CUDA_LAUNCH_BLOCKING, ...).
    std::string why = e.what_without_backtrace();
    why = why.substr(0, why.find('\n'));
    throw InvalidArgument("device " + device.str() + " is not available: " + why);
  }
}

}  // namespace sluice::offload
