#include "offload/device/device.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "offload/device/cpu_device.h"
#include "offload/device/torch_device.h"
#include "runtime/error.h"

namespace sluice::offload {

// Out of line, so that the classes' vtables and type info are emitted once (DeviceAllocator's
// destructor is in device_allocator.cpp, with its ledger).
DeviceStreams::~DeviceStreams() = default;

DeviceBackend::~DeviceBackend() = default;

// Note [device libraries]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// SLUICE_DEVICE_LIBRARY names torch backend libraries (':'
// between several) to load before the first torch device is made, read once. Loading one
// registers its device type with torch (the test accelerator, tests/accel/, registers
// "testaccel"), so "--device testaccel" then parses like "cuda".
void load_device_libraries() {
  static const std::string error = [] {
    const char* env = std::getenv("SLUICE_DEVICE_LIBRARY");
    if (!env || !*env) return std::string();
    std::stringstream paths(env);
    std::string path;
    while (std::getline(paths, path, ':')) {
      if (path.empty()) continue;
      if (!dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
        const char* why = dlerror();
        return "SLUICE_DEVICE_LIBRARY: cannot load '" + path + "': " + (why ? why : "unknown error");
      }
    }
    return std::string();
  }();
  if (!error.empty()) throw InvalidArgument(error);
}

std::unique_ptr<DeviceBackend> make_device(std::string_view spec, uint64_t total_memory, const std::string& flag) {
  if (spec == "cpu") {
    CpuDeviceOptions o;
    o.total_memory = total_memory;
    return make_cpu_device(o);
  }
  load_device_libraries();
  std::optional<c10::Device> device;
  try {
    device = c10::Device(std::string(spec));
  } catch (const c10::Error&) {
    throw InvalidArgument(flag + ": unknown device '" + std::string(spec) + "' (use cpu, cuda or cuda:N)");
  }
  if (device->is_cpu()) return make_device("cpu", total_memory, flag);
  if (device->is_cuda()) {
    // As the CLI says it (cli/options.cpp, resolve_device), in one line: torch's own error
    // for a missing CUDA device runs to five lines of debugging advice.
    const int count = at::hasCUDA() ? static_cast<int>(at::getNumGPUs()) : 0;
    if (count == 0)
      throw InvalidArgument(flag + ": '" + std::string(spec) + "' requested but no CUDA/ROCm device is available");
    if (device->has_index() && device->index() >= count)
      throw InvalidArgument(flag + ": device '" + std::string(spec) + "' does not exist (" + std::to_string(count) +
                            " device(s) visible)");
  }
  TorchDeviceOptions o;
  o.total_memory = total_memory;
  try {
    return make_torch_device(*device, o);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(flag + ": " + e.what());
  }
}

}  // namespace sluice::offload
