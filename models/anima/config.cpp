#include "models/anima/config.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace sluice::anima {
namespace {

void require(bool ok, const std::string& origin, const std::string& what) {
  if (!ok) throw InvalidArgument("Anima config '" + origin + "': " + what);
}

AnimaConfig tiny() {
  AnimaConfig c;
  c.name = "anima-tiny";
  c.model_channels = 64;
  c.num_blocks = 2;
  c.num_heads = 4;  // head_dim 16: 3D RoPE split t 8, h 4, w 4
  c.crossattn_emb_channels = 32;
  c.adaln_lora_dim = 16;
  c.adapter.vocab_size = 128;
  c.adapter.model_dim = 32;
  c.adapter.source_dim = 32;
  c.adapter.num_blocks = 2;
  c.adapter.num_heads = 4;
  c.adapter.output_tokens = 24;
  return c;
}

AnimaConfig small() {
  AnimaConfig c;
  c.name = "anima-small";
  c.model_channels = 256;
  c.num_blocks = 8;
  c.num_heads = 4;  // head_dim 64
  c.crossattn_emb_channels = 128;
  c.adaln_lora_dim = 64;
  c.adapter.vocab_size = 512;
  c.adapter.model_dim = 128;
  c.adapter.source_dim = 128;
  c.adapter.num_blocks = 2;
  c.adapter.num_heads = 4;
  c.adapter.output_tokens = 64;
  return c;
}

AnimaConfig medium() {
  AnimaConfig c;
  c.name = "anima-medium";
  c.model_channels = 512;
  c.num_blocks = 12;
  c.num_heads = 8;  // head_dim 64
  c.crossattn_emb_channels = 256;
  c.adaln_lora_dim = 128;
  c.adapter.vocab_size = 1024;
  c.adapter.model_dim = 256;
  c.adapter.source_dim = 256;
  c.adapter.num_blocks = 2;
  c.adapter.num_heads = 4;
  c.adapter.output_tokens = 128;
  return c;
}

// The depth-expanded Anima models (Note [Anima block layout] in models/anima/block_layout.h):
// anima-2b's shapes at 40 blocks (Anima-2.9B-preview-v1) and 52 (Anima-3.8B v1.1).
AnimaConfig deeper(const std::string& name, int64_t blocks) {
  AnimaConfig c;
  c.name = name;
  c.num_blocks = blocks;
  return c;
}

}  // namespace

void AnimaConfig::validate() const {
  const std::string& o = name;
  require(in_channels > 0 && out_channels > 0, o, "in_channels/out_channels must be positive");
  require(patch_spatial > 0 && patch_temporal > 0, o, "patch sizes must be positive");
  require(model_channels > 0 && num_heads > 0 && model_channels % num_heads == 0, o,
          "model_channels must be a positive multiple of num_heads");
  // 3D RoPE gives h and w (head_dim/6)*2 dims each and needs at least two per axis.
  require(head_dim() % 2 == 0 && head_dim() >= 12, o, "head_dim must be even and at least 12 (3D RoPE)");
  require(num_blocks > 0, o, "num_blocks must be positive");
  require(mlp_ratio > 0, o, "mlp_ratio must be positive");
  require(crossattn_emb_channels > 0, o, "crossattn_emb_channels must be positive");
  require(!use_adaln_lora || adaln_lora_dim > 0, o, "adaln_lora_dim must be positive");
  require(norm_eps > 0, o, "norm_eps must be positive");
  if (adapter.enabled) {
    require(adapter.vocab_size > 0, o, "adapter.vocab_size must be positive");
    require(adapter.model_dim > 0 && adapter.num_heads > 0 && adapter.model_dim % adapter.num_heads == 0, o,
            "adapter.model_dim must be a positive multiple of adapter.num_heads");
    require((adapter.model_dim / adapter.num_heads) % 2 == 0, o, "adapter head dim must be even (RoPE)");
    require(adapter.model_dim == crossattn_emb_channels, o,
            "adapter.model_dim must equal crossattn_emb_channels (the adapter produces the DiT context)");
    require(adapter.num_blocks > 0 && adapter.mlp_ratio > 0 && adapter.output_tokens > 0, o,
            "adapter.num_blocks, mlp_ratio and output_tokens must be positive");
  }
  if (connector.enabled) {
    const ConnectorConfig& k = connector;
    require(adapter.enabled, o, "connector needs the LLM adapter (it runs between the adapter's blocks)");
    require(k.num_queries > 0 && k.resampler_blocks > 0 && k.mlp_hidden_dim > 0 && k.source_dim > 0, o,
            "connector.num_queries, resampler_blocks, mlp_hidden_dim and source_dim must be positive");
    require(k.resampler_dim > 0 && k.resampler_heads > 0 && k.resampler_dim % k.resampler_heads == 0, o,
            "connector.resampler_dim must be a positive multiple of connector.resampler_heads");
    require(!k.layer_indices.empty(), o, "connector.layer_indices must name at least one layer");
  }
}

