#include "models/anima/generator.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "models/anima/anima.h"
#include "models/anima/semantic_connector.h"
#include "runtime/progress.h"
#include "runtime/safetensors.h"

namespace sluice::anima {
namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Note [random checkpoint init]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The checkpoints must keep activations finite through all blocks at anima-2b depth and
// still exercise every parameter, so a parity test against the reference fails when any
// of them is mishandled:
// - Linear weights ~ N(0, 1/fan_in): unit-variance outputs for unit-variance inputs.
// - The adaLN outputs (modulation ".2", or ".1" without LoRA) and t_embedder.1.linear_2
//   (which is added to every modulation as adaln_lora) use half that std, so
//   shift/scale/gate are O(0.5): gates are far from zero (the blocks matter) and the
//   residual stream grows only slowly over 28 blocks.
// - Norm scales ~ 1 + 0.1 N(0, 1) rather than ones, so a forward that ignored them differs.
// - Biases ~ N(0, 0.02^2), non-zero for the same reason. Embedding rows ~ N(0, 1).
double weight_std(const std::string& name, const at::IntArrayRef shape) {
  const double fan_in = shape.size() >= 2 ? static_cast<double>(shape[1]) : 1.0;
  const bool modulation_out =
      (contains(name, "adaln_modulation") &&
       (ends_with(name, ".2.weight") || (ends_with(name, ".1.weight") && shape[0] > shape[1]))) ||
      contains(name, "t_embedder.1.linear_2");
  return (modulation_out ? 0.5 : 1.0) / std::sqrt(fan_in);
}

}  // namespace

std::vector<std::pair<std::string, at::Tensor>> random_weights(const AnimaConfig& config, uint64_t seed,
                                                               at::ScalarType dtype) {
  AnimaModel shapes(config, BuildOptions{at::kFloat, at::kMeta});
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto fopts = at::TensorOptions().dtype(at::kFloat);
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto params = shapes->named_parameters(/*recurse=*/true);
  uint64_t total = 0;
  for (const auto& item : params) total += static_cast<uint64_t>(item.value().numel()) * at::elementSize(dtype);
  progress::Task task("generating " + config.name + " (random weights)", total);
  for (const auto& item : params) {
    const std::string& name = item.key();
    const at::IntArrayRef shape = item.value().sizes();
    at::Tensor t = at::randn(shape, gen, fopts);
    if (contains(name, ".embed.")) {
      // N(0, 1) as drawn
    } else if (ends_with(name, ".bias")) {
      t.mul_(0.02);
    } else if (shape.size() == 1) {  // norm scale
      t.mul_(0.1).add_(1.0);
    } else {
      t.mul_(weight_std(name, shape));
    }
    out.emplace_back(name, dtype == at::kFloat ? t : t.to(dtype));
    task.advance(static_cast<uint64_t>(t.numel()) * at::elementSize(dtype));
  }
  return out;
}

void write_random_checkpoint(const AnimaConfig& config, uint64_t seed, at::ScalarType dtype, const std::string& path) {
  auto weights = random_weights(config, seed, dtype);
  for (auto& [name, t] : weights) name = "net." + name;
  std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {kMetaConfig, config_to_json(config).dump()}, {kMetaSeed, std::to_string(seed)}};
  // A connector is described the way Anima-3.8B v1.1 describes its own (anima_v2_adapter_*).
  if (config.connector.enabled) metadata.merge(connector_metadata(config.connector));
  safetensors::save(path, weights, metadata);
}

}  // namespace sluice::anima
