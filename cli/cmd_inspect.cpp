// sluice inspect: what a checkpoint file (or a model config, built shape-only on the meta
// device) holds: model kind, tensor and parameter counts, bytes by dtype, module groups.
// With --storage it also says what layerwise fp8 storage would make of the model: which
// layers the skip list keeps in the compute dtype and the resulting param_size_mib, on a
// shape-only build (so even anima-2b costs no memory).
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/options.h"
#include "cli/tensor_summary.h"
#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "offload/storage.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace sluice::cli {
namespace {

struct InspectArgs {
  std::string file;               // a .safetensors checkpoint, or
  std::string config;             // a preset / JSON config, built on meta
  std::string dtype = "bfloat16";  // dtype of the meta build (real checkpoints are bf16)
  bool json = false;              // machine-readable output
  std::string storage;            // fp8 what-if: storage dtype (empty: none)
  std::vector<std::string> skips;  // extra skip patterns
  bool no_default_skips = false;   // drop the default skip patterns
  bool no_model_skips = false;     // drop the model's declared skip patterns
};

// MiB rounded to one decimal, the precision the size table is quoted in.
double mib1(double bytes) { return std::round(bytes / (1024.0 * 1024.0) * 10.0) / 10.0; }

// Builds `config` shape-only in the compute dtype and applies the requested storage to it.
nlohmann::json storage_what_if(const InspectArgs& a, const anima::AnimaConfig& config) {
  Fp8Options fp8;
  fp8.storage = parse_storage_dtype(a.storage);
  fp8.compute = parse_compute_dtype(a.dtype);
  fp8.extra_skip_patterns = a.skips;
  fp8.use_default_skips = !a.no_default_skips;
  fp8.use_model_skips = !a.no_model_skips;
  anima::BuildOptions opts;
  opts.dtype = fp8.compute;
  opts.device = at::kMeta;
  anima::AnimaModel model(config, opts);
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

nlohmann::json inspect_config(const InspectArgs& a, TensorSummary& s) {
  const anima::AnimaConfig config = load_config(a.config);
  anima::BuildOptions opts;
  opts.dtype = parse_dtype(a.dtype);
  opts.device = at::kMeta;
  anima::AnimaModel model(config, opts);
  for (const auto& p : model->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = p.value();
    s.add(p.key(), safetensors::dtype_name(t.scalar_type()), t.numel(), static_cast<uint64_t>(t.numel() * t.element_size()));
  }
  nlohmann::json j = {{"source", "config"}, {"model", "anima"}, {"config", anima::config_to_json(config)}, {"dtype", a.dtype}};
  if (!a.storage.empty()) j["fp8"] = storage_what_if(a, config);
  return j;
}

nlohmann::json inspect_file(const InspectArgs& a, TensorSummary& s) {
  const auto file = safetensors::File::open(a.file);
  const anima::CheckpointProbe probe = anima::probe_checkpoint(*file);
  for (const auto& t : file->tensors()) {
    std::string name = t.name;
    if (!probe.prefix.empty() && name.rfind(probe.prefix, 0) == 0) name = name.substr(probe.prefix.size());
    s.add(name, t.dtype_name, t.numel(), t.nbytes());
  }
  nlohmann::json j = {{"source", "file"},
                      {"file", a.file},
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
    if (!a.storage.empty()) j["fp8"] = storage_what_if(a, probe.inferred);
  } else {
    if (!a.storage.empty())
      throw CheckpointError("'" + a.file + "' is not an Anima checkpoint (" + probe.reason + "); --storage needs one");
    j["reason"] = probe.reason;
  }
  return j;
}

int run_inspect(const InspectArgs& a) {
  TensorSummary s;
  nlohmann::json j = a.config.empty() ? inspect_file(a, s) : inspect_config(a, s);
  const nlohmann::json stats = to_json(s);
  for (auto it = stats.begin(); it != stats.end(); ++it) j[it.key()] = it.value();
  // The model's size as stored: the --storage what-if when asked, else what it holds now.
  j["param_size_mib"] = j.contains("fp8") ? j["fp8"]["param_size_mib"].get<double>() : mib1(static_cast<double>(s.bytes));
  if (a.json) {
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  if (j["source"] == "file") {
    std::cout << "file        " << a.file << "\n";
  } else {
    std::cout << "config      " << a.config << " (shape-only build, " << a.dtype << ")\n";
  }
  std::cout << "model       " << j["model"].get<std::string>();
  if (j.contains("config")) std::cout << " (" << j["config"]["name"].get<std::string>() << ")";
  if (j.contains("reason")) std::cout << " (" << j["reason"].get<std::string>() << ")";
  std::cout << "\n" << to_text(s);
  if (j.contains("fp8")) {
    const nlohmann::json& f = j["fp8"];
    std::cout << "fp8         storage=" << f["storage"].get<std::string>() << " compute=" << f["compute"].get<std::string>()
              << ": " << f["cast_layers"].get<int64_t>() << " layers cast, " << f["skipped"].size()
              << " kept in " << f["compute"].get<std::string>() << "\n";
    for (const auto& k : f["skipped"])
      std::cout << "  skip      " << k["module"].get<std::string>() << "  (" << k["pattern"].get<std::string>() << ")\n";
  }
  char size[64];
  std::snprintf(size, sizeof size, "%.1f", j["param_size_mib"].get<double>());
  std::cout << "param_size  " << size << " MiB\n";
  return 0;
}

}  // namespace

Subcommand add_inspect(CLI::App& root) {
  auto args = std::make_shared<InspectArgs>();
  CLI::App* sub = root.add_subcommand("inspect", "Describe a checkpoint file or a model config");
  auto* file = sub->add_option("file", args->file, "Checkpoint (.safetensors) to describe");
  auto* config = sub->add_option("--config", args->config, "Describe a preset or JSON config instead (shape-only build)")
                     ->check(config_validator());
  file->excludes(config);
  config->excludes(file);
  sub->add_option("--dtype", args->dtype, "Dtype of a --config build, and the compute dtype of --storage (bfloat16|float32|float16)")
      ->check(dtype_validator({"bfloat16", "float32", "float16"}))
      ->capture_default_str();
  sub->add_flag("--json", args->json,
                "Print JSON (fields: model, tensors, parameters, bytes, bytes_by_dtype, groups, param_size_mib, fp8)");
  auto* storage = sub->add_option("--storage", args->storage,
                                  "What-if layerwise storage: float8_e4m3fn|float8_e5m2|...|bfloat16 (compute dtype: --dtype)")
                      ->check([](const std::string& v) {
                        try {
                          parse_storage_dtype(v);
                          return std::string();
                        } catch (const std::exception& e) {
                          return std::string(e.what());
                        }
                      });
  sub->add_option("--skip", args->skips,
                  "With --storage: keep modules matching this pattern in the compute dtype (repeatable; plain names "
                  "match whole dotted components, patterns with regex syntax are searched)")
      ->needs(storage);
  sub->add_flag("--no-default-skips", args->no_default_skips, "With --storage: drop the default skip patterns")
      ->needs(storage);
  sub->add_flag("--no-model-skips", args->no_model_skips,
                "With --storage: drop the model's declared skip patterns (Anima: t_embedder, x_embedder, final_layer)")
      ->needs(storage);
  sub->callback([sub, args] {
    if (args->file.empty() && args->config.empty())
      throw CLI::RequiredError("a checkpoint file or --config");
  });
  return {sub, [args] { return run_inspect(*args); }};
}

}  // namespace sluice::cli
