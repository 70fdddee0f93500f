#pragma once
// Reading Anima checkpoints: detection, config inference and strict loading.
//
// Note [checkpoint keys]
// ~~~~~~~~~~~~~~~~~~~~~~
// Official files prefix every key with "net."; ComfyUI bundles use
// "model.diffusion_model." and also carry other models' tensors (VAE, text encoders,
// "model.model_sampling.*"), which are dropped as foreign. Under the prefix, keys ending in
// ".inv_freq" and keys under "pos_embedder." or "model_sampling." are non-persistent
// buffers some exporters write anyway: dropped. Scaled-fp8 files (ComfyUI's layouts,
// docs/FP8_CHECKPOINT_FORMATS.md) add, per layer, a weight scale ("<layer>.weight_scale"
// now, "<layer>.scale_weight" in older files: fp32, a scalar or one per output row, [out]
// or [out, 1]; weight = fp8 * scale), activation scales ("<layer>.input_scale",
// "<layer>.scale_input": dropped, sluice computes in bf16) and markers: "<layer>.comfy_quant"
// (JSON in a uint8 tensor), the "_quantization_metadata" header entry and the old
// "scaled_fp8" tensor. Markers naming an fp8 format are dropped (the weight's dtype and its
// scale say everything); any other format (int8, nvfp4, ...) is a CheckpointError naming
// it. Every remaining key must name a model parameter and vice versa, with equal shapes.
//
// Note [converted checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With layerwise storage (LoadOptions::storage), an fp8 weight or bias of a managed layer
// is read as it is in the file, into its final host memory, with its scale attached: no
// upcast and no cast. offload::apply_storage then keeps it when the file's dtype is the
// storage dtype (and its scale fits the requested scale mode, see cast_layer), checking
// only that no byte is an fp8 NaN/Inf; otherwise it converts from the dequantized values.
// So a file written by `sluice convert` (models/anima/convert.h) loads with no cast, and
// holds the same stored bytes as converting the source at load time.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "offload/layer/storage.h"
#include "runtime/dtype_policy.h"
#include "runtime/skip_patterns.h"

namespace sluice::safetensors {
class File;
}

