#include "offload/plan/residency_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
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
  throw InvalidArgument((flag.empty() ? std::string() : flag + ": ") + "unknown residency policy '" + std::string(text) + "' (use balanced, spread or front_first)");
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

// How select() walks the candidates.
enum class Walk {
  bytes,      // Bresenham by bytes (spread), Note [residency policy], then first fit
  compute,    // Bresenham by measured compute time (balanced), Note [balanced plan], then first fit
  first_fit,  // first fit only (one of balanced's candidate sets)
  prefix,     // whole blocks from the front until one does not fit (front_first), nothing after
};

Walk walk_of(ResidencyPolicy policy) { return policy == ResidencyPolicy::front_first ? Walk::prefix : Walk::bytes; }

// Whether layers a and b belong to the same block (the unit of front_first).
bool same_block(const PlanLayer& a, const PlanLayer& b) {
  return a.block >= 0 && a.block == b.block && a.group == b.group;
}

// Marks candidates resident within `limit` bytes; returns the bytes taken. `compute[i]` is
// layer i's weighted compute time (Walk::compute only).
uint64_t select(const PlanInput& in, const std::vector<size_t>& candidates, uint64_t limit, Walk walk,
                const std::vector<double>& compute, std::vector<bool>& resident) {
  uint64_t total = 0;
  double total_compute = 0;
  for (size_t i : candidates) {
    total += in.layers[i].stored_bytes;
    if (walk == Walk::compute) total_compute += compute[i];
  }
  uint64_t taken = 0;
  auto take = [&](size_t i) {
    resident[i] = true;
    taken += in.layers[i].stored_bytes;
  };
  if (total <= limit) {
    for (size_t i : candidates) take(i);
    return taken;
  }
  if (walk == Walk::prefix) {
    // front_first, Note [residency policy]: whole units in execution order (a block's
    // candidates, or one layer outside blocks) until the first that does not fit; the rest
    // streams, even where a later, smaller layer would fit.
    for (size_t k = 0; k < candidates.size();) {
      size_t end = k + 1;
      uint64_t bytes = in.layers[candidates[k]].stored_bytes;
      while (end < candidates.size() && same_block(in.layers[candidates[k]], in.layers[candidates[end]])) {
        bytes += in.layers[candidates[end++]].stored_bytes;
      }
      if (taken + bytes > limit) break;
      for (; k < end; ++k) take(candidates[k]);
    }
    return taken;
  }
  if (walk == Walk::compute && !(total_compute > 0)) walk = Walk::bytes;  // nothing to weigh by
  if (walk == Walk::bytes && total > 0) {
    // Bresenham by bytes, see Note [residency policy].
    const double fraction = static_cast<double>(limit) / static_cast<double>(total);
    double seen = 0;
    for (size_t i : candidates) {
      const uint64_t b = in.layers[i].stored_bytes;
      seen += static_cast<double>(b);
      if (static_cast<double>(taken) + static_cast<double>(b) / 2.0 <= fraction * seen && taken + b <= limit) take(i);
    }
  } else if (walk == Walk::compute) {
    // Bresenham by compute, see Note [balanced plan]: stream a layer while the streamed
    // bytes so far (half of its own counted) stay within the even rate times the compute
    // before it; otherwise keep it resident if it fits.
    const double rate = static_cast<double>(total - limit) / total_compute;  // streamed bytes per compute-ms
    double streamed = 0, before = 0;
    for (size_t i : candidates) {
      const uint64_t b = in.layers[i].stored_bytes;
      if (streamed + static_cast<double>(b) / 2.0 > rate * before && taken + b <= limit) {
        take(i);
      } else {
        streamed += static_cast<double>(b);
      }
      before += compute[i];
    }
  }
  for (size_t i : candidates) {  // first fit: all of Walk::first_fit, the rest of the budget for the walks
    if (!resident[i] && taken + in.layers[i].stored_bytes <= limit) take(i);
  }
  return taken;
}

// Plans with the k largest streamable layers forced resident, the ring at `ring_slots` of
// the largest streamed slot; returns the resident streamable bytes. `resident` starts with
// the required layers marked.
uint64_t plan_with_forced(const PlanInput& in, const Prepared& p, size_t k, Walk walk, std::vector<bool>& resident) {
  for (size_t j = 0; j < k; ++j) resident[p.by_size[j]] = true;
  uint64_t taken = p.prefix[k];
  uint64_t slot = in.layers[p.by_size[k]].slot_size();
  const std::vector<double> no_compute;
  for (;;) {
    const uint64_t fixed = p.required + in.scratch_bytes + static_cast<uint64_t>(in.ring_slots) * slot + taken;
    TORCH_INTERNAL_ASSERT(fixed <= in.weight_budget, "plan_residency: forced set over budget");
    const uint64_t limit = std::min(in.weight_budget - fixed, p.cap - taken);
    std::vector<size_t> candidates;
    for (size_t i : p.streamable) {
      if (!resident[i]) candidates.push_back(i);
    }
    taken += select(in, candidates, limit, walk, no_compute, resident);
    uint64_t new_slot = 0;
    for (size_t i : p.streamable) {
      if (!resident[i]) new_slot = std::max(new_slot, in.layers[i].slot_size());
    }
    if (new_slot >= slot || new_slot == 0) return taken;
    slot = new_slot;  // a smaller ring frees budget for another pass
  }
}

