#pragma once
// The device that the device-generic test cases run on: the environment variable
// SLUICE_TEST_DEVICE, "cpu" (the default: the CPU-as-device backend), "cuda", "cuda:N" or
// "testaccel" (the torch test accelerator, tests/accel/, with SLUICE_DEVICE_LIBRARY naming
// its library, as ctest's "accel ..." entries set both). bench/gpu/device_all.sh sets it to
// cuda on a GPU machine. When the named accelerator is not available here, each [env-device]
// case warns once and returns (a clean skip: Catch2 v2 has no SKIP).
//
// These cases compare only results computed on the same device (streamed against fully
// resident), never against a host reference, so they hold on any backend.
#include <ATen/Context.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <memory>
#include <string>

#include "offload/device/cpu_device.h"
#include "offload/device/device.h"

namespace sluice::testing {

inline std::string test_device_spec() {
  const char* s = std::getenv("SLUICE_TEST_DEVICE");
  return s && *s ? std::string(s) : std::string("cpu");
}

// The backend SLUICE_TEST_DEVICE names, or null when it names an accelerator this process
// cannot use (no CUDA/ROCm device, or a CPU-only libtorch).
inline std::shared_ptr<offload::DeviceBackend> test_device() {
  const std::string spec = test_device_spec();
  if (spec == "cpu") return std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device());
  if (spec.rfind("cuda", 0) == 0 && !at::hasCUDA()) return nullptr;
  return std::shared_ptr<offload::DeviceBackend>(offload::make_device(spec, 0, "SLUICE_TEST_DEVICE"));
}

// Whether SLUICE_TEST_DEVICE names a device other than the CPU device: tests that are
// device-generic then run on it (test_device_or_cpu()).
inline bool testing_torch_device() { return test_device_spec() != "cpu"; }

// The device for device-generic tests: the SLUICE_TEST_DEVICE device when one is named
// (it must then be available), else a CPU device made with `cpu_options`.
inline std::shared_ptr<offload::DeviceBackend> test_device_or_cpu(const offload::CpuDeviceOptions& cpu_options = {}) {
  if (!testing_torch_device()) return std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device(cpu_options));
  auto dev = test_device();
  REQUIRE(dev);
  return dev;
}

// The most device memory an allocator may have handed out under a weights limit: the CPU
// device's allocator sees only what sluice allocates, a torch device's also the forward's
// activations (and its block rounding), which the working memory beside the limit is for.
inline uint64_t allocator_bound(const offload::DeviceBackend& dev, uint64_t weights_limit, uint64_t working_memory) {
  return weights_limit + (dev.device().is_cpu() ? 0 : working_memory);
}

}  // namespace sluice::testing

// Declares `var`, the test device, or skips the test case when it is unavailable.
#define SLUICE_TEST_DEVICE_OR_SKIP(var)                                                               \
  auto var = ::sluice::testing::test_device();                                                        \
  if (!var) {                                                                                         \
    WARN("SLUICE_TEST_DEVICE=" << ::sluice::testing::test_device_spec() << " is not available: skipped"); \
    return;                                                                                           \
  }                                                                                                   \
  INFO("device " << var->name())
