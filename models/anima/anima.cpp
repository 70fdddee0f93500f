#include "models/anima/anima.h"

#include <ATen/core/grad_mode.h>
#include <algorithm>
#include <c10/util/irange.h>

#include <limits>


#include "models/anima/dit_block.h"
#include "models/anima/embedders.h"
#include "models/anima/llm_adapter.h"
#include "models/anima/norms.h"
#include "models/anima/semantic_connector.h"
#include "offload/layer/layer.h"
#include "offload/layer/output_observer.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/shape_str.h"

namespace sluice::anima {
namespace {

std::string shape_str(const at::Tensor& t) { return sluice::shape_str(t.sizes()); }

bool is_compute_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void require_defined(const at::Tensor& t, const char* name) {
  if (!t.defined()) throw InvalidArgument(std::string(name) + " is an undefined tensor");
}

void require_floating(const at::Tensor& t, const char* name) {
  if (!at::isFloatingType(t.scalar_type())) {
    throw InvalidArgument(std::string(name) + " must be a floating-point tensor, got " +
                          c10::toString(t.scalar_type()));
  }
}

void require_compute_dtype(const at::Tensor& t, const char* name, at::ScalarType compute) {
  if (t.scalar_type() != compute) {
    throw InvalidArgument(std::string(name) + " has dtype " + c10::toString(t.scalar_type()) +
                          ", the model computes in " + c10::toString(compute) +
                          " (convert the input or call set_compute_dtype)");
  }
}

// Note [cross-attention mask]: which blocks a mask applies to, one flag per block; refuses an
// index out of range and a mask that is not boolean, before any compute.
std::vector<char> cross_mask_blocks(const CrossAttnMask& m, int64_t num_blocks) {
  std::vector<char> on(static_cast<size_t>(num_blocks), 0);
  for (const int64_t i : m.blocks) {
    if (i < 0 || i >= num_blocks) {
      throw InvalidArgument("mask_blocks has block " + std::to_string(i) + ", the model has " +
                            std::to_string(num_blocks) + " blocks (0.." + std::to_string(num_blocks - 1) + ")");
    }
    on[static_cast<size_t>(i)] = 1;
  }
  if (m.blocks.empty()) {
    for (int64_t i = 0; i < num_blocks; i += 2) on[static_cast<size_t>(i)] = 1;
  }
  if (m.mask.defined() && m.mask.scalar_type() != at::kBool) {
    throw InvalidArgument("cross_attn_mask has dtype " + std::string(c10::toString(m.mask.scalar_type())) +
                          ", expected Bool (True: the image token attends to the context token)");
  }
  return on;
}

// The additive form of a boolean [L, S] or [B, L, S] mask for L image tokens and S context
// tokens; `grid` says how L came about, for the error.
AttentionMask make_attention_mask(const at::Tensor& mask, int64_t B, int64_t L, int64_t S, const std::string& grid,
                                  at::ScalarType dtype, at::Device device) {
  const bool ok = (mask.dim() == 2 && mask.size(0) == L && mask.size(1) == S) ||
                  (mask.dim() == 3 && mask.size(0) == B && mask.size(1) == L && mask.size(2) == S);
  if (!ok) {
    throw InvalidArgument("cross_attn_mask has shape " + shape_str(mask) + ", expected [L, S] = [" +
                          std::to_string(L) + ", " + std::to_string(S) + "] or [" + std::to_string(B) + ", " +
                          std::to_string(L) + ", " + std::to_string(S) + "] (L = image tokens " + grid +
                          ", S = context tokens)");
  }
  // Rows are checked where the mask is (the host, usually: no wait for the device).
  const at::Tensor m0 = mask.dim() == 2 ? mask.unsqueeze(0) : mask;  // [B or 1, L, S]
  const at::Tensor attends = m0.any(-1, /*keepdim=*/true);           // [B or 1, L, 1]
  AttentionMask out;
  out.any_empty_row = !attends.all().item<bool>();
  out.attends = attends.to(device);
  const at::Tensor m = m0.to(device);
  const at::Tensor allowed = out.any_empty_row ? m.logical_or(out.attends.logical_not()) : m;
  out.bias = at::zeros(allowed.sizes(), at::TensorOptions().dtype(dtype).device(device))
                 .masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity())
                 .unsqueeze(1);  // [B or 1, 1, L, S]
  return out;
}

}  // namespace

