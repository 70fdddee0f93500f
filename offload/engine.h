#pragma once
// StreamingEngine: the WeightProvider that runs a model under a device-memory budget.
//
// attach() plans which managed layers stay resident on the device (residency_plan.h) and
// moves the other parameters and buffers (norms, RoPE tables) to the device. The plan is
// applied, at attach and at every residency change, by the ResidencyApplier
// (residency_applier.h, Note [residency applier]): it copies the resident layers there
// (host->device only) and keeps streamed layers on the host, pinned when allowed (in the
// pinned arena, Note [pinned arena] in pinned_arena.h); the
// engine keeps the per-layer records (layer_record.h), makes the staging ring for what
// streams and logs the result. During a forward each layer's WeightLease calls acquire()/release():
//  - resident layer: upcast its stored tensors on the device into a scratch buffer;
//  - streamed layer: its stored bytes are copied into a staging slot on the copy stream
//    (prefetched ahead of use, see Note [prefetch order]); compute waits on the copy's
//    event, upcasts from the slot, and release() records the event that lets the slot be
//    overwritten (Note [staging ring sizing]).
// Registered parameters always hold the stored dtype. Weights never go device->host: the
// host copy of every layer is kept in RAM for as long as the model is attached, so
// unloading only drops device copies. Pinned host copies stay pinned after a detach (they
// are the model's host weights until it leaves RAM): neither a detach nor a re-attach
// copies anything on the host.
//
// Prefetching follows the recorded acquire order of each forward kind (Note [prefetch
// order] in prefetch_scheduler.h) and runs ahead as far as the staging ring's bytes allow
// (Note [staging ring]). Copies belong to the forward that reads them: each streamed layer
// is copied once per forward, unless a forward calls a layer twice and its slot was reused
// in between, or diverges from the order, or a prefetch was dropped (a replan, a forward of
// another kind). Such a copy is counted as wasted (stats: wasted_prefetch_*), with one
// warning: it costs bytes on the bus, never correctness.
//
// Note [engine faults]
// ~~~~~~~~~~~~~~~~~~~~
// What the engine does when the device or the host fails it (each case has a test in
// tests/test_faults.cpp, driven by the fault points of runtime/fault_injection.h):
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
// allocated (Note [device accounting] in device.h), and the plan leaves room for it, so
// that the minimum budget and every residency change account for it:
//  - LoRA sidecars are placed through place_sidecars() (the SidecarPlacer a LoraScope is
//    given): the plan first streams more layers until the sidecars fit beside the resident
//    ones, then they are allocated as MemoryKind::lora. Sidecars that cannot fit even with
//    every streamable layer streamed give one ResourceError naming them and the bytes
//    missing. When they are dropped (sidecars_released) the plan grows back. (The model
//    cache grows a model's budget by their bytes in the same replan where it can, so that
//    nothing more streams: Note [sidecar share] in cache/model_cache.h.) Their copies
//    are done before place_sidecars() returns (FENCE(F9)); every forward declares them as
//    compute reads (begin_access, so the strict device checks that order) and records its
//    use of them (FENCE(F10)), as it does for the parameters, the resident weights, the
//    staging slots and the upcast scratch. The model's inputs are the caller's tensors,
//    not allocations of the engine: the strict device does not track them.
//  - Upcasts write into the planned scratch buffer; the ATen fallback converts in place
//    (runtime/fp8.h aten_upcast_into), without a temporary of the layer's size.
//  - Leases nested beyond the plan (a module holding two layers' weights at once) need a
//    second scratch buffer or an overflow staging slot. Those are charged when made, and
//    the most a forward held at once is then reserved in every later plan (one warning),
//    so the minimum budget includes them from then on.
// The stats JSON device section reports the bytes by use (weight, ring, scratch, lora).
//
// Not thread-safe: one forward at a time, from one thread.
#include <torch/nn/module.h>

