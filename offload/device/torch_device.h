#pragma once
// A real accelerator through c10's device-generic interfaces (VirtualGuardImpl streams,
// c10::Event, StreamGuard, non-blocking copy_). No CUDA headers: the same code serves
// ROCm builds, which report device type "cuda". It implements both parts of DeviceBackend
// (device.h); the access hooks stay no-ops.
//  - Compute stream: the caller's current stream on the device, read at every call, so a
//    host running the model under its own stream keeps working.
//  - Copy stream: one stream from the global pool, fixed for the backend's life.
//  - Events are created with timing enabled (EventFlag::BACKEND_DEFAULT), so elapsed_ms()
//    gives device-side times.
//  - Memory: free/total, the allocator's counters and cache release come from torch's
//    device-generic accelerator API (ATen/DeviceAccelerator.h: getMemoryInfo,
//    getDeviceStats, emptyCache), so CUDA and ROCm builds need no nvcc for them.
//  - allocate_pinned() takes exact-size page-locked memory from the driver
//    (cudaHostAlloc, or hipHostMalloc on ROCm, looked up at run time in the runtime that
//    torch loaded), not from ATen's caching host allocator (Note [pinned arena]); when
//    neither is loaded it warns once and returns nothing, so the caller stays pageable.
//
// Note [pinned memory on ROCm]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Many ROCm stalls and hangs reported against other offloaders trace back to pinned host
// memory. PinMode::auto_ pins on ROCm exactly as on CUDA (pins_memory() is true for every
// TorchDevice; nothing tells the two apart): ROCm users who see stalls or hangs should run
// with pinning off (`sluice run --pin-memory off`, pin_memory = "off" in the APIs), which
// sends every copy from pageable memory through the bounce ring (slower, correct).
//
// Tested by (on the torch test accelerator, tests/accel/, the PrivateUse1 device torch code
// runs on where no GPU is lent): tests/accel/test_accel.cpp ("accel: TorchDevice
// initialises the device before its first allocation", "accel: a recordStream keeps a block
// from reuse while the stream still writes it", "accel: copies from pageable memory block
// the host, from pinned memory they do not", "accel: events order streams, and elapsed time
// needs timing events that completed", "accel: out of memory is torch's OutOfMemoryError,
// and emptyCache hands the cache back"), tests/offload/device/test_device.cpp ("device: env
// device: the pinned arena gets exact-size page-locked chunks and streams from them"), and
// every `accel ...` ctest entry (the cases tagged [accel], tests/README.md: the engine, model
// cache, API, fault and LoRA tests through it).
#include <c10/core/Device.h>

#include <cstdint>
#include <memory>

#include "offload/device/device.h"

namespace sluice::offload {

struct TorchDeviceOptions {
  uint64_t total_memory = 0;               // device memory to report in bytes (free capped to it); 0: query
  bool high_priority_copy_stream = false;  // take the copy stream from the high-priority pool
};

// Throws InvalidArgument if `device` is the CPU or its backend is not available.
std::unique_ptr<DeviceBackend> make_torch_device(c10::Device device, const TorchDeviceOptions& options = {});

}  // namespace sluice::offload
