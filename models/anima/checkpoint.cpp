#include "models/anima/checkpoint.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "models/anima/generator.h"
#include "models/anima/semantic_connector.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/fused_read.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/progress.h"
#include "runtime/safetensors.h"
#include "runtime/skip_patterns.h"

namespace sluice::anima {
namespace {

const char* const kPrefixes[] = {"model.diffusion_model.", "net.", ""};
const char* const kDiTGroups[] = {"blocks.", "t_embedder.", "x_embedder.", "final_layer."};

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, const std::string& x) {
  return s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
}

// Keys under the prefix that are not model parameters (Note [checkpoint keys]).
bool is_non_model(const std::string& key) {
  return ends_with(key, ".inv_freq") || starts_with(key, "pos_embedder.") || starts_with(key, "model_sampling.") ||
         ends_with(key, ".input_scale") || ends_with(key, ".scale_input") || key == "scaled_fp8";
}

// The weight-scale suffixes of scaled-fp8 files: ComfyUI's current ".weight_scale" and its
// older ".scale_weight" (Note [checkpoint keys]).
constexpr const char* kScaleSuffixes[] = {".weight_scale", ".scale_weight"};

// The suffix of `key` among kScaleSuffixes, or nullptr.
const char* scale_suffix(const std::string& key) {
  for (const char* s : kScaleSuffixes)
    if (ends_with(key, s)) return s;
  return nullptr;
}

// The quantization formats sluice decodes: fp8 weights (scaled or not).
bool fp8_format(const std::string& format) { return format == "float8_e4m3fn" || format == "float8_e5m2"; }

// A ".comfy_quant" marker: JSON text in a uint8 tensor, {"format": "...", ...}. Returns
// its format; CheckpointError for a marker that is not such JSON.
std::string comfy_quant_format(const safetensors::File& f, const std::string& key) {
  const at::Tensor bytes = f.read(key).contiguous();
  const std::string text(reinterpret_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.nbytes()));
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    return j.at("format").get<std::string>();
  } catch (const std::exception&) {
    throw CheckpointError("checkpoint '" + f.path() + "': " + key + " is not a quantization marker (JSON with a format)");
  }
}

// ComfyUI's "_quantization_metadata" header entry: {"format_version": ..., "layers":
// {"<layer>": {"format": ...}}}. CheckpointError for a format sluice cannot decode.
void check_quantization_metadata(const safetensors::File& f) {
  const auto it = f.metadata().find("_quantization_metadata");
  if (it == f.metadata().end()) return;
  nlohmann::json layers;
  try {
    layers = nlohmann::json::parse(it->second).at("layers");
  } catch (const std::exception&) {
    throw CheckpointError("checkpoint '" + f.path() + "': its _quantization_metadata is not JSON with \"layers\"");
  }
  for (const auto& [layer, spec] : layers.items()) {
    const std::string format = spec.is_object() && spec.contains("format") && spec["format"].is_string()
                                   ? spec["format"].get<std::string>()
                                   : std::string();
    if (!fp8_format(format)) {
      throw CheckpointError("checkpoint '" + f.path() + "': layer " + layer + " is quantized as '" + format +
                            "' (_quantization_metadata), which sluice cannot decode; it reads float8_e4m3fn and "
                            "float8_e5m2 weights, scaled or not");
    }
  }
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << s;
  return o.str();
}

bool has_key_with_prefix(const safetensors::File& f, const std::string& p) {
  return std::any_of(f.tensors().begin(), f.tensors().end(),
                     [&](const safetensors::TensorInfo& t) { return starts_with(t.name, p); });
}