#include <chrono>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <array>
#include <regex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "offload/calibration.h"
#include "offload/device.h"
#include "offload/layer.h"
#include "offload/layer_record.h"
#include "offload/pinned_arena.h"
#include "offload/prefetch_scheduler.h"
#include "offload/residency_applier.h"
#include "offload/residency_plan.h"
#include "offload/staging_ring.h"
#include "offload/stats.h"
#include "offload/trace.h"

namespace sluice::offload {

// Page-locked host memory for streamed layers. auto_: on wherever the device's
// pins_memory() is true, which is every TorchDevice (CUDA and ROCm alike; see Note [pinned
// memory on ROCm] for ROCm stalls) and the strict CPU device; off on the plain CPU device.
enum class PinMode { auto_, on, off };
// "auto" | "on" | "off"; throws InvalidArgument naming `flag`.
PinMode parse_pin_mode(std::string_view text, const std::string& flag = "--pin");

// Copies `device`'s allocator_stats() into the allocator fields of `stats`.
void set_allocator_stats(EngineStats& stats, const DeviceBackend& device);

struct EngineOptions {
  std::shared_ptr<DeviceBackend> device;       // where resident layers live; null: a CPU device
  uint64_t budget_bytes = 0;                   // device bytes for this model, working memory included; 0: all device memory
  uint64_t working_memory_bytes = 0;           // part of the budget left free for activations
  std::optional<double> max_resident;          // cap on resident streamable bytes, fraction 0..1; none: budget decides
  uint32_t prefetch_depth = kPrefetchAuto;     // most streamed layers copied ahead; auto: as far as the ring's bytes allow
  uint32_t ring_slots = 0;                     // the ring holds at least this many of the largest streamed layer;
                                               // 0: prefetch_depth + 1, or 3 with auto (Note [staging ring])
  ResidencyPolicy policy = ResidencyPolicy::balanced;  // see Note [residency policy] and Note [balanced plan]
  PinMode pin = PinMode::auto_;                // page-locked host copies of streamed layers
  std::shared_ptr<PinnedArena> pin_arena;      // where they are pinned, under its limit (the model cache shares one);
                                               // null: the engine's own, limited by pin_memory_limit
  std::optional<uint64_t> pin_memory_limit;    // the own arena's limit in bytes; none: default_pin_memory_limit()
  std::vector<std::string> required_patterns = {"^final_layer(\\.|$)"};  // regex search on layer names: always resident
  bool require_unconverted = false;            // true: layers stored in their compute dtype stay resident (they stream
                                               // like any other by default: the stored bytes are sent, no upcast)
  bool timing = true;                          // device-timed stall/upcast/copy stats (a few events per layer)
  bool plan_from_measurements = true;          // measure compute and copies and replan by them (Note [calibration]; needs timing)
  uint32_t bounce_slots = 4;                   // pinned bounce slots for pageable copies to start with; the ring grows
                                               // as far as Note [bounce ring sizing] says rather than wait on compute
  uint64_t bounce_slot_bytes = uint64_t{8} << 20;
  bool trace = false;                          // record per-layer spans for trace() (implies timing)
  size_t max_forward_records = 1024;           // per-forward records kept in stats()
  bool log_attach = true;                      // INFO "Loaded model ..." and residency lines at attach (the model cache logs its own)
  bool grow_working_memory = true;             // grow working_memory_bytes to what forwards measure (Note [measured
                                               // working memory]); the model cache grows its own instead
};

// Device bytes a model needs under an engine's options, known before attaching it (the
// model cache sizes its share of a shared budget with it). Working memory excluded.
struct WeightNeeds {
  uint64_t model_bytes = 0;  // stored bytes of every parameter and buffer (the host copy)
  uint64_t minimum = 0;      // smallest weight budget the model attaches under
  uint64_t full = 0;         // every layer resident (plus upcast scratch): what full_load() needs
  uint64_t wanted = 0;       // what the plan takes with no budget limit: `full`, or less under max_resident
};

class StreamingEngine final : public WeightProvider, public SidecarPlacer {
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
  bool attached() const { return attached_; }

