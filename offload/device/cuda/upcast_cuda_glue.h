#pragma once
// ATen side of the CUDA fp8 upcast: checks the tensors and launches the kernel of
// upcast_cuda.cu on the current CUDA stream. Compiled only when SLUICE_HAS_CUDA.
#include <ATen/ATen.h>

namespace sluice::offload::cuda {

// A sluice::DeviceUpcastFn (runtime/fp8.h): handles fp8 -> bfloat16/float16 with or without
// a scale; returns false for float32 output so the ATen path takes over.
bool upcast_fp8(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out);

}  // namespace sluice::offload::cuda
