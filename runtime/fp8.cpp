#include "runtime/fp8.h"

namespace sluice {

at::Tensor upcast(const at::Tensor& stored, at::ScalarType compute, const at::Tensor& scale) {
  if (!scale.defined()) {
    return stored.scalar_type() == compute ? stored : stored.to(compute);
  }
  at::Tensor s = scale.dim() == 0 ? scale : scale.reshape({-1, 1});
  return (stored.to(at::kFloat) * s.to(stored.device(), at::kFloat)).to(compute);
}

}  // namespace sluice
