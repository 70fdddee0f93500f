// sluice inspect: what a checkpoint file (or a model config, built shape-only on the meta
// device) holds, with the optional fp8 storage what-if. A thin client of sluice::inspect()
// (include/sluice/inspect.hpp).
#include <iostream>

#include "cli/commands.h"
#include "cli/options.h"
#include "runtime/dtype_policy.h"
#include "sluice/inspect.hpp"

namespace sluice::cli {
namespace {

struct InspectArgs {
  std::string file;                // a .safetensors checkpoint, or
  std::string config;              // a preset / JSON config, built on meta
  std::string dtype = "bfloat16";  // dtype of the meta build, compute dtype of --storage
  bool json = false;               // machine-readable output
  std::string storage;             // fp8 what-if: storage dtype (empty: none)
  std::vector<std::string> skips;  // extra skip patterns
  bool no_default_skips = false;   // drop the default skip patterns
  bool no_model_skips = false;     // drop the model's declared skip patterns
};

int run_inspect(const InspectArgs& a) {
  InspectOptions o;
  o.source = a.config.empty() ? InspectOptions::Source::file : InspectOptions::Source::config;
  o.dtype = a.dtype;
  o.storage = a.storage;
  o.extra_skips = a.skips;
  o.use_default_skips = !a.no_default_skips;
  o.use_model_skips = !a.no_model_skips;
  const InspectReport r = inspect(a.config.empty() ? a.file : a.config, o);
  std::cout << (a.json ? r.json + "\n" : r.text);
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
