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
// slot_size / copy_gbps plus copy_overhead_ms on the one copy stream, in the recorded order,
// wrapping around into the next forward of the same kind. A copy starts when
//  - the copy stream is free (copies are serial),
//  - the staging ring has room: the slots of layers whose copy has started and whose
//    compute has not ended, plus this one, fit in ring_bytes (a layer holds its slot from
//    its copy's start until its compute ends), and
//  - it is at most max_ahead streamed positions ahead of the position computing now.
// Compute of position i starts when position i-1's compute has ended and, when i is
// streamed, when its copy has ended (the difference is a stall). The predicted step is the
// steady state: the duration of a forward after two warm-up forwards of the same kind.
// The floor is max(sum of compute_ms, sum of streamed copy times): no plan beats it.
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
  // A copy rate and at least one kind whose order and compute times agree in length.
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

// Predicted steady-state forward of `kind` with layers[i] resident where resident[i].
// `ring_bytes` must hold the largest streamed slot (PlanLayer::slot_size()).
KindPrediction predict_kind(const KindProfile& kind, const std::vector<PlanLayer>& layers,
                            const std::vector<bool>& resident, const CostModel& model, uint64_t ring_bytes,
                            uint32_t max_ahead = kPrefetchAuto);

// Every kind of `model`; the weighted sum of step_ms is what the balanced plan minimises.
std::vector<KindPrediction> predict(const std::vector<PlanLayer>& layers, const std::vector<bool>& resident,
                                    const CostModel& model, uint64_t ring_bytes, uint32_t max_ahead = kPrefetchAuto);

}  // namespace sluice::offload
