#pragma once
// The DiT's input and output layers: patch embedding ("x_embedder"), timestep embedding
// ("t_embedder") and the adaLN-modulated output projection ("final_layer").
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <utility>

#include "models/anima/dit_block.h"
#include "offload/layer/layer.h"

namespace sluice::anima {

// "x_embedder": patchify b c (t r) (h m) (w n) -> b (t h w) (c r m n), then the bias-free
// Linear registered at "proj.1" (proj.0 is the parameter-free rearrange).
class PatchEmbedImpl : public torch::nn::Module {
 public:
  PatchEmbedImpl(int64_t in_channels, int64_t patch_spatial, int64_t patch_temporal, int64_t dim,
                 at::TensorOptions options);
  // x [B, C, T, H, W] with T, H, W multiples of the patch sizes -> [B, T'*H'*W', dim].
  at::Tensor forward(const at::Tensor& x);

 private:
  int64_t ps_;
  int64_t pt_;
  offload::Linear linear_{nullptr};
};
TORCH_MODULE(PatchEmbed);

// Sinusoidal timestep features [B, 1, channels] in fp32: half = channels/2,
// freq_k = exp(-ln(10000) k / half), laid out [cos(t freq), sin(t freq)].
at::Tensor timestep_sinusoid(const at::Tensor& timesteps, int64_t channels);

// "t_embedder": index 0 is the (parameter-free) sinusoid, index "1" the MLP with
// linear_1 (bias only without adaLN-LoRA) and linear_2 (3*dim wide with adaLN-LoRA).
class TimestepEmbedderImpl : public torch::nn::Module {
 public:
  TimestepEmbedderImpl(int64_t dim, bool use_adaln_lora, at::TensorOptions options);
  // sample [B, 1, dim] (the sinusoid in the compute dtype). Returns (sample, emb) with
  // adaLN-LoRA (emb = linear_2(SiLU(linear_1(sample)))), else (emb, undefined).
  std::pair<at::Tensor, at::Tensor> forward(const at::Tensor& sample);

 private:
  bool use_adaln_lora_;
  offload::Linear linear_1_{nullptr};
  offload::Linear linear_2_{nullptr};
};
TORCH_MODULE(TimestepEmbedder);

// "final_layer": LN(x)*(1+scale)+shift with (shift, scale) from adaln_modulation, then
// the bias-free Linear to patch_spatial^2 * patch_temporal * out_channels.
class FinalLayerImpl : public torch::nn::Module {
 public:
  FinalLayerImpl(int64_t dim, int64_t out_features, int64_t adaln_lora_dim, double eps, at::TensorOptions options);
  // x [B, L, dim], t_emb [B, 1, dim], adaln_lora [B, 1, 3*dim] or undefined.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t_emb, const at::Tensor& adaln_lora);

 private:
  double eps_;
  AdaLNModulation adaln_modulation_{nullptr};
  offload::Linear linear_{nullptr};
};
TORCH_MODULE(FinalLayer);

}  // namespace sluice::anima
