#include "models/anima/rope.h"

#include <cmath>
#include <string>

#include "runtime/error.h"

namespace sluice::anima::rope {

Split3D split_3d(int64_t head_dim) {
  if (head_dim % 2 != 0 || head_dim < 12) {
    throw InvalidArgument("3D RoPE needs an even head_dim of at least 12, got " + std::to_string(head_dim));
  }
  Split3D s;
  s.dim_h = (head_dim / 6) * 2;
  s.dim_w = s.dim_h;
  s.dim_t = head_dim - 2 * s.dim_h;
  return s;
}

at::Tensor axis_frequencies(int64_t dim, double theta, double ratio, at::Device device) {
  // Same op sequence as the reference: the exponents 2i/d are fp32, the base theta' is a
  // scalar rounded to fp32 by pow, and the reciprocal is taken in fp32.
  const double ntk = std::pow(ratio, static_cast<double>(dim) / static_cast<double>(dim - 2));
  const at::Tensor exponents =
      at::arange(0, dim, 2, at::TensorOptions().dtype(at::kFloat).device(device)).div(static_cast<double>(dim));
  return at::reciprocal(at::pow(at::Scalar(theta * ntk), exponents));
}

Tables tables_3d(int64_t T, int64_t H, int64_t W, const Params3D& p, at::Device device) {
  TORCH_INTERNAL_ASSERT(T > 0 && H > 0 && W > 0);
  const Split3D s = split_3d(p.head_dim);
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor ft = axis_frequencies(s.dim_t, p.theta, p.t_ratio, device);
  const at::Tensor fh = axis_frequencies(s.dim_h, p.theta, p.h_ratio, device);
  const at::Tensor fw = axis_frequencies(s.dim_w, p.theta, p.w_ratio, device);
  const at::Tensor at_ = at::outer(at::arange(T, fopts), ft);  // [T, dim_t/2]
  const at::Tensor ah = at::outer(at::arange(H, fopts), fh);   // [H, dim_h/2]
  const at::Tensor aw = at::outer(at::arange(W, fopts), fw);   // [W, dim_w/2]
  const at::Tensor angles = at::cat({at_.view({T, 1, 1, -1}).expand({T, H, W, at_.size(1)}),
                                     ah.view({1, H, 1, -1}).expand({T, H, W, ah.size(1)}),
                                     aw.view({1, 1, W, -1}).expand({T, H, W, aw.size(1)})},
                                    -1)
                                .reshape({T * H * W, p.head_dim / 2});
  return {at::cos(angles), at::sin(angles)};
}

at::Tensor apply_3d(const at::Tensor& x, const Tables& tables) {
  const int64_t D = x.size(-1);
  const int64_t half = D / 2;
  TORCH_INTERNAL_ASSERT(x.dim() >= 3 && tables.cos.size(0) == x.size(-3) && tables.cos.size(1) == half);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor a = xf.narrow(-1, 0, half);
  const at::Tensor b = xf.narrow(-1, half, half);
  const at::Tensor c = tables.cos.unsqueeze(1);  // [L, 1, D/2] against [..., L, heads, D/2]
  const at::Tensor s = tables.sin.unsqueeze(1);
  return at::cat({c * a - s * b, s * a + c * b}, -1).to(x.scalar_type());
}

Tables tables_1d(int64_t L, int64_t head_dim, double theta, at::Device device) {
  TORCH_INTERNAL_ASSERT(L > 0 && head_dim % 2 == 0);
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(device);
  const at::Tensor exponents = at::arange(head_dim / 2, fopts).mul(2.0 / static_cast<double>(head_dim));
  const at::Tensor inv_freq = at::reciprocal(at::pow(at::scalar_tensor(theta, fopts), exponents));
  const at::Tensor freqs = at::outer(at::arange(L, fopts), inv_freq);
  const at::Tensor angles = at::cat({freqs, freqs}, -1);
  return {at::cos(angles), at::sin(angles)};
}

at::Tensor apply_1d(const at::Tensor& x, const Tables& tables) {
  const int64_t half = x.size(-1) / 2;
  TORCH_INTERNAL_ASSERT(tables.cos.size(0) == x.size(-2) && tables.cos.size(1) == x.size(-1));
  const at::Tensor c = tables.cos.to(x.scalar_type());
  const at::Tensor s = tables.sin.to(x.scalar_type());
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  return x * c + rotated * s;
}

}  // namespace sluice::anima::rope
