#include "offload/plan/cost_model.h"

#include <algorithm>
#include <cmath>

#include "offload/plan/residency_plan.h"
#include "runtime/error.h"

namespace sluice::offload {

namespace {

bool finite_nonnegative(double x) { return std::isfinite(x) && x >= 0; }

// How many forwards the simulation runs: two warm-ups, then the one it reports. The first
// forward starts with an empty ring; the second starts with the first's wrap-around copies
// already under way, like every later one, so the third is the steady state.
constexpr int kForwards = 3;

}  // namespace

bool CostModel::usable() const {
  if (!(std::isfinite(copy_gbps) && copy_gbps > 0) || !finite_nonnegative(copy_overhead_ms)) return false;
  if (kinds.empty()) return false;
  double total_weight = 0;
  for (const auto& k : kinds) {
    if (k.order.size() != k.compute_ms.size() || !finite_nonnegative(k.weight)) return false;
    if (!std::all_of(k.compute_ms.begin(), k.compute_ms.end(), finite_nonnegative)) return false;
    total_weight += k.weight;
  }
  return total_weight > 0 && std::isfinite(total_weight);
}

KindPrediction predict_kind(const KindProfile& kind, const std::vector<PlanLayer>& layers,
                            const std::vector<bool>& resident, const CostModel& model, uint64_t ring_bytes,
                            uint32_t max_ahead) {
  const std::string what = "cost model: kind '" + kind.kind + "'";
  if (resident.size() != layers.size()) {
    throw InvalidArgument(what + ": residency of " + std::to_string(resident.size()) + " layers for " +
                          std::to_string(layers.size()));
  }
  if (kind.order.size() != kind.compute_ms.size()) {
    throw InvalidArgument(what + ": " + std::to_string(kind.compute_ms.size()) + " compute times for " +
                          std::to_string(kind.order.size()) + " positions");
  }
  const size_t n = kind.order.size();
  KindPrediction out;
  out.kind = kind.kind;

  // Per position: compute time and, for streamed ones, copy time and slot bytes.
  std::vector<double> copy_ms(n, 0.0);
  std::vector<uint64_t> slot(n, 0);
  std::vector<bool> streamed(n, false);
  size_t streamed_per_forward = 0;
  for (size_t i = 0; i < n; ++i) {
    const size_t id = kind.order[i];
    if (id >= layers.size()) {
      throw InvalidArgument(what + ": position " + std::to_string(i) + " names layer " + std::to_string(id) +
                            " of " + std::to_string(layers.size()));
    }
    if (!finite_nonnegative(kind.compute_ms[i])) {
      throw InvalidArgument(what + ": compute time " + std::to_string(kind.compute_ms[i]) + " ms at position " +
                            std::to_string(i) + " is not a finite number >= 0");
    }
    out.compute_ms += kind.compute_ms[i];
    if (resident[id]) continue;
    if (!(std::isfinite(model.copy_gbps) && model.copy_gbps > 0) || !finite_nonnegative(model.copy_overhead_ms)) {
      throw InvalidArgument(what + ": layers stream but the copy rate is " + std::to_string(model.copy_gbps) +
                            " GB/s and the overhead " + std::to_string(model.copy_overhead_ms) + " ms");
    }
    streamed[i] = true;
    slot[i] = layers[id].slot_size();
    // bytes / (GB/s): 1 GB/s moves 1e9 bytes per s = 1e6 bytes per ms.
    copy_ms[i] = static_cast<double>(slot[i]) / (model.copy_gbps * 1e6) + model.copy_overhead_ms;
    out.copy_ms += copy_ms[i];
    ++streamed_per_forward;
  }
  out.floor_ms = std::max(out.compute_ms, out.copy_ms);
  if (n == 0) return out;

  // Global positions g = f * n + i over the simulated forwards; streamed positions are
  // numbered k = 0, 1, ... in the same order (the copy stream's order).
  const size_t total = kForwards * n;
  std::vector<double> compute_end(total, 0.0);
  std::vector<size_t> streamed_pos;    // k -> g
  streamed_pos.reserve(kForwards * streamed_per_forward);
  // acquired(g): when position g is acquired, i.e. its predecessor's compute has ended.
  auto acquired = [&](size_t g) { return g == 0 ? 0.0 : compute_end[g - 1]; };

  double copy_free = 0;    // the copy stream is idle from then on
  size_t oldest = 0;       // the oldest streamed position that may still hold its slot
  uint64_t held = 0;       // slot bytes of streamed positions oldest..k-1
  double prev_end = 0;     // compute of the previous position ends
  for (size_t g = 0; g < total; ++g) {
    const size_t i = g % n;
    double start = prev_end;
    if (streamed[i]) {
      const size_t k = streamed_pos.size();
      streamed_pos.push_back(g);
      double copy_start = copy_free;
      // Ring room: drop the oldest held slots, each free once its compute ends (computes
      // end in order, so the last one dropped is the one to wait for), until this slot
      // fits; a slot larger than the ring waits for an empty ring.
      while (oldest < k && held + slot[i] > ring_bytes) {
        copy_start = std::max(copy_start, compute_end[streamed_pos[oldest]]);
        held -= slot[streamed_pos[oldest] % n];
        ++oldest;
      }
      held += slot[i];
      // At most max_ahead streamed positions ahead of the one computing now.
      if (max_ahead != kPrefetchAuto && k >= max_ahead) {
        copy_start = std::max(copy_start, acquired(streamed_pos[k - max_ahead]));
      }
      // Less than a full forward ahead: position i of the previous forward has computed.
      if (g >= n) copy_start = std::max(copy_start, compute_end[g - n]);
      copy_free = copy_start + copy_ms[i];
      start = std::max(start, copy_free);
    }
    prev_end = compute_end[g] = start + kind.compute_ms[i];
  }
  static_assert(kForwards >= 2, "the steady state needs a forward before it");
  out.step_ms = compute_end[total - 1] - compute_end[total - n - 1];
  out.stall_ms = std::max(0.0, out.step_ms - out.compute_ms);
  return out;
}

std::vector<KindPrediction> predict(const std::vector<PlanLayer>& layers, const std::vector<bool>& resident,
                                    const CostModel& model, uint64_t ring_bytes, uint32_t max_ahead) {
  std::vector<KindPrediction> out;
  out.reserve(model.kinds.size());
  for (const auto& k : model.kinds) out.push_back(predict_kind(k, layers, resident, model, ring_bytes, max_ahead));
  return out;
}

double weighted_step_ms(const std::vector<KindPrediction>& predictions, const CostModel& model) {
  if (predictions.size() != model.kinds.size()) {
    throw InvalidArgument("cost model: " + std::to_string(predictions.size()) + " predictions for " +
                          std::to_string(model.kinds.size()) + " kinds");
  }
  double sum = 0;
  for (size_t i = 0; i < predictions.size(); ++i) sum += model.kinds[i].weight * predictions[i].step_ms;
  return sum;
}

}  // namespace sluice::offload
