#include "offload/engine/residency_applier.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <utility>

#include "runtime/error.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

ResidencyApplier::ResidencyApplier(DeviceBackend& device, ResidencyApplierOptions options)
    : device_(device), options_(std::move(options)), want_pin_(options_.pin) {
  if (!options_.arena) options_.arena = std::make_shared<PinnedArena>(default_pin_memory_limit());
}

void ResidencyApplier::begin_model(std::string model_name, std::shared_ptr<MemoryLedger> budget) {
  model_name_ = std::move(model_name);
  budget_ = std::move(budget);
}

void ResidencyApplier::end_model() noexcept {
  budget_.reset();
  pinned_ = Stat{};
  pinned_bytes_ = 0;
  chunks_.clear();
}

void ResidencyApplier::make_resident(LayerRecord& r) {
  at::Tensor w = device_.allocate(r.host_w.sizes(), r.host_w.scalar_type(), MemoryKind::resident, r.name, budget_);
  at::Tensor b, s;
  if (r.host_b.defined()) b = device_.allocate(r.host_b.sizes(), r.host_b.scalar_type(), MemoryKind::resident, r.name, budget_);
  if (r.host_s.defined()) s = device_.allocate(r.host_s.sizes(), r.host_s.scalar_type(), MemoryKind::resident, r.name, budget_);
  device_.copy_to_device(w, r.host_w);
  if (b.defined()) device_.copy_to_device(b, r.host_b);
  if (s.defined()) device_.copy_to_device(s, r.host_s);
  for (const at::Tensor* t : {&w, &b, &s}) device_.record_use(*t, StreamKind::copy);  // a second guard behind F7
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

void ResidencyApplier::adopt(LayerRecord& r) {
  r.pinned = true;
  pinned_.increase(static_cast<int64_t>(r.stored_bytes));
  for (const at::Tensor* t : {&r.host_w, &r.host_b, &r.host_s}) {
    const PinnedArena::ChunkRef c = options_.arena->chunk_of(*t);
    if (c.id && chunks_.emplace(c.id, c.bytes).second) pinned_bytes_ += c.bytes;
  }
}

void ResidencyApplier::pin_host(std::vector<LayerRecord>& layers) {
  const PinnedArena& arena = *options_.arena;
  auto in_arena = [&](const at::Tensor& t) { return !t.defined() || arena.holds(t); };
  for (auto& r : layers) {
    if (!r.pinned && in_arena(r.host_w) && in_arena(r.host_b) && in_arena(r.host_s)) adopt(r);
  }
  if (!want_pin_) return;
  std::vector<LayerRecord*> todo;
  std::vector<PinnedArena::Group> groups;
  for (auto& r : layers) {
    if (r.resident || r.pinned) continue;
    todo.push_back(&r);
    groups.push_back({r.host_w, r.host_b, r.host_s});
  }
  if (todo.empty()) return;
  // One chunk's run of layers at a time (Note [pinned arena]): each run's pageable copies are
  // let go as soon as the arena holds them, so that pinning a model holds one chunk twice at
  // most, not the whole model.
  PinnedArena::Placed placed;
  for (size_t first = 0; first < todo.size();) {
    size_t last = first;
    uint64_t bytes = 0;
    while (last < todo.size() && (bytes == 0 || bytes + todo[last]->stored_bytes <= PinnedArena::kChunkBytes)) {
      bytes += todo[last++]->stored_bytes;
    }
    std::vector<PinnedArena::Group> run(std::make_move_iterator(groups.begin() + static_cast<std::ptrdiff_t>(first)),
                                        std::make_move_iterator(groups.begin() + static_cast<std::ptrdiff_t>(last)));
    const PinnedArena::Placed done = options_.arena->place(device_, run);
    for (size_t i = 0; i < done.groups; ++i) {
      // The arena's copy replaces the pageable one (not kept anywhere else: host RAM is not doubled).
      LayerRecord& r = *todo[first + i];
      r.host_w = run[i][0];
      r.host_b = run[i][1];
      r.host_s = run[i][2];
      r.layer->set_stored(r.host_w, r.host_b.defined() ? std::optional<at::Tensor>(r.host_b) : std::nullopt);
      r.layer->set_weight_scale(r.host_s);
      adopt(r);
    }
    placed.groups = first + done.groups;
    placed.failed = done.failed;
    placed.limited = done.limited;
    return_freed_host_memory();  // the run's pageable copies back to the system before the next run
    if (done.groups < run.size()) break;  // the limit, or a failed allocation: the rest stay pageable
    first = last;
  }
  if (placed.failed) {
    if (!pin_warned_) {
      log::warn("pinning host memory failed for layer '" + todo[placed.groups]->name + "' of '" + model_name_ +
                "': streamed layers use pageable memory (slower copies)");
      pin_warned_ = true;
    }
    want_pin_ = false;
  } else if (placed.limited && !limit_warned_) {
    uint64_t pageable = 0;
    for (size_t i = placed.groups; i < todo.size(); ++i) pageable += todo[i]->stored_bytes;
    const std::string source = arena.limit_source();
    log::warn("pinned memory limit of " + format_mib(arena.limit()) + (source.empty() ? "" : " (" + source + ")") +
              " reached (" + format_mib(static_cast<uint64_t>(arena.pinned().current)) + " pinned by all models): model '" +
              model_name_ + "' has " + format_mib(static_cast<uint64_t>(pinned_.current)) +
              " of host weights pinned, " + format_mib(pageable) +
              " of streamed layers left in pageable memory (copied through the bounce ring)");
    limit_warned_ = true;
  }
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
    pin_host(layers);
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
