#include "offload/report/stats.h"

#include <nlohmann/json.hpp>

#include "runtime/record_json.h"

namespace sluice::offload {

namespace {

nlohmann::json ms_or_null(double v) { return v > 0 ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

const PlanKindStats* PlanStats::step() const {
  for (const auto& k : kinds) {
    if (k.kind == step_kind) return &k;
  }
  return nullptr;
}

nlohmann::json EngineStats::to_json_value() const {
  nlohmann::json j;
  j["model"] = {{"name", model_name},
                {"total_bytes", model_total_bytes},
                {"resident_bytes", model_resident_bytes},
                {"residency", residency},
                {"layers", layers},
                {"resident_layers", resident_layers},
                {"streamed_layers", streamed_layers}};
  j["budget"] = {{"budget_bytes", budget_bytes},
                 {"working_memory_bytes", working_memory_bytes},
                 {"measured_working_memory_bytes",
                  measured_working_memory ? nlohmann::json(measured_working_memory_bytes) : nlohmann::json()},
                 {"working_memory_grown", working_memory_grown}};
  nlohmann::json kinds = nlohmann::json::object();
  for (size_t k = 0; k < kMemoryKinds; ++k) kinds[memory_kind_name(static_cast<MemoryKind>(k))] = Counter(device_memory.by_kind[k]);
  // The ledger counts the bytes sluice requested; the allocator's numbers are its own.
  const auto allocator = [&](int64_t v) { return allocator_stats_available ? nlohmann::json(v) : nlohmann::json(); };
  j["device"] = {{"name", device},
                 {"ledger_peak_bytes", device_memory.total.peak},
                 {"peak_bytes", device_memory.total.peak},
                 {"current_bytes", device_memory.total.current},
                 {"by_kind", kinds},
                 {"allocator_stats", allocator_stats_available ? "available" : "unavailable"},
                 {"allocator_current_bytes", allocator(allocator_current_bytes)},
                 {"allocator_peak_bytes", allocator(allocator_peak_bytes)},
                 {"allocator_reserved_bytes", allocator(allocator_reserved_bytes)},
                 {"ring_slots", ring_slots},
                 {"slot_bytes", slot_bytes},
                 {"ring_capacity_bytes", ring_capacity_bytes},
                 {"ring_slot_bytes", ring_slot_bytes},
                 // What the budget holds now, by use: weights (resident layers and the
                 // other parameters), the ring's reservation, upcast scratch, LoRA sidecars.
                 {"weight_bytes", device_memory.kind(MemoryKind::resident).current + device_memory.kind(MemoryKind::params).current},
                 {"ring_bytes", device_memory.kind(MemoryKind::ring).current},
                 {"scratch_bytes", device_memory.kind(MemoryKind::scratch).current},
                 {"lora_bytes", device_memory.kind(MemoryKind::lora).current}};
  // The prediction of the step kind (null until measured costs exist), and every kind's.
  const PlanKindStats* step = plan.step();
  nlohmann::json plan_kinds = nlohmann::json::array();
  for (const auto& k : plan.kinds) {
    plan_kinds.push_back({{"kind", k.kind},
                          {"predicted_step_ms", ms_or_null(k.predicted_step_ms)},
                          {"floor_ms", ms_or_null(k.floor_ms)},
                          {"compute_ms", k.compute_ms},
                          {"copy_ms", k.copy_ms},
                          {"measured_step_ms", ms_or_null(k.measured_step_ms)},
                          {"measured_forwards", k.measured_forwards}});
  }
  j["plan"] = {{"policy", plan.policy},
               {"from_measurements", plan.from_measurements},
               {"copy_gbps", plan.copy_gbps},
               {"ring_bytes", plan.ring_bytes},
               {"measured_plans", plan.measured_plans},
               {"recomputed", plan.recomputed},
               {"step_kind", plan.step_kind},
               {"predicted_step_ms", ms_or_null(step ? step->predicted_step_ms : 0)},
               {"floor_ms", ms_or_null(step ? step->floor_ms : 0)},
               {"measured_step_ms", ms_or_null(step ? step->measured_step_ms : 0)},
               {"kinds", plan_kinds}};
  j["prefetch"] = {{"wasted_copies", wasted_prefetch_copies},
                   {"wasted_bytes", wasted_prefetch_bytes},
                   {"mismatched_forwards", mismatched_forwards}};
  j["pinned"] = Counter(pinned);
  j["pinned_bytes"] = pinned_bytes;
  j["pinned_used_bytes"] = pinned.current;
  j["pin_limit_bytes"] = pin_limit_bytes;
  j["residency_h2d"] = Counter(residency_h2d);
  // Seen only where the copy stream is a host thread; a GPU cannot detect it (the strict
  // CPU device's hazard tracker covers the GPU's case in CI).
  j["cpu_device_only"] = {{"slot_violations", slot_violations},
                          {"note", "detected only with --device cpu; a GPU run always reports 0"}};
  j["pageable_copies"] = {{"bounce_ring_bytes", bounce_bytes},
                          {"bounce_copies", bounce_copies},
                          {"synchronous_copies", sync_copies},
                          {"bounce_waits", bounce_waits},
                          {"bounce_ring_limit_bytes", bounce_limit_bytes}};
  j["forward_count"] = forwards;
  nlohmann::json fw = nlohmann::json::array();
  for (const ForwardStats& f : forward_records) {
    nlohmann::json r = f;  // the record's fields (Note [field lists]), and how its stalls were counted
    r["stall_source"] = f.stalls_timed ? "compute-stream events" : "host query (overcounts on a GPU)";
    fw.push_back(std::move(r));
  }
  j["forwards"] = std::move(fw);
  nlohmann::json last;  // null before a re-run
  if (nonfinite) {
    last = *nonfinite;
    last["forward"] = last["forward_index"];  // the key this object had before the record's own
    if (nonfinite->module.empty()) last["module"] = nullptr;
  }
  j["nonfinite"] = {{"reruns", nonfinite_reruns}, {"last", last}};
  return j;
}

std::string EngineStats::to_json(int indent) const { return to_json_value().dump(indent); }

}  // namespace sluice::offload
