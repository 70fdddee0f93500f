// sluice::inspect: a checkpoint's (or a config's shape-only build's) tensor counts, bytes by
// dtype and module groups; with a storage dtype, what layerwise fp8 storage would make of
// it (which layers the skip list keeps in the compute dtype, and param_size_mib).
#include "sluice/inspect.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "api/tensor_summary.h"
#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/anima/config.h"
#include "offload/layer/storage.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace sluice {
namespace {

// MiB rounded to one decimal, the precision the size table is quoted in.
double mib1(double bytes) { return std::round(bytes / (1024.0 * 1024.0) * 10.0) / 10.0; }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_config(const std::string& source, const InspectOptions& o) {
  if (o.source != InspectOptions::Source::detect) return o.source == InspectOptions::Source::config;
  if (ends_with(source, ".json")) return true;
  const auto names = anima::preset_names();
  return std::find(names.begin(), names.end(), source) != names.end();
}

// Builds `config` shape-only in the compute dtype and applies the requested storage to it.
nlohmann::json storage_what_if(const InspectOptions& o, const anima::AnimaConfig& config) {
  Fp8Options fp8;
  fp8.storage = parse_storage_dtype(o.storage);
  fp8.compute = parse_compute_dtype(o.dtype);
  fp8.extra_skip_patterns = o.extra_skips;
  fp8.use_default_skips = o.use_default_skips;
  fp8.use_model_skips = o.use_model_skips;
  anima::BuildOptions build;
  build.dtype = fp8.compute;
  build.device = at::kMeta;
  anima::AnimaModel model(config, build);
  const offload::StorageReport r = offload::apply_storage(*model, config.name, fp8, anima::declared_fp8_skips());
  nlohmann::json skipped = nlohmann::json::array();
  for (const auto& [module, pattern] : r.skipped) skipped.push_back({{"module", module}, {"pattern", pattern}});
  return {{"storage", dtype_name(r.dtypes.storage)},
          {"compute", dtype_name(r.dtypes.compute)},
          {"patterns", r.patterns},
          {"cast_layers", r.cast_layers},
          {"cast_parameters", r.cast_params},
          {"skipped", skipped},
          {"skipped_parameters", r.skipped_params},
          {"param_bytes", r.param_bytes},
          {"param_size_mib", mib1(static_cast<double>(r.param_bytes))}};
}

nlohmann::json inspect_config(const std::string& source, const InspectOptions& o, api::TensorSummary& s) {
  anima::AnimaConfig config = anima::config_from_name_or_file(source);
  config.validate();
  anima::BuildOptions build;
  build.dtype = parse_compute_dtype(o.dtype);
  build.device = at::kMeta;
  anima::AnimaModel model(config, build);
  for (const auto& p : model->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = p.value();
    s.add(p.key(), safetensors::dtype_name(t.scalar_type()), t.numel(), static_cast<uint64_t>(t.numel() * t.element_size()));
  }
  nlohmann::json j = {{"source", "config"}, {"model", "anima"}, {"config", anima::config_to_json(config)}, {"dtype", o.dtype}};
  if (!o.storage.empty()) j["fp8"] = storage_what_if(o, config);
  return j;
}

nlohmann::json inspect_file(const std::string& path, const InspectOptions& o, api::TensorSummary& s) {
  const auto file = safetensors::File::open(path);
  const anima::CheckpointProbe probe = anima::probe_checkpoint(*file);
  for (const auto& t : file->tensors()) {
    std::string name = t.name;
    if (!probe.prefix.empty() && name.rfind(probe.prefix, 0) == 0) name = name.substr(probe.prefix.size());
    s.add(name, t.dtype_name, t.numel(), t.nbytes());
  }
  nlohmann::json j = {{"source", "file"},
                      {"file", path},
                      {"file_bytes", file->file_size()},
                      {"metadata", file->metadata()},
                      {"model", probe.is_anima ? "anima" : probe.has_dit ? "anima-dit" : "unknown"},
                      {"prefix", probe.prefix}};
  if (probe.has_dit) {
    j["config"] = anima::config_to_json(probe.inferred);
    j["config_from_metadata"] = probe.config_from_metadata;
    j["dropped_foreign"] = probe.dropped_foreign;
    j["dropped_non_model"] = probe.dropped_non_model;
    j["scaled_weights"] = probe.scaled_weights;
    if (!o.storage.empty()) j["fp8"] = storage_what_if(o, probe.inferred);
  } else {
    j["reason"] = probe.reason;
    if (!o.storage.empty())
      throw CheckpointError("'" + path + "' is not an Anima checkpoint (" + probe.reason + "); --storage needs one");
  }
  return j;
}

std::string to_text(const std::string& source, const nlohmann::json& j, const api::TensorSummary& s) {
  std::ostringstream o;
  if (j["source"] == "file") {
    o << "file        " << source << "\n";
  } else {
    o << "config      " << source << " (shape-only build, " << j["dtype"].get<std::string>() << ")\n";
  }
  o << "model       " << j["model"].get<std::string>();
  if (j.contains("config")) o << " (" << j["config"]["name"].get<std::string>() << ")";
  if (j.contains("reason")) o << " (" << j["reason"].get<std::string>() << ")";
  o << "\n" << api::to_text(s);
  if (j.contains("fp8")) {
    const nlohmann::json& f = j["fp8"];
    o << "fp8         storage=" << f["storage"].get<std::string>() << " compute=" << f["compute"].get<std::string>()
      << ": " << f["cast_layers"].get<int64_t>() << " layers cast, " << f["skipped"].size() << " kept in "
      << f["compute"].get<std::string>() << "\n";
    for (const auto& k : f["skipped"])
      o << "  skip      " << k["module"].get<std::string>() << "  (" << k["pattern"].get<std::string>() << ")\n";
  }
  char size[64];
  std::snprintf(size, sizeof size, "%.1f", j["param_size_mib"].get<double>());
  o << "param_size  " << size << " MiB\n";
  return o.str();
}

}  // namespace

InspectReport inspect(const std::string& file_or_config, const InspectOptions& options) {
  api::TensorSummary s;
  nlohmann::json j =
      is_config(file_or_config, options) ? inspect_config(file_or_config, options, s) : inspect_file(file_or_config, options, s);
  const nlohmann::json stats = api::to_json(s);
  for (auto it = stats.begin(); it != stats.end(); ++it) j[it.key()] = it.value();
  // The model's size as stored: the storage what-if when asked, else what it holds now.
  j["param_size_mib"] = j.contains("fp8") ? j["fp8"]["param_size_mib"].get<double>() : mib1(static_cast<double>(s.bytes));
  return {j.dump(2), to_text(file_or_config, j, s)};
}

}  // namespace sluice
