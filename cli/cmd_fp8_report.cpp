// sluice fp8-report: how much an Anima checkpoint loses under fp8 storage, per module group
// and per candidate skip list (models/anima/fp8_report.h has the method). Reads tensors
// one at a time from the mapped file, so an anima-2b checkpoint needs about one tensor of
// extra memory (plus, with --forward, the model in bf16 once per candidate).
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/options.h"
#include "models/anima/fp8_report.h"
#include "runtime/dtype_policy.h"

namespace sluice::cli {
namespace {

struct Fp8ReportArgs {
  std::string checkpoint;                // the .safetensors to analyse
  std::string storage = "float8_e4m3fn";  // fp8 dtype to measure
  bool forward = false;                  // also compare single-forward velocities
  uint64_t seed = 0;                     // seed of the --forward inputs
  int64_t latent = 16;                   // latent height/width of the --forward input
  bool json = false;                     // machine-readable output
};

int run_fp8_report(const Fp8ReportArgs& a) {
  anima::Fp8ReportOptions opts;
  opts.storage = parse_storage_dtype(a.storage);
  opts.forward = a.forward;
  opts.seed = a.seed;
  opts.latent_size = a.latent;
  const anima::Fp8Report report = anima::fp8_report(a.checkpoint, opts);
  if (a.json) {
    std::cout << anima::fp8_report_to_json(report).dump(2) << "\n";
  } else {
    std::cout << anima::fp8_report_to_text(report);
  }
  return 0;
}

}  // namespace

Subcommand add_fp8_report(CLI::App& root) {
  auto args = std::make_shared<Fp8ReportArgs>();
  CLI::App* sub = root.add_subcommand(
      "fp8-report", "Measure what fp8 storage loses per module group and per candidate skip list of a checkpoint");
  sub->add_option("checkpoint", args->checkpoint, "Anima checkpoint (.safetensors)")->required();
  sub->add_option("--storage", args->storage, "fp8 dtype to measure: float8_e4m3fn|float8_e5m2")
      ->check(CLI::IsMember({"float8_e4m3fn", "float8_e5m2"}))
      ->capture_default_str();
  sub->add_flag("--forward", args->forward,
                "Also run one forward per candidate skip list on fixed random inputs and report the velocity's "
                "relative L2 error against bf16");
  sub->add_option("--seed", args->seed, "Seed of the --forward inputs (0 to 2^64 - 1)")
      ->check(seed_validator())
      ->capture_default_str();
  sub->add_option("--latent", args->latent, "Latent height and width of the --forward input")
      ->check(CLI::Range(int64_t{1}, int64_t{512}))
      ->capture_default_str();
  sub->add_flag("--json", args->json, "Print JSON (groups[], candidates[], forward)");
  return {sub, [args] { return run_fp8_report(*args); }};
}

}  // namespace sluice::cli
