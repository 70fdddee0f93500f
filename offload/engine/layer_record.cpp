#include "offload/engine/layer_record.h"

#include <c10/core/ScalarType.h>

#include <regex>
#include <tuple>
#include <utility>

#include "offload/device/staging_ring.h"

namespace sluice::offload {

namespace {

// "blocks.3.mlp" -> ("blocks", 3); "llm_adapter.blocks.0.x" -> ("llm_adapter.blocks", 0).
std::pair<std::string, int64_t> parse_block(const std::string& name) {
  static const std::regex re(R"(^((?:.*?\.)?blocks)\.(\d{1,9})(?:\.|$))");
  std::smatch m;
  if (std::regex_search(name, m, re)) return {m[1].str(), std::stoll(m[2].str())};
  return {"", -1};
}

at::Tensor host_alias(const at::Tensor& t) {
  if (!t.defined()) return t;
  at::Tensor a = t.detach();
  return a.is_contiguous() ? a : a.contiguous();
}

}  // namespace

LayerRecord describe_layer(const std::string& name, ManagedLayerImpl& layer) {
  LayerRecord r;
  r.layer = &layer;
  r.name = name;
  r.host_w = host_alias(layer.stored_weight());
  r.host_b = host_alias(layer.stored_bias());
  r.host_s = host_alias(layer.weight_scale());
  r.stored_dtype = r.host_w.scalar_type();
  r.compute = layer.compute_dtype();
  r.upcast_w = r.stored_dtype != r.compute || r.host_s.defined();
  r.upcast_b = r.host_b.defined() && r.host_b.scalar_type() != r.compute;
  r.stored_bytes = static_cast<uint64_t>(layer.stored_bytes());
  uint64_t end = r.host_w.nbytes();
  if (r.host_b.defined()) {
    r.off_b = align_up(end);
    end = r.off_b + r.host_b.nbytes();
  }
  if (r.host_s.defined()) {
    r.off_s = align_up(end);
    end = r.off_s + r.host_s.nbytes();
  }
  r.slot_bytes = end;
  const uint64_t csize = c10::elementSize(r.compute);
  if (r.upcast_w) {
    r.scratch_bytes = static_cast<uint64_t>(r.host_w.numel()) * csize;
    r.scratch_off_b = align_up(r.scratch_bytes);
  }
  if (r.upcast_b) r.scratch_bytes = r.scratch_off_b + static_cast<uint64_t>(r.host_b.numel()) * csize;
  std::tie(r.group, r.block) = parse_block(name);
  return r;
}

}  // namespace sluice::offload
