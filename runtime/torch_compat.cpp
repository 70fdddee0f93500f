#include "runtime/torch_compat.h"

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/Utils.h>
#include <ATen/ops/record_stream.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <sys/utsname.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 11
#define SLUICE_TORCH_CPU_CAPABILITIES 0
#else
#define SLUICE_TORCH_CPU_CAPABILITIES 1
#endif

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 10
#define SLUICE_TORCH_GENERIC_ALLOCATOR 0
#ifdef SLUICE_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif
#else
#define SLUICE_TORCH_GENERIC_ALLOCATOR 1
#endif

namespace sluice::torch_compat {

std::string built_torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

void* find_runtime_symbol(const char* symbol) {
  if (void* p = dlsym(RTLD_DEFAULT, symbol)) return p;
  // Loaded with RTLD_LOCAL (a Python extension's dependencies): look in the runtime itself.
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so",
                          "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so"}) {
    if (void* h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD)) {
      void* p = dlsym(h, symbol);
      dlclose(h);  // RTLD_NOLOAD took a reference; the library stays loaded by its owner
      if (p) return p;
    }
  }
  return nullptr;
}

bool CpuCapabilities::has(std::string_view key) const {
  return std::find(flags.begin(), flags.end(), key) != flags.end();
}

CpuCapabilities cpu_capabilities_from(const std::string& cpuinfo_path) {
  // Linux's flag (x86 "flags", Arm "Features") -> torch's key.
  static constexpr std::pair<const char*, const char*> kNames[] = {
      {"avx", "avx"},           {"avx2", "avx2"},           {"fma", "fma3"},
      {"f16c", "f16c"},         {"avx512f", "avx512_f"},    {"avx512bw", "avx512_bw"},
      {"avx512cd", "avx512_cd"}, {"avx512dq", "avx512_dq"}, {"avx512vl", "avx512_vl"},
      {"avx512_vnni", "avx512_vnni"}, {"avx512_bf16", "avx512_bf16"}, {"avx512_fp16", "avx512_fp16"},
      {"avx_vnni", "avx_vnni"}, {"avx_ne_convert", "avx_ne_convert"}, {"amx_tile", "amx_tile"},
      {"amx_bf16", "amx_bf16"}, {"amx_int8", "amx_int8"}, {"amx_fp16", "amx_fp16"},
      {"asimd", "neon"},        {"asimddp", "dot"},         {"i8mm", "i8mm"},
      {"asimdhp", "fp16_arith"}, {"bf16", "bf16"},          {"sve", "sve"},
      {"sve2", "sve2"},         {"svebf16", "sve_bf16"},    {"sme", "sme"},
      {"sme2", "sme2"}};
  CpuCapabilities out;
  utsname u{};
  if (uname(&u) == 0) out.architecture = u.machine;
  std::ifstream in(cpuinfo_path);
  std::string line;
  bool flags_read = false;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string key = line.substr(0, colon);
    while (!key.empty() && (key.back() == ' ' || key.back() == '\t')) key.pop_back();
    const std::string value = line.substr(std::min(line.size(), colon + 2));
    if (key == "model name" && out.name.empty()) out.name = value;
    if (key == "cpu family" && out.x86_family.empty()) out.x86_family = value;
    if (key == "model" && out.x86_model.empty()) out.x86_model = value;
    if ((key == "flags" || key == "Features") && !flags_read) {
      flags_read = true;
      std::istringstream words(value);
      for (std::string w; words >> w;) {
        for (const auto& [linux_name, torch_name] : kNames)
          if (w == linux_name && !out.has(torch_name)) out.flags.emplace_back(torch_name);
      }
    }
  }
  return out;
}

#if SLUICE_TORCH_CPU_CAPABILITIES

CpuCapabilities cpu_capabilities() {
  CpuCapabilities out;
  for (const auto& [key, value] : at::cpu::get_cpu_capabilities()) {
    if (key == "cpu_name" && value.isString()) out.name = value.toStringRef();
    if (key == "architecture" && value.isString()) out.architecture = value.toStringRef();
    if (value.isBool() && value.toBool()) out.flags.push_back(key);
  }
  return out;
}

