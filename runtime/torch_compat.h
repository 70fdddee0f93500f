#pragma once
// torch's device APIs that moved between the torch releases sluice builds against
// (2.7.1 to 2.15.0, the versions frontends pin): the one place that knows which torch it
// was compiled with. No other file tests TORCH_VERSION_*.
//
// Note [torch compat]
// ~~~~~~~~~~~~~~~~~~~
// torch 2.10 has a device-generic allocator API: at::accelerator::getMemoryInfo,
// getDeviceStats, resetPeakStats, emptyCache, getDeviceCapability, and
// c10::getDeviceAllocator(type)->recordStream (2.9). sluice's device layer uses it, so one
// binary serves CUDA, ROCm and out-of-tree backends (the test accelerator).
// Before 2.10 (InvokeAI's CUDA pin is 2.7.1) those calls do not exist. There:
//  - memory_info: the runtime's own cudaMemGetInfo (or hipMemGetInfo), resolved at run
//    time from the library torch loaded, so no CUDA toolkit is needed to build;
//  - device_stats, reset_peak_stats, empty_cache: c10's CUDA caching allocator
//    (c10::cuda::CUDACachingAllocator, which ROCm builds of torch hipify in place), in a
//    build with CUDA sources (SLUICE_HAS_CUDA); without them, a c10::Error saying so,
//    which the device layer reports once as "unavailable";
//  - record_stream: torch's record_stream operator on a tensor that aliases the block
//    without owning it (the operator hands the block to the backend's caching allocator,
//    which looks it up by address and deleter, as its own recordStream does);
//  - reports_dtype: nothing answers; the caller takes the dtype to be supported.
// torch 2.11 added at::cpu::get_cpu_capabilities (torch's cpuinfo). Before it,
// cpu_capabilities reads /proc/cpuinfo and names each flag as torch's map does.
// Every function throws c10::Error when the device cannot answer; callers decide.
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <utility>

namespace sluice::torch_compat {

// A symbol of the CUDA (or HIP) runtime torch loaded, or nullptr: looked up in the process,
// then in the runtime libraries by name (a Python extension's dependencies are loaded
// RTLD_LOCAL, out of dlsym(RTLD_DEFAULT)'s reach).
void* find_runtime_symbol(const char* symbol);

// "2.11.0": the torch these headers came from (the version the binary was built against).
std::string built_torch_version();

// (free, total) bytes of the device, as cudaMemGetInfo.
std::pair<size_t, size_t> memory_info(c10::Device device);

struct AllocatorCounters {
  int64_t current_bytes = 0;   // allocated now, every pool
  int64_t peak_bytes = 0;      // the most allocated since the last reset_peak_stats
  int64_t reserved_bytes = 0;  // held by the caching allocator (allocated + cached)
};
AllocatorCounters device_stats(c10::Device device);
void reset_peak_stats(c10::Device device);
void empty_cache(c10::Device device);

// The backend's caching allocator must not reuse `block` (one of its own allocations)
// before the work queued on `stream` so far has run.
void record_stream(const c10::DataPtr& block, c10::Stream stream);

// The CPU as torch's cpuinfo sees it: its name ("AMD EPYC 9R14"; empty when unknown), its
// architecture ("x86_64", "aarch64") and the keys of torch's capability map that hold
// (avx2, avx512_bw, amx_bf16, neon, sve, ...).
struct CpuCapabilities {
  std::string name;
  std::string architecture;
  std::vector<std::string> flags;
  // x86 "cpu family" and "model" of the first processor ("25", "17"): the generation that a
  // cloud machine's name ("AMD EPYC") hides. Only cpu_capabilities_from() reads them (torch's
  // map has no such keys); empty elsewhere.
  std::string x86_family, x86_model;
  bool has(std::string_view key) const;
};
CpuCapabilities cpu_capabilities();
// The same from a cpuinfo file (x86 "flags", Arm "Features"), what cpu_capabilities()
// reads before torch 2.11; compiled on every torch, so that its tests run on each. The one
// reader of /proc/cpuinfo in sluice (runtime/hardware.cpp takes the x86 family from it).
CpuCapabilities cpu_capabilities_from(const std::string& cpuinfo_path);

// Whether the device reports `dtype` among the ones it computes; nullopt when it reports
// nothing (an older torch, or a backend without the query).
std::optional<bool> reports_dtype(c10::Device device, c10::ScalarType dtype);

}  // namespace sluice::torch_compat
