#pragma once
// ForwardPass: one forward's life in a streaming engine. A forward opens (begin_forward,
// or implicitly at an acquire outside one), and each layer's WeightLease acquires its
// weights and releases them:
//  - resident layer: its stored tensors on the device are upcast into a scratch buffer;
//  - streamed layer: its stored bytes are copied into a staging slot on the copy stream
//    (prefetched ahead of use, Note [prefetch order] in prefetch_scheduler.h); compute
//    waits on the copy's event (FENCE(F1)), upcasts from the slot, and the release records
//    the event that lets the slot be overwritten (Note [staging ring] in staging_ring.h).
// Copies from pageable host memory go through a pinned bounce ring (bounce_ring.h). Every
// device tensor a lease reads or writes is declared to the device as an access and its use
// recorded on the compute stream at release (FENCE(F5)), so that frees elsewhere wait for
// it. When the forward ends, its counts and events go to the ForwardRecorder
// (forward_recorder.h) and what it measured (nesting beyond the plan, working memory) to
// the engine, which changes the plan between forwards (model_residency.h, model_budget.h).
//
// Note [forward kinds and wasted copies]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each forward kind ("dit", "adapter") has its own recorded acquire order, and prefetching
// follows it, running ahead as far as the staging ring's bytes allow (Note [staging ring]).
// Copies belong to the forward that reads them: each streamed layer is copied once per
// forward, unless a forward calls a layer twice and its slot was reused in between, or
// diverges from the order, or a prefetch was dropped (a replan, a forward of another kind:
// the prefetches made for the next forward follow the last kind's order, so they are
// dropped when the kind changes). Such a copy is counted as wasted (stats:
// wasted_prefetch_*) and the forward as mismatched, with one warning: it costs bytes on
// the bus, never correctness.
// A forward on another compute stream than the last one (a host running forwards on
// streams of its own) reuses the last one's scratch and reads what it left: it waits for
// the last one's end event first (FENCE(F6)).
//
// Not thread-safe: one forward at a time, from one thread.
//
// Tested by (indirectly, through streamed forwards of the engine on the CPU device):
// tests/offload/engine/test_engine.cpp ("engine: outputs are bit-identical to the plain model for
// every depth and cap and policy", "engine: a forward that leaves the recorded order stays correct
// and is re-recorded", "engine: forwards of different kinds keep their own order", "engine: nested
// leases get their own slot and scratch"), tests/offload/engine/test_streams.cpp ("streams:
// streamed forwards through a wrapping ring match the model", "streams: forwards alternate between
// two host streams"), tests/offload/layer/test_foreign_model.cpp ("foreign model: a layer called
// twice per forward is two calls, each prefetched (Note [repeated calls])"),
// tests/python/test_offload_guarantees.py (test_a_forward_off_the_recorded_order_says_so).
#include <array>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "offload/device/bounce_ring.h"
#include "offload/engine/forward_recorder.h"
#include "offload/layer/layer.h"
#include "offload/engine/model_budget.h"
#include "offload/engine/model_residency.h"
#include "offload/plan/prefetch_scheduler.h"

namespace sluice::offload {

class ForwardPass {
 public:
  ForwardPass(ModelResidency& residency, ModelBudget& budget, ForwardRecorder& recorder);
  // A model was attached: a lease list per layer.
  void begin_model() {
    leases_.clear();
    leases_.resize(residency_.records().size());
  }

  // begin_forward() inside an explicit forward: counted, the forward goes on (true).
  bool nest();
  // Opens a forward of `kind`; `implicit`: opened by an acquire outside any forward (it
  // ends at the next begin). Nested explicit calls count once.
  void open(std::string_view kind, bool implicit);
  // What the engine does after a forward closed.
  struct Ended {
    bool closed = false;           // false: a nested end, or no forward was open
    bool explicit_forward = false;
    bool aborted = false;
    uint64_t nested_seen = 0;      // the most held beyond the plan at once (Note [upcast scratch])
  };
  Ended end(bool aborted);
  // After end(): what a first forward of its kind used beyond the ledger (Note [measured
  // working memory]); none when it was not measured or `aborted` (measured again then).
  // Read after the plan follows the forward's nesting, as the device is then.
  std::optional<WorkingMeasure> take_working_measure(bool aborted);
  // `stored`: the weights as stored, not upcast (WeightLease::Form::stored).
  LayerWeights acquire(ManagedLayerImpl& layer, bool stored = false);
  void release(ManagedLayerImpl& layer) noexcept;
  // After a forward: prefetches for the next one, from the start of the recorded order.
  void top_up_for_next();

