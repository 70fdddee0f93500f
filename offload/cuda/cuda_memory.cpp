#include "offload/cuda/cuda_memory.h"

#include <cuda_runtime_api.h>

namespace sluice::offload::cuda {

uint64_t total_memory(c10::DeviceIndex index) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return 0;
  if (index >= 0 && index != previous && cudaSetDevice(index) != cudaSuccess) return 0;
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
  if (index >= 0 && index != previous) cudaSetDevice(previous);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of this call
    return 0;
  }
  return static_cast<uint64_t>(total_bytes);
}

}  // namespace sluice::offload::cuda
