#pragma once
// Anima-3.8B v1.1's semantic connector ("anima_v2_connector"): Qwen3.5 conditioning on top of
// the native LLM adapter. See Note [semantic connector].
//
// Note [semantic connector]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The connector reads the hidden states of four Qwen3.5-4B layers (7, 15, 23, 31; width 2560)
// and their token mask, and the diffusion timestep (sigma in [0, 1]):
// - A timestep-aware resampler distils them into a bank of 64 tokens. The four layers are
//   concatenated along the tokens, each plus its learned layer embedding (a [1, width] row).
//   The timestep is embedded as [cos | sin] of t * 1000 * exp(-ln(1e4) k / half), k < half
//   (half = resampler width / 2, a zero column appended when the width is odd), cast to the
//   compute dtype and passed through time_mlp (Linear, SiLU, Linear). Each block then
//   computes (scale, shift) x 3 = time_modulation(SiLU(time)) and, with LN a LayerNorm
//   without affine (eps 1e-5) and LN(q) * (1 + scale) + shift its modulated form:
//     q += cross_attention(modLN(q), source_norm(features), mask)   (source_norm: LayerNorm)
//     q += self_attention(modLN(q), same)
//     q += mlp_out(SiLU(gate) * value),  (gate, value) = mlp_in(modLN(q)) split in halves
//   Its attentions are plain multi-head attention (bias-free q/k/v/o, no norms, no RoPE).
//   The bank is output_projection(output_norm(q)) in the adapter's width.
// - The native adapter's blocks run unchanged; after block i two residual cross-attentions
//   follow, both adapter attentions (per-head q/k RMSNorm, the adapter's RoPE: the query at
//   the T5 token positions, the keys at 0..S'-1 and 0..63 respectively):
//     x += quality_anchor.semantic_attentions[i](query_norms[i](x),
//              source_norms[i](sum_l softmax(layer_mix_logits[i])_l * hidden_l), mask)
//     x += v2_attentions[i](v2_query_norms[i](x), v2_semantic_norms[i](bank))
//   The mix weights are a softmax in fp32, cast to the compute dtype. The adapter's out_proj
//   and norm follow as usual.
// A fully masked batch row (all false: the reference's empty prompt) attends to nothing in
// the anchor and in the resampler's cross-attention (Note [fully masked rows]): its hidden
// states contribute nothing, and the bank it gets depends only on the timestep.
// Because the bank depends on the timestep, the context is recomputed at every denoising
// step. The math follows InvokeAI's semantic_connector.py (ported from the
// comfyui-anima-3-8B extension); docs/SEMANTIC_CONNECTOR.md records how it was checked.
//
// Tested by: tests/models/anima/test_semantic_connector.cpp.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "models/anima/config.h"
#include "models/anima/llm_adapter.h"
#include "models/anima/norms.h"
#include "offload/layer/layer.h"

namespace sluice::anima {

// The connector's inputs for one encode_text call. Shapes are checked by
// check_connector_inputs (AnimaModelImpl::encode_text calls it).
struct ConnectorInputs {
  // The Qwen3.5 hidden states: one tensor per configured layer, each [B, S', source_dim], or
  // a single stacked tensor [layers, B, S', source_dim].
  std::vector<at::Tensor> hidden;
  at::Tensor mask;       // [B, S'] (bool, or numbers: non-zero is a valid token); undefined: all valid
  at::Tensor timesteps;  // [B]: the flow timestep sigma in [0, 1] the DiT gets at this step
  bool given() const { return !hidden.empty() || mask.defined() || timesteps.defined(); }
};

// The inputs as the connector computes with them: `layers` tensors [B, S', source_dim] in
// `dtype` on `device`, the mask bool [B, S'] and timesteps fp32 [B]. Throws InvalidArgument,
// one line naming the input, for a wrong layer count or width, a batch or length that does not
// match, a mask of another shape, timesteps not [B], or a missing part.
ConnectorInputs check_connector_inputs(const ConnectorInputs& in, const ConnectorConfig& config, int64_t batch,
                                       at::ScalarType dtype, at::Device device);

// The connector's hyper-parameters from a checkpoint's "anima_v2_adapter_*" metadata, starting
// from `base` (defaults 64, 6, 2048, 16, 5632, [7, 15, 23, 31]); enabled is set. Throws
// CheckpointError naming `origin` for an architecture other than
// kConnectorArchitecture or a value that is not a positive integer (list).
ConnectorConfig connector_config_from_metadata(const std::map<std::string, std::string>& metadata,
                                               ConnectorConfig base, const std::string& origin);
// The "anima_v2_adapter_*" metadata that records `config` (what make-checkpoint writes).
std::map<std::string, std::string> connector_metadata(const ConnectorConfig& config);
inline constexpr const char* kConnectorArchitecture = "anima_qwen35_quality_anchored_semantic_connector_v2";

// [cos | sin] of t * 1000 * exp(-ln(1e4) k / half) for k < half = dim / 2, fp32 [B, dim] (a
// zero column appended for odd dim).
at::Tensor connector_timestep_embedding(const at::Tensor& timesteps, int64_t dim);

// Plain multi-head attention of the resampler: bias-free q/k/v/o, no norms, no RoPE.
class ResamplerAttentionImpl : public torch::nn::Module {
 public:
  ResamplerAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads, at::TensorOptions options);
  // query [B, L, query_dim], context [B, S, context_dim], mask bool [B, S] or undefined.
  at::Tensor forward(const at::Tensor& query, const at::Tensor& context, const at::Tensor& mask);