// The "<group><n>." indices present under a key prefix: {lowest, highest + 1}, {0, 0} when none.
std::pair<int64_t, int64_t> index_range(const safetensors::File& f, const std::string& group) {
  int64_t lo = -1, hi = 0;
  for (const auto& t : f.tensors()) {
    if (!starts_with(t.name, group)) continue;
    const std::string rest = t.name.substr(group.size());
    const auto dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos || dot > 6) continue;
    const std::string idx = rest.substr(0, dot);
    if (!std::all_of(idx.begin(), idx.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) continue;
    const int64_t n = std::stoll(idx);
    lo = lo < 0 ? n : std::min(lo, n);
    hi = std::max(hi, n + 1);
  }
  return {std::max<int64_t>(lo, 0), hi};
}

// Shape of `prefix + name`, or nullopt when absent.
std::optional<std::vector<int64_t>> shape_of(const safetensors::File& f, const std::string& prefix,
                                             const std::string& name) {
  const auto* t = f.find(prefix + name);
  if (!t) return std::nullopt;
  return t->shape;
}

// Fills the shape-derived fields of `c`; a field whose tensor is absent or oddly shaped
// keeps its base value (the strict key check then reports the problem precisely).
void infer_from_shapes(const safetensors::File& f, const std::string& p, bool has_adapter, AnimaConfig& c) {
  const auto x_emb = shape_of(f, p, "x_embedder.proj.1.weight");
  if (x_emb && x_emb->size() == 2) {
    c.model_channels = (*x_emb)[0];
    const int64_t patch = c.patch_spatial * c.patch_spatial * c.patch_temporal;
    if ((*x_emb)[1] % patch == 0) c.in_channels = (*x_emb)[1] / patch - (c.concat_padding_mask ? 1 : 0);
  }
  const auto fin = shape_of(f, p, "final_layer.linear.weight");
  if (fin && fin->size() == 2) {
    const int64_t patch = c.patch_spatial * c.patch_spatial * c.patch_temporal;
    if ((*fin)[0] % patch == 0) c.out_channels = (*fin)[0] / patch;
  }
  // Block shapes are read from the first block present, so that a file missing block 0
  // still gets the right widths and the strict check names block 0's keys as missing.
  const auto [first_block, end_block] = index_range(f, p + "blocks.");
  c.num_blocks = std::max<int64_t>(1, end_block);
  const std::string b0 = "blocks." + std::to_string(first_block) + ".";
  if (const auto qn = shape_of(f, p, b0 + "self_attn.q_norm.weight"); qn && qn->size() == 1 && (*qn)[0] > 0) {
    if (c.model_channels % (*qn)[0] == 0) c.num_heads = c.model_channels / (*qn)[0];
  }
  if (const auto kp = shape_of(f, p, b0 + "cross_attn.k_proj.weight"); kp && kp->size() == 2) {
    c.crossattn_emb_channels = (*kp)[1];
  }
  if (const auto l1 = shape_of(f, p, b0 + "mlp.layer1.weight"); l1 && l1->size() == 2) {
    if ((*l1)[0] % c.model_channels == 0) c.mlp_ratio = (*l1)[0] / c.model_channels;
  }
  const auto lora_up = shape_of(f, p, b0 + "adaln_modulation_self_attn.2.weight");
  const auto lora_down = shape_of(f, p, b0 + "adaln_modulation_self_attn.1.weight");
  c.use_adaln_lora = lora_up.has_value();
  if (lora_up && lora_down && lora_down->size() == 2) c.adaln_lora_dim = (*lora_down)[0];

  // Anima-3.8B v1.1's semantic connector: hyper-parameters from its "anima_v2_adapter_*"
  // metadata (defaults where absent), the Qwen3.5 width from its layer embeddings; the strict
  // key check then compares every other shape.
  c.connector.enabled = has_key_with_prefix(f, p + "anima_v2_connector.");
  if (c.connector.enabled) {
    c.connector = connector_config_from_metadata(f.metadata(), c.connector, f.path());
    if (const auto e = shape_of(f, p, "anima_v2_connector.semantic_resampler.layer_embeddings");
        e && e->size() == 3 && (*e)[2] > 0) {
      c.connector.source_dim = (*e)[2];
    }
  }

  c.adapter.enabled = has_adapter;
  if (!has_adapter) return;
  AdapterConfig& a = c.adapter;
  if (const auto e = shape_of(f, p, "llm_adapter.embed.weight"); e && e->size() == 2) {
    a.vocab_size = (*e)[0];
    a.model_dim = (*e)[1];
  }
  const auto [first_ablock, end_ablock] = index_range(f, p + "llm_adapter.blocks.");
  a.num_blocks = std::max<int64_t>(1, end_ablock);
  const std::string a0 = "llm_adapter.blocks." + std::to_string(first_ablock) + ".";
  if (const auto qn = shape_of(f, p, a0 + "self_attn.q_norm.weight");
      qn && qn->size() == 1 && (*qn)[0] > 0 && a.model_dim % (*qn)[0] == 0) {
    a.num_heads = a.model_dim / (*qn)[0];
  }
  if (const auto kp = shape_of(f, p, a0 + "cross_attn.k_proj.weight"); kp && kp->size() == 2) {
    a.source_dim = (*kp)[1];
  }
  if (const auto m = shape_of(f, p, a0 + "mlp.0.weight");
      m && m->size() == 2 && a.model_dim > 0 && (*m)[0] % a.model_dim == 0) {
    a.mlp_ratio = (*m)[0] / a.model_dim;
  }
}

