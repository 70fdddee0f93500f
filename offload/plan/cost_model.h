#pragma once
// The cost model of a streamed forward: what the residency planner minimises
// (residency_plan.h, ResidencyPolicy::balanced) and what the engine reports as the
// predicted step beside the measured one.
//
// Note [cost model]
// ~~~~~~~~~~~~~~~~~
// A forward is the recorded acquire order of its kind (Note [prefetch order]). Position i
// computes for compute_ms[i]: the device time from layer i's acquire to the next acquire,
// with waits for copies taken out (so the attention between two projections belongs to the
// projection before it, and the upcast to its own layer). A streamed layer's copy takes
// slot_size / (copy_gbps * 1e6) ms (copy_gbps in GB/s, 1 GB = 1e9 bytes, so 1 GB/s is one
// byte per ns) plus copy_overhead_ms on the one copy stream, in the recorded order,
// wrapping around into the next forward of the same kind. A layer that appears at several
// positions (called twice) is copied once per position, each copy with its own slot: the
// ring keeps no layer between its uses. A copy starts when
//  - the copy stream is free (copies are serial),
//  - the staging ring has room: the slots of layers whose copy has started and whose
//    compute has not ended, plus this one, fit in ring_bytes (a layer holds its slot from
//    its copy's start until its compute ends); a slot larger than the whole ring is still
//    copied, alone, once the ring is empty,
//  - it is at most max_ahead streamed positions ahead of the position computing now: the
//    copy of the k-th streamed position may start once the (k - max_ahead)-th streamed
//    position has been acquired (its predecessor's compute has ended), which is when the
//    prefetcher offers it; max_ahead 0 copies on demand, at the position's own acquire,
//  - and it is less than one full forward ahead: position i of forward f+1 is offered only
//    once position i of forward f has computed (Note [prefetch order]).
// Compute of position i starts when position i-1's compute has ended and, when i is
// streamed, when its copy has ended (the difference is a stall). The predicted step is the
// steady state: the duration of a forward after two warm-up forwards of the same kind.
// The floor is max(sum of compute_ms, sum of streamed copy times): no plan beats it.
// Every constraint refers to an earlier position, so one pass in order simulates it, and
// the ring's oldest held slot only moves forward: O(positions) per forward.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace sluice::offload {

struct PlanLayer;

// No bound on how many streamed layers the prefetcher runs ahead (only the ring's bytes).
constexpr uint32_t kPrefetchAuto = std::numeric_limits<uint32_t>::max();

// One forward kind as measured ("dit", "adapter").
struct KindProfile {
  std::string kind;
  std::vector<size_t> order;       // indices into the plan's layers, in acquire order
  std::vector<double> compute_ms;  // per position of `order`, see Note [cost model]
  double weight = 1;               // how often this kind runs, relative to the others
};

struct CostModel {
  std::vector<KindProfile> kinds;
  double copy_gbps = 0;         // host->device rate of streamed copies, GB/s (bytes per ns)
  double copy_overhead_ms = 0;  // fixed cost per copy
  // A finite copy rate > 0, a finite overhead >= 0, and at least one kind, every kind with
  // as many compute times as positions, each finite and >= 0, and a finite weight >= 0
  // (not all zero). False rather than an error: the planner then plans without costs.
  bool usable() const;
};

struct KindPrediction {
  std::string kind;
  double step_ms = 0;     // predicted steady-state forward
  double floor_ms = 0;    // max(compute_ms, copy_ms)
  double compute_ms = 0;  // sum of compute_ms
  double copy_ms = 0;     // streamed copies of one forward
  double stall_ms = 0;    // step_ms - compute_ms
};

// Predicted steady-state forward of `kind` with layers[i] resident where resident[i], the
// ring holding `ring_bytes` (see Note [cost model] for slots larger than that). Throws
// InvalidArgument for an order index outside `layers`, a `resident` of another length,
// mismatched or negative/NaN compute times, or a bad copy rate when something streams.
KindPrediction predict_kind(const KindProfile& kind, const std::vector<PlanLayer>& layers,
                            const std::vector<bool>& resident, const CostModel& model, uint64_t ring_bytes,
                            uint32_t max_ahead = kPrefetchAuto);

// Every kind of `model`; the weighted sum of step_ms is what the balanced plan minimises.
std::vector<KindPrediction> predict(const std::vector<PlanLayer>& layers, const std::vector<bool>& resident,
                                    const CostModel& model, uint64_t ring_bytes, uint32_t max_ahead = kPrefetchAuto);

// The weighted sum of step_ms over `predictions` (those of predict(..., model, ...)), each
// kind by its KindProfile::weight.
double weighted_step_ms(const std::vector<KindPrediction>& predictions, const CostModel& model);

}  // namespace sluice::offload