#else  // torch before 2.11: /proc/cpuinfo, named as torch's map names them

CpuCapabilities cpu_capabilities() { return cpu_capabilities_from("/proc/cpuinfo"); }

#endif

#if SLUICE_TORCH_GENERIC_ALLOCATOR

std::pair<size_t, size_t> memory_info(c10::Device device) { return at::accelerator::getMemoryInfo(device.index()); }

AllocatorCounters device_stats(c10::Device device) {
  const auto s = at::accelerator::getDeviceStats(device.index());
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {s.allocated_bytes[all].current, s.allocated_bytes[all].peak, s.reserved_bytes[all].current};
}

void reset_peak_stats(c10::Device device) { at::accelerator::resetPeakStats(device.index()); }

void empty_cache(c10::Device /*device*/) { at::accelerator::emptyCache(); }

void record_stream(const c10::DataPtr& block, c10::Stream stream) {
  c10::getDeviceAllocator(block.device().type())->recordStream(block, stream);
}

std::optional<bool> reports_dtype(c10::Device device, c10::ScalarType dtype) {
  const c10::DeviceCapability cap = at::accelerator::getDeviceCapability(device.has_index() ? device.index() : 0);
  const auto& types = cap.capability_data.supported_scalar_types;
  if (dtype == c10::kBFloat16) return static_cast<bool>(types.has_BFloat16);
  if (dtype == c10::kHalf) return static_cast<bool>(types.has_Half);
  return std::nullopt;
}

#else  // torch 2.7 to 2.9: Note [torch compat]

namespace {
[[noreturn]] void unavailable(const char* what) {
  TORCH_CHECK(false, what, " needs torch >= 2.10 or a build of sluice with CUDA sources (built against torch ",
              built_torch_version(), ")");
}
}  // namespace

std::pair<size_t, size_t> memory_info(c10::Device device) {
  using MemGetInfo = int (*)(size_t*, size_t*);
  static const auto get = [] {
    void* p = find_runtime_symbol("cudaMemGetInfo");
    if (!p) p = find_runtime_symbol("hipMemGetInfo");
    return reinterpret_cast<MemGetInfo>(p);
  }();
  TORCH_CHECK(get, "neither cudaMemGetInfo nor hipMemGetInfo is loaded in this process");
  at::globalContext().lazyInitDevice(device.type());
  size_t free_bytes = 0, total_bytes = 0;
  TORCH_CHECK(get(&free_bytes, &total_bytes) == 0, "cudaMemGetInfo failed for ", device);
  return {free_bytes, total_bytes};
}

#ifdef SLUICE_HAS_CUDA
AllocatorCounters device_stats(c10::Device device) {
  const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  constexpr auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {s.allocated_bytes[all].current, s.allocated_bytes[all].peak, s.reserved_bytes[all].current};
}
void reset_peak_stats(c10::Device device) { c10::cuda::CUDACachingAllocator::resetPeakStats(device.index()); }
void empty_cache(c10::Device /*device*/) { c10::cuda::CUDACachingAllocator::emptyCache(); }
#else
AllocatorCounters device_stats(c10::Device /*device*/) { unavailable("allocator statistics"); }
void reset_peak_stats(c10::Device /*device*/) { unavailable("allocator statistics"); }
void empty_cache(c10::Device /*device*/) { unavailable("emptyCache"); }
#endif

void record_stream(const c10::DataPtr& block, c10::Stream stream) {
  // A tensor over the block that never frees it: a null context is never deleted, while the
  // deleter the allocator checks is the block's own.
  c10::DataPtr alias(block.get(), nullptr, block.get_deleter(), block.device());
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, std::move(alias), nullptr, false);
  const auto key = c10::computeDispatchKey(c10::kByte, c10::kStrided, block.device());
  at::Tensor view = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                             caffe2::TypeMeta::Make<uint8_t>());
  view.record_stream(stream);
}

std::optional<bool> reports_dtype(c10::Device /*device*/, c10::ScalarType /*dtype*/) { return std::nullopt; }

#endif

}  // namespace sluice::torch_compat
