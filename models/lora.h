#pragma once
// LoRA adapters as forward-time sidecars: read a LoRA safetensors file, map its keys onto
// a model's module names, and patch the model for the lifetime of a LoraScope.
// See Note [LoRA sidecars]; key mapping in models/lora_keys.h.
//
// Note [LoRA sidecars]
// ~~~~~~~~~~~~~~~~~~~~
// fp8 has no add, and folding B·A into the weight would destroy the fp8
// storage, so a LoRA is a residual y += scale·(x·Aᵀ)·Bᵀ that offload::LinearImpl adds
// after its own matmul (offload::LoraSidecar). A LoraScope appends one sidecar per
// targeted layer and removes exactly its own (by id) when destroyed, so scopes stack in
// any order and the stored weights (fp8 or not) are never modified. Adding or removing a
// scope while another thread runs a forward on the same model is not supported.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/lora_keys.h"

namespace sluice::offload {
class ManagedLayerImpl;
class SidecarPlacer;
}

namespace sluice {

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
// Block targets ("blocks.N.…") of an adapter trained on a shallower Anima go to the blocks it was
// trained on when `measured_blocks` (Note [Anima block layout] in models/anima/block_layout.h;
// logged once at INFO), else by index; an adapter that addresses a block the model lacks is a
// CheckpointError naming it, its highest block and the model's depth.
LoraAdapter lora_from_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              torch::nn::Module& model, const std::string& source, bool measured_blocks = true);

// Reads a LoRA safetensors file (FileError when unreadable, also when truncated while
// being read; fault point "lora.read") and maps it as above. The tensors are read into
// owned memory (safetensors::File::read), so the file may change afterwards.
LoraAdapter load_lora(const std::string& path, torch::nn::Module& model, bool measured_blocks = true);

// Patches `model` with `adapter` at `strength` while alive (Note [LoRA sidecars]).
// Sidecars are converted to each layer's compute dtype and placed by `placer` when given
// (the streaming engine running the model: it charges them to its budget and streams more
// layers to make room, Note [device extras] in offload/engine/model_budget.h; or the model cache's
// placer, which grows the model's share for them first, Note [sidecar share] in
// cache/sidecar_share.h; the placer must outlive the scope). Without `placer` or `device`, a
// model attached to a streaming engine gets its sidecars through that engine all the same
// (a streamed layer's stored weight is on the host: sidecars there would meet device
// activations on a GPU). Otherwise they go to `device` (default: the device of the layer's
// stored weight) with a plain .to(). The model's layers are kept alive by the scope.
// Throws CheckpointError (before patching anything) when a target module is missing from
// `model` or its shape differs; InvalidArgument for a non-finite strength; whatever placing
// a sidecar on its device throws (out of memory; fault point "lora.patch"), also before
// patching anything.
class LoraScope {
 public:
  LoraScope(torch::nn::Module& model, const LoraAdapter& adapter, double strength = 1.0,
            std::optional<at::Device> device = std::nullopt, offload::SidecarPlacer* placer = nullptr);
  ~LoraScope();
  LoraScope(const LoraScope&) = delete;
  LoraScope& operator=(const LoraScope&) = delete;

  int64_t id() const { return id_; }              // the owner token on this scope's sidecars
  int64_t patched_layers() const { return static_cast<int64_t>(layers_.size()); }
  // Bytes of the sidecars in their compute dtype (what they take on the device).
  uint64_t device_bytes() const { return bytes_; }

 private:
  int64_t id_;
  offload::SidecarPlacer* placer_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<std::shared_ptr<offload::ManagedLayerImpl>> layers_;
};

}  // namespace sluice
