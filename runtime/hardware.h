#pragma once
// What the machine is: the CPU's model and vector extensions, the GPU's name and
// architecture, and whether each computes bf16 / fp16 matrix products natively. Every
// number sluice prints (run's header, benchmarks) carries hardware_summary() beside it,
// because the same job differs by 100x between machines of one cloud kind.
//
// Note [native bf16]
// ~~~~~~~~~~~~~~~~~~
// The answers come from torch's own capability queries, never from a list of CPU or GPU
// models:
//  - CPU: torch's bf16 (and fp16) matrix product is fast only through oneDNN, which torch
//    uses when it is built with it, enabled (at::globalContext().userEnabledMkldnn(), i.e.
//    torch.backends.mkldnn.enabled) and the CPU passes torch's own device check: for bf16
//    avx512_bw + avx512_vl + avx512_dq on x86 (oneDNN's avx512_core), bf16 instructions on
//    Arm; for fp16 avx512_fp16 or amx_fp16. Otherwise torch falls back to a generic kernel:
//    0.5 GFLOP/s in bf16 against 65 GFLOP/s in fp32 on a 2-core AVX2-only AMD EPYC
//    (torch 2.11; 1.3 against 230 on a 2-core AVX-512 AMD EPYC with oneDNN switched off).
//    The CPU flags come from torch_compat::cpu_capabilities(): torch's cpuinfo from torch 2.11,
//    /proc/cpuinfo before it (Note [torch compat]).
//  - CUDA: bf16 tensor cores from compute capability 8.0 (Ampere); fp16 from 7.0 (Volta),
//    and fp16 runs on every CUDA GPU torch supports. ROCm builds report bf16 supported, as
//    torch.cuda.is_bf16_supported() does.
//  - Any other backend: its reported dtypes (torch_compat::reports_dtype, torch >= 2.10); one that does not answer
//    is taken to compute bf16.
// SLUICE_CPU_ONEDNN=off switches oneDNN off in torch (as torch.backends.mkldnn.enabled =
// False) when a ModelCache is made, which reproduces a CPU without native bf16 on one
// that has it: the test suite runs on both paths that way.
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace sluice {

struct CpuDescription {
  std::string model;                           // "AMD EPYC (family 25, model 17)"
  std::string architecture;                    // "x86_64", "aarch64"
  int cores = 0;                               // logical cores
  std::vector<std::string> vector_extensions;  // "avx2", "avx512_f", "avx512_bf16", "amx_bf16", "neon", ...
};

// The CPU this process runs on (cached after the first call).
const CpuDescription& cpu_description();

// "AMD EPYC (family 25, model 17), 2 cores, x86_64: avx avx2 fma3 f16c avx512_f ..."
std::string cpu_summary();

// The CPU and, for a device other than the CPU, the device: "NVIDIA H100 80GB HBM3
// (sm_90), 79.1GiB; CPU: ..." (CUDA with sluice's CUDA sources), "cuda:0; CPU: ..."
// otherwise.
std::string hardware_summary(at::Device device);

// Whether `device` computes matrix products in `dtype` (bfloat16 or float16) natively,
// and why (one clause, e.g. "oneDNN's bf16 kernels need avx512_bw/vl/dq, which this CPU
// lacks"). float32 is native everywhere. See Note [native bf16].
struct NativeAnswer {
  bool native = false;
  std::string why;
};
NativeAnswer native_matmul(at::Device device, at::ScalarType dtype);

// Reads SLUICE_CPU_ONEDNN ("off"/"0"/"false": torch stops using oneDNN); returns true when it
// switched oneDNN off. Called where a ModelCache is made, and by the CLI's main.
bool apply_cpu_onednn_env();

}  // namespace sluice
