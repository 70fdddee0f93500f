#include "models/anima/llm_adapter.h"

#include <memory>
#include <string>

#include "offload/layer/output_observer.h"

namespace sluice::anima {

AdapterAttentionImpl::AdapterAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads,
                                           double norm_eps, at::TensorOptions options)
    : num_heads_(num_heads), head_dim_(query_dim / num_heads) {
  q_proj_ = register_module("q_proj", offload::Linear(query_dim, query_dim, /*bias=*/false, options));
  q_norm_ = register_module("q_norm", RMSNorm(head_dim_, norm_eps, options));
  k_proj_ = register_module("k_proj", offload::Linear(context_dim, query_dim, /*bias=*/false, options));
  k_norm_ = register_module("k_norm", RMSNorm(head_dim_, norm_eps, options));
  v_proj_ = register_module("v_proj", offload::Linear(context_dim, query_dim, /*bias=*/false, options));
  o_proj_ = register_module("o_proj", offload::Linear(query_dim, query_dim, /*bias=*/false, options));
}

at::Tensor masked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  if (!mask.defined()) return at::scaled_dot_product_attention(q, k, v);
  const int64_t B = q.size(0), S = k.size(2);
  const at::Tensor m = mask.to(q.device(), at::kBool).reshape({B, 1, 1, S});
  const at::Tensor y = at::scaled_dot_product_attention(q, k, v, m);
  const at::Tensor any = m.any(-1, /*keepdim=*/true);  // [B, 1, 1, 1]
  return at::where(any, y, at::zeros({}, y.options()));
}

at::Tensor AdapterAttentionImpl::forward(const at::Tensor& x, const at::Tensor& context, const rope::Tables& rope_q,
                                         const rope::Tables& rope_k, const at::Tensor& mask) {
  const at::Tensor& src = context.defined() ? context : x;
  const int64_t B = x.size(0), L = x.size(1), S = src.size(1);
  at::Tensor q = q_norm_(q_proj_(x).view({B, L, num_heads_, head_dim_}).transpose(1, 2));
  at::Tensor k = k_norm_(k_proj_(src).view({B, S, num_heads_, head_dim_}).transpose(1, 2));
  const at::Tensor v = v_proj_(src).view({B, S, num_heads_, head_dim_}).transpose(1, 2);
  q = rope::apply_1d(q, rope_q);
  k = rope::apply_1d(k, rope_k);
  const at::Tensor y = masked_attention(q, k, v, mask);
  return o_proj_(y.transpose(1, 2).reshape({B, L, num_heads_ * head_dim_}));
}

AdapterBlockImpl::AdapterBlockImpl(const AdapterConfig& c, double norm_eps, at::TensorOptions options) {
  const int64_t d = c.model_dim;
  norm_self_attn_ = register_module("norm_self_attn", RMSNorm(d, norm_eps, options));
  self_attn_ = register_module("self_attn", AdapterAttention(d, d, c.num_heads, norm_eps, options));
  norm_cross_attn_ = register_module("norm_cross_attn", RMSNorm(d, norm_eps, options));
  cross_attn_ = register_module("cross_attn", AdapterAttention(d, c.source_dim, c.num_heads, norm_eps, options));
  norm_mlp_ = register_module("norm_mlp", RMSNorm(d, norm_eps, options));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  mlp_in_ = offload::Linear(d, d * c.mlp_ratio, /*bias=*/true, options);
  mlp_out_ = offload::Linear(d * c.mlp_ratio, d, /*bias=*/true, options);
  mlp->register_module("0", mlp_in_);
  mlp->register_module("2", mlp_out_);
}

at::Tensor AdapterBlockImpl::forward(const at::Tensor& x_in, const at::Tensor& context,
                                     const rope::Tables& rope_target, const rope::Tables& rope_source) {
  at::Tensor x = x_in;
  x = x + self_attn_(norm_self_attn_(x), at::Tensor(), rope_target, rope_target);
  x = x + cross_attn_(norm_cross_attn_(x), context, rope_target, rope_source);
  x = x + mlp_out_(at::gelu(mlp_in_(norm_mlp_(x))));
  return x;
}

LLMAdapterImpl::LLMAdapterImpl(const AdapterConfig& c, double norm_eps, at::TensorOptions options) : config_(c) {
  embed_ = register_module("embed", offload::Embedding(c.vocab_size, c.model_dim, options));
  auto blocks = register_module("blocks", std::make_shared<torch::nn::Module>());
  for (int64_t i = 0; i < c.num_blocks; ++i) {
    blocks_.push_back(blocks->register_module(std::to_string(i), AdapterBlock(c, norm_eps, options)));
  }
  out_proj_ = register_module("out_proj", offload::Linear(c.model_dim, c.model_dim, /*bias=*/true, options));
  norm_ = register_module("norm", RMSNorm(c.model_dim, norm_eps, options));
}

at::Tensor LLMAdapterImpl::forward(const at::Tensor& source, const at::Tensor& ids) {
  return forward(source, ids, AfterBlock());
}

at::Tensor LLMAdapterImpl::forward(const at::Tensor& source, const at::Tensor& ids, const AfterBlock& after_block) {
  at::Tensor x = embed_(ids).to(source.scalar_type());
  const int64_t head_dim = config_.model_dim / config_.num_heads;
  const rope::Tables target = rope::tables_1d(x.size(1), head_dim, config_.rope_theta, x.device());
  const rope::Tables src = rope::tables_1d(source.size(1), head_dim, config_.rope_theta, x.device());
  for (size_t i = 0; i < blocks_.size(); ++i) {
    x = blocks_[i](x, source, target, src);
    offload::observe_output(*blocks_[i], x);  // Note [layer output observer]
    if (after_block) x = after_block(i, x, target);
  }
  const at::Tensor y = norm_(out_proj_(x));
  offload::observe_output(*norm_, y);
  return y;
}

}  // namespace sluice::anima
