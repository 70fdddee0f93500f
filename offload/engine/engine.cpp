#include "offload/engine/engine.h"

#include <c10/util/Exception.h>

#include "offload/device/cpu_device.h"
#include "offload/device/upcast_registry.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace sluice::offload {

namespace {

std::shared_ptr<DeviceBackend> device_of(const EngineOptions& options) {
  std::shared_ptr<DeviceBackend> device = options.device ? options.device : std::shared_ptr<DeviceBackend>(make_cpu_device());
  if (device->device().is_cuda()) register_cuda_kernels();  // fp8 upcast kernel, where built
  return device;
}

}  // namespace

StreamingEngine::StreamingEngine(EngineOptions options)
    : options_(resolve_engine_options(std::move(options))),
      device_(device_of(options_)),
      residency_(device_, options_),
      budget_(residency_),
      recorder_(residency_),
      forwards_(residency_, budget_, recorder_) {
  residency_.set_observer(this);
}

StreamingEngine::~StreamingEngine() {
  if (!residency_.attached()) return;
  forwards_.clear();
  budget_.end_model();
  residency_.detach();
}

void StreamingEngine::attach(torch::nn::Module& model, std::string model_name, std::optional<uint64_t> budget_bytes) {
  residency_.attach(model, std::move(model_name), budget_bytes, this);
  forwards_.begin_model();
}

void StreamingEngine::detach() {
  if (!residency_.attached()) return;
  forwards_.require_idle("detach");
  forwards_.clear();
  budget_.end_model();
  residency_.detach();
}

void StreamingEngine::before_change(const char* what) {
  forwards_.require_idle(what);
  if (forwards_.in_implicit_forward()) end_forward(false);
}

LayerWeights StreamingEngine::acquire(ManagedLayerImpl& layer) { return acquire_as(layer, false); }

LayerWeights StreamingEngine::acquire_stored(ManagedLayerImpl& layer) { return acquire_as(layer, true); }

LayerWeights StreamingEngine::acquire_as(ManagedLayerImpl& layer, bool stored) {
  if (!deferred_error_.empty()) {
    std::string msg = std::move(deferred_error_);
    deferred_error_.clear();
    TORCH_INTERNAL_ASSERT(false, "streaming engine: an earlier forward ended with an error: ", msg);
  }
  return forwards_.acquire(layer, stored);
}

std::vector<at::Tensor> StreamingEngine::place_sidecars(const std::vector<at::Tensor>& host,
                                                        const std::vector<at::ScalarType>& dtypes,
                                                        const std::string& what, uint64_t grow_budget) {
  before_change("placing sidecars");
  return budget_.place_sidecars(host, dtypes, what, grow_budget);
}

// ---------------------------------------------------------------------------------------
// forwards

void StreamingEngine::begin_forward(std::string_view kind) {
  if (!residency_.attached()) throw InvalidArgument("begin_forward: no model attached");
  if (forwards_.nest()) return;
  if (forwards_.in_implicit_forward()) end_forward(false);
  forwards_.open(kind, /*implicit=*/false);
}

void StreamingEngine::end_forward(bool aborted) {
  const ForwardPass::Ended ended = forwards_.end(aborted);
  if (!ended.closed) return;
  // What the forward calls for, between forwards and before the next one's prefetches.
  if (ended.nested_seen > residency_.limits().nested_reserve && !aborted) budget_.reserve_nesting(ended.nested_seen);
  if (auto measure = forwards_.take_working_measure(aborted)) {
    budget_.grow_working_memory(*measure, forwards_.last_kind());
  }
  if (!aborted && ended.explicit_forward) {
    residency_.replan_if_measured();
    forwards_.top_up_for_next();
  }
  residency_.check_invariants("end of forward");
}

void StreamingEngine::end_forward_noexcept(bool aborted) noexcept {
  try {
    end_forward(aborted);
  } catch (const c10::Error& e) {
    log::error(std::string("end of forward: ") + e.what_without_backtrace());
    deferred_error_ = e.what_without_backtrace();
  } catch (const std::exception& e) {
    log::error(std::string("end of forward: ") + e.what());
    deferred_error_ = e.what();
  }
}

// ---------------------------------------------------------------------------------------
// reports

uint64_t StreamingEngine::record_nonfinite(NonFiniteRecord record) {
  record.forward_index = forwards_.forwards() ? forwards_.forwards() - 1 : 0;
  nonfinite_ = std::move(record);
  ++nonfinite_reruns_;
  return nonfinite_->forward_index;
}

