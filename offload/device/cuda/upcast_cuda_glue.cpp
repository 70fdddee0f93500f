#include "offload/device/cuda/upcast_cuda_glue.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "offload/device/cuda/upcast_cuda.h"

namespace sluice::offload::cuda {

bool upcast_fp8(const at::Tensor& stored, const at::Tensor& scale, const at::Tensor& out) {
  Fp8Kind kind;
  switch (stored.scalar_type()) {
    case at::kFloat8_e4m3fn: kind = Fp8Kind::e4m3fn; break;
    case at::kFloat8_e5m2: kind = Fp8Kind::e5m2; break;
    case at::kFloat8_e4m3fnuz: kind = Fp8Kind::e4m3fnuz; break;
    case at::kFloat8_e5m2fnuz: kind = Fp8Kind::e5m2fnuz; break;
    default: return false;
  }
  OutKind out_kind;
  switch (out.scalar_type()) {
    case at::kBFloat16: out_kind = OutKind::bf16; break;
    case at::kHalf: out_kind = OutKind::f16; break;
    default: return false;
  }
  // The runtime's contract (runtime/fp8.h DeviceUpcastFn); a broken one is a sluice bug.
  TORCH_INTERNAL_ASSERT(stored.is_cuda() && out.device() == stored.device() && stored.is_contiguous() &&
                        out.is_contiguous() && out.numel() == stored.numel());
  TORCH_INTERNAL_ASSERT(!scale.defined() || (scale.device() == stored.device() && scale.scalar_type() == at::kFloat &&
                                             scale.is_contiguous() && scale.numel() >= 1));
  const int64_t n = stored.numel();
  if (n == 0) return true;

  c10::cuda::CUDAGuard guard(stored.device());
  UpcastLaunch a;
  a.in = stored.data_ptr();
  a.out = out.data_ptr();
  a.n = n;
  a.fp8 = kind;
  a.out_kind = out_kind;
  if (scale.defined()) {
    a.scale = scale.data_ptr<float>();
    a.row_len = n / scale.numel();
    TORCH_INTERNAL_ASSERT(a.row_len * scale.numel() == n, "upcast_fp8: scale does not divide the tensor into rows");
  }
  // Two full waves of 256-thread blocks per SM keep enough 16-byte loads in flight to
  // saturate HBM; the kernel's grid-stride loop covers the rest.
  a.max_blocks = 16 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  a.stream = at::cuda::getCurrentCUDAStream().stream();
  const auto err = static_cast<cudaError_t>(launch_fp8_upcast(a));
  TORCH_CHECK(err == cudaSuccess, "sluice fp8 upcast kernel launch failed: ", cudaGetErrorString(err));
  return true;
}

}  // namespace sluice::offload::cuda
