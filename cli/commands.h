#pragma once
// The `sluice` subcommands. Each add_<name>() registers one subcommand (its flags and
// help) on the root app and returns the function that runs it once parsing succeeded;
// main.cpp lists them, so adding a subcommand is one line there.
//
// Exit status contract (scripts depend on it): 0 success, 1 runtime error (bad file,
// wrong shape, model error), 2 usage error (unknown flag, bad flag value, an output path
// that cannot be written or that is another output or an input: Note [output paths] in
// cli/options.h). Errors are one line on stderr: "sluice: error: ...".
#include <CLI/CLI.hpp>

#include <functional>

namespace sluice::cli {

struct Subcommand {
  CLI::App* app = nullptr;  // owned by the root app
  std::function<int()> run;  // returns the exit status; throws on error
};

// sluice inspect <file.safetensors> | --config NAME|FILE.json [--storage D [--skip P]...
//                [--no-default-skips] [--no-model-skips]] [--json]
Subcommand add_inspect(CLI::App& root);
// sluice forward --checkpoint F --inputs IN --output OUT [--config] [--compute (alias --dtype)] [--device]
Subcommand add_forward(CLI::App& root);
// sluice make-checkpoint --config NAME|FILE.json --seed N --out F [--dtype]
Subcommand add_make_checkpoint(CLI::App& root);
// sluice convert IN --out OUT [--storage float8_e4m3fn|float8_e5m2] [--compute] [--scaled [--scale per_tensor|
//                per_channel]] [--skip P]... [--no-default-skips] [--no-model-skips]
Subcommand add_convert(CLI::App& root);
// sluice fp8-report <checkpoint> [--storage float8_e4m3fn|float8_e5m2] [--forward] [--json]
Subcommand add_fp8_report(CLI::App& root);
// sluice run [--checkpoint F | --synthetic PRESET] [--device] [--vram-budget] [--vram-headroom]
//            [--max-resident] [--working-memory] [--storage] [--steps] [--cfg] [--resolution] [--prefetch]
//            [--pin-memory] [--pin-memory-limit] [--seed] [--context F] [--output F] [--stats-json F] [--trace F]
Subcommand add_run(CLI::App& root);

}  // namespace sluice::cli
