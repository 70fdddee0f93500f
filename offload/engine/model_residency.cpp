#include "offload/engine/model_residency.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <sstream>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

namespace {

// `reserved`: device bytes beside the weights and the ring that the plan leaves room for:
// the upcast scratch, the nested-lease reserve and the LoRA sidecars (Note [device extras]).
PlanInput make_plan_input(const ModelRecords& records, const EngineOptions& options, uint64_t reserved, CostModel costs,
                          uint64_t weight_budget, std::optional<double> max_resident) {
  PlanInput in;
  in.layers = records.plan_layers();
  in.extra_required_bytes = records.extra_bytes();
  in.scratch_bytes = reserved;
  in.weight_budget = weight_budget;
  in.max_resident = max_resident;
  in.policy = options.policy;
  in.ring_slots = options.ring_slots;
  in.max_ahead = options.prefetch_depth;
  in.costs = std::move(costs);
  return in;
}

}  // namespace

ModelResidency::ModelResidency(std::shared_ptr<DeviceBackend> device, const EngineOptions& options)
    : device_(std::move(device)), options_(options), buffers_(*device_) {
  limits_.working_memory = options_.working_memory_bytes;
  limits_.max_resident = options_.max_resident;
  ResidencyApplierOptions applier;
  applier.pin = options_.pin == PinMode::on || (options_.pin == PinMode::auto_ && device_->pins_memory());
  applier.arena = options_.pin_arena ? options_.pin_arena
                 : options_.pin_memory_limit ? std::make_shared<PinnedArena>(*options_.pin_memory_limit)
                                             : std::make_shared<PinnedArena>(default_pin_memory_limit());
  applier.ring_slots = options_.ring_slots;
  applier_ = std::make_unique<ResidencyApplier>(*device_, applier);
}

WeightNeeds ModelResidency::needs(torch::nn::Module& model, const EngineOptions& given) {
  const EngineOptions options = resolve_engine_options(given);
  ModelRecords probe;
  probe.collect(model, "(sizing)", required_regexes(options), options.require_unconverted, /*check_host=*/false);
  WeightNeeds n;
  n.model_bytes = probe.stored_bytes();
  uint64_t largest_slot = 0;
  for (const auto& r : probe.layers()) largest_slot = std::max(largest_slot, r.slot_bytes);
  n.full = n.model_bytes + probe.scratch_bytes();
  const CostModel costs = Calibrator().model(probe.size());
  n.minimum = minimum_weight_budget(make_plan_input(probe, options, probe.scratch_bytes(), costs, 0, options.max_resident));
  // With no budget limit the plan is bounded by max_resident alone.
  const uint64_t unlimited = n.full + static_cast<uint64_t>(options.ring_slots) * largest_slot;
  n.wanted = plan_residency(make_plan_input(probe, options, probe.scratch_bytes(), costs, unlimited, options.max_resident))
                 .device_bytes();
  return n;
}

