#pragma once
// ModelResidency: which layers of an attached model live on the device, and the plan and
// budget that decide it. It attaches a model (its records, model_records.h; its other
// parameters moved to the device; the planned upcast scratch and staging ring,
// forward_buffers.h), plans its residency under the model's budget (residency_plan.h),
// applies each plan through the ResidencyApplier (residency_applier.h) and gives the model
// back at detach. What the budget holds beside the weights (LoRA sidecars, room for nested
// leases, the working memory) is changed through ModelBudget (model_budget.h), which
// replans here. A forward (forward_pass.h) reads the records and buffers this part
// keeps and is told of every plan change through PlanObserver.
//
// Note [residency changes]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A plan is made at attach and again at every change of the limits it is made under: the
// weight budget (budget minus working memory, or less after partial_unload), the cap on
// resident bytes, the room reserved beside the weights, or (Note [calibration]) the costs
// measured by the first forwards. Changes happen between forwards only (the engine checks
// that no lease is open and ends an implicit forward first). Applying one:
//  - synchronizes the device first (a failed prefetch is reported there, as a warning: it
//    was never read), drops the staging ring with its unread prefetches (counted as
//    wasted) and the scratch buffers made beyond the plan, so that the new plan has their
//    bytes;
//  - moves layers through the applier (FENCE(F7) there: resident copies are done before
//    any forward reads them), which makes the ring for what then streams;
//  - keeps the plan the records show when the applier degraded it (out of memory making a
//    layer resident: a smaller residency, one warning) and, when the applier threw,
//    streams the rest through a ring sized for what streams now (Note [engine faults] in
//    engine.h).
// Weights never go device->host: a layer that stops being resident points back at its
// host copy. The ledger's peak is reset after each change (the budget may have shrunk), and
// the device's cached blocks go back to the driver only on a budget cut that asks for it
// (Note [releasing cached memory] in device_allocator.h).
//
// Not thread-safe: the engine's single thread.
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "offload/plan/calibration.h"
#include "offload/device/device.h"
#include "offload/engine/engine_options.h"
#include "offload/engine/forward_buffers.h"
#include "offload/layer/layer.h"
#include "offload/engine/model_records.h"
#include "offload/engine/residency_applier.h"
#include "offload/plan/residency_plan.h"

namespace sluice::offload {

// What the forward side keeps about a plan (the scheduler's streamed layers and prefetch
// frontier, the next forward's prefetches), told as the plan changes; the streaming
// engine implements it. A replan tells before_change, then ring_dropped (when there was a
// ring), plan_changing and streamed_changed; an attach the last three.
class PlanObserver {
 public:
  virtual ~PlanObserver() = default;
  // A change named `what` is about to replan: throws InvalidArgument while a lease is open
  // or an explicit forward runs, and ends an implicit forward.
  virtual void before_change(const char* what) = 0;
  // A plan is about to be applied: the prefetches made for the next forward go with the ring.
  virtual void plan_changing() noexcept = 0;
  // The staging ring was dropped, with its unread prefetches.
  virtual void ring_dropped() noexcept = 0;
  // A plan was applied (or failed half way): which layers stream may have changed.
  virtual void streamed_changed() = 0;
};

// The limits a plan is made under.
struct ResidencyLimits {
  uint64_t budget_bytes = 0;            // the model's device budget, working memory included
  uint64_t working_memory = 0;          // of which left free for activations (Note [measured working memory])
  uint64_t weight_budget = 0;           // the current limit for the rest: budget - working memory, or less
  std::optional<double> max_resident;   // cap on resident streamable bytes
  uint64_t nested_reserve = 0;          // room every plan leaves for nested leases (Note [device extras])
  uint64_t sidecar_bytes = 0;           // LoRA sidecars placed (Note [device extras])

  // The most the weights may take: the budget less the working memory (0 when it leaves none).
  uint64_t full_weight_budget() const { return budget_bytes > working_memory ? budget_bytes - working_memory : 0; }
};

class ModelResidency {
 public:
  ModelResidency(std::shared_ptr<DeviceBackend> device, const EngineOptions& options);
  void set_observer(PlanObserver* observer) { observer_ = observer; }