const std::vector<std::string>& declared_fp8_skips() {
  static const std::vector<std::string> skips = {"t_embedder", "x_embedder", "final_layer"};
  return skips;
}

Fp16Verdict fp16_verdict() {
  // docs/BENCHMARKS.md, "Compute dtype": with random weights fp16 is ~10x closer to fp32
  // than bf16 and its activations peak at 1e-4 of its range (65504); the fp16 sweep
  // overflows only when every Linear weight is x8, which compounds through the adaLN and
  // MLP chains. Trained DiT weights carry outliers that random ones do not, and none were
  // at hand to measure, so auto keeps fp32 where bf16 is not native.
  return {false,
          "Anima's fp16 range is unmeasured on trained weights (random weights peak at 1e-4 of fp16's 65504, "
          "sluice_bench_compute), so auto keeps fp32; --compute float16 runs it, and a non-finite output is named "
          "with its first layer"};
}

AnimaModelImpl::AnimaModelImpl(AnimaConfig config, BuildOptions options)
    : config_(std::move(config)), compute_dtype_(options.dtype) {
  if (!is_compute_dtype(options.dtype)) {
    // Norm scales must not be stored in fp8 (Note [layerwise storage]); fp8 storage is applied to the
    // ManagedLayers after building.
    throw InvalidArgument(std::string("model dtype must be Float, BFloat16 or Half, got ") +
                          c10::toString(options.dtype));
  }
  config_.validate();
  rope::split_3d(config_.head_dim());  // rejects head sizes 3D RoPE cannot split
  const auto topts = at::TensorOptions().dtype(options.dtype).device(options.device);
  const AnimaConfig& c = config_;
  const int64_t D = c.model_channels;
  const int64_t lora = c.use_adaln_lora ? c.adaln_lora_dim : 0;

  x_embedder_ = register_module(
      "x_embedder", std::make_shared<PatchEmbedImpl>(c.in_channels + (c.concat_padding_mask ? 1 : 0), c.patch_spatial,
                                                     c.patch_temporal, D, topts));
  t_embedder_ = register_module("t_embedder", std::make_shared<TimestepEmbedderImpl>(D, c.use_adaln_lora, topts));
  t_embedding_norm_ = register_module("t_embedding_norm", std::make_shared<RMSNormImpl>(D, c.norm_eps, topts));
  DiTBlockOptions bo;
  bo.dim = D;
  bo.context_dim = c.crossattn_emb_channels;
  bo.num_heads = c.num_heads;
  bo.mlp_ratio = c.mlp_ratio;
  bo.adaln_lora_dim = lora;
  bo.norm_eps = c.norm_eps;
  auto blocks = register_module("blocks", std::make_shared<torch::nn::Module>());
  for (const auto i : c10::irange(c.num_blocks)) {
    blocks_.push_back(blocks->register_module(std::to_string(i), std::make_shared<DiTBlockImpl>(bo, topts)));
  }
  const int64_t out_features = c.patch_spatial * c.patch_spatial * c.patch_temporal * c.out_channels;
  final_layer_ = register_module("final_layer",
                                 std::make_shared<FinalLayerImpl>(D, out_features, lora, c.norm_eps, topts));
  if (c.adapter.enabled) {
    llm_adapter_ = register_module("llm_adapter", std::make_shared<LLMAdapterImpl>(c.adapter, c.norm_eps, topts));
  }
  if (c.connector.enabled) {
    connector_ = register_module("anima_v2_connector",
                                 std::make_shared<SemanticConnectorImpl>(c.connector, c.adapter, c.norm_eps, topts));
  }

  int64_t index = 0;
  for (auto& [name, layer] : offload::managed_layers(*this)) {
    layer->set_qualified_name(name);
    layer->set_layer_index(index++);
    layer->set_compute_dtype(compute_dtype_);
  }
}