  // WeightProvider. The returned tensors are valid until release(); they may be views of
  // a staging slot or of a scratch buffer that the next layer reuses.
  LayerWeights acquire(ManagedLayerImpl& layer) override;
  void release(ManagedLayerImpl& layer) noexcept override;

  // SidecarPlacer (Note [device extras]). Between forwards only (InvalidArgument during one);
  // ResourceError naming `what` and the bytes missing when the sidecars cannot fit.
  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what) override;
  void sidecars_released(uint64_t bytes) noexcept override;
  // The same with the budget grown by `grow_budget` bytes in the same replan (the model
  // cache grows a model's share for its sidecars: Note [sidecar share] in
  // cache/model_cache.h), so that the resident layers stay as they are when it grows by the
  // sidecars' bytes. When it throws, the budget is as it was.
  std::vector<at::Tensor> place_sidecars(const std::vector<at::Tensor>& host, const std::vector<at::ScalarType>& dtypes,
                                         const std::string& what, uint64_t grow_budget);
  // sidecars_released with the budget shrunk by `shrink_budget` bytes in the same replan;
  // returns the bytes it shrank (0 when that replan failed and the budget stayed, with one
  // warning).
  uint64_t sidecars_released(uint64_t bytes, uint64_t shrink_budget) noexcept;
  // Device bytes of the sidecars placed now, and reserved for nested leases.
  uint64_t sidecar_bytes() const { return lora_bytes_; }
  // Note [measured working memory]: the most a first forward of a kind used beyond the
  // ledger (none before one was measured), and the working memory now.
  std::optional<uint64_t> measured_working_memory() const {
    return measured_any_ ? std::optional<uint64_t>(measured_working_) : std::nullopt;
  }
  uint64_t working_memory() const { return options_.working_memory_bytes; }
  const std::string& last_forward_kind() const { return last_kind_name_; }
  uint64_t nested_reserve_bytes() const { return nested_reserve_; }

  // Delimit one forward (for per-forward stats, the recorded order and wrap-around
  // prefetch). `kind` names the forward's type ("dit", "adapter"): each kind has its own
  // recorded order. Nested calls count once. Acquires outside any forward open an implicit
  // one that ends at the next begin_forward().
  void begin_forward(std::string_view kind = "");
  // Throws (after closing the forward) if an engine invariant broke during it.
  void end_forward(bool aborted = false);
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
  using LayerProgressFn = std::function<void(int64_t done, int64_t expected)>;
  void set_layer_progress(LayerProgressFn fn) { layer_progress_ = std::move(fn); }
  // The Interrupted a layer callback threw in this forward and no acquire() rethrew yet
  // (null when none); cleared. A new forward starts with none.
  std::exception_ptr take_interrupt() { return std::exchange(interrupt_, nullptr); }
  // As end_forward(), for destructors: an error is logged and rethrown by the next acquire().
  void end_forward_noexcept(bool aborted) noexcept;

  // Residency changes between forwards (InvalidArgument while leases are open). Each
  // replans under a changed device limit and returns the change in device bytes the engine
  // holds (exact, from the accounting). Never copies device->host.
  int64_t partial_load(uint64_t bytes);    // let the engine use up to `bytes` more
  int64_t partial_unload(uint64_t bytes);  // free at least `bytes` (down to the minimum)
  int64_t full_load();                     // every layer resident; ResourceError if it does not fit
  int64_t full_unload();                   // the minimum: required layers, ring, scratch
  // New budget (working memory unchanged); replans. ResourceError if too small. A lower
  // budget gives the memory it freed back to the driver (DeviceBackend::release_cached_memory)
  // unless `release_freed` is false (the model cache releases once per budget cut itself).
  void set_budget(uint64_t budget_bytes, bool release_freed = true);
  // New cap on resident streamable bytes (fraction 0..1, nullopt: none); replans under the
  // current limit (or only kept for the next attach when detached). InvalidArgument for
  // a fraction outside 0..1.
  void set_max_resident(std::optional<double> max_resident);

