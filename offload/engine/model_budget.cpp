#include "offload/engine/model_budget.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

int64_t ModelBudget::partial_load(uint64_t bytes) {
  TORCH_CHECK(residency_.attached(), "partial_load: no model attached");
  const ResidencyLimits& l = residency_.limits();
  const uint64_t full = l.full_weight_budget();
  const uint64_t now = residency_.device_bytes();
  const uint64_t target = bytes >= full - std::min(full, now) ? full : now + bytes;
  return residency_.replan(std::max(l.weight_budget, target), l.max_resident);
}

int64_t ModelBudget::partial_unload(uint64_t bytes) {
  TORCH_CHECK(residency_.attached(), "partial_unload: no model attached");
  const uint64_t now = residency_.device_bytes();
  const uint64_t target = now > bytes ? now - bytes : 0;
  return residency_.replan(std::max(target, residency_.minimum_weights()), residency_.limits().max_resident);
}

int64_t ModelBudget::full_load() {
  TORCH_CHECK(residency_.attached(), "full_load: no model attached");
  const ResidencyLimits& l = residency_.limits();
  const ModelRecords& records = residency_.records();
  const uint64_t full = l.full_weight_budget();
  const uint64_t all = records.stored_bytes() + records.scratch_bytes() + l.nested_reserve + l.sidecar_bytes;
  if (all > full) {
    throw ResourceError("full_load: model '" + residency_.model_name() + "' needs " +
                        format_mib(all + l.working_memory) + " of budget to be fully resident, the budget is " +
                        format_mib(l.budget_bytes));
  }
  return residency_.replan(full, std::nullopt);
}

int64_t ModelBudget::full_unload() {
  TORCH_CHECK(residency_.attached(), "full_unload: no model attached");
  return residency_.replan(residency_.minimum_weights(), residency_.limits().max_resident);
}

void ModelBudget::set_budget(uint64_t budget_bytes, bool release_freed) {
  TORCH_CHECK(residency_.attached(), "set_budget: no model attached");
  ResidencyLimits& l = residency_.limits();
  if (budget_bytes <= l.working_memory) {
    throw ResourceError("budget " + format_mib(budget_bytes) + " for model '" + residency_.model_name() +
                        "' leaves nothing beside the working memory of " + format_mib(l.working_memory));
  }
  const uint64_t old = l.budget_bytes;
  l.budget_bytes = budget_bytes;
  try {
    residency_.replan(budget_bytes - l.working_memory, l.max_resident, release_freed && budget_bytes < old);
  } catch (...) {
    l.budget_bytes = old;
    throw;
  }
}

void ModelBudget::set_max_resident(std::optional<double> max_resident) {
  check_max_resident(max_resident);
  if (!residency_.attached()) {
    residency_.limits().max_resident = max_resident;
    return;
  }
  residency_.replan(residency_.limits().weight_budget, max_resident);
}

// ---------------------------------------------------------------------------------------
// device extras (Note [device extras])

std::vector<at::Tensor> ModelBudget::place_sidecars(const std::vector<at::Tensor>& host,
                                                    const std::vector<at::ScalarType>& dtypes, const std::string& what,
                                                    uint64_t grow_budget) {
  if (!residency_.attached()) throw InvalidArgument(what + ": no model is attached to place sidecars for");
  TORCH_CHECK(host.size() == dtypes.size(), "place_sidecars: ", host.size(), " tensors, ", dtypes.size(), " dtypes");
  ResidencyLimits& l = residency_.limits();
  const std::string& model = residency_.model_name();
  uint64_t bytes = 0;
  for (size_t i = 0; i < host.size(); ++i) bytes += static_cast<uint64_t>(host[i].numel()) * c10::elementSize(dtypes[i]);
  const uint64_t minimum = residency_.minimum_weights();
  const uint64_t old_weight_budget = l.weight_budget, old_budget = l.budget_bytes;
  const uint64_t weight_budget = l.weight_budget + grow_budget;
  const uint64_t room = weight_budget - std::min(weight_budget, minimum);
  if (bytes > room) {
    std::ostringstream msg;
    msg << what << " needs " << format_mib(bytes) << " of device memory (" << bytes << " bytes) for its sidecars, but "
        << "model '" << model << "' has " << format_mib(room) << " beside its minimum of "
        << format_mib(minimum + l.working_memory) << " under its budget of " << format_mib(l.budget_bytes + grow_budget)
        << " even with every streamable layer streamed: " << format_mib(bytes - room) << " missing";
    throw ResourceError(msg.str());
  }
  DeviceBackend& device = residency_.device();
  l.sidecar_bytes += bytes;
  l.budget_bytes += grow_budget;
  std::vector<at::Tensor> out;
  try {
    residency_.replan(weight_budget, l.max_resident);  // streams more layers if the sidecars need their room
    out.reserve(host.size());
    for (size_t i = 0; i < host.size(); ++i) {
      at::Tensor d = device.allocate(host[i].sizes(), dtypes[i], MemoryKind::lora, what, residency_.ledger());
      device.copy_to_device(d, host[i].to(at::kCPU, dtypes[i]).contiguous());
      device.record_use(d, StreamKind::copy);  // freed later without waiting for anything else
      out.push_back(std::move(d));
    }
    // FENCE(F9): the copies are done before a forward reads them (and a failed one throws here)
    device.synchronize();  // FENCE(F9)
    for (const auto& d : out) sidecars_.emplace_back(d.getIntrusivePtr());
  } catch (...) {
    out.clear();
    l.sidecar_bytes -= bytes;
    l.budget_bytes = old_budget;
    try {
      residency_.replan(old_weight_budget, l.max_resident);
    } catch (const std::exception& e) {
      log::warn("model '" + model + "': growing residency back after failed sidecars: " + e.what());
    }
    throw;
  }
  return out;
}