void AnimaModelImpl::set_compute_dtype(at::ScalarType dtype) {
  if (!is_compute_dtype(dtype)) {
    throw InvalidArgument(std::string("compute dtype must be Float, BFloat16 or Half, got ") + c10::toString(dtype));
  }
  compute_dtype_ = dtype;
  for (auto& [name, layer] : offload::managed_layers(*this)) layer->set_compute_dtype(dtype);
}

void AnimaModelImpl::add_forward_listener(std::shared_ptr<ForwardListener> listener) {
  forward_listeners_.push_back(std::move(listener));
}

void AnimaModelImpl::remove_forward_listener(const ForwardListener* listener) {
  auto& v = forward_listeners_;
  v.erase(std::remove_if(v.begin(), v.end(), [&](const auto& l) { return l.get() == listener; }), v.end());
}

rope::Tables AnimaModelImpl::rope_tables(int64_t T, int64_t H, int64_t W, at::Device device) {
  std::lock_guard<std::mutex> lock(rope_mutex_);
  RopeCache& cache = rope_cache_;
  if (cache.T != T || cache.H != H || cache.W != W || cache.device != device) {
    rope::Params3D p;
    p.head_dim = config_.head_dim();
    p.theta = config_.rope_theta;
    p.t_ratio = config_.rope_t_extrapolation_ratio;
    p.h_ratio = config_.rope_h_extrapolation_ratio;
    p.w_ratio = config_.rope_w_extrapolation_ratio;
    cache.tables = rope::tables_3d(T, H, W, p, device);
    cache.T = T;
    cache.H = H;
    cache.W = W;
    cache.device = device;
  }
  return cache.tables;
}

at::Tensor AnimaModelImpl::forward(const at::Tensor& x, const at::Tensor& timesteps, const at::Tensor& context) {
  return forward(x, timesteps, context, CrossAttnMask{});
}