  // WeightNeeds of `model` under `options`, without attaching or allocating anything
  // (sizes only: the model may be attached to an engine meanwhile).
  static WeightNeeds needs(torch::nn::Module& model, const EngineOptions& options);

  const ResidencyPlan& plan() const { return plan_; }
  bool is_resident(const std::string& layer_name) const;
  // Smallest budget (working memory included) the attached model runs under.
  uint64_t minimum_budget() const;
  // Device bytes the engine holds now (resident + params + ring + scratch), the ring at its
  // capacity (a reservation, Note [staging ring]).
  uint64_t device_bytes() const;
  // Of which allocated on the device now: the ring's slots made so far instead of its capacity.
  uint64_t device_allocated_bytes() const;
  // Page-locked bytes holding the attached model's pinned host copies beyond their own
  // bytes (the pinned arena's alignment padding): what pinning adds to its host RAM.
  uint64_t pinned_padding_bytes() const {
    return applier_->pinned_bytes() - static_cast<uint64_t>(applier_->pinned().current);
  }
  // Note [non-finite values] (runtime/nonfinite.h): what a forward re-run with a per-layer
  // check found, kept for stats (EngineStats::nonfinite, counted in nonfinite_reruns).
  // Called after that forward ended: its index is the last forward's, which it returns.
  uint64_t record_nonfinite(NonFiniteRecord record) {
    record.forward = forwards_ ? forwards_ - 1 : 0;
    nonfinite_ = std::move(record);
    ++nonfinite_reruns_;
    return nonfinite_->forward;
  }

  // A snapshot. `wait`: resolve every outstanding timing first (waits for the device to
  // finish the last forward); otherwise only forwards the device has finished are in
  // forward_records (`forwards` counts them all).
  EngineStats stats(bool wait = true);
  // Spans recorded with options.trace (resolved like stats()).
  TraceWriter& trace();
  DeviceBackend& device() { return *device_; }
  const EngineOptions& options() const { return options_; }

 private:
  struct Lease {
    int slot = -1;     // staging slot read, -1 for resident layers
    int scratch = -1;  // scratch buffer written, -1 when no upcast
    std::unique_ptr<DeviceEvent> start;  // compute start marker (trace only)
    std::array<at::Tensor, 3> reads;     // device tensors the lease reads (slot, or resident w/b/s)
    at::Tensor written;                  // scratch buffer the upcast writes
  };
  struct ExtraRec {
    at::Tensor handle;  // the module's tensor (same impl), re-pointed in place (repoint.h)
    at::Tensor host;
    at::Tensor dev;
  };
  struct Anchor {
    std::unique_ptr<DeviceEvent> event;  // recorded on the compute stream
    double host_us = 0;                  // host time it was recorded, since trace epoch
  };
  struct Span {
    TraceTrack track;
    int kind;  // 0 copy, 1 stall, 2 upcast, 3 compute
    int64_t layer;
    bool resident;  // the layer's residency when the work was issued (for the trace)
    std::unique_ptr<DeviceEvent> a, b;
    std::shared_ptr<Anchor> anchor;
  };
  struct ForwardAcc {
    uint64_t bytes = 0, copies = 0, demand = 0, stalls = 0;
    std::vector<Span> spans;
    // Measured in detail (Note [calibration]): per acquire, its layer, an event before its
    // copy wait, and the index of its stall span in `spans` (-1: none).
    bool detail = false;
    std::vector<int64_t> ids;
    std::vector<std::unique_ptr<DeviceEvent>> marks;
    std::vector<int> stall_span;
  };
  struct Unresolved {
    ForwardRecord record;
    std::vector<Span> spans;
    bool detail = false;    // begun as a forward measured in detail
    bool complete = false;  // not aborted, in the recorded order: its measurements count
    std::vector<int64_t> ids;
    std::vector<std::unique_ptr<DeviceEvent>> marks;
    std::vector<int> stall_span;
    std::shared_ptr<Anchor> begin;
    std::unique_ptr<DeviceEvent> end;
  };
  struct Scratch {
    at::Tensor buffer;
    bool in_use = false;
  };

