#include "offload/engine/model_records.h"

#include <algorithm>
#include <unordered_set>

#include "offload/layer/repoint.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace sluice::offload {

namespace {

at::Tensor host_alias(const at::Tensor& t) {
  if (!t.defined()) return t;
  at::Tensor a = t.detach();
  return a.is_contiguous() ? a : a.contiguous();
}

}  // namespace

std::vector<std::regex> required_regexes(const EngineOptions& options) {
  std::vector<std::regex> required;
  for (const auto& p : options.required_patterns) {
    try {
      required.emplace_back(p);
    } catch (const std::regex_error& e) {
      throw InvalidArgument("required layer pattern '" + p + "' is not a valid regex: " + e.what());
    }
  }
  return required;
}

void ModelRecords::check_attachable(torch::nn::Module& model, const std::string& model_name) {
  for (const auto& [name, layer] : managed_layers(model)) {
    if (layer->provider()) {
      throw InvalidArgument("layer '" + name + "' of model '" + model_name + "' already has a weight provider");
    }
    if (!layer->stored_weight().device().is_cpu() || (layer->has_bias() && !layer->stored_bias().device().is_cpu())) {
      throw InvalidArgument("attach: layer '" + name + "' of model '" + model_name +
                            "' is not on the host; attach a model loaded in RAM");
    }
  }
}

void ModelRecords::collect(torch::nn::Module& model, const std::string& model_name,
                           const std::vector<std::regex>& required, bool require_unconverted, bool check_host) {
  const auto managed = managed_layers(model);
  std::unordered_set<const c10::TensorImpl*> managed_impls;
  layers_.reserve(managed.size());
  for (const auto& [name, layer] : managed) {
    LayerRecord r = describe_layer(name, *layer);
    if (check_host && r.host_s.defined() && !r.host_s.device().is_cpu()) {
      throw InvalidArgument("attach: weight scale of layer '" + name + "' is not on the host");
    }
    managed_impls.insert(layer->stored_weight().unsafeGetTensorImpl());
    if (layer->has_bias()) managed_impls.insert(layer->stored_bias().unsafeGetTensorImpl());
    r.required = layer->kind() == LayerKind::embedding || (require_unconverted && !r.upcast_w);
    for (const auto& re : required) r.required = r.required || std::regex_search(name, re);
    index_[layer] = static_cast<int64_t>(layers_.size());
    layers_.push_back(std::move(r));
  }
  auto add_extra = [&](const std::string& name, const at::Tensor& t) {
    if (check_host && !t.device().is_cpu()) {
      throw InvalidArgument("attach: parameter '" + name + "' of model '" + model_name + "' is not on the host");
    }
    extras_.push_back({t, host_alias(t), at::Tensor()});
    extra_bytes_ += extras_.back().host.nbytes();
  };
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    if (!managed_impls.count(item.value().unsafeGetTensorImpl())) add_extra(item.key(), item.value());
  }
  for (const auto& item : model.named_buffers(/*recurse=*/true)) add_extra(item.key(), item.value());
  // The planned scratch: the largest upcast a forward makes. An embedding's lookup upcasts
  // only its rows (Note [embedding rows] in layer.h), so its table is not planned for; a
  // host that leases a table whole (an embedding of its own kind) gets a buffer beyond the
  // plan for it (Note [upcast scratch] in forward_buffers.h).
  for (const auto& r : layers_) {
    if (r.layer->kind() != LayerKind::embedding) scratch_bytes_ = std::max(scratch_bytes_, r.scratch_bytes);
  }
}

void ModelRecords::place_extras(DeviceBackend& device, const std::shared_ptr<MemoryLedger>& budget) {
  for (auto& e : extras_) {
    e.dev = device.allocate(e.host.sizes(), e.host.scalar_type(), MemoryKind::params, "parameter", budget);
    device.copy_to_device(e.dev, e.host);
    // A later allocation that fails gives these back before anything waited for the copy
    // (restore_to_host): the free waits for it (Note [stream-safe frees]).
    device.record_use(e.dev, StreamKind::copy);
  }
  device.synchronize();  // reports a failed parameter copy here (apply_plan's first synchronize orders them)
  for (auto& e : extras_) repoint(e.handle, e.dev);
}

// Frees device memory without waiting for the device: every use by another stream was
// recorded (Note [stream-safe frees]). The engine synchronizes afterwards, only to report a
// copy that failed.
void ModelRecords::restore_to_host() noexcept {
  for (auto& r : layers_) {
    try {
      r.layer->set_stored(r.host_w, r.host_b.defined() ? std::optional<at::Tensor>(r.host_b) : std::nullopt);
      r.layer->set_weight_scale(r.host_s);
      r.layer->set_provider(nullptr);  // the engine's while attached, even if a wrapper was installed
      r.dev_w = r.dev_b = r.dev_s = at::Tensor();
      r.resident = false;
    } catch (const std::exception& e) {
      log::error("detach: restoring layer '" + r.name + "' failed: " + e.what());
    }
  }
  for (auto& e : extras_) {
    try {
      if (e.host.defined()) repoint(e.handle, e.host);
      e.dev = at::Tensor();
    } catch (const std::exception& ex) {
      log::error(std::string("detach: restoring a parameter failed: ") + ex.what());
    }
  }
}

void ModelRecords::clear() noexcept {
  layers_.clear();
  index_.clear();
  extras_.clear();
  extra_bytes_ = scratch_bytes_ = 0;
}

int64_t ModelRecords::find(const ManagedLayerImpl* layer) const {
  const auto it = index_.find(layer);
  return it == index_.end() ? -1 : it->second;
}

uint64_t ModelRecords::stored_bytes() const {
  uint64_t total = extra_bytes_;
  for (const auto& r : layers_) total += r.stored_bytes;
  return total;
}

std::vector<PlanLayer> ModelRecords::plan_layers() const {
  std::vector<PlanLayer> out;
  out.reserve(layers_.size());
  for (const auto& r : layers_) {
    PlanLayer l;
    l.name = r.name;
    l.stored_bytes = r.stored_bytes;
    l.slot_bytes = r.slot_bytes;
    l.group = r.group;
    l.block = r.block;
    l.required = r.required;
    out.push_back(std::move(l));
  }
  return out;
}

}  // namespace sluice::offload
