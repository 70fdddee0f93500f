// sluice make-checkpoint: writes a deterministic random Anima checkpoint (the fixture of
// the tests and benchmarks; same config + seed + dtype -> identical bytes).
#include <ATen/ATen.h>

#include <iostream>
#include <sstream>

#include "cli/commands.h"
#include "cli/options.h"
#include "models/anima/generator.h"
#include "runtime/safetensors.h"

namespace sluice::cli {
namespace {

struct MakeCheckpointArgs {
  std::string config;             // preset name or JSON file
  uint64_t seed = 0;              // generator seed
  std::string out;                // output .safetensors path
  std::string dtype = "bfloat16";  // dtype of every stored tensor
};

int run_make_checkpoint(const MakeCheckpointArgs& a) {
  const anima::AnimaConfig config = load_config(a.config);
  const at::ScalarType dtype = parse_dtype(a.dtype);
  anima::write_random_checkpoint(config, a.seed, dtype, a.out);
  // Re-open what was written: proves the file parses, and gives the numbers to report.
  const auto file = safetensors::File::open(a.out);
  int64_t params = 0;
  for (const auto& t : file->tensors()) params += t.numel();
  std::ostringstream msg;
  msg << "wrote " << a.out << ": " << config.name << ", " << file->tensors().size() << " tensors, " << params
      << " parameters, " << a.dtype << ", " << file->file_size() << " bytes\n";
  std::cout << msg.str();
  return 0;
}

}  // namespace

Subcommand add_make_checkpoint(CLI::App& root) {
  auto args = std::make_shared<MakeCheckpointArgs>();
  CLI::App* sub = root.add_subcommand("make-checkpoint", "Write a random Anima checkpoint (deterministic per seed)");
  sub->add_option("--config", args->config, "Model preset name or JSON config file")
      ->required()
      ->check(config_validator());
  sub->add_option("--seed", args->seed, "Random seed (0 to 2^64 - 1)")->required()->check(seed_validator());
  sub->add_option("--out", args->out, "Output .safetensors file")->required()->check(output_file_validator());
  check_output_paths(sub, {{"--out", &args->out}}, {{"--config", &args->config}});  // Note [output paths]
  sub->add_option("--dtype", args->dtype, "Stored dtype: bfloat16|float32")
      ->check(dtype_validator({"bfloat16", "float32"}))
      ->capture_default_str();
  return {sub, [args] { return run_make_checkpoint(*args); }};
}

}  // namespace sluice::cli
