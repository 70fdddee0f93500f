#pragma once
// Multi-head attention of a DiT block ("self_attn" / "cross_attn"): bias-free q/k/v/output
// projections, per-head RMSNorm on q and k, 3D RoPE on self-attention only, SDPA with the
// default 1/sqrt(head_dim) scale; cross-attention may take a mask (Note [cross-attention mask]
// in models/anima/anima.h).
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "models/anima/norms.h"
#include "models/anima/rope.h"
#include "offload/layer/layer.h"

namespace sluice::anima {

// A cross-attention mask as the attention applies it, made once per forward from the
// caller's boolean mask (AnimaModelImpl::forward; Note [cross-attention mask]).
struct AttentionMask {
  at::Tensor bias;      // [B or 1, 1, L, S] in the compute dtype: 0 where attended, -inf elsewhere; a row
                        // with no True is all 0 (so SDPA stays finite) and zeroed through `attends`
  at::Tensor attends;   // [B or 1, L, 1] bool: whether the image token attends to any context token
  bool any_empty_row = false;  // some row has no True: the output is zeroed there
};

class DiTAttentionImpl : public torch::nn::Module {
 public:
  // context_dim == query_dim for self-attention.
  DiTAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads, double norm_eps,
                   at::TensorOptions options);

  // x [B, L, query_dim] in the compute dtype. context [B, S, context_dim], or undefined
  // for self-attention. rope: 3D RoPE tables for the L tokens, or nullptr (cross-attention).
  // mask: nullptr, or a cross-attention mask for these L and S tokens.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& context, const rope::Tables* rope,
                     const AttentionMask* mask = nullptr);

 private:
  int64_t num_heads_;
  int64_t head_dim_;
  offload::Linear q_proj_{nullptr};
  RMSNorm q_norm_{nullptr};
  offload::Linear k_proj_{nullptr};
  RMSNorm k_norm_{nullptr};
  offload::Linear v_proj_{nullptr};
  offload::Linear output_proj_{nullptr};
};
TORCH_MODULE(DiTAttention);

}  // namespace sluice::anima
