#include "models/anima/dit_block.h"

#include "models/anima/norms.h"

namespace sluice::anima {

AdaLNModulationImpl::AdaLNModulationImpl(int64_t in_dim, int64_t lora_dim, int64_t out_dim,
                                         at::TensorOptions options) {
  if (lora_dim > 0) {
    first_ = register_module("1", offload::Linear(in_dim, lora_dim, /*bias=*/false, options));
    second_ = register_module("2", offload::Linear(lora_dim, out_dim, /*bias=*/false, options));
  } else {
    first_ = register_module("1", offload::Linear(in_dim, out_dim, /*bias=*/false, options));
  }
}

at::Tensor AdaLNModulationImpl::forward(const at::Tensor& emb) {
  at::Tensor y = first_(at::silu(emb));
  return second_ ? second_(y) : y;
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden, at::TensorOptions options) {
  layer1_ = register_module("layer1", offload::Linear(dim, hidden, /*bias=*/false, options));
  layer2_ = register_module("layer2", offload::Linear(hidden, dim, /*bias=*/false, options));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x) { return layer2_(at::gelu(layer1_(x))); }

DiTBlockImpl::DiTBlockImpl(const DiTBlockOptions& o, at::TensorOptions options) : eps_(o.norm_eps) {
  // The three modulations run first in forward, so they are registered first.
  adaln_sa_ = register_module("adaln_modulation_self_attn", AdaLNModulation(o.dim, o.adaln_lora_dim, 3 * o.dim, options));
  adaln_ca_ = register_module("adaln_modulation_cross_attn", AdaLNModulation(o.dim, o.adaln_lora_dim, 3 * o.dim, options));
  adaln_mlp_ = register_module("adaln_modulation_mlp", AdaLNModulation(o.dim, o.adaln_lora_dim, 3 * o.dim, options));
  self_attn_ = register_module("self_attn", DiTAttention(o.dim, o.dim, o.num_heads, o.norm_eps, options));
  cross_attn_ = register_module("cross_attn", DiTAttention(o.dim, o.context_dim, o.num_heads, o.norm_eps, options));
  mlp_ = register_module("mlp", FeedForward(o.dim, o.dim * o.mlp_ratio, options));
}

std::vector<at::Tensor> adaln_chunks(AdaLNModulation& modulation, const at::Tensor& t_emb,
                                     const at::Tensor& adaln_lora, int64_t n) {
  at::Tensor m = modulation(t_emb);
  if (adaln_lora.defined()) m = m + adaln_lora.narrow(-1, 0, m.size(-1));
  return m.chunk(n, -1);
}

at::Tensor DiTBlockImpl::forward(const at::Tensor& x_in, const at::Tensor& t_emb, const at::Tensor& context,
                                 const rope::Tables& rope, const at::Tensor& adaln_lora,
                                 const AttentionMask* cross_mask) {
  const at::ScalarType residual = x_in.scalar_type();
  const at::ScalarType compute = t_emb.scalar_type();
  const auto sa = adaln_chunks(adaln_sa_, t_emb, adaln_lora, 3);  // shift, scale, gate
  const auto ca = adaln_chunks(adaln_ca_, t_emb, adaln_lora, 3);
  const auto ff = adaln_chunks(adaln_mlp_, t_emb, adaln_lora, 3);
  auto modulate = [&](const at::Tensor& x, const std::vector<at::Tensor>& m) {
    return (layer_norm_no_affine(x, eps_) * (1 + m[1]) + m[0]).to(compute);
  };

  at::Tensor x = x_in;
  at::Tensor r = self_attn_(modulate(x, sa), at::Tensor(), &rope);
  x = x + sa[2].to(residual) * r.to(residual);
  r = cross_attn_(modulate(x, ca), context, nullptr, cross_mask);
  x = r.to(residual) * ca[2].to(residual) + x;
  r = mlp_(modulate(x, ff));
  x = x + ff[2].to(residual) * r.to(residual);
  return x;
}

}  // namespace sluice::anima
