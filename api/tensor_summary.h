#pragma once
// Tensor counts, parameter counts and bytes, in total, by dtype and by module group:
// the numbers sluice::inspect() reports, for a checkpoint file or a model built on meta.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace sluice::api {

struct GroupStats {
  std::string name;        // "t_embedder", "blocks.*.self_attn", "llm_adapter", ...
  int64_t tensors = 0;
  int64_t parameters = 0;
  uint64_t bytes = 0;
};

struct TensorSummary {
  int64_t tensors = 0;
  int64_t parameters = 0;
  uint64_t bytes = 0;
  std::map<std::string, uint64_t> bytes_by_dtype;  // keyed by safetensors dtype name ("BF16")
  std::vector<GroupStats> groups;                  // in first-seen (checkpoint) order
  int64_t blocks = 0;                              // distinct blocks.N seen

  // `name` is a dotted parameter name without any checkpoint prefix.
  void add(const std::string& name, const std::string& dtype_name, int64_t numel, uint64_t bytes);
};

// The group a parameter belongs to: repeated blocks fold together ("blocks.3.mlp.layer1"
// -> "blocks.*.mlp"; the three adaln_modulation_* of a block are one group), anything
// else groups by its first name component.
std::string group_of(const std::string& name);

nlohmann::json to_json(const TensorSummary& s);
// Human-readable table (MiB with two decimals).
std::string to_text(const TensorSummary& s);

}  // namespace sluice::api