std::vector<std::string> preset_names() {
  return {"anima-2b", "anima-tiny", "anima-small", "anima-medium", "anima-2.9b", "anima-3.8b"};
}

AnimaConfig preset(const std::string& name) {
  if (name == "anima-2b") return AnimaConfig{};
  if (name == "anima-tiny") return tiny();
  if (name == "anima-small") return small();
  if (name == "anima-medium") return medium();
  if (name == "anima-2.9b") return deeper(name, 40);
  if (name == "anima-3.8b") return deeper(name, 52);
  std::string known;
  for (const auto& n : preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("unknown model preset '" + name + "' (known: " + known + ")");
}

nlohmann::json config_to_json(const AnimaConfig& c) {
  nlohmann::json a = {{"enabled", c.adapter.enabled},       {"vocab_size", c.adapter.vocab_size},
                      {"model_dim", c.adapter.model_dim},   {"source_dim", c.adapter.source_dim},
                      {"num_blocks", c.adapter.num_blocks}, {"num_heads", c.adapter.num_heads},
                      {"mlp_ratio", c.adapter.mlp_ratio},   {"rope_theta", c.adapter.rope_theta},
                      {"output_tokens", c.adapter.output_tokens}};
  const ConnectorConfig& k = c.connector;
  nlohmann::json conn = {{"enabled", k.enabled},
                         {"num_queries", k.num_queries},
                         {"resampler_blocks", k.resampler_blocks},
                         {"resampler_dim", k.resampler_dim},
                         {"resampler_heads", k.resampler_heads},
                         {"mlp_hidden_dim", k.mlp_hidden_dim},
                         {"source_dim", k.source_dim},
                         {"layer_indices", k.layer_indices}};
  return {{"name", c.name},
          {"in_channels", c.in_channels},
          {"out_channels", c.out_channels},
          {"concat_padding_mask", c.concat_padding_mask},
          {"patch_spatial", c.patch_spatial},
          {"patch_temporal", c.patch_temporal},
          {"model_channels", c.model_channels},
          {"num_blocks", c.num_blocks},
          {"num_heads", c.num_heads},
          {"mlp_ratio", c.mlp_ratio},
          {"crossattn_emb_channels", c.crossattn_emb_channels},
          {"use_adaln_lora", c.use_adaln_lora},
          {"adaln_lora_dim", c.adaln_lora_dim},
          {"rope_h_extrapolation_ratio", c.rope_h_extrapolation_ratio},
          {"rope_w_extrapolation_ratio", c.rope_w_extrapolation_ratio},
          {"rope_t_extrapolation_ratio", c.rope_t_extrapolation_ratio},
          {"rope_theta", c.rope_theta},
          {"norm_eps", c.norm_eps},
          {"adapter", a},
          {"connector", conn}};
}

AnimaConfig config_from_json(const nlohmann::json& j, const std::string& origin) {
  if (!j.is_object()) throw InvalidArgument("Anima config '" + origin + "': expected a JSON object");
  AnimaConfig c = j.contains("preset") ? preset(j.at("preset").get<std::string>()) : AnimaConfig{};
  c.name = origin;
  const nlohmann::json known = config_to_json(c);
  auto get = [&](const nlohmann::json& obj, const char* key, auto& field, const std::string& path) {
    if (!obj.contains(key)) return;
    try {
      obj.at(key).get_to(field);
    } catch (const nlohmann::json::exception&) {
      throw InvalidArgument("Anima config '" + origin + "': field '" + path + "' has the wrong type");
    }
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "preset" && !known.contains(it.key()))
      throw InvalidArgument("Anima config '" + origin + "': unknown field '" + it.key() + "'");
  }
  get(j, "name", c.name, "name");
  get(j, "in_channels", c.in_channels, "in_channels");
  get(j, "out_channels", c.out_channels, "out_channels");
  get(j, "concat_padding_mask", c.concat_padding_mask, "concat_padding_mask");
  get(j, "patch_spatial", c.patch_spatial, "patch_spatial");
  get(j, "patch_temporal", c.patch_temporal, "patch_temporal");
  get(j, "model_channels", c.model_channels, "model_channels");
  get(j, "num_blocks", c.num_blocks, "num_blocks");
  get(j, "num_heads", c.num_heads, "num_heads");
  get(j, "mlp_ratio", c.mlp_ratio, "mlp_ratio");
  get(j, "crossattn_emb_channels", c.crossattn_emb_channels, "crossattn_emb_channels");
  get(j, "use_adaln_lora", c.use_adaln_lora, "use_adaln_lora");
  get(j, "adaln_lora_dim", c.adaln_lora_dim, "adaln_lora_dim");
  get(j, "rope_h_extrapolation_ratio", c.rope_h_extrapolation_ratio, "rope_h_extrapolation_ratio");
  get(j, "rope_w_extrapolation_ratio", c.rope_w_extrapolation_ratio, "rope_w_extrapolation_ratio");
  get(j, "rope_t_extrapolation_ratio", c.rope_t_extrapolation_ratio, "rope_t_extrapolation_ratio");
  get(j, "rope_theta", c.rope_theta, "rope_theta");
  get(j, "norm_eps", c.norm_eps, "norm_eps");
  if (j.contains("adapter")) {
    const auto& a = j.at("adapter");
    if (!a.is_object()) throw InvalidArgument("Anima config '" + origin + "': 'adapter' must be an object");
    for (auto it = a.begin(); it != a.end(); ++it) {
      if (!known.at("adapter").contains(it.key()))
        throw InvalidArgument("Anima config '" + origin + "': unknown field 'adapter." + it.key() + "'");
    }
    get(a, "enabled", c.adapter.enabled, "adapter.enabled");
    get(a, "vocab_size", c.adapter.vocab_size, "adapter.vocab_size");
    get(a, "model_dim", c.adapter.model_dim, "adapter.model_dim");
    get(a, "source_dim", c.adapter.source_dim, "adapter.source_dim");
    get(a, "num_blocks", c.adapter.num_blocks, "adapter.num_blocks");
    get(a, "num_heads", c.adapter.num_heads, "adapter.num_heads");
    get(a, "mlp_ratio", c.adapter.mlp_ratio, "adapter.mlp_ratio");
    get(a, "rope_theta", c.adapter.rope_theta, "adapter.rope_theta");
    get(a, "output_tokens", c.adapter.output_tokens, "adapter.output_tokens");
  }
  if (j.contains("connector")) {
    const auto& k = j.at("connector");
    if (!k.is_object()) throw InvalidArgument("Anima config '" + origin + "': 'connector' must be an object");
    for (auto it = k.begin(); it != k.end(); ++it) {
      if (!known.at("connector").contains(it.key()))
        throw InvalidArgument("Anima config '" + origin + "': unknown field 'connector." + it.key() + "'");
    }
    ConnectorConfig& kc = c.connector;
    get(k, "enabled", kc.enabled, "connector.enabled");
    get(k, "num_queries", kc.num_queries, "connector.num_queries");
    get(k, "resampler_blocks", kc.resampler_blocks, "connector.resampler_blocks");
    get(k, "resampler_dim", kc.resampler_dim, "connector.resampler_dim");
    get(k, "resampler_heads", kc.resampler_heads, "connector.resampler_heads");
    get(k, "mlp_hidden_dim", kc.mlp_hidden_dim, "connector.mlp_hidden_dim");
    get(k, "source_dim", kc.source_dim, "connector.source_dim");
    get(k, "layer_indices", kc.layer_indices, "connector.layer_indices");
  }
  c.validate();
  return c;
}

void require_preset_or_path(const std::string& source) {
  auto ends_with = [&](const std::string& suffix) {
    return source.size() >= suffix.size() && source.compare(source.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (source.find('/') != std::string::npos || ends_with(".safetensors") || ends_with(".json")) return;
  const auto names = preset_names();
  if (std::find(names.begin(), names.end(), source) != names.end()) return;
  struct stat st;
  if (::stat(source.c_str(), &st) == 0) return;  // a file of that name: opened as given
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  throw InvalidArgument("unknown preset '" + source + "' (known: " + known +
                        "; or a path to a .safetensors checkpoint or a .json config)");
}

AnimaConfig config_from_name_or_file(const std::string& name_or_path) {
  const bool looks_like_file = name_or_path.size() > 5 && name_or_path.substr(name_or_path.size() - 5) == ".json";
  if (!looks_like_file) return preset(name_or_path);
  std::ifstream in(name_or_path);
  if (!in) throw FileError("cannot open config file '" + name_or_path + "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw FileError("config file '" + name_or_path + "' is not valid JSON: " + e.what());
  }
  return config_from_json(j, name_or_path);
}

}  // namespace sluice::anima
