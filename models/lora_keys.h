#pragma once
// Mapping LoRA file keys onto a model's module names: pure string functions, no torch, so
// the fuzz target (tests/fuzz/fuzz_lora_keys.cpp) builds without it.
//
// Note [LoRA key layouts]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Recognised per-module keys (<m> is a module path):
//   <m>.lora_A.weight / <m>.lora_B.weight             (PEFT / diffusers)
//   <m>.lora_A.<adapter>.weight / <m>.lora_B.<adapter>.weight  (PEFT with an adapter name)
//   <m>.lora_down.weight / <m>.lora_up.weight         (kohya / ComfyUI)
//   <m>.alpha                                          (optional; scale = alpha / rank)
// <m> may carry a prefix: "diffusion_model.", "model.diffusion_model.", "transformer.",
// "net.", "base_model.model." (repeatable, in any combination), or be kohya's flattened
// "lora_unet_<path with '.' as '_'>" (also "lora_transformer_"), which is mapped back by
// comparing against the model's module names with '.' replaced by '_'. A flattened name
// that two module names flatten to is ambiguous and reported as unknown.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace sluice {

// Which tensor of a LoRA pair a key names.
enum class LoraPart { down, up, alpha };

// The result of map_lora_key for a key with a recognised LoRA suffix.
struct LoraKeyMatch {
  LoraPart part = LoraPart::down;
  std::string module;  // the model's module name when `known`, else the key's stem minus known prefixes
  bool known = false;  // `module` is one of module_names
};

// Maps one LoRA file key onto a module name (Note [LoRA key layouts]). nullopt when the key
// has no recognised LoRA suffix. Pure function over strings: never throws for any input
// (beyond std::bad_alloc) and reads nothing else.
std::optional<LoraKeyMatch> map_lora_key(const std::string& key, const std::vector<std::string>& module_names);

// The block index N of a module path "blocks.N.<rest>" (or kohya's flattened "blocks_N_<rest>",
// as an unknown key's module keeps it), nullopt for any other path. For the adapter block remap
// (Note [Anima block layout] in models/anima/block_layout.h). Never throws (beyond std::bad_alloc).
std::optional<int64_t> block_index(const std::string& module);

// "blocks.N.<rest>" with N replaced by `block`; `module` unchanged when it has no dotted block index.
std::string with_block_index(const std::string& module, int64_t block);

}  // namespace sluice
