#include "models/anima/norms.h"

namespace sluice::anima {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps, at::TensorOptions options) : eps_(eps) {
  // Ones is the identity scale; a meta build allocates nothing here.
  weight_ = register_parameter("weight", at::ones({dim}, options), /*requires_grad=*/false);
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  const at::Tensor w = weight_.scalar_type() == x.scalar_type() && weight_.device() == x.device()
                           ? weight_
                           : weight_.to(x.device(), x.scalar_type());
  return at::rms_norm(x, {x.size(-1)}, w, eps_);
}

LayerNormImpl::LayerNormImpl(int64_t dim, double eps, at::TensorOptions options) : eps_(eps) {
  weight_ = register_parameter("weight", at::ones({dim}, options), /*requires_grad=*/false);
  bias_ = register_parameter("bias", at::zeros({dim}, options), /*requires_grad=*/false);
}

at::Tensor LayerNormImpl::forward(const at::Tensor& x) {
  auto cast = [&](const at::Tensor& p) {
    return p.scalar_type() == x.scalar_type() && p.device() == x.device() ? p : p.to(x.device(), x.scalar_type());
  };
  return at::layer_norm(x, {x.size(-1)}, cast(weight_), cast(bias_), eps_);
}

at::Tensor layer_norm_no_affine(const at::Tensor& x, double eps) {
  return at::layer_norm(x, {x.size(-1)}, /*weight=*/{}, /*bias=*/{}, eps);
}

}  // namespace sluice::anima
