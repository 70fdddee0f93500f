#pragma once
// Which managed layers stay on the device and which are streamed, under a byte budget.
// A plain data structure: planned once at attach and again on every residency change,
// printable, and tested on its own.
//
// Note [residency policy]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A budgeted forward costs at least max(compute time, streamed bytes / H2D bandwidth).
// Reaching that floor needs the copy stream busy whenever there is something left to
// copy. But the copy stream can run ahead of compute only as far as the staging ring's
// bytes allow (Note [staging ring]): once the ring is full it idles until compute frees a
// slot. So a long stretch of resident layers hides only a ring's worth of copies, and a
// long stretch of streamed layers runs at copy speed. Copies hide best when the streamed
// layers are spread as evenly as possible through the execution order, so that every
// streamed layer's copy runs under the compute of the resident layers just before it.
//
// `spread` therefore distributes residency at *layer* granularity, by bytes,
// with a Bresenham walk over the streamable layers in execution order: with a resident
// fraction f, layer i becomes resident when the resident bytes so far, plus half of its
// own, stay within f times the bytes seen so far. Choosing at block granularity (whole
// blocks resident, "RRSRRS") would leave the copy stream idle during each resident block
// once the ring is full and then make the streamed block wait on all of its copies; it
// only matches the layer-level plan with a ring as deep as a block. A first-fit pass then
// fills what the walk left of the budget. Streamed bytes, and so the floor, are the same
// for any plan that fills the budget; the spread only decides how close to it we get.
// spread and front_first size the ring at its minimum, `ring_slots` of the largest
// streamed slot. Compute per byte differs between layers (adaLN modulation runs on one
// token, attention sits on the output projection), which a byte spread cannot see:
// `balanced` (the default) plans by measured compute time, Note [balanced plan].
//
// `front_first` keeps whole blocks resident from the front of the execution order, like
// InvokeAI's partial load: blocks (and layers outside blocks) are taken in order until the
// first that does not fit in what the budget (and max_resident) leaves after the ring, and
// everything after it streams, even a later layer small enough to fit. The streamed layers
// then form one run at the end, the worst case for overlap. Its ring holds `ring_slots` of
// the largest streamed layer; only where the budget is too small for that ring (near the
// minimum) are the largest layers kept resident out of order to shrink it. Plans made again
// from measurements keep the policy. It is kept for comparison and for the benchmarks.
//
// Required layers (skip-listed unconverted modules, embeddings, the final layer) and the
// parameters outside managed layers (norms) are always resident.
//
// Note [balanced plan]
// ~~~~~~~~~~~~~~~~~~~~
// With measured costs (PlanInput::costs usable: per-kind acquire order and per-position
// compute times, the copy rate), `balanced` minimises the predicted step of
// Note [cost model], weighted over the kinds, by a joint search over the ring's byte
// capacity and the resident set. Both draw on the same budget: a larger ring lets copies
// run further ahead under long resident stretches, but leaves fewer bytes resident.
//  - As for spread, keeping the k largest layers resident shrinks the minimum ring; each k
//    at which the largest slot changes is tried.
//  - For each k, ring capacities from the minimum (`ring_slots` of the largest streamed
//    slot) upward in steps of x1.25, and 1..4 whole slots more, up to what the budget
//    leaves after required, scratch and the forced layers (and no more than every
//    candidate's slot together). The resident limit is the rest of the budget (and the
//    max_resident cap).
//  - For each ring, three resident sets: a compute-weighted spread, the byte spread and
//    first fit, each topped up by first fit. The compute-weighted spread is the Bresenham
//    walk of Note [residency policy] with compute time in place of bytes: with S bytes to
//    stream and W ms of compute (summed over each layer's positions, weighted across
//    kinds), a layer streams while the streamed bytes so far, half of its own included,
//    stay within S/W times the compute *before* it (its copy must end before it computes),
//    and is resident otherwise. Streamed bytes per compute-ms are then even through the
//    order, so the ring only absorbs the local unevenness.
//  - Every candidate is predicted (O(positions) each), and so are the spread, first-fit and
//    front_first plans of the same input. The plan is the smallest ring whose prediction
//    is within 1% of the best, and no worse than spread's, first fit's or front_first's (a
//    smaller ring is fewer device bytes held, for the same step); ties go to the better
//    prediction.
//  - That ring then gets headroom, up to 4x, from budget the resident set leaves unused
//    (under a max_resident cap or a roomy budget; never beyond the streamed layers'
//    slots): the model sees exact times, while real ones vary and copies are issued at
//    acquires and releases. On anima-medium at max_resident 0.5 (CPU device) the smallest
//    ring ran 1.20-1.30x its floor with 24-30 ms of stall; with the headroom, 0.2 ms.
// A few k values x up to ~20 rings x 3 sets: at most a few hundred predictions of three
// forwards each (137 for anima-2b's 454 layers), about 2 ms
// (tests/offload/plan/test_residency_plan.cpp and bench_predict report it).
// Without usable costs (at attach, before anything was measured) balanced plans as spread;
// the engine replans once it has measured a forward. Every policy fills plan.predictions
// when costs are usable.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "offload/plan/cost_model.h"