void ModelResidency::attach(torch::nn::Module& model, std::string model_name, std::optional<uint64_t> budget_bytes,
                            WeightProvider* provider) {
  if (attached_) throw InvalidArgument("engine already has model '" + model_name_ + "' attached");
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<std::regex> required = required_regexes(options_);
  ModelRecords::check_attachable(model, model_name);
  model_name_ = std::move(model_name);
  try {
    records_.collect(model, model_name_, required, options_.require_unconverted, /*check_host=*/true);
    uint64_t& budget = limits_.budget_bytes;
    const uint64_t wm = limits_.working_memory;
    budget = budget_bytes ? *budget_bytes : options_.budget_bytes ? options_.budget_bytes : device_->total_memory();
    if (budget == 0) {
      throw InvalidArgument("the memory of device " + device_->name() + " is unknown: give the budget in bytes");
    }
    if (budget <= wm) {
      throw ResourceError("budget " + format_mib(budget) + " for model '" + model_name_ +
                          "' leaves nothing beside the working memory of " + format_mib(wm));
    }
    limits_.weight_budget = budget - wm;
    const PlanInput input = plan_input(limits_.weight_budget, limits_.max_resident);
    const uint64_t min_weights = minimum_weight_budget(input);
    if (limits_.weight_budget < min_weights) {
      const uint64_t min_budget = min_weights + wm;
      std::ostringstream msg;
      msg << "budget " << format_mib(budget) << " is too small for model '" << model_name_ << "' on "
          << device_->name() << ": the minimum is " << format_mib(min_budget) << " (" << min_budget
          << " bytes: always-resident layers and params, upcast scratch and the staging ring need "
          << format_mib(min_weights) << ", working memory " << format_mib(wm) << ")";
      throw ResourceError(msg.str());
    }
    const ResidencyPlan plan = plan_residency(input);
    budget_ = std::make_shared<MemoryLedger>("device budget of model '" + model_name_ + "'", limits_.weight_budget);
    applier_->begin_model(model_name_, budget_);
    records_.place_extras(*device_, budget_);
    buffers_.begin_model(budget_, records_.scratch_bytes());
    apply_plan(plan);
    planned();
    for (auto& r : records_.layers()) r.layer->set_provider(provider);
    attached_ = true;
  } catch (...) {
    records_.restore_to_host();
    clear();
    throw;
  }
  if (options_.log_attach) log_attached(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

void ModelResidency::log_attached(double seconds) const {
  const uint64_t total = records_.stored_bytes();
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(2);
  line << "Loaded model '" << model_name_ << "' onto " << device_->name() << " in " << seconds
       << "s. Total model size: " << format_mib(total) << ", VRAM: " << format_mib(plan_.resident_bytes);
  line.precision(1);
  line << " (" << (total ? 100.0 * static_cast<double>(plan_.resident_bytes) / static_cast<double>(total) : 100.0)
       << "%)";
  log::info(line.str());
  std::ostringstream map;
  map << "Residency of '" << model_name_ << "' (" << residency_policy_name(plan_.policy) << "): "
      << plan_.residency_map() << "; ring " << format_mib(plan_.ring_bytes) << " (largest slot "
      << format_mib(plan_.slot_bytes) << "), scratch " << format_mib(records_.scratch_bytes()) << ", budget "
      << format_mib(limits_.budget_bytes) << " (working memory " << format_mib(limits_.working_memory) << ")";
  log::info(map.str());
  if (log::enabled(log::Level::debug)) log::debug(plan_.to_string());
}

void ModelResidency::detach() noexcept {
  if (!attached_) return;
  records_.restore_to_host();
  clear();
}

void ModelResidency::retire_ring() noexcept {
  if (buffers_.retire_ring() && observer_) observer_->ring_dropped();
}

// The device memory is freed without waiting for the device: every use by another stream
// was recorded (Note [stream-safe frees]); the synchronize afterwards only reports a copy
// that failed, and lets release_cached_memory give back blocks that were waiting for one.
void ModelResidency::clear() noexcept {
  retire_ring();
  buffers_.end_model();
  records_.clear();
  limits_.sidecar_bytes = limits_.nested_reserve = 0;
  plan_ = ResidencyPlan{};
  calib_.reset();
  if (budget_ && budget_->current() != 0) {
    log::warn("model '" + model_name_ + "': " + format_mib(budget_->current()) +
              " of device memory is still referenced outside the engine after detach");
  }
  budget_.reset();
  try {
    device_->synchronize();
  } catch (const std::exception& e) {
    log::error("detach of model '" + model_name_ + "': a device copy had failed: " + e.what());
  }
  device_->release_cached_memory();  // the model's device memory goes back to the driver
  applier_->end_model();
  attached_ = false;
}

PlanInput ModelResidency::plan_input(uint64_t weight_budget, std::optional<double> max_resident) const {
  const uint64_t reserved = records_.scratch_bytes() + limits_.nested_reserve + limits_.sidecar_bytes;
  return make_plan_input(records_, options_, reserved, calib_.model(records_.size()), weight_budget, max_resident);
}

void ModelResidency::apply_plan(const ResidencyPlan& plan) {
  TORCH_INTERNAL_ASSERT(plan.resident.size() == records_.size(), "apply_plan: plan for another model");
  try {
    device_->synchronize();
  } catch (const DeviceError& e) {
    // A copy that no forward read (a prefetch) failed; its slot goes with the ring below.
    log::warn("model '" + model_name_ + "': " + e.what() + " (an unread prefetch, dropped with the staging ring)");
  }
  retire_ring();
  if (observer_) observer_->plan_changing();
  buffers_.trim_scratch();  // extra buffers from nested leases
  ResidencyApplier::Applied applied;
  auto& layers = records_.layers();
  try {
    // Note [residency applier]: the residency moves, their synchronize, the ring, pinning.
    applied = applier_->apply(layers, plan, [this](uint64_t capacity) { make_ring(capacity); });
    plan_ = plan;
    if (applied.is_degraded()) plan_from_layers(plan_, layers, records_.extra_bytes(), options_.ring_slots);
  } catch (...) {
    // The applier dropped what this call made resident; stream the rest through a ring
    // sized for what is streamed now (if that still fits).
    plan_ = plan;
    plan_from_layers(plan_, layers, records_.extra_bytes(), options_.ring_slots);
    retire_ring();
    try {
      ensure_ring();
    } catch (const std::exception& e) {
      log::error("model '" + model_name_ + "': no staging ring after a failed residency change (" + e.what() +
                 "); the next forward tries again");
    }
    if (observer_) observer_->streamed_changed();
    throw;
  }
  if (applied.is_degraded()) {
    std::ostringstream msg;
    msg << "model '" << model_name_ << "': " << applied.degraded << "; continuing with a smaller residency: "
        << format_mib(plan_.resident_bytes) << " resident, " << format_mib(plan_.streamed_bytes) << " streamed ("
        << plan_.residency_map() << ")";
    log::warn(msg.str());
  }
  if (observer_) observer_->streamed_changed();
}

void ModelResidency::ensure_ring() {
  if (buffers_.ring() || plan_.ring_bytes == 0) return;
  make_ring(plan_.ring_bytes);
}

void ModelResidency::make_ring(uint64_t capacity) {
  retire_ring();
  buffers_.make_ring(capacity, records_.layers());
}

int64_t ModelResidency::replan(uint64_t weight_budget, std::optional<double> max_resident, bool release_freed) {
  TORCH_CHECK(attached_, "no model attached");
  if (observer_) observer_->before_change("residency change");
  const PlanInput input = plan_input(weight_budget, max_resident);
  const uint64_t min_weights = minimum_weight_budget(input);
  const uint64_t wm = limits_.working_memory;
  if (weight_budget < min_weights) {
    throw ResourceError("model '" + model_name_ + "' needs at least " + format_mib(min_weights + wm) + " of budget (" +
                        std::to_string(min_weights + wm) + " bytes), got " + format_mib(weight_budget + wm));
  }
  const ResidencyPlan plan = plan_residency(input);
  const int64_t before = static_cast<int64_t>(budget_->current());
  budget_->set_limit(weight_budget);
  limits_.weight_budget = weight_budget;
  limits_.max_resident = max_resident;
  apply_plan(plan);
  planned();
  budget_->reset_peak();  // the budget may have shrunk: peaks count from the new plan on
  check_invariants("residency change");
  const int64_t change = static_cast<int64_t>(budget_->current()) - before;
  // Note [releasing cached memory]: only a budget cut gives the freed blocks back to the
  // driver; a shrinking replan leaves them in the allocator's cache for the next forward.
  if (change < 0 && release_freed) device_->release_cached_memory();
  return change;
}

void ModelResidency::planned() {
  if (plan_.predictions.empty()) {
    calib_.unplanned();
  } else {
    calib_.planned(plan_.predictions);
  }
}

void ModelResidency::replan_if_measured() {
  if (!calib_.replan_due() || !attached_) return;
  try {
    const PlanInput input = plan_input(limits_.weight_budget, limits_.max_resident);
    if (!input.costs.usable()) {
      calib_.planned({});  // nothing to plan by yet (no copy was timed): keep the plan
      return;
    }
    ResidencyPlan plan = plan_residency(input);
    if (plan.resident == plan_.resident && plan.ring_bytes == plan_.ring_bytes) {
      plan_.predictions = plan.predictions;  // the same residency: keep the ring and its prefetches
    } else {
      apply_plan(plan);
      budget_->reset_peak();
      check_invariants("plan from measurements");
    }
    calib_.planned(plan_.predictions);
  } catch (const std::exception& e) {
    calib_.planned(plan_.predictions);  // do not retry every forward
    log::warn("model '" + model_name_ + "': planning from the measured costs failed, keeping the plan: " + e.what());
    return;
  }
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(2);
  line << "Plan of '" << model_name_ << "' (" << residency_policy_name(plan_.policy) << ", from measurements"
       << (calib_.recomputed() ? ", recomputed" : "") << "): " << plan_.residency_map() << "; ring "
       << format_mib(plan_.ring_bytes) << ", copy " << calib_.copy_fit()->gbps << " GB/s";
  for (const auto& p : plan_.predictions) {
    line << "; '" << p.kind << "' predicted " << p.step_ms << " ms (floor " << p.floor_ms << ", compute "
         << p.compute_ms << ", copy " << p.copy_ms << ")";
  }
  log::info(line.str());
}

uint64_t ModelResidency::minimum_weights() const {
  return minimum_weight_budget(plan_input(0, limits_.max_resident));
}

uint64_t ModelResidency::minimum_budget() const {
  TORCH_CHECK(attached_, "minimum_budget: no model attached");
  return minimum_weights() + limits_.working_memory;
}

bool ModelResidency::is_resident(const std::string& layer_name) const {
  for (const auto& r : records_.layers()) {
    if (r.name == layer_name) return r.resident;
  }
  throw InvalidArgument("model '" + model_name_ + "' has no managed layer '" + layer_name + "'");
}

void ModelResidency::check_invariants(const char* where) const {
  const uint64_t full = limits_.full_weight_budget();
  const DeviceMemoryStats mem = budget_->stats();
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(mem.total.peak) <= full, where, ": device peak ", mem.total.peak,
                        " bytes over the budget minus working memory ", full);
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(mem.total.current) <= limits_.weight_budget, where, ": device use ",
                        mem.total.current, " over the current limit ", limits_.weight_budget);
  for (const auto& r : records_.layers()) {
    const at::Tensor& w = r.layer->stored_weight();
    TORCH_INTERNAL_ASSERT(w.scalar_type() == r.stored_dtype, where, ": stored dtype of '", r.name, "' changed to ",
                          w.scalar_type());
    const at::Tensor& expected = r.resident ? r.dev_w : r.host_w;
    TORCH_INTERNAL_ASSERT(w.data_ptr() == expected.data_ptr(), where, ": stored weight of '", r.name,
                          "' is not where the plan puts it");
  }
  if (const StagingRing* ring = buffers_.ring()) {
    TORCH_INTERNAL_ASSERT(ring->violations() == 0, where, ": a staging slot was overwritten while in use");
  }
}

}  // namespace sluice::offload
