#pragma once
// Writing an Anima model as sluice stores it: `sluice convert`. Note [convert layout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The output is a safetensors file that sluice loads with no cast (Note [converted
// checkpoints] in checkpoint.h) and that other tools read as they read community fp8
// files (docs/FP8_CHECKPOINT_FORMATS.md):
//  - keys "net.<parameter>" (the official files' prefix), every parameter in its stored
//    dtype: the Linear/Embedding weights and biases the skip list does not keep in fp8,
//    the rest (norms, skipped layers) in the compute dtype;
//  - scaled: "net.<layer>.weight_scale", fp32, weight = fp8 * scale. Per tensor it is a
//    scalar [] (ComfyUI's layout); per channel [out, 1] (sluice's extension: ComfyUI
//    dequantizes it correctly only on its non-fp8-matmul path);
//  - metadata: "format" = "pt"; "sluice.config" (the full config, so nothing is inferred
//    on load); "sluice.storage", "sluice.compute", "sluice.scale" (none | per_tensor |
//    per_channel), "sluice.skips" (JSON list of the skip patterns used); scaled files also
//    carry ComfyUI's "_quantization_metadata" ({"format_version": "1.0", "layers":
//    {"net.<layer>": {"format": "float8_e4m3fn", "full_precision_matrix_mult": true}}}:
//    dequantize and compute in full precision, as sluice does).
// Unscaled files carry no quantization marker: ComfyUI reads plain fp8 weights as they are.
#include <cstdint>
#include <string>

#include "runtime/dtype_policy.h"

namespace sluice::anima {

struct ConvertReport {
  std::string model_name;
  int64_t tensors = 0;         // written, scales included
  int64_t fp8_tensors = 0;     // of which in the fp8 storage dtype
  int64_t scales = 0;          // of which weight scales
  int64_t skipped_layers = 0;  // managed layers the skip list kept in the compute dtype
  uint64_t in_bytes = 0;       // size of the input file
  uint64_t out_bytes = 0;      // size of the output file
};

// Loads `in` with `storage` (offload::apply_storage: skips, scales, range checks) and
// writes it to `out` in the layout above, through a temporary file renamed into place.
// Throws InvalidArgument when `out` is `in` (the same file, by inode) or `storage` is not
// an fp8 dtype, and what load_anima() and safetensors::save() throw. `threads`: read
// workers (LoadOptions::threads).
ConvertReport convert_checkpoint(const std::string& in, const std::string& out, const Fp8Options& storage,
                                 int threads = 0);

}  // namespace sluice::anima
