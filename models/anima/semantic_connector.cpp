#include "models/anima/semantic_connector.h"

#include <c10/util/irange.h>

#include <cmath>
#include <memory>
#include <string>

#include "models/anima/rope.h"
#include "offload/layer/output_observer.h"
#include "runtime/error.h"
#include "runtime/shape_str.h"

namespace sluice::anima {
namespace {

// nn.LayerNorm's default eps: the resampler's norms (Note [semantic connector]).
constexpr double kLayerNormEps = 1e-5;

std::string shape_of(const at::Tensor& t) { return shape_str(t.sizes()); }

// One positive integer of the metadata, or `fallback` when absent.
int64_t positive(const std::map<std::string, std::string>& m, const std::string& key, int64_t fallback,
                 const std::string& origin) {
  const auto it = m.find(key);
  if (it == m.end()) return fallback;
  try {
    size_t used = 0;
    const long long v = std::stoll(it->second, &used);
    if (used == it->second.size() && v > 0) return v;
  } catch (const std::exception&) {
  }
  throw CheckpointError("checkpoint '" + origin + "': metadata " + key + " = '" + it->second +
                        "' is not a positive integer");
}

// "[7, 15, 23, 31]" (or without brackets) -> {7, 15, 23, 31}.
std::vector<int64_t> index_list(const std::string& raw, const std::string& key, const std::string& origin) {
  std::string s = raw;
  for (char& ch : s)
    if (ch == '[' || ch == ']' || ch == ',') ch = ' ';
  std::vector<int64_t> out;
  size_t pos = 0;
  while (pos < s.size()) {
    while (pos < s.size() && s[pos] == ' ') ++pos;
    if (pos >= s.size()) break;
    size_t end = s.find(' ', pos);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(pos, end - pos);
    try {
      size_t used = 0;
      const long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw CheckpointError("checkpoint '" + origin + "': metadata " + key + " = '" + raw +
                            "' is not a list of layer indices");
    }
    pos = end;
  }
  if (out.empty()) {
    throw CheckpointError("checkpoint '" + origin + "': metadata " + key + " = '" + raw + "' names no layer");
  }
  return out;
}

// LN(x) * (1 + scale) + shift, scale and shift [B, dim] (the resampler's modulated norm).
at::Tensor modulated_norm(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
  return layer_norm_no_affine(x, kLayerNormEps) * (1.0 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

std::shared_ptr<torch::nn::Module> list(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

}  // namespace

ConnectorConfig connector_config_from_metadata(const std::map<std::string, std::string>& metadata,
                                               ConnectorConfig base, const std::string& origin) {
  if (const auto it = metadata.find("anima_v2_adapter_architecture");
      it != metadata.end() && it->second != kConnectorArchitecture) {
    throw CheckpointError("checkpoint '" + origin + "': unknown semantic connector architecture '" + it->second +
                          "' (anima_v2_adapter_architecture; sluice runs " + kConnectorArchitecture + ")");
  }
  ConnectorConfig c = std::move(base);
  c.enabled = true;
  c.num_queries = positive(metadata, "anima_v2_adapter_semantic_query_tokens", c.num_queries, origin);
  c.resampler_blocks = positive(metadata, "anima_v2_adapter_semantic_resampler_blocks", c.resampler_blocks, origin);
  c.resampler_dim = positive(metadata, "anima_v2_adapter_semantic_resampler_dim", c.resampler_dim, origin);
  c.resampler_heads = positive(metadata, "anima_v2_adapter_semantic_resampler_heads", c.resampler_heads, origin);
  c.mlp_hidden_dim =
      positive(metadata, "anima_v2_adapter_semantic_resampler_mlp_hidden_dim", c.mlp_hidden_dim, origin);
  if (const auto it = metadata.find("anima_v2_adapter_layer_indices"); it != metadata.end()) {
    c.layer_indices = index_list(it->second, it->first, origin);
  }
  return c;
}

std::map<std::string, std::string> connector_metadata(const ConnectorConfig& c) {
  std::string layers = "[";
  for (size_t i = 0; i < c.layer_indices.size(); ++i) layers += (i ? ", " : "") + std::to_string(c.layer_indices[i]);
  layers += "]";
  return {{"anima_v2_adapter_architecture", kConnectorArchitecture},
          {"anima_v2_adapter_semantic_query_tokens", std::to_string(c.num_queries)},
          {"anima_v2_adapter_semantic_resampler_blocks", std::to_string(c.resampler_blocks)},
          {"anima_v2_adapter_semantic_resampler_dim", std::to_string(c.resampler_dim)},
          {"anima_v2_adapter_semantic_resampler_heads", std::to_string(c.resampler_heads)},
          {"anima_v2_adapter_semantic_resampler_mlp_hidden_dim", std::to_string(c.mlp_hidden_dim)},
          {"anima_v2_adapter_layer_indices", layers}};
}

ConnectorInputs check_connector_inputs(const ConnectorInputs& in, const ConnectorConfig& c, int64_t batch,
                                       at::ScalarType dtype, at::Device device) {
  const int64_t layers = static_cast<int64_t>(c.layer_indices.size());
  std::vector<at::Tensor> hidden = in.hidden;
  if (hidden.empty()) {
    throw InvalidArgument("semantic connector: the Qwen3.5 hidden states are missing (qwen35_hidden: " +
                          std::to_string(layers) + " layers)");
  }
  for (const auto& h : hidden) {
    if (!h.defined()) throw InvalidArgument("semantic connector: a Qwen3.5 hidden-state tensor is undefined");
  }
  if (hidden.size() == 1 && hidden[0].dim() == 4) hidden = hidden[0].unbind(0);
  if (static_cast<int64_t>(hidden.size()) != layers) {
    throw InvalidArgument("semantic connector: got " + std::to_string(hidden.size()) +
                          " Qwen3.5 hidden-state layers, the connector reads " + std::to_string(layers));
  }
  const int64_t S = hidden[0].dim() == 3 ? hidden[0].size(1) : -1;
  for (const auto i : c10::irange(layers)) {
    const at::Tensor& h = hidden[i];
    if (h.dim() != 3 || h.size(0) != batch || h.size(1) != S || S == 0) {
      throw InvalidArgument("semantic connector: Qwen3.5 hidden layer " + std::to_string(i) + " has shape " +
                            shape_of(h) + ", expected [" + std::to_string(batch) + ", S', " +
                            std::to_string(c.source_dim) + "] with S' equal for every layer");
    }
    if (h.size(2) != c.source_dim) {
      throw InvalidArgument("semantic connector: Qwen3.5 hidden layer " + std::to_string(i) + " has width " +
                            std::to_string(h.size(2)) + ", the connector reads " + std::to_string(c.source_dim));
    }
    if (!at::isFloatingType(h.scalar_type())) {
      throw InvalidArgument("semantic connector: Qwen3.5 hidden layer " + std::to_string(i) + " has dtype " +
                            c10::toString(h.scalar_type()) + ", expected a floating-point dtype");
    }
  }
  ConnectorInputs out;
  for (auto& h : hidden) out.hidden.push_back(h.to(device, dtype));
  if (in.mask.defined()) {
    if (in.mask.dim() != 2 || in.mask.size(0) != batch || in.mask.size(1) != S) {
      throw InvalidArgument("semantic connector: qwen35_mask has shape " + shape_of(in.mask) + ", expected [" +
                            std::to_string(batch) + ", " + std::to_string(S) + "] like the hidden states");
    }
    if (in.mask.is_complex()) throw InvalidArgument("semantic connector: qwen35_mask must be bool or real numbers");
    out.mask = in.mask.scalar_type() == at::kBool ? in.mask.to(device) : in.mask.to(device).ne(0);
  }
  if (!in.timesteps.defined()) {
    throw InvalidArgument("semantic connector: the timestep is missing (the connector depends on it)");
  }
  if (in.timesteps.dim() != 1 || in.timesteps.size(0) != batch || in.timesteps.is_complex() ||
      in.timesteps.scalar_type() == at::kBool) {
    throw InvalidArgument("semantic connector: timesteps has shape " + shape_of(in.timesteps) + " (" +
                          c10::toString(in.timesteps.scalar_type()) + "), expected [" + std::to_string(batch) +
                          "] real numbers");
  }
  out.timesteps = in.timesteps.to(device, at::kFloat);
  return out;
}

at::Tensor connector_timestep_embedding(const at::Tensor& timesteps, int64_t dim) {
  const int64_t half = dim / 2;
  const auto fopts = at::TensorOptions().dtype(at::kFloat).device(timesteps.device());
  const at::Tensor freqs = at::exp(at::arange(half, fopts) * (-std::log(10000.0) / std::max<int64_t>(half, 1)));
  const at::Tensor angles = timesteps.to(at::kFloat).reshape({-1, 1}) * 1000.0 * freqs.reshape({1, -1});
  at::Tensor emb = at::cat({angles.cos(), angles.sin()}, -1);
  if (dim % 2) emb = at::constant_pad_nd(emb, {0, 1}, 0);
  return emb;
}

ResamplerAttentionImpl::ResamplerAttentionImpl(int64_t query_dim, int64_t context_dim, int64_t num_heads,
                                               at::TensorOptions options)
    : num_heads_(num_heads) {
  q_proj_ = register_module("q_proj", offload::Linear(query_dim, query_dim, false, options));
  k_proj_ = register_module("k_proj", offload::Linear(context_dim, query_dim, false, options));
  v_proj_ = register_module("v_proj", offload::Linear(context_dim, query_dim, false, options));
  o_proj_ = register_module("o_proj", offload::Linear(query_dim, query_dim, false, options));
}

at::Tensor ResamplerAttentionImpl::forward(const at::Tensor& query, const at::Tensor& context,
                                           const at::Tensor& mask) {
  const int64_t B = query.size(0), L = query.size(1), S = context.size(1), D = query.size(2);
  const int64_t hd = D / num_heads_;
  auto heads = [&](const at::Tensor& t, int64_t n) { return t.view({B, n, num_heads_, hd}).transpose(1, 2); };
  const at::Tensor y = masked_attention(heads(q_proj_(query), L), heads(k_proj_(context), S),
                                        heads(v_proj_(context), S), mask);
  return o_proj_(y.transpose(1, 2).reshape({B, L, D}));
}

ResamplerBlockImpl::ResamplerBlockImpl(const ConnectorConfig& c, at::TensorOptions options) : dim_(c.resampler_dim) {
  const int64_t d = c.resampler_dim;
  // Registered in the reference's order (its module tree), which is also the order of use
  // except for the modulation, computed first.
  source_norm_ = register_module("source_norm", LayerNorm(c.source_dim, kLayerNormEps, options));
  cross_attention_ = register_module("cross_attention", ResamplerAttention(d, c.source_dim, c.resampler_heads, options));
  self_attention_ = register_module("self_attention", ResamplerAttention(d, d, c.resampler_heads, options));
  mlp_in_ = register_module("mlp_in", offload::Linear(d, 2 * c.mlp_hidden_dim, false, options));
  mlp_out_ = register_module("mlp_out", offload::Linear(c.mlp_hidden_dim, d, false, options));
  time_modulation_ = register_module("time_modulation", offload::Linear(d, 6 * d, true, options));
}

at::Tensor ResamplerBlockImpl::forward(const at::Tensor& queries_in, const at::Tensor& features,
                                       const at::Tensor& time, const at::Tensor& mask) {
  const std::vector<at::Tensor> m = time_modulation_(at::silu(time)).chunk(6, -1);
  at::Tensor q = queries_in;
  q = q + cross_attention_(modulated_norm(q, m[0], m[1]), source_norm_(features), mask);
  const at::Tensor n = modulated_norm(q, m[2], m[3]);
  q = q + self_attention_(n, n, at::Tensor());
  const std::vector<at::Tensor> gv = mlp_in_(modulated_norm(q, m[4], m[5])).chunk(2, -1);
  return q + mlp_out_(at::silu(gv[0]) * gv[1]);
}

SemanticResamplerImpl::SemanticResamplerImpl(const ConnectorConfig& c, int64_t output_dim, at::TensorOptions options)
    : config_(c) {
  const int64_t d = c.resampler_dim;
  const int64_t layers = static_cast<int64_t>(c.layer_indices.size());
  query_tokens_ = register_parameter("query_tokens", at::zeros({1, c.num_queries, d}, options), false);
  layer_embeddings_ = register_parameter("layer_embeddings", at::zeros({layers, 1, c.source_dim}, options), false);
  auto time_mlp = list(*this, "time_mlp");
  time_in_ = time_mlp->register_module("0", offload::Linear(d, d, true, options));
  time_out_ = time_mlp->register_module("2", offload::Linear(d, d, true, options));
  auto blocks = list(*this, "blocks");
  for (const auto i : c10::irange(c.resampler_blocks)) {
    blocks_.push_back(blocks->register_module(std::to_string(i), ResamplerBlock(c, options)));
  }
  output_norm_ = register_module("output_norm", LayerNorm(d, kLayerNormEps, options));
  output_projection_ = register_module("output_projection", offload::Linear(d, output_dim, false, options));
}

at::Tensor SemanticResamplerImpl::forward(const std::vector<at::Tensor>& hidden, const at::Tensor& mask,
                                          const at::Tensor& timesteps) {
  const at::Tensor& h0 = hidden.at(0);
  const int64_t B = h0.size(0);
  const at::Tensor emb = layer_embeddings_.to(h0.device(), h0.scalar_type());
  std::vector<at::Tensor> parts;
  for (const auto i : c10::irange(hidden.size())) parts.push_back(hidden[i] + emb[i].unsqueeze(0));
  const at::Tensor features = at::cat(parts, 1);  // [B, layers * S', source_dim]
  at::Tensor feature_mask;
  if (mask.defined()) feature_mask = at::cat(std::vector<at::Tensor>(hidden.size(), mask), 1);
  const at::Tensor sinusoid = connector_timestep_embedding(timesteps, config_.resampler_dim).to(h0.scalar_type());
  const at::Tensor time = time_out_(at::silu(time_in_(sinusoid)));
  at::Tensor q = query_tokens_.to(h0.device(), h0.scalar_type()).expand({B, -1, -1});
  for (auto& block : blocks_) {
    q = block(q, features, time, feature_mask);
    offload::observe_output(*block, q);  // Note [layer output observer]
  }
  return output_projection_(output_norm_(q));
}

SemanticConnectorImpl::SemanticConnectorImpl(const ConnectorConfig& c, const AdapterConfig& a, double norm_eps,
                                             at::TensorOptions options)
    : config_(c), adapter_(a) {
  const int64_t d = a.model_dim;
  const int64_t layers = static_cast<int64_t>(c.layer_indices.size());
  // The resampler runs first (its bank feeds every v2 attention): registered first, so that
  // managed_layers() follows the order of use as far as a module tree can.
  resampler_ = register_module("semantic_resampler", SemanticResampler(c, d, options));
  auto anchor = list(*this, "quality_anchor");
  auto query_norms = list(*anchor, "query_norms");
  auto source_norms = list(*anchor, "source_norms");
  auto attentions = list(*anchor, "semantic_attentions");
  for (const auto i : c10::irange(a.num_blocks)) {
    const std::string n = std::to_string(i);
    anchor_query_norms_.push_back(query_norms->register_module(n, RMSNorm(d, norm_eps, options)));
    anchor_source_norms_.push_back(source_norms->register_module(n, RMSNorm(c.source_dim, norm_eps, options)));
    anchor_attentions_.push_back(
        attentions->register_module(n, AdapterAttention(d, c.source_dim, a.num_heads, norm_eps, options)));
  }
  layer_mix_logits_ = anchor->register_parameter("layer_mix_logits", at::zeros({a.num_blocks, layers}, options), false);
  auto v2_query = list(*this, "v2_query_norms");
  auto v2_semantic = list(*this, "v2_semantic_norms");
  auto v2_attn = list(*this, "v2_attentions");
  for (const auto i : c10::irange(a.num_blocks)) {
    const std::string n = std::to_string(i);
    v2_query_norms_.push_back(v2_query->register_module(n, RMSNorm(d, norm_eps, options)));
    v2_semantic_norms_.push_back(v2_semantic->register_module(n, RMSNorm(d, norm_eps, options)));
    v2_attentions_.push_back(v2_attn->register_module(n, AdapterAttention(d, d, a.num_heads, norm_eps, options)));
  }
}

at::Tensor SemanticConnectorImpl::bank(const ConnectorInputs& in) { return resampler_(in.hidden, in.mask, in.timesteps); }

at::Tensor SemanticConnectorImpl::forward(LLMAdapterImpl& adapter, const at::Tensor& source, const at::Tensor& ids,
                                          const ConnectorInputs& in) {
  const at::ScalarType dt = source.scalar_type();
  const at::Device dev = source.device();
  const at::Tensor semantic_bank = bank(in);
  const int64_t head_dim = adapter_.model_dim / adapter_.num_heads;
  const rope::Tables anchor_rope = rope::tables_1d(in.hidden[0].size(1), head_dim, adapter_.rope_theta, dev);
  const rope::Tables bank_rope = rope::tables_1d(semantic_bank.size(1), head_dim, adapter_.rope_theta, dev);
  const at::Tensor mix = layer_mix_logits_.to(dev, at::kFloat).softmax(-1).to(dt);  // [blocks, layers]
  const size_t blocks = anchor_attentions_.size();
  return adapter.forward(source, ids, [&](size_t i, const at::Tensor& x_in, const rope::Tables& rope_target) {
    if (i >= blocks) return x_in;  // validate() keeps the block counts equal
    at::Tensor mixed = in.hidden[0] * mix[i][0];
    for (const auto l : c10::irange(size_t{1}, in.hidden.size())) mixed = mixed + in.hidden[l] * mix[i][l];
    at::Tensor x = x_in;
    x = x + anchor_attentions_[i](anchor_query_norms_[i](x), anchor_source_norms_[i](mixed), rope_target, anchor_rope,
                                  in.mask);
    x = x + v2_attentions_[i](v2_query_norms_[i](x), v2_semantic_norms_[i](semantic_bank), rope_target, bank_rope);
    return x;
  });
}

}  // namespace sluice::anima
