#pragma once
// Conversions between storage and compute dtypes. The fp8 issue fills in the fast
// kernels; this header is the one entry point the layers use.
#include <ATen/ATen.h>

namespace sluice {

// Returns `stored` as `compute` dtype on the same device, multiplied by `scale` when it
// is defined (per tensor [] or per output channel [out]). Returns `stored` itself, not a
// copy, when no conversion is needed.
at::Tensor upcast(const at::Tensor& stored, at::ScalarType compute, const at::Tensor& scale);

}  // namespace sluice