  // Takes over every ManagedLayer of `model` for `provider` (Note [attached model on the
  // host]); ResourceError naming the minimum budget when `budget_bytes` is too small.
  // Leaves the model as it was on any error.
  void attach(torch::nn::Module& model, std::string model_name, std::optional<uint64_t> budget_bytes,
              WeightProvider* provider);
  // Gives the model back on the host and frees all its device memory.
  void detach() noexcept;
  bool attached() const { return attached_; }
  // WeightNeeds of `model` under `options`, without attaching or allocating anything.
  static WeightNeeds needs(torch::nn::Module& model, const EngineOptions& options);

  const std::string& model_name() const { return model_name_; }
  const EngineOptions& options() const { return options_; }
  DeviceBackend& device() const { return *device_; }
  ModelRecords& records() { return records_; }
  const ModelRecords& records() const { return records_; }
  ForwardBuffers& buffers() { return buffers_; }
  const ForwardBuffers& buffers() const { return buffers_; }
  const ResidencyPlan& plan() const { return plan_; }
  Calibrator& calibrator() { return calib_; }
  const Calibrator& calibrator() const { return calib_; }
  const ResidencyApplier& applier() const { return *applier_; }
  const ResidencyLimits& limits() const { return limits_; }
  ResidencyLimits& limits() { return limits_; }  // ModelBudget changes them, then replans
  const std::shared_ptr<MemoryLedger>& ledger() const { return budget_; }

  // The smallest weight budget the model runs under now, and with the working memory.
  uint64_t minimum_weights() const;
  uint64_t minimum_budget() const;
  bool is_resident(const std::string& layer_name) const;
  // Device bytes held now (the ring at its capacity), and of which allocated.
  uint64_t device_bytes() const { return budget_ ? budget_->current() : 0; }
  uint64_t device_allocated_bytes() const { return device_bytes() - buffers_.unmade_ring_bytes(); }
  // Page-locked bytes holding the model's pinned host copies beyond their own bytes (the
  // pinned arena's alignment padding): what pinning adds to its host RAM.
  uint64_t pinned_padding_bytes() const {
    return applier_->pinned_bytes() - static_cast<uint64_t>(applier_->pinned().current);
  }

  // A plan under these limits, applied (Note [residency changes]); returns the change in
  // device bytes held. ResourceError (nothing changed) when the budget is below the minimum.
  // `release_freed`: a budget cut, whose freed blocks go back to the driver.
  int64_t replan(uint64_t weight_budget, std::optional<double> max_resident, bool release_freed = false);
  // Between forwards: a plan from new measurements, when the calibrator has one due.
  void replan_if_measured();
  // A ring for the plan if there is none (ResourceError if it does not fit).
  void ensure_ring();
  // Throws (an internal error) when the ledger passed the budget, a stored weight changed
  // dtype or is not where the plan puts it, or a staging slot was overwritten in use.
  void check_invariants(const char* where) const;

 private:
  PlanInput plan_input(uint64_t weight_budget, std::optional<double> max_resident) const;
  void apply_plan(const ResidencyPlan& plan);
  void make_ring(uint64_t capacity);
  void retire_ring() noexcept;
  void planned();  // tells the calibrator what plan_ predicts (Note [calibration])
  void clear() noexcept;
  void log_attached(double seconds) const;

  std::shared_ptr<DeviceBackend> device_;
  const EngineOptions& options_;
  PlanObserver* observer_ = nullptr;
  std::shared_ptr<MemoryLedger> budget_;  // what the model holds on the device, limited
  bool attached_ = false;
  std::string model_name_;
  ModelRecords records_;
  ForwardBuffers buffers_;
  ResidencyLimits limits_;
  ResidencyPlan plan_;
  Calibrator calib_;
  // Residency moves and pinning (lives as long as the engine: its counters and warnings
  // span attaches).
  std::unique_ptr<ResidencyApplier> applier_;
};

}  // namespace sluice::offload
