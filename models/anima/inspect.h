#pragma once
// Parameter counts and sizes of a model, per dtype and per top-level group; works on a
// shape-only (meta) build.
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace sluice::anima {

struct ModelSummary {
  int64_t tensors = 0;                          // parameter tensors
  int64_t parameters = 0;                       // elements over all of them
  std::map<std::string, int64_t> bytes_by_dtype; // dtype name ("BFloat16", ...) -> bytes
  int64_t total_bytes = 0;
  // Elements per top-level module ("x_embedder", "t_embedder", "t_embedding_norm",
  // "blocks", "final_layer", "llm_adapter", then any other), in that order.
  std::vector<std::pair<std::string, int64_t>> params_by_group;
};

ModelSummary summarize(torch::nn::Module& model);

}  // namespace sluice::anima