uint64_t ModelBudget::sidecars_released(uint64_t bytes, uint64_t shrink_budget) noexcept {
  ResidencyLimits& l = residency_.limits();
  l.sidecar_bytes -= std::min(l.sidecar_bytes, bytes);
  if (!residency_.attached()) return 0;
  shrink_budget = std::min(shrink_budget, l.weight_budget);
  std::string error;
  if (shrink_budget > 0) {
    try {
      // The room goes back to resident layers, less what the budget gives back.
      residency_.replan(l.weight_budget - shrink_budget, l.max_resident, /*release_freed=*/false);
      l.budget_bytes -= std::min(l.budget_bytes, shrink_budget);
      return shrink_budget;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  try {
    residency_.replan(l.weight_budget, l.max_resident);  // the room goes back to resident layers
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (!error.empty()) {
    log::warn("model '" + residency_.model_name() + "': residency stays as it is after sidecars were dropped: " + error);
  }
  return 0;
}

std::vector<at::Tensor> ModelBudget::live_sidecars() {
  sidecars_.erase(std::remove_if(sidecars_.begin(), sidecars_.end(), [](const auto& w) { return w.expired(); }),
                  sidecars_.end());
  std::vector<at::Tensor> live;
  for (const auto& w : sidecars_) {
    auto impl = w.lock();
    if (impl) live.emplace_back(std::move(impl));
  }
  return live;
}

void ModelBudget::reserve_nesting(uint64_t seen) {
  ResidencyLimits& l = residency_.limits();
  const uint64_t before = l.nested_reserve;
  l.nested_reserve = seen;
  std::string outcome;
  try {
    residency_.replan(l.weight_budget, l.max_resident);
    outcome = "every plan reserves that room from now on (" + residency_.plan().residency_map() + ")";
  } catch (const ResourceError& e) {
    l.nested_reserve = before;  // the plan did not change
    outcome = std::string("the budget has no room to reserve it (") + e.what() +
              "): such forwards allocate it while the budget has room, and fail when it has none";
  }
  if (!nested_warned_) {
    nested_warned_ = true;
    log::warn("model '" + residency_.model_name() + "': a forward held " + format_mib(seen) +
              " of upcast scratch and staging slots beyond its plan (leases open at once); " + outcome);
  }
}

// ---------------------------------------------------------------------------------------
// working memory (Note [measured working memory])

void ModelBudget::grow_working_memory(const WorkingMeasure& m, const std::string& kind) {
  const uint64_t used = m.used;
  measured_any_ = true;
  measured_working_ = std::max(measured_working_, used);
  ResidencyLimits& l = residency_.limits();
  const std::string& model = residency_.model_name();
  const uint64_t wm = l.working_memory;
  if (!residency_.options().grow_working_memory || used <= wm) return;
  const uint64_t min_weights = residency_.minimum_weights();
  uint64_t want = used + used / 8;
  const uint64_t most = l.budget_bytes > min_weights ? l.budget_bytes - min_weights : 0;
  const bool short_of_it = want > most;
  want = std::min(want, most);
  if (want <= wm) {
    log::warn("model '" + model + "': the first '" + kind + "' forward used " + format_mib(used) +
              " of device memory beyond the weights, more than the working memory of " + format_mib(wm) +
              ", and the budget of " + format_mib(l.budget_bytes) + " has no room to reserve more");
    return;
  }
  l.working_memory = want;
  try {
    residency_.replan(std::min(l.weight_budget, l.budget_bytes - want), l.max_resident);
  } catch (const std::exception& e) {
    l.working_memory = wm;
    log::warn("model '" + model + "': growing the working memory to " + format_mib(want) + " after measuring " +
              format_mib(used) + " failed, keeping " + format_mib(wm) + ": " + e.what());
    return;
  }
  ++working_grown_;
  std::ostringstream line;
  line << "model '" << model << "': the first '" << kind << "' forward used " << format_mib(used)
       << " of device memory beyond the weights (allocator peak " << format_mib(static_cast<uint64_t>(m.allocator_peak))
       << ", sluice's ledger " << format_mib(static_cast<uint64_t>(m.ledger)) << "), more than the working memory of "
       << format_mib(wm) << ": working memory now " << format_mib(want)
       << (short_of_it ? " (all the budget leaves beside the minimum)" : " (measured plus a margin)")
       << ", replanned: " << residency_.plan().residency_map();
  if (short_of_it) {
    log::warn(line.str());
  } else {
    log::info(line.str());
  }
}

}  // namespace sluice::offload
