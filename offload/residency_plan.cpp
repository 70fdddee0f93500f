#include "offload/residency_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>

#include "runtime/error.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

ResidencyPolicy parse_residency_policy(std::string_view text, const std::string& flag) {
  if (text == "balanced") return ResidencyPolicy::balanced;
  if (text == "spread") return ResidencyPolicy::spread;
  if (text == "front_first" || text == "front-first") return ResidencyPolicy::front_first;
  throw InvalidArgument(flag + ": unknown residency policy '" + std::string(text) + "' (use balanced, spread or front_first)");
}

const char* residency_policy_name(ResidencyPolicy policy) {
  switch (policy) {
    case ResidencyPolicy::balanced: return "balanced";
    case ResidencyPolicy::spread: return "spread";
    case ResidencyPolicy::front_first: return "front_first";
  }
  return "?";
}

size_t ResidencyPlan::streamed_count() const {
  return static_cast<size_t>(std::count(resident.begin(), resident.end(), false));
}

namespace {

struct Prepared {
  uint64_t required = 0;            // required layers + extra
  std::vector<size_t> streamable;   // indices, execution order
  uint64_t streamable_bytes = 0;
  uint64_t cap = 0;                 // max resident streamable bytes
  std::vector<size_t> by_size;      // streamable, largest slot first
  std::vector<uint64_t> prefix;     // prefix[k] = stored bytes of by_size[0..k)
};

Prepared prepare(const PlanInput& in) {
  if (in.max_resident && !(*in.max_resident >= 0.0 && *in.max_resident <= 1.0)) {
    throw InvalidArgument("max_resident must be between 0 and 1, got " + std::to_string(*in.max_resident));
  }
  TORCH_CHECK(in.ring_slots >= 1, "plan_residency: ring_slots must be >= 1");
  Prepared p;
  p.required = in.extra_required_bytes;
  for (size_t i = 0; i < in.layers.size(); ++i) {
    if (in.layers[i].required) {
      p.required += in.layers[i].stored_bytes;
    } else {
      p.streamable.push_back(i);
      p.streamable_bytes += in.layers[i].stored_bytes;
    }
  }
  p.cap = in.max_resident
              ? static_cast<uint64_t>(std::floor(*in.max_resident * static_cast<double>(p.streamable_bytes)))
              : p.streamable_bytes;
  if (p.cap > p.streamable_bytes) p.cap = p.streamable_bytes;
  p.by_size = p.streamable;
  std::stable_sort(p.by_size.begin(), p.by_size.end(),
                   [&](size_t a, size_t b) { return in.layers[a].slot_size() > in.layers[b].slot_size(); });
  p.prefix.assign(p.by_size.size() + 1, 0);
  for (size_t k = 0; k < p.by_size.size(); ++k) p.prefix[k + 1] = p.prefix[k] + in.layers[p.by_size[k]].stored_bytes;
  return p;
}

// Device bytes of the cheapest plan that keeps the k largest streamable layers resident and
// streams the rest through a ring sized for the (k+1)-th. k == n: everything resident.
uint64_t cost_with_forced(const PlanInput& in, const Prepared& p, size_t k) {
  const uint64_t base = p.required + in.scratch_bytes + p.prefix[k];
  if (k == p.by_size.size()) return base;
  return base + static_cast<uint64_t>(in.ring_slots) * in.layers[p.by_size[k]].slot_size();
}

uint64_t minimum(const PlanInput& in, const Prepared& p) {
  uint64_t best = std::numeric_limits<uint64_t>::max();
  for (size_t k = 0; k <= p.by_size.size(); ++k) {
    if (p.prefix[k] > p.cap) break;  // prefix sums only grow
    best = std::min(best, cost_with_forced(in, p, k));
  }
  return best;
}

// Marks candidates resident within `limit` bytes; returns the bytes taken.
uint64_t select(const PlanInput& in, const std::vector<size_t>& candidates, uint64_t limit, std::vector<bool>& resident) {
  uint64_t total = 0;
  for (size_t i : candidates) total += in.layers[i].stored_bytes;
  uint64_t taken = 0;
  auto take = [&](size_t i) {
    resident[i] = true;
    taken += in.layers[i].stored_bytes;
  };
  if (total <= limit) {
    for (size_t i : candidates) take(i);
    return taken;
  }
  if (in.policy != ResidencyPolicy::front_first && total > 0) {
    // Bresenham by bytes, see Note [residency policy].
    const double fraction = static_cast<double>(limit) / static_cast<double>(total);
    double seen = 0;
    for (size_t i : candidates) {
      const uint64_t b = in.layers[i].stored_bytes;
      seen += static_cast<double>(b);
      if (static_cast<double>(taken) + static_cast<double>(b) / 2.0 <= fraction * seen && taken + b <= limit) take(i);
    }
  }
  for (size_t i : candidates) {  // first fit: all of front_first, the rest of the budget for spread
    if (!resident[i] && taken + in.layers[i].stored_bytes <= limit) take(i);
  }
  return taken;
}

// Plans with the k largest streamable layers forced resident; returns the resident
// streamable bytes. `resident` starts with the required layers marked.
uint64_t plan_with_forced(const PlanInput& in, const Prepared& p, size_t k, std::vector<bool>& resident) {
  for (size_t j = 0; j < k; ++j) resident[p.by_size[j]] = true;
  uint64_t taken = p.prefix[k];
  uint64_t slot = in.layers[p.by_size[k]].slot_size();
  for (;;) {
    const uint64_t fixed = p.required + in.scratch_bytes + static_cast<uint64_t>(in.ring_slots) * slot + taken;
    TORCH_INTERNAL_ASSERT(fixed <= in.weight_budget, "plan_residency: forced set over budget");
    const uint64_t limit = std::min(in.weight_budget - fixed, p.cap - taken);
    std::vector<size_t> candidates;
    for (size_t i : p.streamable) {
      if (!resident[i]) candidates.push_back(i);
    }
    taken += select(in, candidates, limit, resident);
    uint64_t new_slot = 0;
    for (size_t i : p.streamable) {
      if (!resident[i]) new_slot = std::max(new_slot, in.layers[i].slot_size());
    }
    if (new_slot >= slot || new_slot == 0) return taken;
    slot = new_slot;  // a smaller ring frees budget for another pass
  }
}

}  // namespace

