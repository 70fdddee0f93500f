#pragma once
// Flag values shared by several subcommands: dtypes, devices, model configs. Validators
// turn a bad value into a CLI11 parse error (exit status 2) that names the flag.
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "models/anima/config.h"
#include "runtime/shape_str.h"

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
CLI::Validator size_validator(const std::string& flag, bool allow_percent, bool allow_auto = false);

// --prefetch: "auto" or a number of streamed layers (offload::parse_prefetch).
CLI::Validator prefetch_validator();
// --policy: balanced | spread | front_first (offload::parse_residency_policy).
CLI::Validator policy_validator();

// A file the command writes at its end (--timeline): its folder exists and is writable and
// it is not itself a folder, checked before the command starts (so a typo does not cost a
// whole run). The write itself can still fail (a full disk): that is a FileError.
CLI::Validator output_file_validator();

// --vram-budget (size, percent of total device memory, or auto) and --vram-headroom on `sub`.
void add_vram_budget_options(CLI::App* sub, std::string& vram_budget, std::string& vram_headroom,
                             const std::string& default_text);

// --load-threads N: threads that read (and cast) a checkpoint, 0 (the default) for every core.
void add_load_threads_option(CLI::App* sub, int& load_threads);

// Accepts a preset name or a path ending in ".json" (whose contents are checked later,
// when it is read, because that can fail for runtime reasons).
CLI::Validator config_validator();
anima::AnimaConfig load_config(const std::string& name_or_file);

}  // namespace sluice::cli
