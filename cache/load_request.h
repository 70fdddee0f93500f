#pragma once
// LoadRequest: a LoadSpec resolved once, as ModelCache::load receives it, into everything
// the rest of the load asks of it: where the model comes from (SourceKind), the dtype pair
// for the cache's device, the skip list, the entry's identity (key) and loading settings,
// and, once a new entry needs it, the model's config. The RAM tier keeps it on the entry
// and hands it down: the estimate, the read and the model's stats read it from there, and
// nothing derives these facts from the spec again.
//
// Tested by: tests/cache/test_ram_tier.cpp ("ram_tier: a load request is resolved once: its key,
// settings, dtypes, skip list and config"), and through every load of tests/cache/test_model_cache.cpp.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>

#include "models/anima/config.h"
#include "runtime/dtype_policy.h"
#include "runtime/skip_patterns.h"

namespace sluice::cache {

// What to load and how.
struct LoadSpec {
  std::string source;                       // preset name, .json config or .safetensors path
  std::string name;                         // for logs and stats; empty: preset/config name or file stem
  Fp8Options storage;                       // storage/compute dtypes and skip patterns
  std::string compute_reason;               // why storage.compute (Note [compute dtype auto]); empty: "requested"
  std::optional<anima::AnimaConfig> config; // overrides the file's inferred config / the preset's
  uint64_t seed = 0;                        // generated weights (preset and .json sources)
  std::optional<double> max_resident;       // cap on resident fraction; none: the budget decides
};

// Where a model comes from.
enum class SourceKind { preset, json_config, checkpoint };
// Preset name, "*.json" (a config to generate from), or a checkpoint path.
SourceKind source_kind(const std::string& source);

struct LoadRequest {
  LoadSpec spec;
  SourceKind kind = SourceKind::preset;
  DtypePair dtypes;  // resolved for the device (resolve_dtypes)
  SkipList skips;    // SkipList::from_options(spec.storage, Anima's declared patterns)
  std::string key;       // identity: source (+ seed for generated models)
  std::string settings;  // the loading settings; a load with other settings reloads
  // The model's config: spec.config when given; else, once resolve_config() ran, the
  // preset's, the .json file's or the checkpoint's inferred one.
  std::optional<anima::AnimaConfig> config;

  // Everything but the config, which may read a file: InvalidArgument for a max_resident
  // outside [0, 1] or a bad skip pattern, whatever resolve_dtypes throws for the device.
  static LoadRequest resolve(const LoadSpec& spec, at::Device device);
  // Fills `config` if unset (reads the .json file, or the checkpoint's header:
  // CheckpointError for a file that is not an Anima checkpoint). Call outside the cache
  // mutex.
  const anima::AnimaConfig& resolve_config();
  // The entry's name: spec.name, else the config's (given, preset or .json), else the file's stem.
  std::string model_name() const;
};

}  // namespace sluice::cache
