#pragma once
// StreamingEngine: the WeightProvider that runs a model under a device-memory budget. It is
// what other code includes; it ties four parts, each in its own file:
//  - ModelResidency (model_residency.h): the attached model's records (model_records.h),
//    its residency plan under the budget, the applier that moves layers, and the staging
//    ring and upcast scratch the plan sizes (forward_buffers.h);
//  - ModelBudget (model_budget.h): every request that changes what the model may hold on
//    the device (loads and unloads, budget, cap, LoRA sidecars, nesting reserve, working
//    memory), each a replan through ModelResidency;
//  - ForwardPass (forward_pass.h): one forward's life, its leases, copies, prefetches and
//    bounce slots;
//  - ForwardRecorder (forward_recorder.h): each forward's events, read into its record,
//    the trace and the calibrator.
// The engine orders them: a residency change waits for no forward but refuses to run
// during one (PlanObserver::before_change), the end of a forward is followed by the plan
// changes it calls for (nesting reserve, working memory, a plan from measurements), and
// the stats gather all four.
// Registered parameters always hold the stored dtype. Weights never go device->host: the
// host copy of every layer is kept in RAM for as long as the model is attached, so
// unloading only drops device copies. Pinned host copies stay pinned after a detach (they
// are the model's host weights until it leaves RAM): neither a detach nor a re-attach
// copies anything on the host.
//
// Note [engine faults]
// ~~~~~~~~~~~~~~~~~~~~
// What the engine does when the device or the host fails it (each case has a test in
// tests/offload/engine/test_faults.cpp, driven by the fault points of runtime/fault_injection.h):
//  - Out of device memory making a layer resident (attach or a residency change): the
//    layers that made it stay resident, the rest stream, with one warning naming the
//    error and the residency reached: a smaller residency, same outputs. If the ring for
//    the newly streamed layers does not fit, residency is given back until it does.
//  - Out of memory for the ring, the scratch or the other parameters at attach: a
//    ResourceError, and the model is given back as it was. For the ring in a residency
//    change: a ResourceError, the previous residency minus what this call promoted, and
//    the ring is made again by the next forward that streams.
//  - Pinning fails: streamed layers use pageable memory, with one warning. Pinning would
//    pass the pinned arena's limit: the layers past it stay pageable (copied through the
//    bounce ring), with one warning.
//  - A host->device copy fails or times out (DeviceError from the device): while making
//    layers resident, the change is undone (attach: the model is given back) and the
//    error raised; for a streamed layer, the acquire throws a DeviceError naming the layer
//    and its slot is dropped, so that forward fails and the next one copies afresh. A
//    failed prefetch only warns: the layer is copied on demand when used.
// Stored weights are never written by any of these paths, and the device accounting
// returns to what the engine holds (tests compare the ledgers before and after).
//
// Not thread-safe: one forward at a time, from one thread.
#include <torch/nn/module.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/engine_options.h"
#include "offload/engine/forward_pass.h"
#include "offload/engine/forward_recorder.h"
#include "offload/layer/layer.h"
#include "offload/engine/model_budget.h"
#include "offload/engine/model_residency.h"
#include "offload/report/stats.h"
#include "offload/report/trace.h"

namespace sluice::offload {

// Copies `device`'s allocator_stats() into the allocator fields of `stats`.
void set_allocator_stats(EngineStats& stats, const DeviceAllocator& device);

class StreamingEngine final : public WeightProvider, public SidecarPlacer, private PlanObserver {
 public:
  explicit StreamingEngine(EngineOptions options = {});
  ~StreamingEngine() override;
  StreamingEngine(const StreamingEngine&) = delete;
  StreamingEngine& operator=(const StreamingEngine&) = delete;

  // Takes over every ManagedLayer of `model` (which must be on the host, and not attached
  // elsewhere). Throws ResourceError naming the minimum budget when it is too small;
  // leaves the model as it was on any error. `budget_bytes` overrides options.budget_bytes
  // for this attach (the model cache attaches with the model's share of a shared budget).
  void attach(torch::nn::Module& model, std::string model_name, std::optional<uint64_t> budget_bytes = std::nullopt);
  // Gives the model back on the host (no device->host copies) and frees all device memory.
  // Throws InvalidArgument while leases are open.
  void detach();
  bool attached() const { return residency_.attached(); }

  // WeightProvider. The returned tensors are valid until release(); they may be views of
  // a staging slot or of a scratch buffer that the next layer reuses.
  LayerWeights acquire(ManagedLayerImpl& layer) override;
  LayerWeights acquire_stored(ManagedLayerImpl& layer) override;
  void release(ManagedLayerImpl& layer) noexcept override { forwards_.release(layer); }