 private:
  int64_t num_heads_;
  offload::Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
};
TORCH_MODULE(ResamplerAttention);

class ResamplerBlockImpl : public torch::nn::Module {
 public:
  ResamplerBlockImpl(const ConnectorConfig& c, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& queries, const at::Tensor& features, const at::Tensor& time,
                     const at::Tensor& mask);

 private:
  int64_t dim_;
  LayerNorm source_norm_{nullptr};
  ResamplerAttention cross_attention_{nullptr};
  ResamplerAttention self_attention_{nullptr};
  offload::Linear mlp_in_{nullptr};
  offload::Linear mlp_out_{nullptr};
  offload::Linear time_modulation_{nullptr};
};
TORCH_MODULE(ResamplerBlock);

class SemanticResamplerImpl : public torch::nn::Module {
 public:
  SemanticResamplerImpl(const ConnectorConfig& c, int64_t output_dim, at::TensorOptions options);
  // hidden: the layers [B, S', source_dim] (compute dtype); mask bool [B, S'] or undefined;
  // timesteps fp32 [B] -> the bank [B, num_queries, output_dim].
  at::Tensor forward(const std::vector<at::Tensor>& hidden, const at::Tensor& mask, const at::Tensor& timesteps);

 private:
  ConnectorConfig config_;
  at::Tensor query_tokens_;      // [1, num_queries, resampler_dim]
  at::Tensor layer_embeddings_;  // [layers, 1, source_dim]
  offload::Linear time_in_{nullptr};   // "time_mlp.0", with bias, then SiLU ("time_mlp.1")
  offload::Linear time_out_{nullptr};  // "time_mlp.2", with bias
  std::vector<ResamplerBlock> blocks_;
  LayerNorm output_norm_{nullptr};
  offload::Linear output_projection_{nullptr};
};
TORCH_MODULE(SemanticResampler);

class SemanticConnectorImpl : public torch::nn::Module {
 public:
  // adapter: the native adapter's config (width, heads, block count, RoPE theta);
  // norm_eps: its RMSNorms' eps.
  SemanticConnectorImpl(const ConnectorConfig& c, const AdapterConfig& adapter, double norm_eps,
                        at::TensorOptions options);
  const ConnectorConfig& config() const { return config_; }

  // The native adapter's forward with the connector's cross-attentions after each block:
  // source [B, S, adapter.source_dim] and ids [B, S_t] as LLMAdapterImpl::forward; `in` as
  // check_connector_inputs returns it -> [B, S_t, model_dim].
  at::Tensor forward(LLMAdapterImpl& adapter, const at::Tensor& source, const at::Tensor& ids,
                     const ConnectorInputs& in);
  // The resampled bank alone [B, num_queries, model_dim].
  at::Tensor bank(const ConnectorInputs& in);

 private:
  ConnectorConfig config_;
  AdapterConfig adapter_;
  SemanticResampler resampler_{nullptr};
  // quality_anchor.*
  std::vector<RMSNorm> anchor_query_norms_, anchor_source_norms_;
  std::vector<AdapterAttention> anchor_attentions_;
  at::Tensor layer_mix_logits_;  // [adapter blocks, layers]
  // v2_*
  std::vector<RMSNorm> v2_query_norms_, v2_semantic_norms_;
  std::vector<AdapterAttention> v2_attentions_;
};
TORCH_MODULE(SemanticConnector);

}  // namespace sluice::anima
