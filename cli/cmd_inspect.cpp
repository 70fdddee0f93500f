// sluice inspect: what a checkpoint file (or a model config, built shape-only on the meta
// device) holds: model kind, tensor and parameter counts, bytes by dtype, module groups.
#include <ATen/ATen.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/options.h"
#include "cli/tensor_summary.h"
#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace sluice::cli {
namespace {

struct InspectArgs {
  std::string file;               // a .safetensors checkpoint, or
  std::string config;             // a preset / JSON config, built on meta
  std::string dtype = "bfloat16";  // dtype of the meta build (real checkpoints are bf16)
  bool json = false;              // machine-readable output
};

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
  return {{"source", "config"}, {"model", "anima"}, {"config", anima::config_to_json(config)}, {"dtype", a.dtype}};
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
  } else {
    j["reason"] = probe.reason;
  }
  return j;
}

int run_inspect(const InspectArgs& a) {
  TensorSummary s;
  nlohmann::json j = a.config.empty() ? inspect_file(a, s) : inspect_config(a, s);
  const nlohmann::json stats = to_json(s);
  for (auto it = stats.begin(); it != stats.end(); ++it) j[it.key()] = it.value();
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
  sub->add_option("--dtype", args->dtype, "With --config: dtype of the build (bfloat16|float32|float16)")
      ->check(dtype_validator({"bfloat16", "float32", "float16"}))
      ->capture_default_str()
      ->needs(config);
  sub->add_flag("--json", args->json, "Print JSON (fields: model, tensors, parameters, bytes, bytes_by_dtype, groups)");
  sub->callback([sub, args] {
    if (args->file.empty() && args->config.empty())
      throw CLI::RequiredError("a checkpoint file or --config");
  });
  return {sub, [args] { return run_inspect(*args); }};
}

}  // namespace sluice::cli