  // InvalidArgument naming `what` while a lease is open or an explicit forward runs.
  void require_idle(const char* what) const;
  bool in_forward() const { return depth_ > 0; }
  bool in_implicit_forward() const { return depth_ > 0 && implicit_; }
  // PlanObserver's calls, through the engine.
  void plan_changing() noexcept { recorder_.next() = ForwardAcc{}; }
  void ring_dropped() noexcept { sched_.reset_frontier(); }
  void streamed_changed();
  // The model was detached: leases, scheduler and events go (counters stay).
  void clear() noexcept;

  using LayerProgressFn = std::function<void(int64_t done, int64_t expected)>;
  void set_layer_progress(LayerProgressFn fn) { layer_progress_ = std::move(fn); }
  std::exception_ptr take_interrupt() { return std::exchange(interrupt_, nullptr); }

  uint64_t forwards() const { return forwards_; }
  const std::string& last_kind() const { return last_kind_; }
  uint64_t mismatched_forwards() const { return mismatched_; }
  const BounceRing* bounce() const { return bounce_.get(); }

 private:
  struct Lease {
    int slot = -1;     // staging slot read, -1 for resident layers
    int scratch = -1;  // scratch buffer written, -1 when no upcast
    std::unique_ptr<DeviceEvent> start;  // compute start marker (trace only)
    std::array<at::Tensor, 3> reads;     // device tensors the lease reads (slot, or resident w/b/s)
    at::Tensor written;                  // scratch buffer the upcast writes
  };

  // The slot holding layer `id` for this forward, its copy waited for on the compute stream.
  int read_streamed(int64_t id, size_t pos);
  void top_up(size_t pos, bool at_end);
  PrefetchScheduler::Offer offer(int64_t id, uint64_t epoch, uint32_t occurrence);
  int issue(int64_t id, uint64_t epoch, uint32_t occurrence, bool demand);
  BounceRing* bounce_for(const std::vector<SlotPart>& parts);  // the bounce ring when a part is pageable
  size_t bounce_limit() const;  // the most slots it grows to (Note [bounce ring sizing])
  void end_lease(Lease& lease) noexcept;  // ends a lease's accesses, records its uses, frees its slot and scratch
  void warn_mismatch(const ForwardRecord& rec, uint64_t expected);

  ModelResidency& residency_;
  ModelBudget& budget_;
  ForwardRecorder& recorder_;
  DeviceBackend& device_;
  const EngineOptions& options_;
  std::vector<std::vector<Lease>> leases_;  // open leases of each layer, indexed like the records
  int depth_ = 0;                // nesting of begin_forward()
  bool implicit_ = false;        // the open forward was opened by an acquire
  uint64_t epoch_ = 0;           // current forward number (copies are tagged with it)
  uint64_t forwards_ = 0;
  std::string kind_;
  std::string last_kind_;
  PrefetchScheduler sched_;
  size_t last_pos_ = PrefetchScheduler::kNone;  // recorded position of the latest acquire
  std::vector<at::Tensor> sidecars_;            // the live LoRA sidecars the open forward reads
  uint64_t nested_seen_ = 0;     // the most leases beyond the plan held at once in this forward
  bool nested_flag_ = false;     // this acquire made a buffer beyond the plan
  std::unique_ptr<BounceRing> bounce_;  // made at the first copy from pageable memory
  uint64_t last_stream_ = 0;               // compute stream of the last forward
  std::unique_ptr<DeviceEvent> last_end_;  // recorded on it at that forward's end
  LayerProgressFn layer_progress_;
  std::exception_ptr interrupt_;  // an Interrupted from layer_progress_, raised by the next acquire()
  int64_t released_ = 0;          // leases released in the open forward (for layer_progress_)
  uint64_t mismatched_ = 0;       // forwards whose streamed bytes were not the streamed layers' bytes
  uint64_t loaded_before_ = 0;    // residency bytes made resident up to the last forward (ForwardRecord::bytes_loaded)
  bool waste_warned_ = false;
  bool diverge_logged_ = false;  // the first forward off its recorded order was logged
  // See Note [measured working memory] in model_budget.h.
  std::unordered_set<std::string> measured_kinds_;
  bool measuring_ = false;         // the open forward is measured
  int64_t measure_base_ = 0;       // the backend ledger's bytes at its start
  int64_t measure_base_peak_ = 0;  // and its peak
};

}  // namespace sluice::offload