uint64_t minimum_weight_budget(const PlanInput& input) { return minimum(input, prepare(input)); }

ResidencyPlan plan_residency(const PlanInput& in) {
  const Prepared p = prepare(in);
  ResidencyPlan plan;
  plan.layers = in.layers;
  plan.policy = in.policy;
  plan.weight_budget = in.weight_budget;
  plan.required_bytes = p.required;
  plan.scratch_bytes = in.scratch_bytes;
  plan.resident.assign(in.layers.size(), false);
  for (size_t i = 0; i < in.layers.size(); ++i) plan.resident[i] = in.layers[i].required;

  const uint64_t min_budget = minimum(in, p);
  if (in.weight_budget < min_budget) {
    std::ostringstream msg;
    msg << "weight budget " << format_mib(in.weight_budget) << " is too small: at least " << format_mib(min_budget)
        << " is needed (always-resident layers and params " << format_mib(p.required) << ", upcast scratch "
        << format_mib(in.scratch_bytes);
    if (!p.by_size.empty()) {
      msg << ", staging ring " << in.ring_slots << " x " << format_mib(in.layers[p.by_size.front()].slot_size())
          << " at most";
    }
    msg << ")";
    throw ResourceError(msg.str());
  }

  uint64_t resident_streamable = 0;
  const size_t n = p.by_size.size();
  if (p.required + in.scratch_bytes + p.streamable_bytes <= in.weight_budget && p.streamable_bytes <= p.cap) {
    for (size_t i : p.streamable) plan.resident[i] = true;
    resident_streamable = p.streamable_bytes;
  } else {
    // Keeping the k largest layers resident shrinks the ring to the (k+1)-th largest. Try
    // every k at which the ring size changes and keep the plan with the most resident
    // bytes (ties: the smaller k, i.e. the policy's own choice).
    std::vector<bool> best;
    uint64_t best_resident = 0;
    bool found = false;
    for (size_t k = 0; k < n; ++k) {
      if (p.prefix[k] > p.cap) break;
      if (k > 0 && in.layers[p.by_size[k]].slot_size() == in.layers[p.by_size[k - 1]].slot_size()) continue;
      if (cost_with_forced(in, p, k) > in.weight_budget) continue;
      std::vector<bool> resident = plan.resident;
      const uint64_t r = plan_with_forced(in, p, k, resident);
      if (!found || r > best_resident) {
        best = std::move(resident);
        best_resident = r;
        found = true;
      }
    }
    TORCH_INTERNAL_ASSERT(found, "plan_residency: no feasible plan above the minimum");
    plan.resident = std::move(best);
    resident_streamable = best_resident;
  }

  plan.resident_bytes = p.required + resident_streamable;
  plan.streamed_bytes = p.streamable_bytes - resident_streamable;
  for (size_t i : p.streamable) {
    if (!plan.resident[i]) plan.slot_bytes = std::max(plan.slot_bytes, in.layers[i].slot_size());
  }
  plan.ring_slots = plan.slot_bytes ? in.ring_slots : 0;
  plan.ring_bytes = static_cast<uint64_t>(plan.ring_slots) * plan.slot_bytes;
  TORCH_INTERNAL_ASSERT(plan.device_bytes() <= in.weight_budget, "plan_residency: plan of ", plan.device_bytes(),
                        " bytes exceeds the weight budget ", in.weight_budget);
  TORCH_INTERNAL_ASSERT(resident_streamable <= p.cap, "plan_residency: max_resident exceeded");
  return plan;
}

