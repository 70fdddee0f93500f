#pragma once
// Plugs offload's device kernels into the runtime's upcast hooks (runtime/fp8.h).
//
// Registration is an explicit call, not a static initializer: sluice's libraries are static,
// and the linker drops an object file nobody references, initializer and all. The engine
// and the model loaders call register_cuda_kernels() before their first upcast.
namespace sluice::offload {

// Installs the CUDA fp8 upcast kernel for device type CUDA. Idempotent and thread-safe.
// Returns true when a kernel is installed; false (and does nothing) in builds without
// CUDA sources, where CUDA tensors take ATen's .to() path.
bool register_cuda_kernels();

// Whether this build carries the CUDA kernels at all.
bool has_cuda_kernels();

}  // namespace sluice::offload