// "first, second, ... and N more" for a list of items.
std::string list_some(const std::vector<std::string>& items, size_t shown = 10) {
  std::string s;
  for (size_t i = 0; i < items.size() && i < shown; ++i) s += (i ? ", " : "") + items[i];
  if (items.size() > shown) s += " and " + std::to_string(items.size() - shown) + " more";
  return s;
}

std::string plural(size_t n, const std::string& one, const std::string& many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

// The dtypes a model parameter may be read from: what sluice casts from.
bool is_float_dtype(at::ScalarType t) {
  return is_fp8(t) || t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kDouble;
}

}  // namespace

at::Tensor read_scale(const safetensors::File& f, const TensorSource& src, const std::string& name, int64_t out_rows,
                      int64_t weight_dims) {
  at::Tensor scale = f.read(src.scale_key).to(at::kFloat);
  if (scale.numel() == 1) {
    scale = scale.reshape({});
  } else if (scale.numel() == out_rows && weight_dims == 2 && (scale.dim() == 1 || scale.size(-1) == 1)) {
    scale = scale.reshape({out_rows});
  } else {
    throw CheckpointError("checkpoint '" + f.path() + "': " + src.scale_key + " has shape " +
                          shape_str(scale.sizes()) + ", expected a scalar, [" + std::to_string(out_rows) + "] or [" +
                          std::to_string(out_rows) + ", 1] for " + name);
  }
  if (!at::isfinite(scale).all().item<bool>() || (scale <= 0).any().item<bool>()) {
    throw CheckpointError("checkpoint '" + f.path() + "': " + src.scale_key + " holds a scale that is not a positive "
                          "finite number");
  }
  return scale;
}

at::Tensor source_tensor(const safetensors::File& f, const TensorSource& src, const std::string& name,
                         int64_t out_rows) {
  // read(), not tensor(): a file truncated since it was opened is a FileError, not SIGBUS.
  at::Tensor t = f.read(src.key);
  if (src.scale_key.empty()) return t;
  const at::Tensor scale = read_scale(f, src, name, out_rows, t.dim());
  return t.to(at::kFloat) * (scale.dim() == 1 ? scale.reshape({out_rows, 1}) : scale);
}

