#pragma once
// Flag values shared by several subcommands: dtypes, devices, model configs. Validators
// turn a bad value into a CLI11 parse error (exit status 2) that names the flag.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "models/anima/config.h"
#include "runtime/shape_str.h"
#include "sluice/sluice.hpp"

namespace sluice::cli {

// Accepts exactly the dtype names in `allowed` ("float32", "bfloat16", "float16").
CLI::Validator dtype_validator(const std::vector<std::string>& allowed);
// "float32" | "bfloat16" | "float16" -> torch dtype. Throws InvalidArgument otherwise.
at::ScalarType parse_dtype(const std::string& name);
// The flag spelling of a dtype ("bfloat16"); used in messages and JSON.
std::string dtype_flag_name(at::ScalarType t);

// Accepts "cpu", "cuda" and "cuda:N" (ROCm builds of torch also call their GPUs cuda).
CLI::Validator device_validator();
// Parses a validated device string and checks the device exists on this machine;
// throws ResourceError when it does not.
at::Device resolve_device(const std::string& spec);

// Syntax-only check of a size flag (the real value needs the device's memory): turns a
// malformed value into a usage error (exit 2). `allow_auto`: "auto" is accepted too.
// CLI11 names the flag, so the message does not: "--vram-budget: invalid size 'abc': ...".
CLI::Validator size_validator(const std::string& flag, bool allow_percent, bool allow_auto = false);

// A finite number in [lo, hi]: "expected a number from 0 to 1, got 'abc'" (after CLI11's
// "--max-resident: ").
CLI::Validator number_validator(double lo, double hi);
// A whole number in [lo, hi]: "expected a whole number from 1 to 100000, got 'abc'".
CLI::Validator integer_validator(uint64_t lo, uint64_t hi);
// --seed: a whole number from 0 to 2^64 - 1; "-1" and 2^64 are refused, not wrapped.
CLI::Validator seed_validator();

// --prefetch: "auto" or a number of streamed layers (offload::parse_prefetch).
CLI::Validator prefetch_validator();
// --policy: balanced | spread | front_first (offload::parse_residency_policy).
CLI::Validator policy_validator();

// Note [output paths]
// ~~~~~~~~~~~~~~~~~~~
// Every file a command writes (run's --output, --stats-json, --trace, --timeline, forward's
// --output, convert's and make-checkpoint's --out) is checked when the flags are parsed,
// before anything is read or computed, so that a typo does not cost a whole run: its
// folder exists and is writable, it is not a folder, an existing file there is writable,
// and it is none of the command's other outputs and none of its inputs (the same file
// under another spelling or link counts). A failure is a usage error (exit 2) of one line
// naming the flag and the path. The write itself can still fail (a full disk): that is a
// FileError (exit 1).

// The per-file part of Note [output paths], for one flag.
CLI::Validator output_file_validator();

// A flag and the path it was given (empty: not given, skipped).
struct PathFlag {
  std::string flag;  // "--output"; for a positional argument, a description ("the input file")
  const std::string* path;
};
// The cross-flag part of Note [output paths], run when `sub` has been parsed: every output
// distinct from the others and from every input. Throws CLI::ValidationError (exit 2).
void check_output_paths(CLI::App* sub, std::vector<PathFlag> outputs, std::vector<PathFlag> inputs);

// Messages of the public API name its options (vram_budget); on the command line they are
// flags (--vram-budget). Returns `message` with each option name that has a flag replaced.
std::string api_names_to_flags(const std::string& message);
// The public API's ModelCache for `options`, its InvalidArgument messages in flag names
// ("--vram-budget 10TB (9.1TiB) is more than the ...").
std::unique_ptr<ModelCache> make_model_cache(const RuntimeOptions& options);

// --vram-budget (size, percent of total device memory, or auto) and --vram-headroom on `sub`.
void add_vram_budget_options(CLI::App* sub, std::string& vram_budget, std::string& vram_headroom,
                             const std::string& default_text);

// --load-threads N: threads that read (and cast) a checkpoint, 0 (the default) for every core.
void add_load_threads_option(CLI::App* sub, int& load_threads);

// Accepts a preset name or a path ending in ".json" (whose contents are checked later,
// when it is read, because that can fail for runtime reasons).
CLI::Validator config_validator();
anima::AnimaConfig load_config(const std::string& name_or_file);

// --mask-blocks (regional prompting, README "Regional prompting"): "even" or empty (the
// model's default, the even blocks: an empty list), "odd", "all" of `num_blocks`, or
// comma-separated block indices (each checked by the forward); InvalidArgument naming the
// flag otherwise.
std::vector<int64_t> parse_mask_blocks(const std::string& spec, int64_t num_blocks);

}  // namespace sluice::cli
