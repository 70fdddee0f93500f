#pragma once
// Layerwise storage casting: turns a built model's ManagedLayers into their storage dtype
// (fp8 or not), leaving skipped layers, norms and buffers in the compute dtype.
// See Note [layerwise storage].
//
// Note [layerwise storage]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Every parameter (weight and bias) of a Linear/Embedding whose dotted name
// matches no skip pattern is stored in the storage dtype; skipped layers are stored in the
// compute dtype; norm parameters and buffers are never touched. Only ManagedLayers are
// cast because they are the only modules whose forward upcasts through a WeightLease; a
// norm's forward reads its parameter directly, so casting it would break it.
//  - Values go through cast_to_storage (runtime/fp8.h): out-of-range values saturate or
//    are refused per Fp8Options::out_of_range, NaN/inf are always refused, never stored,
//    whatever the storage dtype (fp8, bfloat16, float16, float32). A tensor already in its
//    dtype (a generated model's, one a read left there) is scanned for NaN/inf once, unless
//    the read already did (ReadCasts::checked).
//  - On a meta (shape-only) model the dtype changes without value checks, so sizes of a
//    model that was never allocated can be reported (`sluice inspect --storage`).
//  - apply_storage uses options.storage/options.compute as given (validated, not
//    resolved): callers that target a real device run resolve_dtypes() first, which may
//    turn fp8 off for a device that cannot hold it.
//  - Layers are converted one at a time, so peak extra memory is one layer. If a cast
//    throws (a NaN in the checkpoint), the layers before it are already converted; each
//    layer is always self-consistent (stored dtype + compute dtype + scale) and usable.
//
// Tested by (directly through apply_storage on Anima models, and through load_anima and `sluice
// inspect --storage`): tests/offload/layer/test_fp8_model.cpp ("fp8 model: apply_storage casts
// weight and bias of unskipped layers only, norms and buffers untouched", "fp8 model: apply_storage
// refuses NaN weights and leaves that layer untouched", "fp8 model: apply_storage refuses NaN and
// Inf weights for every storage dtype, a weight kept as it is too", "fp8 model: apply_storage on a
// meta model also builds meta scales for scaled storage", "fp8 model: load_anima with fp8 storage
// yields the fp8 resident size (dead-toggle guard)"), tests/models/anima/test_checkpoint_loader.cpp
// ("checkpoint loader: fused load: casting as read stores the bytes of a cast after a plain load,
// for any thread count"), tests/cli/test_cli.cpp ("cli: inspect --storage reproduces the anima-2b
// fp8 size table exactly").
#include <torch/nn/module.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runtime/dtype_policy.h"
#include "runtime/skip_patterns.h"

namespace sluice::offload {

// What apply_storage did (or, on a meta model, would do).
struct StorageReport {
  std::string model_name;                                     // as passed, for messages
  DtypePair dtypes;                                           // storage/compute applied
  int64_t param_bytes = 0;                                    // sum of nbytes over ALL parameters
  int64_t cast_layers = 0;                                    // ManagedLayers now in `dtypes.storage`
  int64_t kept_layers = 0;                                    // of which stored as read (already in it: no cast)
  int64_t cast_params = 0;                                    // elements in those layers (weight+bias)
  std::vector<std::pair<std::string, std::string>> skipped;  // (module, pattern that matched)
  int64_t skipped_params = 0;                                 // elements kept in compute dtype
  int64_t clipped = 0;                                        // values saturated (fp8 only)
  std::vector<std::string> patterns;                          // the effective skip list

  // param_bytes in MiB (unrounded).
  double param_mib() const { return static_cast<double>(param_bytes) / (1024.0 * 1024.0); }
};

class ManagedLayerImpl;

// What a loader's fused read (runtime/fused_read.h) already did to the layers it wrote in
// their storage dtype, so that apply_storage neither redoes nor miscounts it.
struct ReadCasts {
  std::set<const ManagedLayerImpl*> cast;     // converted to the storage dtype as read
  std::set<const ManagedLayerImpl*> checked;  // values checked for NaN/Inf as read
  int64_t clipped = 0;                        // values the read saturated
};

// Casts every ManagedLayer of `model` per Note [layerwise storage] and sets every layer's
// compute dtype to options.compute. The skip list is SkipList::from_options(options,
// model_declared_skips). Logs one INFO line when the storage dtype is fp8:
//   FP8 layerwise casting enabled for <name> (storage=float8_e4m3fn, compute=bfloat16, param_size=2012.0MiB)
// (MB = MiB rounded to an integer). Throws InvalidArgument for an invalid storage/compute
// dtype or skip pattern, and what cast_to_storage throws (NaN/inf, refused out-of-range).
// `read`: what a fused read did (its layers count as cast, not as stored as read; their
// values are not checked again; its saturations are added to the report).
StorageReport apply_storage(torch::nn::Module& model, const std::string& model_name, const Fp8Options& options,
                            const std::vector<std::string>& model_declared_skips, const ReadCasts* read = nullptr);
// The same with the skip list already made (SkipList::from_options(options, the model's
// declared patterns)): a caller that resolved it once for a load hands it down.
StorageReport apply_storage(torch::nn::Module& model, const std::string& model_name, const Fp8Options& options,
                            const SkipList& skips, const ReadCasts* read = nullptr);

// Sum of nelement * element_size over every parameter of `model` (works on meta).
int64_t param_bytes(torch::nn::Module& model);

}  // namespace sluice::offload
