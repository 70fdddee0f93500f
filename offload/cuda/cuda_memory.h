#pragma once
// The one CUDA runtime call the device-generic backend cannot make through c10: the
// device's memory size. Compiled only with SLUICE_HAS_CUDA.
#include <c10/core/Device.h>

#include <cstdint>

namespace sluice::offload::cuda {

// Total memory of CUDA device `index` in bytes (cudaMemGetInfo); 0 if the query fails.
uint64_t total_memory(c10::DeviceIndex index);

}  // namespace sluice::offload::cuda
