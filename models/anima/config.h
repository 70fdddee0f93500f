#pragma once
// AnimaConfig: every hyper-parameter of the Anima DiT and its LLM adapter, with the
// named presets. Preset "anima-2b" holds the published model's numbers.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace sluice::anima {

struct AdapterConfig {
  bool enabled = true;          // false: a DiT-only model (no llm_adapter.* keys)
  int64_t vocab_size = 32128;   // llm_adapter.embed rows (T5 vocabulary)
  int64_t model_dim = 1024;     // adapter width; also the qwen hidden size it attends to
  int64_t source_dim = 1024;    // qwen hidden size (cross-attention k/v input)
  int64_t num_blocks = 6;
  int64_t num_heads = 16;       // head_dim = model_dim / num_heads (64 on the real model)
  int64_t mlp_ratio = 4;
  double rope_theta = 10000.0;
  int64_t output_tokens = 512;  // zero-padded context length
};

// Anima-3.8B v1.1's semantic connector (models/anima/semantic_connector.h): its keys sit under
// "anima_v2_connector."; a checkpoint records these in its "anima_v2_adapter_*" metadata.
struct ConnectorConfig {
  bool enabled = false;             // true: the model has anima_v2_connector.* (needs the adapter)
  int64_t num_queries = 64;         // semantic_query_tokens: tokens of the resampled bank
  int64_t resampler_blocks = 6;     // semantic_resampler_blocks
  int64_t resampler_dim = 2048;     // semantic_resampler_dim: the resampler's width
  int64_t resampler_heads = 16;     // semantic_resampler_heads
  int64_t mlp_hidden_dim = 5632;    // semantic_resampler_mlp_hidden_dim: SwiGLU hidden width
  int64_t source_dim = 2560;        // width of the Qwen3.5 hidden states (Qwen3.5-4B: 2560)
  std::vector<int64_t> layer_indices = {7, 15, 23, 31};  // the Qwen3.5 layers it reads, in order
};

struct AnimaConfig {
  std::string name = "anima-2b";  // preset name, or the file/JSON it came from
  int64_t in_channels = 16;
  int64_t out_channels = 16;
  bool concat_padding_mask = true;  // adds one input channel to the patch embedder
  int64_t patch_spatial = 2;
  int64_t patch_temporal = 1;
  int64_t model_channels = 2048;
  int64_t num_blocks = 28;
  int64_t num_heads = 16;
  int64_t mlp_ratio = 4;
  int64_t crossattn_emb_channels = 1024;
  bool use_adaln_lora = true;
  int64_t adaln_lora_dim = 256;
  double rope_h_extrapolation_ratio = 4.0;
  double rope_w_extrapolation_ratio = 4.0;
  double rope_t_extrapolation_ratio = 1.0;
  double rope_theta = 10000.0;
  double norm_eps = 1e-6;
  AdapterConfig adapter;
  ConnectorConfig connector;

  int64_t head_dim() const { return model_channels / num_heads; }
  int64_t patch_in_features() const {
    return (in_channels + (concat_padding_mask ? 1 : 0)) * patch_spatial * patch_spatial * patch_temporal;
  }
  // Throws InvalidArgument naming the field when a value is impossible.
  void validate() const;
};

// Names of the built-in presets: "anima-2b", "anima-tiny", "anima-small", ..., and the
// depth-expanded "anima-2.9b" (40 blocks) and "anima-3.8b" (52), anima-2b's shapes otherwise.
std::vector<std::string> preset_names();
// Throws InvalidArgument listing the known presets when `name` is not one.
AnimaConfig preset(const std::string& name);
// A preset name, or a path to a JSON file whose fields override anima-2b's.
AnimaConfig config_from_name_or_file(const std::string& name_or_path);

// For a model source that is neither a preset nor a path: a name with no '/', without a
// ".safetensors" or ".json" suffix, that is no file either ("anima-nope"), throws
// InvalidArgument "unknown preset 'anima-nope' (known: ...)" rather than letting the file
// open fail with "cannot open". Does nothing for anything else (paths keep "cannot open").
void require_preset_or_path(const std::string& source);
AnimaConfig config_from_json(const nlohmann::json& j, const std::string& origin);
nlohmann::json config_to_json(const AnimaConfig& c);

}  // namespace sluice::anima
