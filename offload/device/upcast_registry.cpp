#include "offload/device/upcast_registry.h"

#include "runtime/fp8.h"

#ifdef SLUICE_HAS_CUDA
#include "offload/device/cuda/upcast_cuda_glue.h"
#endif

namespace sluice::offload {

bool register_cuda_kernels() {
#ifdef SLUICE_HAS_CUDA
  sluice::register_device_upcast(c10::DeviceType::CUDA, &cuda::upcast_fp8);
  return true;
#else
  return false;
#endif
}

bool has_cuda_kernels() {
#ifdef SLUICE_HAS_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace sluice::offload