std::string ResidencyPlan::residency_map() const {
  std::vector<std::string> group_order;
  std::map<std::string, std::map<int64_t, std::pair<int, int>>> groups;  // group -> block -> (resident, total)
  int other_resident = 0, other_required = 0, other_streamed = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    if (l.block >= 0) {
      if (!groups.count(l.group)) group_order.push_back(l.group);
      auto& counts = groups[l.group][l.block];
      counts.first += resident[i] ? 1 : 0;
      counts.second += 1;
    } else if (resident[i]) {
      ++other_resident;
      if (l.required) ++other_required;
    } else {
      ++other_streamed;
    }
  }
  std::ostringstream out;
  const char* sep = "";
  for (const auto& g : group_order) {
    out << sep << g << ": ";
    for (const auto& [block, counts] : groups[g]) {
      (void)block;
      out << (counts.first == counts.second ? 'R' : counts.first == 0 ? 'S' : 'P');
    }
    sep = "; ";
  }
  if (other_resident + other_streamed > 0) {
    out << sep << "other: " << other_resident << " resident";
    if (other_required) out << " (" << other_required << " required)";
    out << ", " << other_streamed << " streamed";
  }
  return out.str();
}

std::string ResidencyPlan::to_string() const {
  std::ostringstream out;
  out << "residency plan (" << residency_policy_name(policy) << "): weight budget " << format_mib(weight_budget)
      << ", resident " << format_mib(resident_bytes) << " (required " << format_mib(required_bytes) << "), streamed "
      << format_mib(streamed_bytes) << " in " << streamed_count() << " layers, ring " << ring_slots << " x "
      << format_mib(slot_bytes) << ", scratch " << format_mib(scratch_bytes) << "\n";
  out << "  " << residency_map() << "\n";
  for (size_t i = 0; i < layers.size(); ++i) {
    out << "  " << (resident[i] ? (layers[i].required ? "required " : "resident ") : "streamed ") << layers[i].name
        << " " << format_mib(layers[i].stored_bytes) << "\n";
  }
  return out.str();
}

}  // namespace sluice::offload