std::map<std::string, TensorSource> model_tensor_sources(const safetensors::File& f, const std::string& prefix) {
  check_quantization_metadata(f);
  std::map<std::string, TensorSource> out;
  std::map<std::string, std::string> scales;  // model weight name -> scale key
  for (const auto& t : f.tensors()) {
    if (!starts_with(t.name, prefix)) continue;
    const std::string key = t.name.substr(prefix.size());
    if (is_non_model(key)) continue;
    if (ends_with(key, ".comfy_quant")) {
      const std::string format = comfy_quant_format(f, t.name);
      if (!fp8_format(format)) {
        throw CheckpointError("checkpoint '" + f.path() + "': " + t.name + " quantizes its layer as '" + format +
                              "', which sluice cannot decode; it reads float8_e4m3fn and float8_e5m2 weights, "
                              "scaled or not");
      }
      continue;  // fp8: the weight's dtype and its scale say everything
    }
    if (const char* suffix = scale_suffix(key)) {
      scales[key.substr(0, key.size() - std::strlen(suffix)) + ".weight"] = t.name;
      continue;
    }
    out[key] = TensorSource{t.name, ""};
  }
  for (const auto& [weight, scale_key] : scales) {
    auto it = out.find(weight);
    if (it == out.end()) {
      // A scale without its weight: report it as an unexpected key through the strict check.
      out[scale_key.substr(prefix.size())] = TensorSource{scale_key, ""};
      continue;
    }
    it->second.scale_key = scale_key;
  }
  return out;
}

CheckpointProbe probe_checkpoint(const safetensors::File& f) {
  CheckpointProbe p;
  for (const char* candidate : kPrefixes) {
    const std::string pre = candidate;
    const bool all = std::all_of(std::begin(kDiTGroups), std::end(kDiTGroups),
                                 [&](const char* g) { return has_key_with_prefix(f, pre + g); });
    if (all) {
      p.has_dit = true;
      p.prefix = pre;
      break;
    }
  }
  if (!p.has_dit) {
    p.reason = "no blocks./t_embedder./x_embedder./final_layer. tensors under any of the prefixes "
               "'model.diffusion_model.', 'net.' or none";
    return p;
  }
  p.has_adapter = has_key_with_prefix(f, p.prefix + "llm_adapter.");
  p.is_anima = p.has_adapter;
  if (!p.has_adapter) p.reason = "no llm_adapter. tensors: a DiT-only (Cosmos-Predict2) checkpoint";

  AnimaConfig base;
  const auto meta = f.metadata().find(kMetaConfig);
  if (meta != f.metadata().end()) {
    try {
      base = config_from_json(nlohmann::json::parse(meta->second), f.path());
      p.config_from_metadata = true;
    } catch (const std::exception& e) {
      log::warn("checkpoint '" + f.path() + "': ignoring unreadable " + kMetaConfig + " metadata: " + e.what());
      base = AnimaConfig{};
    }
  }
  base.name = f.path();
  infer_from_shapes(f, p.prefix, p.has_adapter, base);
  p.inferred = base;

  for (const auto& t : f.tensors()) {
    if (!starts_with(t.name, p.prefix)) {
      ++p.dropped_foreign;
    } else if (is_non_model(t.name.substr(p.prefix.size()))) {
      ++p.dropped_non_model;
    } else if (scale_suffix(t.name) != nullptr) {
      ++p.scaled_weights;
    } else if (ends_with(t.name, ".comfy_quant")) {
      ++p.dropped_non_model;
    } else {
      ++p.tensors;
      p.tensors_by_dtype[c10::toString(t.dtype)] += 1;
    }
  }
  return p;
}