at::Tensor AnimaModelImpl::forward(const at::Tensor& x_in, const at::Tensor& timesteps, const at::Tensor& context,
                                   const CrossAttnMask& cross_attn) {
  const AnimaConfig& c = config_;
  require_defined(x_in, "x");
  require_defined(timesteps, "timesteps");
  require_defined(context, "context");
  if (x_in.dim() != 5) {
    throw InvalidArgument("x must be [B,C,T,H,W], got shape " + shape_str(x_in));
  }
  if (x_in.size(1) != c.in_channels) {
    throw InvalidArgument("x has " + std::to_string(x_in.size(1)) + " channels, model expects " +
                          std::to_string(c.in_channels) + " (x shape " + shape_str(x_in) + ")");
  }
  if (x_in.numel() == 0) throw InvalidArgument("x has an empty dimension: shape " + shape_str(x_in));
  require_floating(x_in, "x");
  require_compute_dtype(x_in, "x", compute_dtype_);
  const int64_t B = x_in.size(0);
  if (timesteps.dim() != 1 || timesteps.size(0) != B) {
    throw InvalidArgument("timesteps has shape " + shape_str(timesteps) + ", expected [" + std::to_string(B) +
                          "] (one per batch item of x " + shape_str(x_in) + ")");
  }
  if (timesteps.is_complex() || timesteps.scalar_type() == at::kBool) {
    throw InvalidArgument("timesteps must be real numbers, got " + std::string(c10::toString(timesteps.scalar_type())));
  }
  if (context.dim() != 3 || context.size(0) != B || context.size(1) == 0 ||
      context.size(2) != c.crossattn_emb_channels) {
    throw InvalidArgument("context has shape " + shape_str(context) + ", model expects [" + std::to_string(B) +
                          ", S, " + std::to_string(c.crossattn_emb_channels) + "]");
  }
  require_floating(context, "context");
  const std::vector<char> masked_blocks = cross_mask_blocks(cross_attn, c.num_blocks);

  at::NoGradGuard no_grad;
  const at::ScalarType compute = compute_dtype_;
  const at::Device device = x_in.device();
  const at::Tensor ctx = context.to(device, compute);
  const int64_t T0 = x_in.size(2), H0 = x_in.size(3), W0 = x_in.size(4);
  const int64_t pt = c.patch_temporal, ps = c.patch_spatial;
  const int64_t pad_t = (pt - T0 % pt) % pt, pad_h = (ps - H0 % ps) % ps, pad_w = (ps - W0 % ps) % ps;
  at::Tensor x = (pad_t || pad_h || pad_w) ? at::constant_pad_nd(x_in, {0, pad_w, 0, pad_h, 0, pad_t}, 0) : x_in;
  if (c.concat_padding_mask) {
    x = at::cat({x, at::zeros({B, 1, x.size(2), x.size(3), x.size(4)}, x.options())}, 1);
  }
  const int64_t T = x.size(2) / pt, H = x.size(3) / ps, W = x.size(4) / ps;
  for (const auto& l : forward_listeners_) l->begin_forward(T, x.size(3), x.size(4), device, compute);

  std::optional<AttentionMask> cross_mask;
  if (cross_attn.mask.defined()) {
    const std::string grid = std::to_string(T) + "*" + std::to_string(H) + "*" + std::to_string(W) + " of x " +
                             shape_str(x_in) + ", padded to the patch grid";
    cross_mask = make_attention_mask(cross_attn.mask, B, T * H * W, ctx.size(1), grid, compute, device);
  }
  at::Tensor tokens = x_embedder_->forward(x);  // [B, T*H*W, D]
  const rope::Tables rope = rope_tables(T, H, W, device);
  const at::Tensor sinusoid = timestep_sinusoid(timesteps.to(device), c.model_channels).to(tokens.scalar_type());
  auto [sample, emb] = t_embedder_->forward(sinusoid);
  const at::Tensor t_emb = t_embedding_norm_->forward(sample);
  // Note [layer output observer]: the block-level outputs, beside the layers' own.
  offload::observe_output(*t_embedding_norm_, t_emb);
  const at::Tensor& adaln_lora = emb;  // undefined without adaLN-LoRA
  // fp16 cannot hold the residual stream's range over 28 blocks; the reference keeps it in fp32.
  if (tokens.scalar_type() == at::kHalf) tokens = tokens.to(at::kFloat);
  for (const auto i : c10::irange(blocks_.size())) {
    auto& block = blocks_[i];
    const AttentionMask* block_mask = cross_mask && masked_blocks[i] ? &*cross_mask : nullptr;
    tokens = block->forward(tokens, t_emb, ctx, rope, adaln_lora, block_mask);
    offload::observe_output(*block, tokens);
  }
  const at::Tensor out = final_layer_->forward(tokens.to(compute), t_emb, adaln_lora);
  offload::observe_output(*final_layer_, out);

  // Unpatchify B (T H W) (p1 p2 t C) -> B C (T t) (H p1) (W p2): note the channel is the
  // innermost factor here, unlike the patchify order (c r m n).
  const int64_t C = c.out_channels;
  const at::Tensor video = out.view({B, T, H, W, ps, ps, pt, C})
                               .permute({0, 7, 1, 6, 2, 4, 3, 5})
                               .reshape({B, C, T * pt, H * ps, W * ps});
  return video.narrow(2, 0, T0).narrow(3, 0, H0).narrow(4, 0, W0).contiguous();
}

