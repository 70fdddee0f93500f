// Registers the test accelerator with torch as its PrivateUse1 backend "testaccel": the
// device guard (streams, events), the hooks (lazy init, pinned memory) and the device
// allocator. Loading this library (dlopen, SLUICE_DEVICE_LIBRARY) is all it takes; the
// kernels register themselves in kernels.cpp. Note [test accelerator contracts] in
// runtime.h says what it enforces.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceCapability.h>
#include <c10/core/DeviceType.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "tests/accel/runtime.h"

namespace sluice::accel {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

// c10::Event keeps a void*; ours owns a shared_ptr so that queued work can outlive it.
using EventHandle = std::shared_ptr<Event>;

EventHandle& handle(void* event) { return *static_cast<EventHandle*>(event); }

class GuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    check(d);
    return {kType, 0};
  }
  c10::Device getDevice() const override { return {kType, 0}; }
  void setDevice(c10::Device d) const override { check(d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override { return stream(d, current_stream()); }
  c10::Stream getDefaultStream(c10::Device d) const override { return stream(d, 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return stream(d, pool_stream()); }
  c10::Stream getNewStream(c10::Device d, int) const override { return stream(d, new_stream()); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::Stream old = stream(s.device(), current_stream());
    set_current_stream(s.id());
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }

  void record(void** event, const c10::Stream& s, const c10::DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == s.device_index(), "testaccel: event device index ",
                static_cast<int>(device_index), " does not match the recording stream's device ",
                static_cast<int>(s.device_index()));
    if (!*event) *event = new EventHandle(std::make_shared<Event>(flag == c10::EventFlag::BACKEND_DEFAULT));
    record_event(handle(*event), s.id());
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event) block_on_event(handle(event), s.id());
  }
  bool queryEvent(void* event) const override { return !event || query_event(handle(event)); }
  void synchronizeEvent(void* event) const override {
    if (event) synchronize_event(handle(event));
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<EventHandle*>(event);
  }
  double elapsedTime(void* from, void* to, const c10::DeviceIndex) const override {
    TORCH_CHECK(from && to, "testaccel: both events must be recorded before calculating elapsed time");
    return elapsed_ms(handle(from), handle(to));
  }
  bool queryStream(const c10::Stream& s) const override { return query_stream(s.id()); }
  void synchronizeStream(const c10::Stream& s) const override { synchronize_stream(s.id()); }
  void synchronizeDevice(const c10::DeviceIndex) const override { synchronize_device(); }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& s) const override {
    device_allocator().recordStream(data_ptr, s);
  }
  // Every dtype, less those named in SLUICE_TEST_ACCEL_NO_DTYPES (read at each call, e.g.
  // "BFloat16" plays a GPU before Ampere): how sluice's `compute auto` asks a backend.
  c10::DeviceCapability getDeviceCapability(c10::Device d) const override {
    check(d);
    c10::DeviceCapability cap;
    const char* no = std::getenv("SLUICE_TEST_ACCEL_NO_DTYPES");
    const std::string list = no ? no : "";
    if (list.find("BFloat16") != std::string::npos) cap.capability_data.supported_scalar_types.has_BFloat16 = 0;
    if (list.find("Half") != std::string::npos) cap.capability_data.supported_scalar_types.has_Half = 0;
    return cap;
  }

 private:
  static void check(c10::Device d) {
    TORCH_CHECK(d.type() == kType && (!d.has_index() || d.index() == 0), "testaccel: there is one device (",
                kBackendName, ":0); asked for ", d.str());
  }
  static c10::Stream stream(c10::Device d, StreamId id) {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kType, d.has_index() ? d.index() : 0), id);
  }
};

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  void init() const override { initialize(); }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return initialized(); }
  c10::DeviceIndex deviceCount() const override { return 1; }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator(); }
  at::Device getDeviceFromPtr(void*) const override { return {kType, 0}; }
  // Random numbers are drawn by the CPU kernels (fallback), so the device's generator is a
  // CPU one: at::manual_seed seeds it like CUDA's, and operators given it draw from it.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    static const at::Generator generator = at::detail::createCPUGenerator();
    return generator;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl)

const bool kRegistered = [] {
  c10::register_privateuse1_backend(kBackendName);
  c10::SetAllocator(kType, &device_allocator());
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

}  // namespace
}  // namespace sluice::accel
