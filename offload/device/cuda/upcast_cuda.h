#pragma once
// The fused CUDA fp8 upcast, behind a raw-pointer launcher. This header and
// upcast_cuda.cu include no torch header: nvcc then never parses torch's headers (slow, and
// sensitive to torch's half/bfloat16 operator macros), and the ATen glue lives in
// upcast_cuda_glue.cpp, compiled by the host compiler.
#include <cstdint>

namespace sluice::offload::cuda {

// fp8 encodings, numbered as sluice::fp8::Format (runtime/fp8_format.h).
enum class Fp8Kind : int { e4m3fn = 0, e5m2 = 1, e4m3fnuz = 2, e5m2fnuz = 3 };
// Output dtypes the kernel writes.
enum class OutKind : int { bf16 = 0, f16 = 1 };

struct UpcastLaunch {
  const void* in = nullptr;     // n fp8 bytes, device memory
  void* out = nullptr;          // n 16-bit values, device memory
  int64_t n = 0;                // elements
  Fp8Kind fp8 = Fp8Kind::e4m3fn;
  OutKind out_kind = OutKind::bf16;
  const float* scale = nullptr;  // nullptr: unscaled; else one float per row of row_len elements
  int64_t row_len = 0;           // elements per scale row (n for a per-tensor scale)
  int max_blocks = 0;            // grid cap (e.g. 16 * SM count); 0 = no cap
  void* stream = nullptr;        // cudaStream_t
};

// Launches the kernel; returns the cudaError_t of the launch as an int (0 = success).
int launch_fp8_upcast(const UpcastLaunch& args);

}  // namespace sluice::offload::cuda