  // SidecarPlacer (Note [device extras]). Between forwards only (InvalidArgument during one);
  // ResourceError naming `what` and the bytes missing when the sidecars cannot fit.
  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what) override {
    return place_sidecars(host, dtypes, what, 0);
  }
  void sidecars_released(uint64_t bytes) noexcept override { sidecars_released(bytes, 0); }
  // The same with the budget grown by `grow_budget` bytes in the same replan (the model
  // cache grows a model's share for its sidecars: Note [sidecar share]), so that the
  // resident layers stay as they are when it grows by the sidecars' bytes. When it throws,
  // the budget is as it was.
  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what, uint64_t grow_budget);
  // sidecars_released with the budget shrunk by `shrink_budget` bytes in the same replan;
  // returns the bytes it shrank (0 when that replan failed and the budget stayed, with one
  // warning).
  uint64_t sidecars_released(uint64_t bytes, uint64_t shrink_budget) noexcept {
    return budget_.sidecars_released(bytes, shrink_budget);
  }

  // Delimit one forward (for per-forward stats, the recorded order and wrap-around
  // prefetch). `kind` names the forward's type ("dit", "adapter"): each kind has its own
  // recorded order. Nested calls count once. Acquires outside any forward open an implicit
  // one that ends at the next begin_forward().
  void begin_forward(std::string_view kind = "");
  // Throws (after closing the forward) if an engine invariant broke during it.
  void end_forward(bool aborted = false);
  // As end_forward(), for destructors: an error is logged and rethrown by the next acquire().
  void end_forward_noexcept(bool aborted) noexcept;
  // Called on the forward's thread after each layer's lease is released inside a forward:
  // the layers released so far in this forward, and the acquires the recorded order of its
  // kind expects (0 before the first forward of a kind). On a GPU the layer's work is then
  // enqueued, not necessarily finished. If it throws, the exception is logged (one
  // warning) and the callback turned off; the forward goes on. An empty function turns it
  // off. For progress displays (sluice run's live line).
  // Except sluice::Interrupted (runtime/error.h), a host's request to stop (Python's
  // Ctrl-C, Note [Ctrl-C in a forward] in python/src/sluice_python.cpp): it is kept, the
  // callback turned off, and the next acquire() of this forward throws it, so the forward
  // unwinds before its next layer as from any error (leases released, weights left in
  // their storage dtype). After the forward's last layer, take_interrupt() hands it over.
  using LayerProgressFn = ForwardPass::LayerProgressFn;
  void set_layer_progress(LayerProgressFn fn) { forwards_.set_layer_progress(std::move(fn)); }
  // The Interrupted a layer callback threw in this forward and no acquire() rethrew yet
  // (null when none); cleared. A new forward starts with none.
  std::exception_ptr take_interrupt() { return forwards_.take_interrupt(); }

  // Residency changes between forwards (partial_load, partial_unload, full_load,
  // full_unload, set_budget, set_max_resident) are the budget's own: engine.budget().X
  // (offload/engine/model_budget.h). The engine adds nothing to them, so it does not
  // forward them.

  // WeightNeeds of `model` under `options`, without attaching or allocating anything
  // (sizes only: the model may be attached to an engine meanwhile).
  static WeightNeeds needs(torch::nn::Module& model, const EngineOptions& options) {
    return ModelResidency::needs(model, options);
  }

  const ResidencyPlan& plan() const { return residency_.plan(); }
  bool is_resident(const std::string& layer_name) const { return residency_.is_resident(layer_name); }
  // Smallest budget (working memory included) the attached model runs under.
  uint64_t minimum_budget() const { return residency_.minimum_budget(); }
  // Device bytes the engine holds now (resident + params + ring + scratch), the ring at its
  // capacity (a reservation, Note [staging ring]).
  uint64_t device_bytes() const { return residency_.device_bytes(); }
  // The parts, for what the calls above do not say: the limits the plan is made under
  // (working memory, sidecar bytes, nesting reserve), device bytes allocated, pinning.
  const ModelResidency& residency() const { return residency_; }
  ModelBudget& budget() { return budget_; }
  const ModelBudget& budget() const { return budget_; }
  const std::string& last_forward_kind() const { return forwards_.last_kind(); }
  // Note [non-finite values] (runtime/nonfinite.h): what a forward re-run with a per-layer
  // check found, kept for stats (EngineStats::nonfinite, counted in nonfinite_reruns).
  // Called after that forward ended: its index is the last forward's, which it returns.
  uint64_t record_nonfinite(NonFiniteRecord record);

  // A snapshot. `wait`: resolve every outstanding timing first (waits for the device to
  // finish the last forward); otherwise only forwards the device has finished are in
  // forward_records (`forwards` counts them all).
  EngineStats stats(bool wait = true);
  // Spans recorded with options.trace (resolved like stats()).
  TraceWriter& trace();
  DeviceBackend& device() { return *device_; }
  const EngineOptions& options() const { return options_; }

 private:
  LayerWeights acquire_as(ManagedLayerImpl& layer, bool stored);
  // PlanObserver (model_residency.h).
  void before_change(const char* what) override;
  void plan_changing() noexcept override { forwards_.plan_changing(); }
  void ring_dropped() noexcept override { forwards_.ring_dropped(); }
  void streamed_changed() override { forwards_.streamed_changed(); }

  EngineOptions options_;
  std::shared_ptr<DeviceBackend> device_;
  ModelResidency residency_;
  ModelBudget budget_;
  ForwardRecorder recorder_;
  ForwardPass forwards_;
  std::string deferred_error_;  // from end_forward_noexcept(), raised by the next acquire()
  uint64_t nonfinite_reruns_ = 0;
  std::optional<NonFiniteRecord> nonfinite_;
};

// Delimits one forward: begin_forward() now, end_forward() at scope exit (aborted when
// leaving by an exception).
class ForwardScope {
 public:
  explicit ForwardScope(StreamingEngine& engine, std::string_view kind = "");
  ~ForwardScope();
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;

 private:
  StreamingEngine& engine_;
  int uncaught_;
};

}  // namespace sluice::offload
