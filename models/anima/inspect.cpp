#include "models/anima/inspect.h"

#include <algorithm>

namespace sluice::anima {

ModelSummary summarize(torch::nn::Module& model) {
  ModelSummary s;
  for (const auto& group : {"x_embedder", "t_embedder", "t_embedding_norm", "blocks", "final_layer", "llm_adapter"}) {
    s.params_by_group.emplace_back(group, 0);
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    s.tensors += 1;
    s.parameters += t.numel();
    s.bytes_by_dtype[c10::toString(t.scalar_type())] += bytes;
    s.total_bytes += bytes;
    const std::string& name = item.key();
    const std::string group = name.substr(0, name.find('.'));
    auto it = std::find_if(s.params_by_group.begin(), s.params_by_group.end(),
                           [&](const auto& g) { return g.first == group; });
    if (it == s.params_by_group.end()) it = s.params_by_group.insert(s.params_by_group.end(), {group, 0});
    it->second += t.numel();
  }
  s.params_by_group.erase(std::remove_if(s.params_by_group.begin(), s.params_by_group.end(),
                                         [](const auto& g) { return g.second == 0; }),
                          s.params_by_group.end());
  return s;
}

}  // namespace sluice::anima
