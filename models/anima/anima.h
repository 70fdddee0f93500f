#pragma once
// Public face of the Anima model family: build, load, generate, run.
//
// The module tree mirrors the checkpoint exactly (DESIGN.md §1): named_parameters() of
// an AnimaModel yields the key set of a real checkpoint minus its "net." prefix, e.g.
// "x_embedder.proj.1.weight", "blocks.3.self_attn.q_proj.weight",
// "llm_adapter.blocks.0.mlp.0.bias". Every Linear/Embedding is an offload::Linear /
// offload::Embedding (offload/layer.h) so the fp8 and streaming machinery can manage it.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <optional>
#include <string>
#include <vector>

#include "models/anima/config.h"

namespace sluice::anima {

class AnimaDiTImpl;        // models/anima/dit.h
class LLMAdapterImpl;      // models/anima/llm_adapter.h

// Options for building / loading a model.
struct BuildOptions {
  at::ScalarType dtype = at::kFloat;    // dtype the weights are created/converted in
  at::Device device = at::kCPU;         // at::kMeta builds shape-only (no allocation)
};

class AnimaModelImpl : public torch::nn::Module {
 public:
  AnimaModelImpl(AnimaConfig config, BuildOptions options);
  const AnimaConfig& config() const { return config_; }

  // DiT: x [B,C,T,H,W], timesteps [B] (sigma in [0,1]), context [B,S,crossattn] ->
  // velocity, same shape as x. Pads T/H/W to patch multiples and crops back.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context);

  // LLM adapter: qwen hidden [B,S,1024], t5 ids [B,S_t] int, optional weights [B,S_t]
  // -> context [B, output_tokens(512), model_dim]. Throws if the model has no adapter.
  at::Tensor encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                         const std::optional<at::Tensor>& t5_weights = std::nullopt);

  // Dotted names of the transformer blocks' root modules in execution order
  // ("blocks.0" ... ), used by residency maps.
  int64_t num_blocks() const { return config_.num_blocks; }

 private:
  AnimaConfig config_;
  // submodules registered in checkpoint order (see anima_model.cpp)
  std::shared_ptr<torch::nn::Module> dit_parts_;  // implementation detail
};
TORCH_MODULE(AnimaModel);

}  // namespace sluice::anima