void set_allocator_stats(EngineStats& stats, const DeviceAllocator& device) {
  const DeviceBackend::AllocatorStats a = device.allocator_stats();
  stats.allocator_stats_available = a.available;
  stats.allocator_current_bytes = a.current_bytes;
  stats.allocator_peak_bytes = a.peak_bytes;
  stats.allocator_reserved_bytes = a.reserved_bytes;
}

EngineStats StreamingEngine::stats(bool wait) {
  recorder_.resolve(wait);
  const ResidencyPlan& plan = residency_.plan();
  const ResidencyLimits& limits = residency_.limits();
  const ForwardBuffers& buffers = residency_.buffers();
  const StagingRing* ring = buffers.ring();
  const Calibrator& calib = residency_.calibrator();
  const ResidencyApplier& applier = residency_.applier();
  EngineStats s;
  s.model_name = residency_.model_name();
  s.device = device_->name();
  s.budget_bytes = limits.budget_bytes;
  s.working_memory_bytes = limits.working_memory;
  s.measured_working_memory = budget_.measured_working_memory().has_value();
  s.measured_working_memory_bytes = budget_.measured_working_memory().value_or(0);
  s.working_memory_grown = budget_.working_grown();
  s.model_total_bytes = residency_.records().stored_bytes();
  for (const auto& r : residency_.records().layers()) {
    s.layers += 1;
    (r.resident ? s.resident_layers : s.streamed_layers) += 1;
  }
  s.model_resident_bytes = plan.resident_bytes;
  s.residency = plan.residency_map();
  s.residency_grid = plan.residency_grid();
  s.ring_slots = ring ? ring->live_slots() : 0;
  s.slot_bytes = plan.slot_bytes;
  s.ring_capacity_bytes = ring ? ring->capacity() : 0;
  s.ring_slot_bytes = ring ? ring->bytes() : 0;
  s.wasted_prefetch_copies = buffers.wasted_copies();
  s.wasted_prefetch_bytes = buffers.wasted_bytes();
  s.mismatched_forwards = forwards_.mismatched_forwards();
  s.plan.policy = residency_policy_name(plan.policy);
  s.plan.from_measurements = !plan.predictions.empty();
  s.plan.copy_gbps = calib.copy_fit() ? calib.copy_fit()->gbps : 0.0;
  s.plan.ring_bytes = plan.ring_bytes;
  s.plan.measured_plans = calib.measured_plans();
  s.plan.recomputed = calib.recomputed();
  s.plan.step_kind = calib.main_kind();
  for (const auto& p : plan.predictions) {
    PlanKindStats k;
    k.kind = p.kind;
    k.predicted_step_ms = p.step_ms;
    k.floor_ms = p.floor_ms;
    k.compute_ms = p.compute_ms;
    k.copy_ms = p.copy_ms;
    k.measured_step_ms = calib.measured_step_ms(p.kind);
    k.measured_forwards = calib.measured_forwards(p.kind);
    s.plan.kinds.push_back(std::move(k));
  }
  if (residency_.ledger()) s.device_memory = residency_.ledger()->stats();
  s.pinned = applier.pinned();
  s.pinned_bytes = applier.pinned_bytes();
  s.pin_limit_bytes = applier.arena().limit();
  s.residency_h2d = applier.residency_h2d();
  s.forwards = forwards_.forwards();
  s.slot_violations = buffers.violations();
  if (const BounceRing* bounce = forwards_.bounce()) {
    s.bounce_bytes = bounce->bytes();
    s.bounce_copies = bounce->copies();
    s.sync_copies = bounce->sync_copies();
    s.bounce_waits = bounce->waits();
    s.bounce_limit_bytes = bounce->limit() * bounce->slot_bytes();
  }
  const auto& records = recorder_.records();
  s.forward_records.assign(records.begin(), records.end());
  s.nonfinite_reruns = nonfinite_reruns_;
  s.nonfinite = nonfinite_;
  set_allocator_stats(s, *device_);
  return s;
}

TraceWriter& StreamingEngine::trace() {
  recorder_.resolve(true);
  return recorder_.trace();
}

ForwardScope::ForwardScope(StreamingEngine& engine, std::string_view kind)
    : engine_(engine), uncaught_(std::uncaught_exceptions()) {
  engine_.begin_forward(kind);
}

ForwardScope::~ForwardScope() { engine_.end_forward_noexcept(std::uncaught_exceptions() > uncaught_); }

}  // namespace sluice::offload
