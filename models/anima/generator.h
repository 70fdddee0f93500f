#pragma once
// Random Anima checkpoints in the real key layout ("net." prefix), for tests, benchmarks
// and the reference-parity check. See Note [random checkpoint init].
#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "models/anima/config.h"

namespace sluice::anima {

// Metadata keys written into generated files ("__metadata__").
inline constexpr const char* kMetaConfig = "sluice.config";  // config_to_json(config).dump()
inline constexpr const char* kMetaSeed = "sluice.seed";

// The tensors of a random checkpoint, named as in the model (no prefix), fp32 values
// converted to `dtype`, deterministic for `seed` (CPU generator).
std::vector<std::pair<std::string, at::Tensor>> random_weights(const AnimaConfig& config, uint64_t seed,
                                                               at::ScalarType dtype);

// Writes random_weights(...) with the "net." prefix and the config/seed metadata (with a
// semantic connector, also its "anima_v2_adapter_*" metadata, as Anima-3.8B v1.1 writes it).
// The whole model is held in RAM once (in `dtype`) while the file is written, because
// safetensors::save takes the full tensor list.
void write_random_checkpoint(const AnimaConfig& config, uint64_t seed, at::ScalarType dtype, const std::string& path);

}  // namespace sluice::anima