at::Tensor AnimaModelImpl::encode_text(const at::Tensor& qwen_hidden, const at::Tensor& t5_ids,
                                       const std::optional<at::Tensor>& t5_weights,
                                       const ConnectorInputs* connector) {
  const AdapterConfig& a = config_.adapter;
  if (!llm_adapter_) {
    throw InvalidArgument("model '" + config_.name + "' has no LLM adapter (DiT-only); encode_text is unavailable");
  }
  require_defined(qwen_hidden, "qwen_hidden");
  require_defined(t5_ids, "t5_ids");
  if (qwen_hidden.dim() != 3 || qwen_hidden.size(1) == 0 || qwen_hidden.size(2) != a.source_dim) {
    throw InvalidArgument("qwen_hidden has shape " + shape_str(qwen_hidden) + ", adapter expects [B, S, " +
                          std::to_string(a.source_dim) + "]");
  }
  require_floating(qwen_hidden, "qwen_hidden");
  require_compute_dtype(qwen_hidden, "qwen_hidden", compute_dtype_);
  const int64_t B = qwen_hidden.size(0);
  if (t5_ids.dim() != 2 || t5_ids.size(0) != B || t5_ids.size(1) == 0) {
    throw InvalidArgument("t5_ids has shape " + shape_str(t5_ids) + ", expected [" + std::to_string(B) +
                          ", S_t] (batch of qwen_hidden " + shape_str(qwen_hidden) + ")");
  }
  if (t5_ids.scalar_type() != at::kLong && t5_ids.scalar_type() != at::kInt) {
    throw InvalidArgument("t5_ids must be int32 or int64, got " + std::string(c10::toString(t5_ids.scalar_type())));
  }
  const int64_t St = t5_ids.size(1);
  if (St > a.output_tokens) {
    throw InvalidArgument("t5_ids has " + std::to_string(St) + " tokens, more than the adapter's " +
                          std::to_string(a.output_tokens) + " output tokens");
  }
  const int64_t lo = t5_ids.min().item<int64_t>(), hi = t5_ids.max().item<int64_t>();
  if (lo < 0 || hi >= a.vocab_size) {
    throw InvalidArgument("t5_ids contains id " + std::to_string(lo < 0 ? lo : hi) + ", outside the vocabulary [0, " +
                          std::to_string(a.vocab_size) + ")");
  }
  at::Tensor weights;
  if (t5_weights) {
    weights = *t5_weights;
    require_defined(weights, "t5_weights");
    const bool ok = (weights.dim() == 2 || (weights.dim() == 3 && weights.size(2) == 1)) && weights.size(0) == B &&
                    weights.size(1) == St;
    if (!ok) {
      throw InvalidArgument("t5_weights has shape " + shape_str(weights) + ", expected [" + std::to_string(B) + ", " +
                            std::to_string(St) + "] like t5_ids");
    }
    require_floating(weights, "t5_weights");
  }

  const bool use_connector = connector && connector->given();
  if (use_connector && !connector_) {
    throw InvalidArgument("model '" + config_.name +
                          "' has no semantic connector (no anima_v2_connector.* weights); its Qwen3.5 inputs "
                          "cannot be used");
  }
  ConnectorInputs semantic;
  if (use_connector) {
    semantic = check_connector_inputs(*connector, config_.connector, B, compute_dtype_, qwen_hidden.device());
  } else if (connector_) {
    std::call_once(connector_skipped_, [&] {
      log::info("model '" + config_.name +
                "': no Qwen3.5 inputs given, so its semantic connector is skipped and the native LLM adapter "
                "runs alone");
    });
  }

  at::NoGradGuard no_grad;
  const at::Device device = qwen_hidden.device();
  // [B, S_t, model_dim]
  at::Tensor out = use_connector ? connector_->forward(*llm_adapter_, qwen_hidden, t5_ids.to(device), semantic)
                                 : llm_adapter_->forward(qwen_hidden, t5_ids.to(device));
  if (weights.defined()) out = out * weights.to(device, out.scalar_type()).reshape({B, St, 1});
  if (St < a.output_tokens) out = at::constant_pad_nd(out, {0, 0, 0, a.output_tokens - St}, 0);
  return out;
}

}  // namespace sluice::anima
