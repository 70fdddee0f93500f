#pragma once
// What a checkpoint file or a model config holds, without loading it: the report behind
// `sluice inspect` and Python's sluice.inspect().
#include <string>
#include <vector>

namespace sluice {

struct InspectOptions {
  enum class Source { detect, file, config };
  Source source = Source::detect;         // detect: ".json" and preset names are configs, anything else a file
  std::string dtype = "bfloat16";         // dtype of a config's shape-only build, and the compute dtype of `storage`
  std::string storage;                    // what-if layerwise storage ("float8_e4m3fn"); empty: none
  std::vector<std::string> extra_skips;   // with `storage`: more skip patterns
  bool use_default_skips = true;          // with `storage`: include the default skip patterns
  bool use_model_skips = true;            // with `storage`: include the model's declared patterns
};

struct InspectReport {
  std::string json;  // model, tensors, parameters, bytes, bytes_by_dtype, blocks, groups, config,
                     // param_size_mib (MiB to one decimal: the what-if size with `storage`), fp8 {...}
  std::string text;  // the same, as the human-readable table `sluice inspect` prints
};

// Reads only the file's header (or builds the config on the meta device), so even anima-2b
// costs no memory. Throws FileError for an unreadable file, CheckpointError for a
// non-Anima file with `storage`, InvalidArgument for a bad dtype, pattern or preset.
InspectReport inspect(const std::string& file_or_config, const InspectOptions& options = {});

}  // namespace sluice