namespace sluice::offload {

// balanced: the default, see Note [balanced plan]; spread and front_first are kept for
// comparison and for the benchmarks.
enum class ResidencyPolicy { balanced, spread, front_first };

// "balanced" | "spread" | "front_first" (also "front-first"); throws InvalidArgument naming `flag`.
ResidencyPolicy parse_residency_policy(std::string_view text, const std::string& flag = "--policy");
const char* residency_policy_name(ResidencyPolicy policy);

// One managed layer as the planner sees it.
struct PlanLayer {
  std::string name;           // dotted module name
  uint64_t stored_bytes = 0;  // device bytes when resident
  uint64_t slot_bytes = 0;    // staging-slot bytes when streamed (packed, aligned); 0: stored_bytes
  std::string group;          // block family ("blocks", "llm_adapter.blocks"); empty outside blocks
  int64_t block = -1;         // block index within `group`; -1 outside blocks
  bool required = false;      // always resident

  uint64_t slot_size() const { return slot_bytes ? slot_bytes : stored_bytes; }
};

struct PlanInput {
  std::vector<PlanLayer> layers;           // in execution order
  uint64_t extra_required_bytes = 0;       // parameters/buffers outside managed layers
  uint64_t scratch_bytes = 0;              // upcast scratch kept on the device
  uint64_t weight_budget = 0;              // device bytes for everything above + resident + ring
  std::optional<double> max_resident;      // cap on resident streamable bytes, fraction 0..1
  ResidencyPolicy policy = ResidencyPolicy::balanced;  // see Note [residency policy]
  uint32_t ring_slots = 3;                 // the ring holds at least this many of the largest streamed slot
  uint32_t max_ahead = kPrefetchAuto;      // prefetch bound in streamed layers (the user's --prefetch)
  CostModel costs;                         // measured costs; balanced plans by them when usable()
};

struct ResidencyPlan {
  std::vector<PlanLayer> layers;   // as given
  std::vector<bool> resident;      // per layer
  ResidencyPolicy policy = ResidencyPolicy::balanced;
  uint64_t weight_budget = 0;
  uint64_t required_bytes = 0;     // required layers + extra_required_bytes
  uint64_t resident_bytes = 0;     // every weight byte on the device (required included)
  uint64_t streamed_bytes = 0;     // stored bytes of streamed layers
  uint64_t scratch_bytes = 0;
  uint32_t ring_slots = 0;         // the minimum the ring holds, in largest slots; 0 when nothing streams
  uint64_t slot_bytes = 0;         // largest streamed layer's slot size
  uint64_t ring_bytes = 0;         // the staging ring's capacity (>= ring_slots * slot_bytes); 0 when nothing streams
  // predict() of the plan under the input's costs, at ring_bytes and the input's max_ahead
  // (empty when the input had no usable CostModel).
  std::vector<KindPrediction> predictions;
  // What the plan puts on the device: weights + ring + scratch.
  uint64_t device_bytes() const { return resident_bytes + ring_bytes + scratch_bytes; }
  size_t streamed_count() const;

  // One char per block of each group, in block order: R (all resident), S (all streamed),
  // P (partly), then a summary of the layers outside blocks. E.g.
  // "blocks: RRSRRSRRS; other: 3 resident (2 required), 1 streamed".
  std::string residency_map() const;
  // The same per layer: for each group, one row per layer name within a block (its name
  // after "<group>.<block>."), one column per block, R or S ('.' where a block lacks the
  // layer), under a header of block numbers; then the layers outside blocks by name. E.g.
  //   blocks              0123
  //     self_attn.q_proj  RRSS
  //   other: R x_embedder.proj.1, S t_embedder.1.linear_1
  std::string residency_grid() const;
  // Multi-line description: totals, map, then one line per layer.
  std::string to_string() const;
};

// Smallest weight_budget for which plan_residency(input) succeeds (everything else in
// `input` as given).
uint64_t minimum_weight_budget(const PlanInput& input);

// Plans residency. Throws ResourceError naming the minimum weight budget (in MiB) when
// input.weight_budget is below it, InvalidArgument for a max_resident outside 0..1.
ResidencyPlan plan_residency(const PlanInput& input);

}  // namespace sluice::offload
