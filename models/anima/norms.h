#pragma once
// Normalisation layers of the Anima model. They are not ManagedLayers: their weights are
// tiny ([head_dim] or [model_dim]) and stay in the dtype they were built or loaded in;
// the forward casts the weight to the activation dtype, as the reference model does by
// running everything in one dtype.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

namespace sluice::anima {

// RMSNorm over the last dimension with a learned scale ("weight", shape [dim]); same op
// as torch.nn.RMSNorm (at::rms_norm).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& x);
  const at::Tensor& weight() const { return weight_; }
  double eps() const { return eps_; }

 private:
  at::Tensor weight_;
  double eps_;
};
TORCH_MODULE(RMSNorm);

// LayerNorm over the last dimension with a learned scale and shift ("weight", "bias", shape
// [dim]); same op as torch.nn.LayerNorm (the semantic connector's norms).
class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, double eps, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& x);

 private:
  at::Tensor weight_;
  at::Tensor bias_;
  double eps_;
};
TORCH_MODULE(LayerNorm);

// LayerNorm over the last dimension without affine parameters (the DiT's block norms).
at::Tensor layer_norm_no_affine(const at::Tensor& x, double eps);

}  // namespace sluice::anima