WeightReadReport load_weights(AnimaModelImpl& model, const safetensors::File& f, const std::string& prefix,
                              const WeightReadOptions& options) {
  const auto sources = model_tensor_sources(f, prefix);
  const auto params = model.named_parameters(/*recurse=*/true);

  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> names;
  for (const auto& item : params) {
    names.insert(item.key());
    auto it = sources.find(item.key());
    if (it == sources.end()) {
      missing.push_back(prefix + item.key());
      continue;
    }
    const auto* info = f.find(it->second.key);
    if (!is_float_dtype(info->dtype) && is_float_dtype(item.value().scalar_type())) {
      // Never converted: an int8 or bool tensor where a weight belongs is a broken or
      // foreign file, not values to cast (issue 29).
      throw CheckpointError("checkpoint '" + f.path() + "': tensor '" + it->second.key + "' has dtype " +
                            dtype_name(info->dtype) +
                            ", expected a floating-point dtype (float8_e4m3fn, float8_e5m2, bfloat16, float16, "
                            "float32 or float64) for the model's parameter '" + item.key() + "'");
    }
    if (at::IntArrayRef(info->shape) != item.value().sizes()) {
      mismatched.push_back(it->second.key + " file " + shape_str(info->shape) + " vs model " +
                           shape_str(item.value().sizes()));
    }
  }
  for (const auto& [name, src] : sources) {
    if (!names.count(name)) unexpected.push_back(src.key);
  }
  if (!missing.empty() || !unexpected.empty() || !mismatched.empty()) {
    std::string msg = "checkpoint '" + f.path() + "' does not match model config '" + model.config().name + "':";
    std::string sep = " ";
    if (!missing.empty()) {
      msg += sep + plural(missing.size(), "missing key", "missing keys") + ": " + list_some(missing);
      sep = "; ";
    }
    if (!unexpected.empty()) {
      msg += sep + plural(unexpected.size(), "unexpected key", "unexpected keys") + ": " + list_some(unexpected);
      sep = "; ";
    }
    if (!mismatched.empty()) {
      msg += sep + plural(mismatched.size(), "shape mismatch", "shape mismatches") + ": " + list_some(mismatched);
    }
    throw CheckpointError(msg);
  }

  // Read everything first, assign after: a read that fails (a file truncated since it was
  // opened, an I/O error, a NaN) leaves every parameter as it was.
  at::NoGradGuard no_grad;
  WeightReadReport report;
  const Fp8Options* storage = options.storage;
  // With storage: each managed layer's parameters, and whether the layer is to be cast.
  struct LayerOf {
    offload::ManagedLayerImpl* layer;
    bool to_storage;  // matches no skip pattern
  };
  std::map<std::string, LayerOf> layer_of;  // parameter name -> its layer
  if (storage != nullptr) {
    std::optional<SkipList> made;  // when the caller gave none
    const SkipList& skips = options.skips ? *options.skips
                                          : made.emplace(SkipList::from_options(*storage, declared_fp8_skips()));
    for (const auto& [name, layer] : offload::managed_layers(model)) {
      const LayerOf l{layer, !skips.matches(name).has_value()};
      layer_of[name + ".weight"] = l;
      if (layer->has_bias()) layer_of[name + ".bias"] = l;
    }
  }
  std::vector<std::pair<offload::ManagedLayerImpl*, at::Tensor>> scales;  // set with the parameters
  std::vector<at::Tensor> loaded(params.size());
  std::vector<safetensors::ReadTarget> fused;
  std::vector<std::pair<size_t, offload::ManagedLayerImpl*>> fused_of;  // fused[k]: parameter index, layer
  std::vector<size_t> one_by_one;                                       // parameter indices read alone
  size_t i = 0;
  for (const auto& item : params) {
    const at::Tensor& param = item.value();
    const TensorSource& src = sources.at(item.key());
    const safetensors::TensorInfo& info = *f.find(src.key);
    report.file_bytes += info.nbytes();
    const auto l = layer_of.find(item.key());
    offload::ManagedLayerImpl* layer = l == layer_of.end() ? nullptr : l->second.layer;
    const bool cpu = param.device().is_cpu();
    // The dtype this tensor ends in: fp8 tensors of managed layers stay as they are (Note
    // [converted checkpoints]), unscaled ones of layers to cast go to the storage dtype,
    // anything else to the parameter's dtype.
    at::ScalarType dtype = param.scalar_type();
    ScaleMode scale_mode = ScaleMode::none;
    bool fuse = src.scale_key.empty();  // a scaled source is dequantized, unless kept as read
    if (layer != nullptr && cpu && is_fp8(info.dtype)) {
      dtype = info.dtype;
      fuse = true;
      if (!src.scale_key.empty()) {
        scales.emplace_back(layer, read_scale(f, src, src.key, param.dim() > 0 ? param.size(0) : 1, param.dim()));
      }
      report.casts.checked.insert(layer);
    } else if (layer != nullptr && cpu && l->second.to_storage && src.scale_key.empty() &&
               safetensors::can_fuse(info.dtype, storage->storage)) {
      dtype = storage->storage;
      scale_mode = storage->scale_mode;
      if (dtype != info.dtype) report.casts.cast.insert(layer);
    }
    if (layer != nullptr && l->second.to_storage && info.dtype != storage->storage &&
        ends_with(item.key(), ".weight")) {
      report.cast_from[dtype_name(info.dtype)] += 1;  // Note [converted checkpoints]: said once by load_anima
    }
    if (fuse && safetensors::can_fuse(info.dtype, dtype)) {
      safetensors::ReadTarget t;
      t.source = &info;
      t.name = src.key;
      t.dst = host_empty(info.shape, dtype);  // the final host storage of a CPU parameter
      t.scale_mode = scale_mode;
      fused.push_back(std::move(t));
      fused_of.emplace_back(i, layer);
    } else {
      one_by_one.push_back(i);
    }
    ++i;
  }

  const std::string& path = f.path();
  progress::Task task("reading " + path.substr(path.find_last_of('/') + 1), report.file_bytes);
  safetensors::FusedReadOptions ro;
  ro.threads = options.threads;
  if (storage != nullptr) ro.out_of_range = storage->out_of_range;
  uint64_t shown = 0;
  ro.progress = [&](uint64_t done) {
    task.advance(done - shown);
    shown = done;
  };
  const safetensors::FusedReadStats rs = safetensors::read_tensors(f, fused, ro);
  task.advance(rs.bytes_read - shown);
  for (size_t k = 0; k < fused.size(); ++k) {
    loaded[fused_of[k].first] = std::move(fused[k].dst);
    if (fused[k].scale.defined()) scales.emplace_back(fused_of[k].second, std::move(fused[k].scale));
  }
  report.threads = rs.threads;
  report.fused = static_cast<int64_t>(fused.size());
  report.cast = rs.cast;
  report.casts.clipped = rs.clipped;
  fused.clear();
  // The rest (scaled fp8 into another dtype, float64 sources), one at a time, checked as the
  // fused read checks: NaN/Inf refused naming the file, values beyond the parameter's dtype
  // saturated (cast_to_storage).
  for (size_t j : one_by_one) {
    const auto& item = params[j];
    const TensorSource& src = sources.at(item.key());
    const at::Tensor& param = item.value();
    at::Tensor values = source_tensor(f, src, src.key, param.dim() > 0 ? param.size(0) : 1);
    if (is_fp8(values.scalar_type())) values = values.to(at::kFloat);
    if (!at::isfinite(values).all().item<bool>()) {
      refuse_non_finite(src.key, at::isnan(values).sum().item<int64_t>(), at::isinf(values).sum().item<int64_t>(),
                        param.scalar_type(), "file '" + f.path() + "'");
    }
    Fp8Options range;
    if (storage != nullptr) range.out_of_range = storage->out_of_range;
    loaded[j] = to_host_owned(cast_to_storage(values, param.scalar_type(), src.key, range).stored, param.scalar_type());
    task.advance(f.find(src.key)->nbytes());
  }
  // Every value read above was checked for NaN/Inf (Note [fused read]): apply_storage need
  // not look again at what it keeps.
  for (const auto& [name, l] : layer_of) report.casts.checked.insert(l.layer);
  report.other = static_cast<int64_t>(one_by_one.size());
  i = 0;
  for (const auto& item : params) {
    at::Tensor param = item.value();
    if (param.device().is_cpu()) {
      // The untouched storage the model was built with is freed.
      param.set_data(loaded[i]);
    } else {
      param.copy_(loaded[i]);
    }
    loaded[i++] = at::Tensor();
  }
  for (auto& [layer, scale] : scales) layer->set_weight_scale(std::move(scale));
  return report;
}