// Whether forcing the k largest streamable layers resident is a plan worth trying: within
// the cap and the budget, and the first k at which the ring's slot size changes.
bool forced_candidate(const PlanInput& in, const Prepared& p, size_t k) {
  if (p.prefix[k] > p.cap) return false;
  if (k > 0 && in.layers[p.by_size[k]].slot_size() == in.layers[p.by_size[k - 1]].slot_size()) return false;
  return cost_with_forced(in, p, k) <= in.weight_budget;
}

// A residency and its ring.
constexpr uint64_t kRingHeadroom = 4;  // see balanced_plan

struct Choice {
  std::vector<bool> resident;
  uint64_t taken = 0;  // resident streamable bytes
  uint64_t ring = 0;
  double step = 0;     // weighted predicted step (costs only)
};

uint64_t largest_streamed_slot(const PlanInput& in, const Prepared& p, const std::vector<bool>& resident) {
  uint64_t slot = 0;
  for (size_t i : p.streamable) {
    if (!resident[i]) slot = std::max(slot, in.layers[i].slot_size());
  }
  return slot;
}

// Whether the resident streamable layers are whole blocks (and layers outside blocks) from
// the front of the execution order, everything after them streamed: front_first's shape.
bool front_shaped(const PlanInput& in, const Prepared& p, const std::vector<bool>& resident) {
  bool streaming = false;
  for (size_t k = 0; k < p.streamable.size(); ++k) {
    const size_t i = p.streamable[k];
    if (streaming && resident[i]) return false;
    if (!streaming && !resident[i]) {
      // The first streamed layer starts its block: the last resident unit is whole.
      if (k > 0 && same_block(in.layers[p.streamable[k - 1]], in.layers[i])) return false;
      streaming = true;
    }
  }
  return true;
}

// The spread / front_first / first-fit plan: keeping the k largest layers resident shrinks
// the ring to the (k+1)-th largest. Try every k at which the ring size changes and keep the
// plan with the most resident bytes (ties: the smaller k, i.e. the walk's own choice). For
// front_first (Walk::prefix) only plans of its shape count (the forced layers lie in the
// resident front); only where none is feasible (a budget near the minimum, which needs the
// largest layers resident to shrink the ring) does it take the best plan of another shape.
Choice walk_plan(const PlanInput& in, const Prepared& p, Walk walk, const std::vector<bool>& required) {
  Choice best, best_any;
  bool found = false, found_any = false;
  for (size_t k = 0; k < p.by_size.size(); ++k) {
    if (p.prefix[k] > p.cap) break;
    if (!forced_candidate(in, p, k)) continue;
    std::vector<bool> resident = required;
    const uint64_t r = plan_with_forced(in, p, k, walk, resident);
    if (walk == Walk::prefix && !front_shaped(in, p, resident)) {
      if (!found_any || r > best_any.taken) {
        best_any.resident = std::move(resident);
        best_any.taken = r;
        found_any = true;
      }
      continue;
    }
    if (!found || r > best.taken) {
      best.resident = std::move(resident);
      best.taken = r;
      found = true;
    }
  }
  if (!found && found_any) {
    best = std::move(best_any);
    found = true;
  }
  TORCH_INTERNAL_ASSERT(found, "plan_residency: no feasible plan above the minimum");
  best.ring = static_cast<uint64_t>(in.ring_slots) * largest_streamed_slot(in, p, best.resident);
  return best;
}

double predicted_step(const PlanInput& in, const std::vector<bool>& resident, uint64_t ring) {
  return weighted_step_ms(predict(in.layers, resident, in.costs, ring, in.max_ahead), in.costs);
}

// Ring capacities to try above `base` (ring_slots of the largest streamed slot `slot`), up
// to `most`: geometric steps of 1.25 and the next few whole slots.
std::vector<uint64_t> ring_candidates(uint64_t base, uint64_t slot, uint32_t ring_slots, uint64_t most) {
  std::vector<uint64_t> rings{base};
  for (double r = static_cast<double>(base) * 1.25; r <= static_cast<double>(most); r *= 1.25) {
    rings.push_back(std::max(base, static_cast<uint64_t>(r)));
  }
  for (uint64_t j = 1; j <= 4; ++j) {
    const uint64_t r = (ring_slots + j) * slot;
    if (r <= most) rings.push_back(r);
  }
  std::sort(rings.begin(), rings.end());
  rings.erase(std::unique(rings.begin(), rings.end()), rings.end());
  return rings;
}

