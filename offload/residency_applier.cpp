#include "offload/residency_applier.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

namespace {

at::Tensor pageable_copy(const at::Tensor& t) {
  if (!t.defined()) return t;
  at::Tensor out = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()));
  out.copy_(t);
  return out;
}

}  // namespace

ResidencyApplier::ResidencyApplier(DeviceBackend& device, ResidencyApplierOptions options)
    : device_(device), options_(options), want_pin_(options.pin) {}

void ResidencyApplier::begin_model(std::string model_name, std::shared_ptr<MemoryLedger> budget) {
  model_name_ = std::move(model_name);
  budget_ = std::move(budget);
}

void ResidencyApplier::end_model() noexcept {
  budget_.reset();
  pinned_ = Stat{};
}

void ResidencyApplier::make_resident(LayerRecord& r) {
  at::Tensor w = device_.allocate(r.host_w.sizes(), r.host_w.scalar_type(), MemoryKind::resident, r.name, budget_);
  at::Tensor b, s;
  if (r.host_b.defined()) b = device_.allocate(r.host_b.sizes(), r.host_b.scalar_type(), MemoryKind::resident, r.name, budget_);
  if (r.host_s.defined()) s = device_.allocate(r.host_s.sizes(), r.host_s.scalar_type(), MemoryKind::resident, r.name, budget_);
  device_.copy_to_device(w, r.host_w);
  if (b.defined()) device_.copy_to_device(b, r.host_b);
  if (s.defined()) device_.copy_to_device(s, r.host_s);
  for (const at::Tensor* t : {&w, &b, &s}) device_.record_use(*t, StreamKind::copy);  // FENCE(F4)
  r.dev_w = w;
  r.dev_b = b;
  r.dev_s = s;
  r.resident = true;
  r.layer->set_stored(w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
  r.layer->set_weight_scale(s);
  residency_h2d_.increase(static_cast<int64_t>(r.stored_bytes));
}

void ResidencyApplier::make_streamed(LayerRecord& r) {
  r.layer->set_stored(r.host_w, r.host_b.defined() ? std::optional<at::Tensor>(r.host_b) : std::nullopt);
  r.layer->set_weight_scale(r.host_s);
  if (r.resident) residency_h2d_.decrease(static_cast<int64_t>(r.stored_bytes));
  r.dev_w = r.dev_b = r.dev_s = at::Tensor();
  r.resident = false;
}

void ResidencyApplier::pin_host(LayerRecord& r) {
  if (!want_pin_ || r.pinned) return;
  if (static_cast<uint64_t>(pinned_.current) + r.stored_bytes > options_.pin_cap_bytes) {
    if (!pin_warned_) {
      log::warn("pinned host memory cap of " + format_mib(options_.pin_cap_bytes) + " reached: further streamed layers of '" +
                model_name_ + "' use pageable memory (slower copies)");
      pin_warned_ = true;
    }
    return;
  }
  const bool injected = fault::triggered("host.pin");  // before pins_memory(): testable on the CPU device
  if (injected || device_.pins_memory()) {
    at::Tensor w, b, s;
    if (!injected) {
      w = device_.pin(r.host_w);
      b = r.host_b.defined() ? device_.pin(r.host_b) : at::Tensor();
      s = r.host_s.defined() ? device_.pin(r.host_s) : at::Tensor();
    }
    if (!w.defined() || (r.host_b.defined() && !b.defined()) || (r.host_s.defined() && !s.defined())) {
      if (!pin_warned_) {
        log::warn("pinning host memory failed for layer '" + r.name + "' of '" + model_name_ +
                  "': streamed layers use pageable memory (slower copies)");
        pin_warned_ = true;
      }
      want_pin_ = false;
      return;
    }
    if (device_.pins_memory()) {
      // The pinned copy replaces the pageable one, so host RAM is not doubled.
      r.host_w = w;
      r.host_b = b;
      r.host_s = s;
      if (!r.resident) {
        r.layer->set_stored(w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt);
        r.layer->set_weight_scale(s);
      }
    }
  }
  r.pinned = true;
  pinned_.increase(static_cast<int64_t>(r.stored_bytes));
}

void ResidencyApplier::unpin_host(LayerRecord& r) {
  if (!r.pinned) return;
  if (device_.pins_memory()) {
    r.host_w = pageable_copy(r.host_w);
    r.host_b = pageable_copy(r.host_b);
    r.host_s = pageable_copy(r.host_s);
  }
  r.pinned = false;
  pinned_.decrease(static_cast<int64_t>(r.stored_bytes));
}

ResidencyApplier::Applied ResidencyApplier::apply(std::vector<LayerRecord>& layers, const ResidencyPlan& plan,
                                                  const RingFn& make_ring) {
  TORCH_INTERNAL_ASSERT(plan.resident.size() == layers.size(), "apply_plan: plan for another model");
  Applied out;
  std::vector<size_t>& promoted = out.promoted;
  std::string& degraded = out.degraded;  // why fewer layers than planned became resident (Note [engine faults])
  try {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i].resident && !plan.resident[i]) make_streamed(layers[i]);
    }
    for (size_t i = 0; i < layers.size() && degraded.empty(); ++i) {
      if (!layers[i].resident && plan.resident[i]) {
        try {
          make_resident(layers[i]);
          promoted.push_back(i);
        } catch (const ResourceError& e) {
          degraded = e.what();
        }
      }
    }
    // FENCE(F7): resident copies are done before any compute reads them (and a failed one
    // throws DeviceError: undo below).
    device_.synchronize();  // FENCE(F7)
    if (degraded.empty()) {
      if (plan.ring_bytes) make_ring(plan.ring_bytes);
    } else {
      // The layers that failed stream instead; the ring must hold the largest of them,
      // which may not fit beside what did become resident: give back residency until it does.
      for (;;) {
        try {
          const uint64_t slot = streamed_slot_bytes(layers);
          if (slot) make_ring(uint64_t{options_.ring_slots} * slot);
          break;
        } catch (const ResourceError&) {
          if (promoted.empty()) throw;
          make_streamed(layers[promoted.back()]);
          promoted.pop_back();
        }
      }
    }
    for (auto& r : layers) {
      if (!r.resident) pin_host(r);
    }
  } catch (...) {
    // Leave a consistent state: drop what this call made resident (the caller makes the
    // ring for what streams now).
    try {
      device_.synchronize();
    } catch (...) {
    }
    for (size_t i : promoted) make_streamed(layers[i]);
    throw;
  }
  return out;
}

uint64_t streamed_slot_bytes(const std::vector<LayerRecord>& layers) {
  uint64_t slot = 0;
  for (const auto& r : layers) {
    if (!r.resident) slot = std::max(slot, r.slot_bytes);
  }
  return slot;
}

void plan_from_layers(ResidencyPlan& plan, const std::vector<LayerRecord>& layers, uint64_t extra_bytes,
                      uint32_t ring_slots) {
  uint64_t resident = extra_bytes, streamed = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    plan.resident[i] = layers[i].resident;
    (layers[i].resident ? resident : streamed) += layers[i].stored_bytes;
  }
  plan.resident_bytes = resident;
  plan.streamed_bytes = streamed;
  plan.slot_bytes = streamed_slot_bytes(layers);
  plan.ring_slots = plan.slot_bytes ? ring_slots : 0;
  plan.ring_bytes = uint64_t{plan.ring_slots} * plan.slot_bytes;
  plan.predictions.clear();  // not the plan they were made for
}

}  // namespace sluice::offload
