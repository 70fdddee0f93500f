// sluice::OffloadedModel (include/sluice/offload.hpp) over ForeignModel
// (offload/foreign_model.h, Note [foreign layers]) and a StreamingEngine of its own.
#include "sluice/offload.hpp"

#include "offload/device.h"
#include "offload/engine.h"
#include "offload/foreign_model.h"
#include "offload/vram_budget.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/hardware.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice {

namespace detail {
struct OffloadState {
  std::unique_ptr<offload::ForeignModel> model;
  std::unique_ptr<offload::StreamingEngine> engine;
  std::shared_ptr<offload::DeviceBackend> device;
  uint64_t working_memory = 0;
};
}  // namespace detail

namespace {

// A budget string ("6GiB", "50%", "" = all device memory) in bytes on `device`.
uint64_t budget_bytes(offload::DeviceBackend& device, const std::string& text) {
  const offload::ResolvedVramBudget budget = offload::resolve_vram_budget(device, text, "", "vram_budget", "vram_headroom");
  return budget.bytes ? budget.bytes : device.total_memory();
}

offload::ForeignOptions foreign_options(const OffloadOptions& o) {
  offload::ForeignOptions f;
  f.storage = parse_storage_dtype(o.storage);
  f.compute = parse_compute_dtype(o.compute);
  f.skip = o.skip;
  return f;
}

}  // namespace

OffloadedModel::OffloadedModel(std::vector<OffloadLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                               const OffloadOptions& o)
    : state_(std::make_unique<detail::OffloadState>()) {
  apply_cpu_onednn_env();  // Note [native bf16]: SLUICE_CPU_ONEDNN=off
  offload::check_max_resident(o.max_resident);
  const offload::ForeignOptions fo = foreign_options(o);
  state_->device = offload::make_device(o.device, 0, "device");
  if (is_fp8(fo.storage) && !device_supports_fp8_storage(state_->device->device(), fo.storage)) {
    throw InvalidArgument("storage: " + dtype_name(fo.storage) + " is not supported on " + state_->device->name());
  }
  std::vector<offload::ForeignLayer> fl;
  fl.reserve(layers.size());
  for (auto& l : layers) fl.push_back({std::move(l.name), std::move(l.weight), std::move(l.bias)});
  state_->model = std::make_unique<offload::ForeignModel>(std::move(fl), std::move(extras), fo);
  const uint64_t total = budget_bytes(*state_->device, o.vram_budget);
  offload::EngineOptions eo;
  eo.device = state_->device;
  eo.budget_bytes = total;
  eo.working_memory_bytes = parse_size(o.working_memory, total ? std::optional<uint64_t>(total) : std::nullopt,
                                       "working_memory");
  eo.max_resident = o.max_resident;
  eo.pin = offload::parse_pin_mode(o.pin_memory, "pin_memory");
  eo.required_patterns = {};
  state_->working_memory = eo.working_memory_bytes;
  state_->engine = std::make_unique<offload::StreamingEngine>(eo);
  state_->engine->attach(state_->model->module(), "offloaded model");
}

OffloadedModel::~OffloadedModel() {
  if (!state_ || !state_->engine) return;
  try {
    state_->engine->detach();
  } catch (const std::exception& e) {
    // A forward still holds a lease (a host destroying the model mid-forward): the
    // engine's own destructor gives the model back regardless.
    log::warn(std::string("offload: removing the model at its destruction: ") + e.what());
  }
}

size_t OffloadedModel::layers() const { return state_->model->size(); }

at::ScalarType OffloadedModel::stored_dtype(int64_t i) const {
  if (i < 0 || static_cast<size_t>(i) >= state_->model->size()) throw InvalidArgument("offload: no layer " + std::to_string(i));
  return state_->model->stored_dtype(static_cast<size_t>(i));
}

std::pair<at::Tensor, std::optional<at::Tensor>> OffloadedModel::stored_layer(int64_t i) const {
  if (!removed()) throw InvalidArgument("offload: a layer's stored tensors are read after remove()");
  if (i < 0) throw InvalidArgument("offload: no layer " + std::to_string(i));
  offload::StoredLayer s = state_->model->host_copy(static_cast<size_t>(i));
  return {std::move(s.weight), std::move(s.bias)};
}

bool OffloadedModel::removed() const { return !state_->engine->attached(); }

void OffloadedModel::require_attached() const {
  if (removed()) throw InvalidArgument("offload: the model was removed; offload it again to run it through sluice");
}

at::Tensor OffloadedModel::linear(int64_t i, const at::Tensor& x) {
  require_attached();
  if (i < 0) throw InvalidArgument("offload: no layer " + std::to_string(i));
  // Inference only: a weight leased for one layer must not live on in an autograd graph
  // (it is a staging slot or scratch that the next layer reuses).
  at::NoGradGuard no_grad;
  return state_->model->linear(static_cast<size_t>(i), x);
}

void OffloadedModel::begin_forward(const std::string& kind) {
  require_attached();
  state_->engine->begin_forward(kind);
}

void OffloadedModel::end_forward(bool aborted) { state_->engine->end_forward(aborted); }

std::string OffloadedModel::stats_json(int indent) const { return state_->engine->stats().to_json(indent); }

void OffloadedModel::set_vram_budget(const std::string& text) {
  require_attached();
  state_->engine->set_budget(budget_bytes(*state_->device, text));
}

void OffloadedModel::remove() {
  if (removed()) throw InvalidArgument("offload: the model was already removed");
  state_->engine->detach();
}

}  // namespace sluice
