#pragma once
// ModelBudget: what an attached model may hold on the device, and every request that
// changes it. The budget (working memory included) and the cap on resident bytes are set
// by the user or the model cache (partial and full loads and unloads, set_budget,
// set_max_resident); the device extras beside the weights (LoRA sidecars, room for leases
// nested beyond the plan) and the working memory grow and shrink as forwards need them.
// Each request changes the limits ModelResidency (model_residency.h) plans under and
// replans there; this part holds no plan of its own.
//
// Note [measured working memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The working memory (activations, cuBLAS workspaces, the allocator's rounding, blocks
// still waiting on stream events) starts as a guess (EngineOptions::working_memory_bytes;
// the CLI and the model cache use 1 GiB x (res/1024)^2, Note [working memory default]).
// The first forward of each kind measures it: at its start the device allocator's peak is
// reset (DeviceBackend::reset_allocator_peak), at its end the peak is compared with the
// device bytes sluice's ledger holds (the larger of its start and end):
//     measured = allocator peak - ledger
// When the measurement passes the working memory, the working memory grows to it plus a
// margin (an eighth) and the engine replans under the smaller weight
// budget, with one INFO line; a budget too small for it keeps the most it can and warns.
// The stats report the measurement (budget.measured_working_memory_bytes) and the grown
// working memory. Only backends with allocator statistics measure (a GPU's caching
// allocator, the CPU device's count of device bytes alive). The measurement is an upper
// bound where other users allocate on the device during the forward (the whole device's
// allocator is read).
//
// Note [device extras]
// ~~~~~~~~~~~~~~~~~~~~
// Every device byte the engine's model uses is charged to its budget before it is
// allocated (Note [device accounting] in device_allocator.h), and the plan leaves room for it, so
// that the minimum budget and every residency change account for it:
//  - LoRA sidecars are placed through place_sidecars() (the SidecarPlacer a LoraScope is
//    given): the plan first streams more layers until the sidecars fit beside the resident
//    ones, then they are allocated as MemoryKind::lora. Sidecars that cannot fit even with
//    every streamable layer streamed give one ResourceError naming them and the bytes
//    missing. When they are dropped (sidecars_released) the plan grows back. (The model
//    cache grows a model's budget by their bytes in the same replan where it can, so that
//    nothing more streams: Note [sidecar share] in cache/sidecar_share.h.) Their copies
//    are done before place_sidecars() returns (FENCE(F9)); every forward declares them as
//    compute reads (begin_access, so the strict device checks that order) and records its
//    use of them (FENCE(F10)), as it does for the parameters, the resident weights, the
//    staging slots and the upcast scratch. The model's inputs are the caller's tensors,
//    not allocations of the engine: the strict device does not track them.
//  - Upcasts write into the planned scratch buffer (Note [upcast scratch] in
//    forward_buffers.h); the ATen fallback converts in place
//    (runtime/fp8.h aten_upcast_into), without a temporary of the layer's size.
//  - Leases nested beyond the plan (a module holding two layers' weights at once) need a
//    second scratch buffer or an overflow staging slot. Those are charged when made, and
//    the most a forward held at once is then reserved in every later plan (one warning),
//    so the minimum budget includes them from then on.
// The stats JSON device section reports the bytes by use (weight, ring, scratch, lora).
//
// Not thread-safe: the engine's single thread.
//
// Tested by (indirectly, through the engine's set_budget, set_max_resident, LoRA scopes and
// measured forwards): tests/offload/engine/test_engine.cpp ("engine: set_budget replans and a
// too-small budget changes nothing", "engine: set_max_resident replans under the current limit",
// "engine: a first forward whose activations pass the working memory grows it to the measurement
// and replans", "engine: what nested leases held beyond the plan is reserved in later plans and the
// minimum"), tests/models/test_lora.cpp ("lora: a rank-64 LoRA on every Linear under a budget that
// fits the model exactly streams more layers", "lora: sidecars that cannot fit even with every
// layer streamed give one error naming the LoRA"), tests/offload/engine/test_streams.cpp ("streams:
// a forward right after placing LoRA sidecars reads them after their copies"),
// tests/python/test_offload_guarantees.py
// (test_the_working_memory_of_an_offloaded_module_is_measured_and_grown).
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "offload/engine/model_residency.h"

namespace sluice::offload {

// What a first forward of a kind used on the device (Note [measured working memory]).
struct WorkingMeasure {
  uint64_t used = 0;          // allocator peak - ledger
  int64_t allocator_peak = 0;
  int64_t ledger = 0;         // the most sluice's ledger held during the forward
};

class ModelBudget {
 public:
  explicit ModelBudget(ModelResidency& residency) : residency_(residency) {}

  // Residency changes between forwards (InvalidArgument while leases are open), called as
  // engine.budget().X. Each replans under a changed device limit and returns the change in
  // device bytes the engine holds (exact, from the accounting). Never copies device->host.
  int64_t partial_load(uint64_t bytes);    // let the model use up to `bytes` more
  int64_t partial_unload(uint64_t bytes);  // free at least `bytes` (down to the minimum)
  int64_t full_load();                     // every layer resident; ResourceError if it does not fit
  int64_t full_unload();                   // the minimum: required layers, ring, scratch
  // New budget (working memory unchanged); replans. ResourceError if too small. A lower
  // budget gives the memory it freed back to the driver (DeviceBackend::release_cached_memory)
  // unless `release_freed` is false (the model cache releases once per budget cut itself).
  void set_budget(uint64_t budget_bytes, bool release_freed = true);
  // New cap on resident streamable bytes (fraction 0..1, nullopt: none); replans under the
  // current limit (or only kept for the next attach when detached). InvalidArgument for a
  // fraction outside 0..1.
  void set_max_resident(std::optional<double> max_resident);

  // Note [device extras]: places `host` as `dtypes` on the device for `what`, the budget
  // grown by `grow_budget` in the same replan; ResourceError naming `what` and the bytes
  // missing when they cannot fit. When it throws, the budget is as it was.
  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what, uint64_t grow_budget);
  // `bytes` of sidecars were dropped: the budget shrinks by `shrink_budget` in the same
  // replan; returns the bytes it shrank (0 when that failed, with one warning).
  uint64_t sidecars_released(uint64_t bytes, uint64_t shrink_budget) noexcept;
  // The sidecars alive now, which every forward reads (pruned of those dropped).
  std::vector<at::Tensor> live_sidecars();
  // After a forward that held `seen` bytes beyond the plan: every plan reserves them.
  void reserve_nesting(uint64_t seen);
  // After a measured first forward of `kind` (Note [measured working memory]).
  void grow_working_memory(const WorkingMeasure& measure, const std::string& kind);
  // The most a first forward of a kind used beyond the ledger (none before one was measured).
  std::optional<uint64_t> measured_working_memory() const {
    return measured_any_ ? std::optional<uint64_t>(measured_working_) : std::nullopt;
  }
  uint64_t working_grown() const { return working_grown_; }
  // The model was detached: its sidecars are forgotten.
  void end_model() noexcept { sidecars_.clear(); }

 private:
  ModelResidency& residency_;
  // The sidecars placed, without keeping them alive: every forward declares them as compute
  // reads (begin_access) and records its use of them, like the parameters.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> sidecars_;
  bool nested_warned_ = false;
  bool measured_any_ = false;
  uint64_t measured_working_ = 0;
  uint64_t working_grown_ = 0;
};

}  // namespace sluice::offload
