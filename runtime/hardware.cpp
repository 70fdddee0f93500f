#include "runtime/hardware.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/DeviceGuard.h>

#ifdef SLUICE_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>
#include <thread>

#include "runtime/logging.h"
#include "runtime/size_parse.h"
#include "runtime/torch_compat.h"

namespace sluice {
namespace {

// The vector and matrix extensions worth naming beside a number, in the order printed;
// torch's capability map has these keys (torch_compat::cpu_capabilities()).
constexpr const char* kVectorKeys[] = {
    "avx", "avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_ne_convert", "avx10_1", "avx10_2",
    "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    // Arm
    "neon", "dot", "i8mm", "fp16_arith", "bf16", "sve", "sve2", "sve_bf16", "sme", "sme2"};

// "family 25, model 17" from /proc/cpuinfo (x86 Linux); empty elsewhere. cpuinfo's package
// name hides the generation on many cloud machines ("AMD EPYC"), the family does not.
std::string x86_family_model() {
  const torch_compat::CpuCapabilities c = torch_compat::cpu_capabilities_from("/proc/cpuinfo");
  if (c.x86_family.empty() || c.x86_model.empty()) return {};
  return "family " + c.x86_family + ", model " + c.x86_model;
}

CpuDescription describe_cpu() {
  CpuDescription d;
  const torch_compat::CpuCapabilities caps = torch_compat::cpu_capabilities();
  d.model = caps.name.empty() ? "unknown CPU" : caps.name;
  d.architecture = caps.architecture;
  if (d.architecture == "x86_64")
    if (const std::string fm = x86_family_model(); !fm.empty()) d.model += " (" + fm + ")";
  d.cores = static_cast<int>(std::thread::hardware_concurrency());
  for (const char* key : kVectorKeys)
    if (caps.has(key)) d.vector_extensions.emplace_back(key);
  return d;
}

// torch's oneDNN bf16 device check (aten/src/ATen/native/mkldnn/Utils.h, not exported):
// avx512_core on x86, bf16 instructions on Arm.
NativeAnswer cpu_native(at::ScalarType dtype) {
  if (!at::hasMKLDNN()) return {false, "this torch is built without oneDNN, torch's only fast CPU path for it"};
  if (!at::globalContext().userEnabledMkldnn())
    return {false, "torch's oneDNN is switched off (torch.backends.mkldnn.enabled = False, or SLUICE_CPU_ONEDNN=off)"};
  // The flags cpu_description() read once from torch's cpuinfo (every key asked here is
  // among kVectorKeys).
  const CpuDescription& cpu = cpu_description();
  const auto has = [&](const char* key) {
    return std::find(cpu.vector_extensions.begin(), cpu.vector_extensions.end(), key) != cpu.vector_extensions.end();
  };
  if (dtype == at::kBFloat16) {
    if (cpu.architecture == "x86_64") {
      if (has("avx512_bw") && has("avx512_vl") && has("avx512_dq"))
        return {true, std::string("torch's oneDNN runs bf16 matrix products natively on this CPU (avx512_bw/vl/dq") +
                          (has("avx512_bf16") ? ", avx512_bf16" : "") + (has("amx_bf16") ? ", amx_bf16" : "") +
                          ")"};
      return {false, "this CPU has no AVX-512 (avx512_bw/vl/dq), which torch's oneDNN bf16 matrix product needs; "
                     "torch falls back to a generic kernel about 100x slower than fp32"};
    }
    if (has("bf16") || has("sve_bf16")) return {true, "torch's oneDNN runs bf16 natively on this CPU (Arm bf16)"};
    return {false, "this CPU has no bf16 instructions that torch's oneDNN uses"};
  }
  if (dtype == at::kHalf) {
    if (has("avx512_fp16") || has("amx_fp16") || has("fp16_arith"))
      return {true, "torch's oneDNN runs fp16 natively on this CPU"};
    return {false, "this CPU has no fp16 matrix instructions (avx512_fp16, amx_fp16) that torch's oneDNN uses"};
  }
  return {true, "fp32 is native everywhere"};
}

NativeAnswer cuda_native(at::Device device, at::ScalarType dtype) {
  const auto& hooks = at::detail::getCUDAHooks();
  if (hooks.hasROCM())
    return {true, "ROCm GPUs compute bf16 and fp16 (torch.cuda.is_bf16_supported() is true on ROCm)"};
#ifdef SLUICE_HAS_CUDA
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(device.has_index() ? device.index() : hooks.current_device());
  const std::string sm = "sm_" + std::to_string(p->major) + std::to_string(p->minor);
  if (dtype == at::kBFloat16)
    return p->major >= 8 ? NativeAnswer{true, sm + " has bf16 tensor cores"}
                         : NativeAnswer{false, sm + " has no bf16 tensor cores (they start at sm_80, Ampere)"};
  return {true, sm + " computes fp16 natively"};
#else
  // Without sluice's CUDA sources the compute capability comes from torch's hooks: bf16
  // cuDNN convolutions need sm_80, exactly where bf16 tensor cores start.
  if (dtype == at::kBFloat16) {
    c10::DeviceGuard guard(device);
    return hooks.supportsBFloat16ConvolutionWithCuDNNv8()
               ? NativeAnswer{true, "the GPU has bf16 tensor cores (sm_80 or later)"}
               : NativeAnswer{false, "the GPU has no bf16 tensor cores (before sm_80, Ampere)"};
  }
  return {true, "CUDA GPUs compute fp16 natively"};
#endif
}

}  // namespace

const CpuDescription& cpu_description() {
  static const CpuDescription d = describe_cpu();
  return d;
}

std::string cpu_summary() {
  const CpuDescription& d = cpu_description();
  std::string s = d.model + ", " + std::to_string(d.cores) + (d.cores == 1 ? " core, " : " cores, ") + d.architecture;
  if (!d.vector_extensions.empty()) {
    s += ":";
    for (const auto& e : d.vector_extensions) s += " " + e;
  }
  return s;
}

std::string hardware_summary(at::Device device) {
  if (device.is_cpu()) return "CPU " + cpu_summary();
  std::string dev = device.str();
#ifdef SLUICE_HAS_CUDA
  if (device.is_cuda()) {
    try {
      const cudaDeviceProp* p = at::cuda::getDeviceProperties(device.has_index() ? device.index() : 0);
      const std::string mem = format_bytes(p->totalGlobalMem);  // Note [size suffixes]: reads back as all of it
      dev = std::string(p->name) + " (" + device.str() + ", sm_" + std::to_string(p->major) + std::to_string(p->minor) +
            ", " + mem + ")";
    } catch (const std::exception&) {
    }
  }
#endif
  return "GPU " + dev + "; CPU " + cpu_summary();
}

NativeAnswer native_matmul(at::Device device, at::ScalarType dtype) {
  if (dtype == at::kFloat || dtype == at::kDouble) return {true, "fp32 is native everywhere"};
  if (device.is_cpu()) return cpu_native(dtype);
  if (device.is_cuda()) return cuda_native(device, dtype);
  try {
    if (const std::optional<bool> ok = torch_compat::reports_dtype(device, dtype)) {
      return {*ok, std::string(device.str()) + (*ok ? " reports " : " does not report ") + c10::toString(dtype) +
                       " among its supported dtypes"};
    }
  } catch (const std::exception&) {
  }
  return {true, device.str() + " does not report its dtypes; taken to compute it"};
}

bool apply_cpu_onednn_env() {
  const char* v = std::getenv("SLUICE_CPU_ONEDNN");
  if (v == nullptr) return false;
  const std::string_view s(v);
  if (s == "off" || s == "0" || s == "false") {
    if (at::globalContext().userEnabledMkldnn()) {
      at::globalContext().setUserEnabledMkldnn(false);
      log::info(std::string("SLUICE_CPU_ONEDNN=") + v +
                ": torch's oneDNN is off (CPU bf16 matrix products take torch's generic kernel)");
    }
    return true;
  }
  return false;
}

}  // namespace sluice