AnimaModel load_anima(const std::string& path, const LoadOptions& options) {
  if (options.device.is_meta()) throw InvalidArgument("load_anima: cannot load '" + path + "' onto the meta device");
  const auto file = safetensors::File::open(path);
  const CheckpointProbe probe = probe_checkpoint(*file);
  if (!probe.has_dit) throw CheckpointError("'" + path + "' is not an Anima checkpoint: " + probe.reason);
  AnimaConfig config = options.config ? *options.config : probe.inferred;
  if (!probe.has_adapter) {
    log::warn("checkpoint '" + path + "' has no llm_adapter tensors; loading the DiT only (encode_text unavailable)");
  }
  std::optional<Fp8Options> storage = options.storage;
  if (storage) {
    const DtypePair pair = resolve_dtypes(storage->storage, storage->compute, options.device);
    storage->storage = pair.storage;
    storage->compute = pair.compute;
  }
  const at::ScalarType build_dtype = storage ? storage->compute : options.dtype;
  AnimaModel model{nullptr};
  try {
    model = AnimaModel(config, BuildOptions{build_dtype, options.device});
  } catch (const InvalidArgument& e) {
    throw CheckpointError("checkpoint '" + path + "': cannot build a model for it: " + e.what());
  }
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  WeightReadOptions ro;
  ro.storage = storage ? &*storage : nullptr;
  // The skip list, made once for the read and the cast when the caller gave none.
  std::optional<SkipList> made;
  const SkipList* skips = options.skips;
  if (storage && !skips) skips = &made.emplace(SkipList::from_options(*storage, declared_fp8_skips()));
  ro.skips = skips;
  ro.threads = options.threads;
  const WeightReadReport read = load_weights(*model, *file, probe.prefix, ro);
  const auto t1 = clock::now();
  offload::StorageReport report;
  if (storage) report = offload::apply_storage(*model, config.name, *storage, *skips, &read.casts);
  if (storage) {
    // The file's weights in another dtype than the storage: said once (the CLI's `run` says
    // it on stdout, Note [run storage] in cli/cmd_run.cpp).
    for (const auto& [dtype, n] : read.cast_from) {
      log::info("checkpoint '" + path + "' stores " + plural(static_cast<size_t>(n), "weight", "weights") + " as " +
                dtype + "; cast to " + dtype_name(storage->storage) + " storage");
    }
  }
  const auto t2 = clock::now();
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(2);
  const double read_s = std::chrono::duration<double>(t1 - t0).count();
  s << "loaded " << probe.tensors << " tensors from '" << path << "' (prefix '" << probe.prefix << "', "
    << config.num_blocks << " blocks, " << (config.adapter.enabled ? "with" : "without") << " LLM adapter) as "
    << build_dtype << " on " << options.device << ": read " << read_s << " s ("
    << static_cast<double>(read.file_bytes) / 1e9 / std::max(read_s, 1e-9) << " GB/s, " << read.threads
    << " threads; " << read.cast << " tensors cast as read";
  if (read.other > 0) s << ", " << read.other << " converted after";
  s << ")";
  if (storage) {
    s << ", storage " << std::chrono::duration<double>(t2 - t1).count() << " s (" << report.kept_layers << " of "
      << report.cast_layers << " " << dtype_name(storage->storage) << " layers stored as in the file, "
      << report.cast_layers - report.kept_layers << " cast)";
    if (options.report != nullptr) *options.report = std::move(report);
  }
  log::info(s.str());
  return model;
}

}  // namespace sluice::anima
