#pragma once
// The CLI's LoRA flags and the block layout of every adapter it applies (README, "The
// depth-expanded Anima-2.9B and Anima-3.8B, and adapters trained on a shallower model"):
// `--lora FILE[:SCALE]` (repeatable, applied in the order given) and `--adapter-blocks
// measured|as-is` on `sluice run` and `sluice forward`. --adapter-blocks covers --lllite too.
#include <CLI/CLI.hpp>

#include <string>
#include <utility>
#include <vector>

#include "sluice/sluice.hpp"

namespace sluice::cli {

struct AdapterFlags {
  std::vector<std::string> loras;           // --lora FILE[:SCALE], as given
  std::string adapter_blocks = "measured";  // --adapter-blocks: measured | as-is
  BlockLayout layout() const { return parse_block_layout(adapter_blocks, "--adapter-blocks"); }
};

// Adds --lora and --adapter-blocks to `sub`; a malformed value is a usage error (exit 2) of
// one line naming the flag.
void add_adapter_options(CLI::App* sub, AdapterFlags& flags);

// One --lora value: its path and scale (1 when no ":SCALE"). The scale is what follows the
// last ':'; CLI::ValidationError naming `flag` and the value when that is no finite number.
std::pair<std::string, double> parse_lora_spec(const std::string& spec, const std::string& flag = "--lora");

// Applies each --lora to `model` with the flags' block layout, in order; they stay applied while
// the handles live (and at most until the lock ends). Prints one line per LoRA to `out` when
// given ("LoRA 'F' at scale S: N layers"). FileError / CheckpointError / ResourceError as
// LockedModel::apply_lora's.
std::vector<LoraHandle> apply_loras(LockedModel& model, const AdapterFlags& flags, std::ostream* out);

}  // namespace sluice::cli
