#pragma once
// DeviceBackend: the few device operations the streaming engine needs, behind one small
// interface, so that the same engine runs on a real accelerator (torch_device.h) and on
// the CPU playing both host and device (cpu_device.h), where every invariant is testable.
// It is two parts, as c10 keeps them apart:
//  - DeviceAllocator (device_allocator.h): memory info and the allocator's statistics,
//    accounted allocation (Note [device accounting]), page-locked host memory, the record
//    of a stream's use of an allocation (Note [stream-safe frees]), and
//    Note [releasing cached memory];
//  - DeviceStreams (device_streams.h): the two streams, events, copies, waits, and the
//    access hooks through which the strict CPU device checks the order they make.
// A backend implements both. A component that needs one part only takes that part (the
// pinned arena takes a DeviceAllocator); the engine takes the whole DeviceBackend.
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "offload/device/device_allocator.h"
#include "offload/device/device_streams.h"
#include "offload/device/hazard_tracker.h"
#include "offload/device/memory_stats.h"

namespace sluice::offload {

class DeviceBackend : public DeviceAllocator, public DeviceStreams {
 public:
  DeviceBackend() = default;
  ~DeviceBackend() override;
};

// Loads the torch backend libraries SLUICE_DEVICE_LIBRARY names (once per process; later
// calls rethrow a failure as InvalidArgument naming the library). make_device() calls it.
void load_device_libraries();

// The backend for a --device value: "cpu" is the CPU device (cpu_device.h), anything else
// c10 parses ("cuda", "cuda:1", a device type a library in SLUICE_DEVICE_LIBRARY registered)
// the torch device (torch_device.h). Note [device libraries] in device.cpp. `total_memory` (0:
// query) is the device memory to report. Throws InvalidArgument naming `flag` for a value
// that is malformed or a device that is not available.
std::unique_ptr<DeviceBackend> make_device(std::string_view spec, uint64_t total_memory = 0,
                                           const std::string& flag = "--device");

}  // namespace sluice::offload
