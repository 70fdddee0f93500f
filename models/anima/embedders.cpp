#include "models/anima/embedders.h"

#include <cmath>
#include <memory>

#include "models/anima/norms.h"

namespace sluice::anima {

PatchEmbedImpl::PatchEmbedImpl(int64_t in_channels, int64_t patch_spatial, int64_t patch_temporal, int64_t dim,
                               at::TensorOptions options)
    : ps_(patch_spatial), pt_(patch_temporal) {
  auto proj = register_module("proj", std::make_shared<torch::nn::Module>());
  linear_ = offload::Linear(in_channels * patch_spatial * patch_spatial * patch_temporal, dim, /*bias=*/false, options);
  proj->register_module("1", linear_);
}

at::Tensor PatchEmbedImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1);
  const int64_t T = x.size(2) / pt_, H = x.size(3) / ps_, W = x.size(4) / ps_;
  const at::Tensor patches = x.view({B, C, T, pt_, H, ps_, W, ps_})
                                 .permute({0, 2, 4, 6, 1, 3, 5, 7})
                                 .reshape({B, T * H * W, C * pt_ * ps_ * ps_});
  return linear_(patches);
}

at::Tensor timestep_sinusoid(const at::Tensor& timesteps, int64_t channels) {
  const int64_t half = channels / 2;
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(timesteps.device());
  // Same op order as the reference: (-ln(1e4) * k) / half, exp, outer product, [cos, sin].
  const at::Tensor exponent = at::arange(half, fopts).mul(-std::log(10000.0)).div(static_cast<double>(half));
  const at::Tensor angles = timesteps.to(at::kFloat).reshape({-1, 1}) * at::exp(exponent).unsqueeze(0);
  return at::cat({at::cos(angles), at::sin(angles)}, -1).unsqueeze(1);
}

TimestepEmbedderImpl::TimestepEmbedderImpl(int64_t dim, bool use_adaln_lora, at::TensorOptions options)
    : use_adaln_lora_(use_adaln_lora) {
  auto mlp = register_module("1", std::make_shared<torch::nn::Module>());
  linear_1_ = offload::Linear(dim, dim, /*bias=*/!use_adaln_lora, options);
  linear_2_ = offload::Linear(dim, use_adaln_lora ? 3 * dim : dim, /*bias=*/false, options);
  mlp->register_module("linear_1", linear_1_);
  mlp->register_module("linear_2", linear_2_);
}

std::pair<at::Tensor, at::Tensor> TimestepEmbedderImpl::forward(const at::Tensor& sample) {
  at::Tensor emb = linear_2_(at::silu(linear_1_(sample)));
  if (use_adaln_lora_) return {sample, emb};
  return {emb, at::Tensor()};
}

FinalLayerImpl::FinalLayerImpl(int64_t dim, int64_t out_features, int64_t adaln_lora_dim, double eps,
                               at::TensorOptions options)
    : eps_(eps) {
  adaln_modulation_ = register_module("adaln_modulation", AdaLNModulation(dim, adaln_lora_dim, 2 * dim, options));
  linear_ = register_module("linear", offload::Linear(dim, out_features, /*bias=*/false, options));
}

at::Tensor FinalLayerImpl::forward(const at::Tensor& x, const at::Tensor& t_emb, const at::Tensor& adaln_lora) {
  const auto m = adaln_chunks(adaln_modulation_, t_emb, adaln_lora, 2);  // shift, scale
  return linear_(layer_norm_no_affine(x, eps_) * (1 + m[1]) + m[0]);
}

}  // namespace sluice::anima
