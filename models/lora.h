#pragma once
// LoRA adapters as forward-time sidecars: read a LoRA safetensors file, map its keys onto
// a model's module names, and patch the model for the lifetime of a LoraScope.
// See Note [LoRA sidecars].
//
// Note [LoRA sidecars]
// ~~~~~~~~~~~~~~~~~~~~
// DESIGN.md §2: fp8 has no add, and folding B·A into the weight would destroy the fp8
// storage, so a LoRA is a residual y += scale·(x·Aᵀ)·Bᵀ that offload::LinearImpl adds
// after its own matmul (offload::LoraSidecar). A LoraScope appends one sidecar per
// targeted layer and removes exactly its own (by id) when destroyed, so scopes stack in
// any order and the stored weights (fp8 or not) are never modified. Adding or removing a
// scope while another thread runs a forward on the same model is not supported.
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
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace sluice::offload {
class ManagedLayerImpl;
}

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

// One targeted layer of an adapter.
struct LoraTarget {
  std::string module;  // model module name ("blocks.0.self_attn.q_proj")
  at::Tensor down;     // A [rank, in], as read (dtype of the file, CPU)
  at::Tensor up;       // B [out, rank]
  double alpha_scale = 1.0;  // alpha / rank (1 when the file has no alpha)
};

// A LoRA file mapped onto one model.
struct LoraAdapter {
  std::string source;               // file path (or a name given by the caller), for messages
  std::vector<LoraTarget> targets;  // in the model's layer order
  int64_t rank() const;             // largest rank among targets (0 when empty)
};

// Maps named LoRA tensors onto the ManagedLayers of `model`. Throws CheckpointError naming
// `source` and listing: keys that are no LoRA key, target modules the model does not have
// (first 10 and the count), modules with only one of down/up, and shape mismatches (naming
// the module, the tensors' shapes and the layer's [out, in]); InvalidArgument for a
// non-finite or non-positive alpha. Embedding layers cannot be targeted (CheckpointError).
LoraAdapter lora_from_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              torch::nn::Module& model, const std::string& source);

// Reads a LoRA safetensors file (FileError when unreadable) and maps it as above. The
// tensors are copied out of the mapping, so the file may change afterwards.
LoraAdapter load_lora(const std::string& path, torch::nn::Module& model);

// Patches `model` with `adapter` at `strength` while alive (Note [LoRA sidecars]).
// Sidecars are converted to each layer's compute dtype and placed on `device` (default:
// the device of the layer's stored weight). The model's layers are kept alive by the scope.
// Throws CheckpointError (before patching anything) when a target module is missing from
// `model` or its shape differs; InvalidArgument for a non-finite strength.
class LoraScope {
 public:
  LoraScope(torch::nn::Module& model, const LoraAdapter& adapter, double strength = 1.0,
            std::optional<at::Device> device = std::nullopt);
  ~LoraScope();
  LoraScope(const LoraScope&) = delete;
  LoraScope& operator=(const LoraScope&) = delete;

  int64_t id() const { return id_; }              // the owner token on this scope's sidecars
  int64_t patched_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  int64_t id_;
  std::vector<std::shared_ptr<offload::ManagedLayerImpl>> layers_;
};

}  // namespace sluice