// Note [balanced plan]: the joint search over the ring's capacity and the resident set.
Choice balanced_plan(const PlanInput& in, const Prepared& p, const std::vector<bool>& required) {
  // Each layer's compute time, summed over its positions and weighted across kinds.
  std::vector<double> compute(in.layers.size(), 0.0);
  for (const auto& kind : in.costs.kinds) {
    for (size_t pos = 0; pos < kind.order.size(); ++pos) {
      if (kind.order[pos] < compute.size()) compute[kind.order[pos]] += kind.weight * kind.compute_ms[pos];
    }
  }
  // The plans of the other policies (and plain first fit) at this budget: the balanced plan
  // never predicts worse.
  constexpr size_t kBaselines = 3;
  std::vector<Choice> choices;
  for (Walk walk : {Walk::bytes, Walk::first_fit, Walk::prefix}) {
    Choice c = walk_plan(in, p, walk, required);
    c.step = predicted_step(in, c.resident, c.ring);
    choices.push_back(std::move(c));
  }

  for (size_t k = 0; k < p.by_size.size(); ++k) {
    if (p.prefix[k] > p.cap) break;
    if (!forced_candidate(in, p, k)) continue;
    const uint64_t slot = in.layers[p.by_size[k]].slot_size();
    const uint64_t base = static_cast<uint64_t>(in.ring_slots) * slot;
    const uint64_t fixed = p.required + in.scratch_bytes + p.prefix[k];
    std::vector<bool> forced = required;
    std::vector<size_t> candidates;
    uint64_t candidate_slots = 0;  // a ring larger than every candidate's slot gains nothing
    for (size_t j = 0; j < k; ++j) forced[p.by_size[j]] = true;
    for (size_t i : p.streamable) {
      if (forced[i]) continue;
      candidates.push_back(i);
      candidate_slots += in.layers[i].slot_size();
    }
    const uint64_t most = std::min(in.weight_budget - fixed, std::max(base, candidate_slots));
    for (uint64_t ring : ring_candidates(base, slot, in.ring_slots, most)) {
      const uint64_t limit = std::min(in.weight_budget - fixed - ring, p.cap - p.prefix[k]);
      for (Walk walk : {Walk::compute, Walk::bytes, Walk::first_fit}) {
        Choice c;
        c.resident = forced;
        c.taken = p.prefix[k] + select(in, candidates, limit, walk, compute, c.resident);
        if (largest_streamed_slot(in, p, c.resident) == 0) continue;  // all resident: the caller's case
        c.ring = ring;
        c.step = predicted_step(in, c.resident, ring);
        choices.push_back(std::move(c));
      }
    }
  }
  // The smallest ring within 1% of the best prediction, and no worse than spread, first fit
  // or front_first (the baselines, choices[0..3)); then the better prediction, then more
  // resident.
  double best = choices[0].step;
  for (const auto& c : choices) best = std::min(best, c.step);
  double bound = best * 1.01;
  for (size_t i = 0; i < kBaselines; ++i) bound = std::min(bound, choices[i].step);
  size_t pick = 0;
  bool found = false;
  for (size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    if (c.step > bound) continue;
    const Choice& b = choices[pick];
    if (!found || c.ring < b.ring || (c.ring == b.ring && (c.step < b.step || (c.step == b.step && c.taken > b.taken)))) {
      pick = i;
      found = true;
    }
  }
  TORCH_INTERNAL_ASSERT(found, "plan_residency: no balanced plan");
  Choice c = std::move(choices[pick]);
  // Headroom for what the model does not see (compute and copy times vary from forward
  // to forward; copies are issued at acquires and releases, not the instant a slot
  // frees): up to kRingHeadroom times the chosen ring, from budget the resident set
  // leaves unused (a max_resident cap, a roomy budget), never more than the streamed
  // layers' slots. Measured on anima-medium at max_resident 0.5 (CPU device): the
  // smallest ring at the predicted step ran at 1.20-1.30x the floor, with 4x the ring 1.0x.
  uint64_t streamed_slots = 0;
  for (size_t i : p.streamable) {
    if (!c.resident[i]) streamed_slots += in.layers[i].slot_size();
  }
  const uint64_t used = p.required + in.scratch_bytes + c.taken + c.ring;
  const uint64_t spare = in.weight_budget > used ? in.weight_budget - used : 0;
  const uint64_t wanted = std::min(streamed_slots, (kRingHeadroom - 1) * c.ring);
  if (c.ring < streamed_slots) c.ring += std::min({spare, wanted, streamed_slots - c.ring});
  return c;
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

  const bool costs = in.costs.usable();
  uint64_t resident_streamable = 0;
  uint64_t ring = 0;
  if (p.required + in.scratch_bytes + p.streamable_bytes <= in.weight_budget && p.streamable_bytes <= p.cap) {
    for (size_t i : p.streamable) plan.resident[i] = true;
    resident_streamable = p.streamable_bytes;
  } else {
    Choice c = in.policy == ResidencyPolicy::balanced && costs ? balanced_plan(in, p, plan.resident)
                                                               : walk_plan(in, p, walk_of(in.policy), plan.resident);
    plan.resident = std::move(c.resident);
    resident_streamable = c.taken;
    ring = c.ring;
  }

  plan.resident_bytes = p.required + resident_streamable;
  plan.streamed_bytes = p.streamable_bytes - resident_streamable;
  plan.slot_bytes = largest_streamed_slot(in, p, plan.resident);
  plan.ring_slots = plan.slot_bytes ? in.ring_slots : 0;
  plan.ring_bytes = plan.slot_bytes ? std::max(ring, static_cast<uint64_t>(plan.ring_slots) * plan.slot_bytes) : 0;
  if (costs) plan.predictions = predict(plan.layers, plan.resident, in.costs, plan.ring_bytes, in.max_ahead);
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

std::string ResidencyPlan::residency_grid() const {
  struct Group {
    std::vector<std::string> rows;                            // in first-seen order
    std::map<std::string, std::map<int64_t, bool>> cells;     // row -> block -> resident
    int64_t blocks = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Group> groups;
  std::string other_resident, other_streamed;
  size_t width = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const PlanLayer& l = layers[i];
    if (l.block < 0) {
      std::string& list = resident[i] ? other_resident : other_streamed;
      list += (list.empty() ? "" : ", ") + l.name;
      continue;
    }
    if (!groups.count(l.group)) order.push_back(l.group);
    Group& g = groups[l.group];
    const std::string prefix = l.group + "." + std::to_string(l.block) + ".";
    const std::string row = l.name.rfind(prefix, 0) == 0 ? l.name.substr(prefix.size()) : l.name;
    if (!g.cells.count(row)) g.rows.push_back(row);
    g.cells[row][l.block] = resident[i];
    g.blocks = std::max(g.blocks, l.block + 1);
    width = std::max({width, row.size() + 2, l.group.size()});
  }
  std::ostringstream out;
  for (const auto& name : order) {
    const Group& g = groups.at(name);
    if (g.blocks > 10) {  // the tens digit of each block number over its ones digit
      out << std::string(width + 1, ' ');
      for (int64_t b = 0; b < g.blocks; ++b) out << (b % 10 == 0 ? static_cast<char>('0' + (b / 10) % 10) : ' ');
      out << "\n";
    }
    out << name << std::string(width + 1 - name.size(), ' ');
    for (int64_t b = 0; b < g.blocks; ++b) out << static_cast<char>('0' + b % 10);
    out << "\n";
    for (const auto& row : g.rows) {
      out << "  " << row << std::string(width - 1 - row.size(), ' ');
      const auto& cells = g.cells.at(row);
      for (int64_t b = 0; b < g.blocks; ++b) {
        const auto it = cells.find(b);
        out << (it == cells.end() ? '.' : it->second ? 'R' : 'S');
      }
      out << "\n";
    }
  }
  if (!other_resident.empty()) out << "other, resident: " << other_resident << "\n";
  if (!other_streamed.empty()) out << "other, streamed: " << other_streamed << "\n";
  return out.str();
}

std::string ResidencyPlan::to_string() const {
  std::ostringstream out;
  out << "residency plan (" << residency_policy_name(policy) << "): weight budget " << format_mib(weight_budget)
      << ", resident " << format_mib(resident_bytes) << " (required " << format_mib(required_bytes) << "), streamed "
      << format_mib(streamed_bytes) << " in " << streamed_count() << " layers, ring " << format_mib(ring_bytes)
      << " (at least " << ring_slots << " x " << format_mib(slot_bytes) << "), scratch " << format_mib(scratch_bytes)
      << "\n";
  out << "  " << residency_map() << "\n";
  for (const auto& k : predictions) {
    char line[256];
    std::snprintf(line, sizeof line,
                  "  predicted %s: step %.3f ms, floor %.3f ms (compute %.3f, copy %.3f, stall %.3f)\n",
                  k.kind.c_str(), k.step_ms, k.floor_ms, k.compute_ms, k.copy_ms, k.stall_ms);
    out << line;
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    out << "  " << (resident[i] ? (layers[i].required ? "required " : "resident ") : "streamed ") << layers[i].name
        << " " << format_mib(layers[i].stored_bytes) << "\n";
  }
  return out.str();
}

}  // namespace sluice::offload
