// sluice convert: writes a checkpoint as sluice stores it (fp8 Linear weights, the skip
// list in the compute dtype, optional scales, metadata; Note [convert layout] in
// models/anima/convert.h), so that later loads need no cast and other tools can read it.
#include <chrono>
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "cli/options.h"
#include "models/anima/convert.h"
#include "runtime/dtype_policy.h"
#include "runtime/size_parse.h"

namespace sluice::cli {
namespace {

struct ConvertArgs {
  std::string in;                      // source checkpoint
  std::string out;                     // converted checkpoint
  std::string storage = "float8_e4m3fn";
  std::string compute = "bfloat16";
  bool scaled = false;                 // write weight scales (also set by --scale)
  std::string scale = "per_tensor";    // per_tensor (ComfyUI's layout) | per_channel; given, it implies --scaled
  std::vector<std::string> skips;      // extra skip patterns
  bool no_default_skips = false;
  bool no_model_skips = false;
  int load_threads = 0;                // read workers; 0: every core
};

int run_convert(const ConvertArgs& a) {
  Fp8Options o;
  o.storage = parse_storage_dtype(a.storage);
  o.compute = parse_dtype(a.compute);
  o.extra_skip_patterns = a.skips;
  o.use_default_skips = !a.no_default_skips;
  o.use_model_skips = !a.no_model_skips;
  o.scale_mode = a.scaled ? parse_scale_mode(a.scale) : ScaleMode::none;
  const auto t0 = std::chrono::steady_clock::now();
  const anima::ConvertReport r = anima::convert_checkpoint(a.in, a.out, o, a.load_threads);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char line[512];
  std::snprintf(line, sizeof line,
                "wrote %s: %s, %lld tensors (%lld %s, %lld weight scales, %lld layers kept in %s), %s from %s, "
                "in %.2f s\n",
                a.out.c_str(), r.model_name.c_str(), static_cast<long long>(r.tensors),
                static_cast<long long>(r.fp8_tensors), a.storage.c_str(), static_cast<long long>(r.scales),
                static_cast<long long>(r.skipped_layers), a.compute.c_str(), format_mib(r.out_bytes).c_str(),
                format_mib(r.in_bytes).c_str(), s);
  std::cout << line;
  return 0;
}

}  // namespace

Subcommand add_convert(CLI::App& root) {
  auto a = std::make_shared<ConvertArgs>();
  CLI::App* sub = root.add_subcommand(
      "convert", "Write a checkpoint in sluice's stored form (fp8 weights, skip list in bf16), loadable with no cast");
  sub->add_option("in", a->in, "Source checkpoint (.safetensors)")->required();
  sub->add_option("--out", a->out, "Converted checkpoint (.safetensors)")->required()->check(output_file_validator());
  check_output_paths(sub, {{"--out", &a->out}}, {{"the input file", &a->in}});  // Note [output paths]
  sub->add_option("--storage", a->storage, "fp8 storage dtype")
      ->check(CLI::IsMember({"float8_e4m3fn", "float8_e5m2"}))
      ->capture_default_str();
  sub->add_option("--compute", a->compute, "Compute dtype (the skip list and norms are stored in it)")
      ->check(dtype_validator({"bfloat16", "float16", "float32"}))
      ->capture_default_str();
  sub->add_flag("--scaled", a->scaled, "Store a weight scale per layer (amax / max finite) for more exact values");
  sub->add_option("--scale", a->scale,
                  "Weight scales: per_tensor (one scalar per layer, ComfyUI's layout) or per_channel (one per output "
                  "row, [out, 1]); implies --scaled")
      ->check(CLI::IsMember({"per_tensor", "per_channel"}))
      ->each([a](const std::string&) { a->scaled = true; })  // a scale mode given means scales wanted
      ->capture_default_str();
  sub->add_option("--skip", a->skips,
                  "Keep modules matching this pattern in the compute dtype (repeatable; plain names match whole "
                  "dotted components, patterns with regex syntax are searched)");
  sub->add_flag("--no-default-skips", a->no_default_skips, "Drop the default skip patterns");
  sub->add_flag("--no-model-skips", a->no_model_skips,
                "Drop the model's declared skip patterns (Anima: t_embedder, x_embedder, final_layer)");
  add_load_threads_option(sub, a->load_threads);
  return {sub, [a] { return run_convert(*a); }};
}

}  // namespace sluice::cli
