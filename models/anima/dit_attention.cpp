#include "models/anima/dit_attention.h"

namespace sluice::anima {

DiTAttentionImpl::DiTAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads, double norm_eps,
                                   at::TensorOptions options)
    : num_heads_(num_heads), head_dim_(query_dim / num_heads) {
  // Registration order is execution order (offload::managed_layers relies on it).
  q_proj_ = register_module("q_proj", offload::Linear(query_dim, query_dim, /*bias=*/false, options));
  q_norm_ = register_module("q_norm", RMSNorm(head_dim_, norm_eps, options));
  k_proj_ = register_module("k_proj", offload::Linear(context_dim, query_dim, /*bias=*/false, options));
  k_norm_ = register_module("k_norm", RMSNorm(head_dim_, norm_eps, options));
  v_proj_ = register_module("v_proj", offload::Linear(context_dim, query_dim, /*bias=*/false, options));
  output_proj_ = register_module("output_proj", offload::Linear(query_dim, query_dim, /*bias=*/false, options));
}

at::Tensor DiTAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context, const rope::Tables* rope,
                                     const AttentionMask* mask) {
  const at::Tensor& src = context.defined() ? context : x;
  const int64_t B = x.size(0), L = x.size(1), S = src.size(1);
  at::Tensor q = q_norm_(q_proj_(x).view({B, L, num_heads_, head_dim_}));
  at::Tensor k = k_norm_(k_proj_(src).view({B, S, num_heads_, head_dim_}));
  at::Tensor v = v_proj_(src).view({B, S, num_heads_, head_dim_});
  if (rope != nullptr) {
    q = rope::apply_3d(q, *rope);
    k = rope::apply_3d(k, *rope);
  }
  const std::optional<at::Tensor> bias = mask ? std::optional<at::Tensor>(mask->bias) : std::nullopt;
  const at::Tensor y = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias);
  at::Tensor out = y.transpose(1, 2).reshape({B, L, num_heads_ * head_dim_});
  // Note [cross-attention mask]: a token that attends to nothing gets nothing; output_proj has no
  // bias, so zero stays zero.
  if (mask && mask->any_empty_row) out = at::where(mask->attends, out, at::zeros({}, out.options()));
  return output_proj_(out);
}

}  // namespace sluice::anima
