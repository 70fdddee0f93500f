#pragma once
// The LLM adapter ("llm_adapter"): maps T5 token ids plus Qwen3 hidden states to the
// DiT's cross-attention context. Six pre-RMSNorm blocks of self-attention, cross-attention
// to the Qwen states and a GELU MLP, all with rotate-half RoPE (Note [adapter RoPE]).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <vector>

#include "models/anima/config.h"
#include "models/anima/norms.h"
#include "models/anima/rope.h"
#include "offload/layer/layer.h"

namespace sluice::anima {

// Attention with bias-free q/k/v/o projections and per-head RMSNorm on q and k before RoPE.
class AdapterAttentionImpl : public torch::nn::Module {
 public:
  AdapterAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads, double norm_eps,
                       at::TensorOptions options);
  // x [B, L, query_dim]; context [B, S, context_dim] or undefined (self-attention);
  // rope_q / rope_k: tables_1d for L and S positions; mask: undefined, or bool [B, S] (true:
  // attend), a row with no true entry giving zero (Note [fully masked rows]).
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const rope::Tables& rope_q,
                     const rope::Tables& rope_k, const at::Tensor& mask = {});

 private:
  int64_t num_heads_;
  int64_t head_dim_;
  offload::Linear q_proj_{nullptr};
  RMSNorm q_norm_{nullptr};
  offload::Linear k_proj_{nullptr};
  RMSNorm k_norm_{nullptr};
  offload::Linear v_proj_{nullptr};
  offload::Linear o_proj_{nullptr};
};
TORCH_MODULE(AdapterAttention);

class AdapterBlockImpl : public torch::nn::Module {
 public:
  AdapterBlockImpl(const AdapterConfig& c, double norm_eps, at::TensorOptions options);
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const rope::Tables& rope_target,
                     const rope::Tables& rope_source);

 private:
  RMSNorm norm_self_attn_{nullptr};
  AdapterAttention self_attn_{nullptr};
  RMSNorm norm_cross_attn_{nullptr};
  AdapterAttention cross_attn_{nullptr};
  RMSNorm norm_mlp_{nullptr};
  offload::Linear mlp_in_{nullptr};   // "mlp.0", with bias, followed by exact GELU ("mlp.1")
  offload::Linear mlp_out_{nullptr};  // "mlp.2", with bias
};
TORCH_MODULE(AdapterBlock);

// Multi-head attention whose context rows may be masked out, in [B, heads, L, head_dim]
// layout; mask: undefined or bool [B, S].
//
// Note [fully masked rows]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A batch row whose mask is all false (the semantic connector's encoding of an empty
// Qwen3.5 prompt) attends to nothing and its attention output is exactly zero, so with
// bias-free output projections it adds nothing to the residual. PyTorch's SDPA gives zeros
// for such rows on some backends and NaN on others; masked_attention zeroes them itself.
at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask);

class LLMAdapterImpl : public torch::nn::Module {
 public:
  LLMAdapterImpl(const AdapterConfig& c, double norm_eps, at::TensorOptions options);
  // source [B, S, source_dim] in the compute dtype, ids [B, S_t] int -> [B, S_t, model_dim]
  // (before per-token weights and padding; callers validate shapes).
  at::Tensor forward(const at::Tensor& source, const at::Tensor& ids);
  // Called after block `index` with its output and the target tokens' RoPE tables; returns the
  // stream the next block reads (the semantic connector's residual cross-attentions).
  using AfterBlock = std::function<at::Tensor(size_t index, const at::Tensor& x, const rope::Tables& rope_target)>;
  at::Tensor forward(const at::Tensor& source, const at::Tensor& ids, const AfterBlock& after_block);
  const AdapterConfig& config() const { return config_; }

 private:
  AdapterConfig config_;
  offload::Embedding embed_{nullptr};
  std::vector<AdapterBlock> blocks_;
  offload::Linear out_proj_{nullptr};
  RMSNorm norm_{nullptr};
};
TORCH_MODULE(LLMAdapter);

}  // namespace sluice::anima
