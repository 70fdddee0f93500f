#pragma once
// Public face of the Anima model family: build and run.
//
// The module tree mirrors the checkpoint exactly: named_parameters() of
// an AnimaModel yields the key set of a real checkpoint minus its "net." prefix, e.g.
// "x_embedder.proj.1.weight", "blocks.3.self_attn.q_proj.weight",
// "llm_adapter.blocks.0.mlp.0.bias". Every Linear/Embedding is an offload::Linear /
// offload::Embedding (offload/layer/layer.h) so the fp8 and streaming machinery can manage it.
// Modules are registered in execution order (DiT first, the LLM adapter last), so
// offload::managed_layers() lists the DiT's layers in the order one forward uses them.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "models/anima/config.h"
#include "models/anima/rope.h"
#include "runtime/dtype_policy.h"

namespace sluice::anima {

class PatchEmbedImpl;
class TimestepEmbedderImpl;
class RMSNormImpl;
class DiTBlockImpl;
class FinalLayerImpl;
class LLMAdapterImpl;
class SemanticConnectorImpl;
struct ConnectorInputs;

// Options for building a model.
struct BuildOptions {
  at::ScalarType dtype = at::kFloat;  // weights' and compute dtype: Float, BFloat16 or Half
  at::Device device = at::kCPU;       // at::kMeta builds shape-only (no allocation)
};

// The skip patterns Anima declares for fp8 storage (README "fp8 storage"): t_embedder,
// x_embedder, final_layer. On anima-2b they match exactly 6 Linears.
const std::vector<std::string>& declared_fp8_skips();

// Whether `compute auto` may run Anima in fp16 on a device without native bf16 (Note
// [compute dtype auto]), from the fp16-against-fp32 velocity error measured by
// sluice_bench_compute (docs/BENCHMARKS.md, "Compute dtype").
Fp16Verdict fp16_verdict();

// Note [cross-attention mask]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Regional prompting (InvokeAI's anima_transformer_patch.py): a boolean mask of image tokens
// x context tokens restricts what each image token's cross-attention may read, True =
// attend. Its shape is [L, S] (one for the batch) or [B, L, S], with L the image tokens
// after padding to the patch grid, T' * ceil(H / p) * ceil(W / p) for x [B, C, T, H, W]
// (p = patch_spatial = 2, T' = ceil(T / patch_temporal)), in (t, h, w) row-major order,
// and S the context's tokens. It applies on the listed blocks; by default on the even
// ones (0, 2, 4, ...), the odd ones unmasked, as InvokeAI does. The attention takes it as
// an additive mask (0 or -inf) in the compute dtype, as InvokeAI's patch builds it, so
// fp32 outputs match its to rounding. A row with no True (an image token that may attend
// to nothing) is defined here, unlike in InvokeAI (NaN): that token's cross-attention
// contributes zero. Unlike InvokeAI, whose patch falls back to no mask when the context's
// length differs from the mask's, a mismatched mask is refused.
struct CrossAttnMask {
  at::Tensor mask;              // bool [L, S] or [B, L, S]; undefined: no mask
  std::vector<int64_t> blocks;  // block indices it applies to (each in [0, num_blocks)); empty: the even ones
};

// Told the token grid of each DiT forward before its blocks run: an LLLite's conditioning
// embedding depends on it (models/anima/lllite.h).
class ForwardListener {
 public:
  virtual ~ForwardListener() = default;
  // T: tokens along time; H, W: the latent's height and width padded to the patch size;
  // device and dtype: where and in what the blocks compute.
  virtual void begin_forward(int64_t T, int64_t H, int64_t W, at::Device device, at::ScalarType dtype) = 0;
};

class AnimaModelImpl : public torch::nn::Module {
 public:
  // Weights are uninitialised (at::empty, so untouched pages cost no RAM) except norm
  // scales (ones) and biases (zeros): load a checkpoint (checkpoint.h) or generate one
  // (generator.h). Throws InvalidArgument for an invalid config or dtype.
  AnimaModelImpl(AnimaConfig config, BuildOptions options);
  const AnimaConfig& config() const { return config_; }

  // DiT: x [B,C,T,H,W] (C = in_channels, dtype = compute_dtype()), timesteps [B]
  // (sigma in [0,1]; any real dtype), context [B,S,crossattn_emb_channels] (cast to the
  // compute dtype) -> velocity, same shape and dtype as x. Pads T/H/W to patch multiples
  // and crops back. With fp16 compute the residual stream is kept in fp32. Throws
  // InvalidArgument naming the offending input.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context);
  // The same with a cross-attention mask on some blocks (regional prompting, Note
  // [cross-attention mask]); an undefined cross_attn.mask is the plain forward.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context,
                     const CrossAttnMask& cross_attn);

  // LLM adapter: qwen_hidden [B,S,source_dim] (dtype = compute_dtype()), t5_ids [B,S_t]
  // int32/int64 in [0, vocab), optional per-token weights [B,S_t] or [B,S_t,1] ->
  // context [B, output_tokens, model_dim], rows S_t.. zero. Throws InvalidArgument when
  // the model has no adapter, when S_t > output_tokens, or on a bad shape/dtype/id.
  // With a semantic connector (config.connector.enabled) and `connector` inputs, the
  // connector's cross-attentions run after each adapter block (Note [semantic connector]);
  // without inputs the native adapter runs alone, said once per model in an INFO line.
  // Inputs given to a model without a connector: InvalidArgument.
  at::Tensor encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                         const std::optional<at::Tensor>& t5_weights = std::nullopt,
                         const ConnectorInputs* connector = nullptr);
  bool has_connector() const { return config_.connector.enabled; }

  int64_t num_blocks() const { return config_.num_blocks; }
  bool has_adapter() const { return config_.adapter.enabled; }

  // The dtype forward/encode_text compute in; sets it on every ManagedLayer (their
  // leases then upcast stored weights to it). Must be fp32, bf16 or fp16.
  void set_compute_dtype(at::ScalarType dtype);
  at::ScalarType compute_dtype() const { return compute_dtype_; }

  // Listeners called by forward() before the blocks run, in the order added. Not to be
  // changed while a forward runs (like a layer's sidecars, Note [LoRA sidecars]).
  void add_forward_listener(std::shared_ptr<ForwardListener> listener);
  void remove_forward_listener(const ForwardListener* listener);

 private:
  // 3D RoPE tables for a token grid, cached for the last grid/device seen.
  rope::Tables rope_tables(int64_t T, int64_t H, int64_t W, at::Device device);

  AnimaConfig config_;
  at::ScalarType compute_dtype_;
  std::shared_ptr<PatchEmbedImpl> x_embedder_;
  std::shared_ptr<TimestepEmbedderImpl> t_embedder_;
  std::shared_ptr<RMSNormImpl> t_embedding_norm_;
  std::vector<std::shared_ptr<DiTBlockImpl>> blocks_;
  std::shared_ptr<FinalLayerImpl> final_layer_;
  std::shared_ptr<LLMAdapterImpl> llm_adapter_;  // null when config.adapter.enabled is false
  std::shared_ptr<SemanticConnectorImpl> connector_;  // null when config.connector.enabled is false
  std::once_flag connector_skipped_;                  // the "runs without its connector" line, once

  struct RopeCache {
    int64_t T = -1, H = -1, W = -1;
    at::Device device = at::kCPU;
    rope::Tables tables;
  };
  std::mutex rope_mutex_;
  RopeCache rope_cache_;
  std::vector<std::shared_ptr<ForwardListener>> forward_listeners_;
};
TORCH_MODULE(AnimaModel);

}  // namespace sluice::anima