  std::vector<std::regex> required_regexes() const;
  // Fills layers_, index_, extras_ and the byte totals from `model` (reads only);
  // `check_host`: refuse tensors that are not on the host (attach).
  void collect(torch::nn::Module& model, const std::vector<std::regex>& required, bool check_host);
  void clear_state() noexcept;
  void restore_to_host() noexcept;
  PlanInput plan_input(uint64_t weight_budget, std::optional<double> max_resident) const;
  uint64_t weight_budget_of(uint64_t budget) const;
  // Device bytes beside the weights and the ring that every plan leaves room for: the
  // upcast scratch, the nested-lease reserve and the LoRA sidecars (Note [device extras]).
  uint64_t reserved_bytes() const { return scratch_bytes_ + nested_reserve_ + lora_bytes_; }
  void note_nesting();     // the most this lease holds beyond the plan
  void reserve_nesting();  // after a forward that held more than nested_reserve_: replan with it
  void apply_plan(const ResidencyPlan& plan);  // through applier_, then the ring and the scheduler
  void plan_from_layers();               // plan_'s residency and sizes from the layers as they are
  void ensure_ring();                    // a ring for plan_ if there is none (ResourceError if it does not fit)
  void make_ring(uint64_t capacity);     // a new ring with its first slots made (ResourceError if it does not fit)
  // `release_freed`: a budget cut, whose freed device memory goes back to the driver
  // (Note [releasing cached memory]).
  int64_t replan(uint64_t weight_budget, std::optional<double> max_resident, bool release_freed = false);
  void planned();              // tells the calibrator what plan_ predicts (Note [calibration])
  void replan_if_measured();   // between forwards: a plan from new measurements, when due
  void require_idle(const char* what) const;
  void open_forward(std::string_view kind, bool implicit);
  void refresh_streamed();  // tells the scheduler which layers stream now
  void top_up(size_t pos, bool at_end);
  PrefetchScheduler::Offer offer(int64_t id, uint64_t epoch);
  int issue(int64_t id, uint64_t epoch, bool demand);
  void retire_ring();  // drops the ring, counting its unread copies as wasted
  int take_scratch(uint64_t bytes);
  BounceRing* bounce_for(const std::vector<SlotPart>& parts);  // the bounce ring when a part is pageable
  size_t bounce_limit() const;  // the most slots it grows to (Note [bounce ring sizing])
  std::unique_ptr<DeviceEvent> take_event();  // from the pool of finished events
  std::unique_ptr<DeviceEvent> mark();        // take_event() recorded on the compute stream
  void add_span(ForwardAcc& acc, TraceTrack track, int kind, int64_t layer, std::unique_ptr<DeviceEvent> a,
                std::unique_ptr<DeviceEvent> b);
  void resolve(bool wait_all);
  void end_lease(Lease& lease) noexcept;  // ends a lease's accesses, records its uses, frees its slot and scratch
  // A compute-stream wait for a copy shorter than this is no stall (two events around a
  // wait that had nothing to wait for read a few microseconds).
  static constexpr double kStallMs = 0.02;
  void check_invariants(const char* where);
  double now_us() const;
  double trace_us(const DeviceEvent& e) const;
  bool timing() const { return options_.timing || options_.trace; }