namespace sluice::anima {

// What a safetensors file holds, as far as the Anima loader is concerned.
struct CheckpointProbe {
  bool is_anima = false;     // DiT keys plus llm_adapter keys (both parts present: a whole Anima)
  bool has_dit = false;      // blocks./t_embedder./x_embedder./final_layer. keys under `prefix`
  bool has_adapter = false;  // llm_adapter. keys under `prefix`
  std::string prefix;        // "net.", "model.diffusion_model." or "" (meaningful when has_dit)
  // Shape-derived fields (block count, widths, head_dim, adaLN-LoRA, adapter dims) from
  // the tensors; the rest (RoPE ratios/theta, norm eps, patch sizes, output_tokens) from
  // the file's "sluice.config" metadata when present, else anima-2b's defaults.
  AnimaConfig inferred;
  bool config_from_metadata = false;  // the metadata supplied the non-inferable fields
  int64_t tensors = 0;                // model tensors (after dropping the keys below)
  int64_t dropped_foreign = 0;        // keys outside `prefix` (other models of a bundle)
  int64_t dropped_non_model = 0;      // inv_freq / pos_embedder / model_sampling / fp8 markers
  int64_t scaled_weights = 0;         // weights with a ".weight_scale" companion
  std::map<std::string, int64_t> tensors_by_dtype;  // storage dtype name -> model tensors
  std::string reason;                 // why has_dit / is_anima is false
};

// Never throws for a non-Anima file: it reports has_dit = false and a reason.
CheckpointProbe probe_checkpoint(const safetensors::File& file);

// One model tensor of a file: its key in the file and, for scaled fp8, its scale's key.
struct TensorSource {
  std::string key;
  std::string scale_key;  // empty when unscaled
};
// Model parameter name -> source, for every model tensor under `prefix` (Note
// [checkpoint keys]). Throws CheckpointError for undecodable quantization markers.
std::map<std::string, TensorSource> model_tensor_sources(const safetensors::File& file, const std::string& prefix);

// The values of one model tensor: a copy read from the file (File::read, so a file
// truncated since it was opened is a FileError), or for scaled fp8 the dequantized fp32
// tensor (scale per tensor or per output row; out_rows = size(0)). `name` is used in
// messages. Throws CheckpointError for a scale of the wrong shape.
at::Tensor source_tensor(const safetensors::File& file, const TensorSource& src, const std::string& name,
                         int64_t out_rows);
// The weight scale of `src` (which has a scale_key) as sluice stores it: fp32, [] per tensor
// or [out_rows] per output row (a file's [1], [out_rows] or [out_rows, 1]). Throws
// CheckpointError for another shape (`weight_dims`: the weight's dims; rows need 2) or a
// scale that is not positive and finite.
at::Tensor read_scale(const safetensors::File& file, const TensorSource& src, const std::string& name, int64_t out_rows,
                      int64_t weight_dims);

// Options for load_anima.
struct LoadOptions {
  std::optional<AnimaConfig> config;  // overrides the inferred config; must match the file
  at::ScalarType dtype = at::kFloat;  // weights are converted to this dtype (when `storage` is unset)
  at::Device device = at::kCPU;       // where the weights end up
  // Layerwise storage (fp8). Unset: every weight in `dtype`. Set: the model is built and
  // read in storage->compute (norms stay there; `dtype` is not used), then
  // offload::apply_storage casts the Linears/Embeddings that match no skip pattern
  // (defaults + declared_fp8_skips() + extras) to the storage dtype resolved for `device`.
  std::optional<Fp8Options> storage;
  // With `storage`: receives offload::apply_storage's report (layers cast, kept as read,
  // skipped, values saturated) when set.
  offload::StorageReport* report = nullptr;
  int threads = 0;  // read workers; 0: every core this process may use
  // With `storage`: the skip list already made from it and declared_fp8_skips() (a model
  // cache resolves it once per load, cache/load_request.h); null: made here.
  const SkipList* skips = nullptr;
};

// Opens, probes, builds and strictly loads, then applies options.storage. Throws FileError
// (unreadable file), CheckpointError naming the file (not Anima, missing/unexpected keys,
// shape mismatches, a tensor that is not floating-point), InvalidArgument for bad storage
// options or NaN/inf weights (any storage dtype; the message names the file and the tensor).
// Logs one INFO line per file dtype its weights are cast from to another storage dtype.
// A DiT-only file (no llm_adapter keys) loads with adapter.enabled = false.
AnimaModel load_anima(const std::string& path, const LoadOptions& options = {});

// How load_weights reads.
struct WeightReadOptions {
  // Layerwise storage, dtypes resolved (see load_anima). Set: a managed layer that matches
  // no skip pattern is read straight into options.storage (bf16/fp16/fp32 files: cast as
  // read, with its scale when scale_mode asks; fp8 files: as they are, scale attached), and
  // the model must then go through offload::apply_storage with the returned casts.
  const Fp8Options* storage = nullptr;
  const SkipList* skips = nullptr;  // with storage: its skip list, already made; null: made here
  int threads = 0;  // read workers (runtime/fused_read.h); 0: every core
};

// What load_weights did.
struct WeightReadReport {
  int threads = 0;         // workers of the fused read
  int64_t fused = 0;       // tensors read by the fused read: copied, or cast as read
  int64_t cast = 0;        // of which cast to their storage dtype as read
  int64_t other = 0;       // tensors read one at a time, then converted (e.g. scaled fp8 into bf16)
  uint64_t file_bytes = 0;  // bytes of the file's model tensors
  offload::ReadCasts casts;  // for offload::apply_storage
  // With storage: file dtype name -> weights of layers to store that the file holds in
  // another dtype than the storage (cast as read, or after it for fp8 files).
  std::map<std::string, int64_t> cast_from;
};

// Strictly copies a file's tensors into an existing model's parameters, converting to
// each parameter's dtype and device (or, with options.storage, to the storage dtype).
// CPU parameters get one owned buffer each, written once (nothing aliases the file):
// Note [fused read]. Throws CheckpointError listing missing, unexpected and mismatched
// keys (first 10 of each and the count) or naming a tensor whose dtype is not floating-point
// (int8, bool, complex: never converted), FileError when a tensor cannot be read (a file
// truncated since it was opened), and InvalidArgument naming the file and the tensor for
// NaN/Inf values, whatever the dtype read into (every tensor is checked in the pass that
// reads it), all before touching any parameter: every tensor is read into host memory
// first, so loading onto a device holds the model in RAM once.
WeightReadReport load_weights(AnimaModelImpl& model, const safetensors::File& file, const std::string& prefix,
                              const WeightReadOptions& options = {});

}  // namespace sluice::anima
