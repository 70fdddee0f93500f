#pragma once
// One DiT block ("blocks.N") and its parts: the adaLN modulation MLPs and the GELU MLP.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <vector>

#include "models/anima/dit_attention.h"
#include "models/anima/rope.h"
#include "offload/layer/layer.h"

namespace sluice::anima {

// Sequential(SiLU, Linear(in, lora), Linear(lora, out)) with adaLN-LoRA, else
// Sequential(SiLU, Linear(in, out)); children are named "1" and "2" like the checkpoint's
// Sequential indices (the SiLU at "0" has no parameters and is not registered).
class AdaLNModulationImpl : public torch::nn::Module {
 public:
  // lora_dim <= 0: no low-rank bottleneck.
  AdaLNModulationImpl(int64_t in_dim, int64_t lora_dim, int64_t out_dim, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& emb);

 private:
  offload::Linear first_{nullptr};
  offload::Linear second_{nullptr};  // null without adaLN-LoRA
};
TORCH_MODULE(AdaLNModulation);

// "mlp": layer2(GELU_erf(layer1(x))), bias-free.
class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& x);

 private:
  offload::Linear layer1_{nullptr};
  offload::Linear layer2_{nullptr};
};
TORCH_MODULE(FeedForward);

struct DiTBlockOptions {
  int64_t dim = 2048;           // model_channels
  int64_t context_dim = 1024;   // crossattn_emb_channels
  int64_t num_heads = 16;
  int64_t mlp_ratio = 4;
  int64_t adaln_lora_dim = 256; // <= 0: no adaLN-LoRA
  double norm_eps = 1e-6;       // for the LayerNorms and the q/k RMSNorms
};

class DiTBlockImpl : public torch::nn::Module {
 public:
  DiTBlockImpl(const DiTBlockOptions& o, at::TensorOptions options);

  // x [B, L, D] residual stream (fp32 when the compute dtype is fp16); t_emb [B, 1, D] in
  // the compute dtype; context [B, S, context_dim]; rope tables for the L tokens;
  // adaln_lora [B, 1, 3D] or undefined without adaLN-LoRA; cross_mask: nullptr, or the
  // cross-attention mask for this block (Note [cross-attention mask] in models/anima/anima.h).
  // Returns the new residual.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& t_emb, const at::Tensor& context,
                     const rope::Tables& rope, const at::Tensor& adaln_lora,
                     const AttentionMask* cross_mask = nullptr);

 private:
  double eps_;
  AdaLNModulation adaln_sa_{nullptr};
  AdaLNModulation adaln_ca_{nullptr};
  AdaLNModulation adaln_mlp_{nullptr};
  DiTAttention self_attn_{nullptr};
  DiTAttention cross_attn_{nullptr};
  FeedForward mlp_{nullptr};
};
TORCH_MODULE(DiTBlock);

// shift, scale, gate (or shift, scale): modulation(t_emb) (+ adaln_lora[..., :n*D]) split
// into `n` chunks on the last dim.
std::vector<at::Tensor> adaln_chunks(AdaLNModulation& modulation, const at::Tensor& t_emb,
                                     const at::Tensor& adaln_lora, int64_t n);

}  // namespace sluice::anima