  EngineOptions options_;
  std::shared_ptr<DeviceBackend> device_;
  std::shared_ptr<MemoryLedger> budget_;  // what this engine holds on the device, limited
  bool attached_ = false;
  std::string model_name_;
  std::vector<LayerRecord> layers_;
  std::vector<std::vector<Lease>> leases_;  // open leases of each layer, indexed like layers_
  std::unordered_map<const ManagedLayerImpl*, int64_t> index_;
  std::vector<ExtraRec> extras_;
  uint64_t extra_bytes_ = 0;
  uint64_t scratch_bytes_ = 0;
  uint64_t lora_bytes_ = 0;        // sidecars placed through place_sidecars()
  // The sidecars placed, without keeping them alive: every forward declares them as compute
  // reads (begin_access) and records its use of them, like the parameters.
  std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> sidecars_;
  std::vector<at::Tensor> forward_sidecars_;  // the live ones the open forward reads
  uint64_t nested_reserve_ = 0;    // room every plan leaves for nested leases (Note [device extras])
  uint64_t nested_seen_ = 0;       // the most leases beyond the plan held at once in this forward
  bool nested_warned_ = false;
  bool nested_flag_ = false;       // this acquire made a buffer beyond the plan
  uint64_t budget_bytes_ = 0;
  uint64_t weight_budget_ = 0;  // current limit: budget - working memory, or less after partial_unload
  std::optional<double> max_resident_;
  ResidencyPlan plan_;
  std::unique_ptr<StagingRing> ring_;
  std::unique_ptr<BounceRing> bounce_;  // made at the first copy from pageable memory
  std::vector<Scratch> scratch_;
  uint64_t ring_violations_ = 0;  // from rings already dropped
  uint64_t wasted_copies_ = 0, wasted_bytes_ = 0;  // from rings already dropped
  uint64_t nonfinite_reruns_ = 0;
  std::optional<NonFiniteRecord> nonfinite_;
  uint64_t mismatched_forwards_ = 0;  // forwards whose streamed bytes were not the streamed layers' bytes
  bool waste_warned_ = false;

  // Residency moves and pinning (lives as long as the engine: its counters and warnings
  // span attaches).
  std::unique_ptr<ResidencyApplier> applier_;

  // Forwards.
  int depth_ = 0;                // nesting of begin_forward()
  bool implicit_ = false;        // the open forward was opened by an acquire
  uint64_t epoch_ = 0;           // current forward number (copies are tagged with it)
  uint64_t forwards_ = 0;
  std::string kind_name_;
  std::string last_kind_name_;
  PrefetchScheduler sched_;
  size_t last_pos_ = PrefetchScheduler::kNone;  // recorded position of the latest acquire
  Calibrator calib_;
  ForwardAcc acc_cur_, acc_next_;
  std::shared_ptr<Anchor> anchor_;
  // Note [trace clock]: the first forward's anchor while tracing. Every span is placed at
  // its host time plus device time since it, so that forwards line up on the device's
  // clock: a host running ahead of its device (any GPU) records the next forward's anchor
  // before the device has finished the last forward.
  std::shared_ptr<Anchor> trace_origin_;
  uint64_t last_stream_ = 0;               // compute stream of the last forward
  std::unique_ptr<DeviceEvent> last_end_;  // recorded on it at that forward's end
  std::deque<Unresolved> unresolved_;
  std::deque<ForwardRecord> records_;
  std::vector<std::unique_ptr<DeviceEvent>> event_pool_;
  std::chrono::steady_clock::time_point epoch0_ = std::chrono::steady_clock::now();
  TraceWriter trace_;
  std::string deferred_error_;  // from end_forward_noexcept(), raised by the next acquire()
  LayerProgressFn layer_progress_;
  std::exception_ptr interrupt_;  // an Interrupted from layer_progress_, raised by the next acquire()
  // Note [measured working memory]
  std::unordered_set<std::string> measured_kinds_;
  bool measuring_ = false;       // the open forward is measured
  int64_t measure_base_ = 0;     // the backend ledger's bytes at its start
  int64_t measure_base_peak_ = 0;  // and its peak
  bool measured_any_ = false;
  uint64_t measured_working_ = 0;
  uint64_t working_grown_ = 0;
  void measure_working_memory(bool aborted);  // at the end of a measured forward
  int64_t released_ = 0;  // leases released in the open forward (for layer_progress_)
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
