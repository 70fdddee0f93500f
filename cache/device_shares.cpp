#include "cache/device_shares.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <sstream>
#include <vector>

#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::cache {

namespace {

std::string percent(uint64_t part, uint64_t whole) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << (whole ? 100.0 * static_cast<double>(part) / static_cast<double>(whole) : 100.0) << "%";
  return o.str();
}

}  // namespace

uint64_t default_working_memory(uint64_t budget, int64_t resolution) {
  const double scale = std::pow(static_cast<double>(std::max<int64_t>(resolution, 1)) / 1024.0, 2.0);
  const uint64_t sized = std::max<uint64_t>(256 * kMiB, static_cast<uint64_t>(static_cast<double>(kGiB) * scale));
  return std::min(sized, budget / 4);
}

uint64_t minimum_vram_budget(uint64_t minimum, const CacheOptions& options) {
  // The smallest budget B with B - working_memory(B) >= minimum.
  if (options.working_memory) return minimum + *options.working_memory;
  // B - default_working_memory(B) never decreases as B grows: bisect.
  uint64_t lo = minimum, hi = minimum + default_working_memory(UINT64_MAX / 4, options.resolution);
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (mid - default_working_memory(mid, options.resolution) >= minimum) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// ---------------------------------------------------------------------------------------
// arithmetic (cache mutex held)

uint64_t DeviceShares::reserved() const {
  uint64_t sum = 0;
  for (const auto& e : s_.entries) {
    if (e->attached) sum += e->share;
  }
  return sum;
}

uint64_t DeviceShares::wanted_share(const Entry& e) const {
  uint64_t want = e.needs.wanted;
  if (e.target) want = std::clamp(*e.target, e.needs.minimum, std::max(e.needs.minimum, e.needs.wanted));
  return std::min(want, limit());
}

std::string DeviceShares::budget_error(const Entry& e) const {
  const uint64_t m = e.needs.minimum;
  const uint64_t need = minimum_vram_budget(m, s_.options);
  std::ostringstream msg;
  msg << "vram budget " << format_mib(s_.budget) << " is too small for model '" << e.name << "' on " << s_.device->name()
      << ": the minimum that would work is " << format_mib(need) << " (" << need << " bytes: " << format_mib(m)
      << " for always-resident layers, upcast scratch and the staging ring, plus working memory)";
  return msg.str();
}

offload::EngineOptions DeviceShares::engine_options(const Entry& e) const {
  offload::EngineOptions o;
  o.device = s_.device;
  o.budget_bytes = e.share;
  o.working_memory_bytes = 0;  // the cache keeps the working memory out of every share
  o.grow_working_memory = false;  // and grows it itself from the engines' measurements
  o.max_resident = e.max_resident;
  o.prefetch_depth = s_.options.prefetch;
  o.policy = s_.options.policy;
  o.pin = s_.options.pin;
  o.pin_arena = s_.pin_arena;
  o.timing = s_.options.timing;
  o.trace = s_.options.trace;
  o.log_attach = false;
  return o;
}

void DeviceShares::refresh_needs(Entry& e) {
  e.needs = offload::StreamingEngine::needs(*e.module(), engine_options(e));
  e.needs.minimum += e.sidecar_bytes;
  e.needs.full += e.sidecar_bytes;
  e.needs.wanted += e.sidecar_bytes;
}

uint64_t DeviceShares::device_bytes_of(Entry& e) {
  if (!e.attached) return 0;
  TORCH_INTERNAL_ASSERT(!e.running, "device bytes of '", e.name, "' read during its forward");
  return e.engine->device_bytes();
}

// ---------------------------------------------------------------------------------------
// on and off the device (cache mutex held, the entry not running: Note [cache locking])

void DeviceShares::attach(Entry& e, uint64_t share) {
  TORCH_INTERNAL_ASSERT(!e.running, "attach of '", e.name, "' during its forward");
  const auto t0 = std::chrono::steady_clock::now();
  if (!e.engine) e.engine = std::make_unique<offload::StreamingEngine>(engine_options(e));
  e.engine->budget().set_max_resident(e.max_resident);
  e.engine->attach(*e.module(), e.name, share);
  e.attached = true;
  e.share = share;
  count_pinned_ram(e);
  locking_.publish(e);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const offload::ResidencyPlan& plan = e.engine->plan();
  std::ostringstream line;
  line.setf(std::ios::fixed);
  if (!e.announced) {
    line.precision(2);
    // InvokeAI's wording first (frontends parse it), then the split.
    line << "Loaded model '" << e.name << "' onto " << s_.device->name() << " in " << e.load_seconds + secs
         << "s. Total model size: " << format_mib(e.needs.model_bytes) << ", VRAM: " << format_mib(plan.resident_bytes)
         << " (" << percent(plan.resident_bytes, e.needs.model_bytes) << "); host load (read or generate, cast) "
         << e.load_seconds << "s, attach " << secs << "s; compute " << dtype_name(e.request.dtypes.compute) << " ("
         << (e.request.spec.compute_reason.empty() ? "requested" : e.request.spec.compute_reason) << ")";
    log::info(line.str());
    e.announced = true;
  } else {
    line.precision(2);
    line << "Model '" << e.name << "' back onto " << s_.device->name() << " in " << secs
         << "s, VRAM: " << format_mib(plan.resident_bytes) << " (" << percent(plan.resident_bytes, e.needs.model_bytes)
         << ")";
    log::info(line.str());
  }
  std::ostringstream map;
  map << "Residency of '" << e.name << "' (" << offload::residency_policy_name(plan.policy)
      << "): " << plan.residency_map() << "; ring " << format_mib(plan.ring_bytes) << " (largest slot "
      << format_mib(plan.slot_bytes) << ")"
      << ", share " << format_mib(share) << " of " << format_mib(limit()) << " (budget " << format_mib(s_.budget)
      << ", working memory " << format_mib(s_.working_memory) << ")";
  log::info(map.str());
}

void DeviceShares::detach(Entry& e) {
  if (!e.attached) return;
  TORCH_INTERNAL_ASSERT(!e.running, "detach of '", e.name, "' during its forward");
  e.engine->detach();
  e.attached = false;
  e.share = 0;
  locking_.publish(e);
}

void DeviceShares::resize(Entry& e, uint64_t share) {
  TORCH_INTERNAL_ASSERT(e.attached, "resize of a detached model");
  if (share == e.share) return;
  TORCH_INTERNAL_ASSERT(!e.running, "resize of '", e.name, "' during its forward");
  e.engine->budget().set_budget(share, /*release_freed=*/false);  // Note [releasing cached memory]: the cache decides
  e.share = share;
  count_pinned_ram(e);
  locking_.publish(e);
  log::debug("Residency of '" + e.name + "': " + e.engine->plan().residency_map() + ", share " + format_mib(share));
}

// Pinned host copies replace the pageable ones (Note [pinned arena]): the model then takes
// its bytes plus the arena's alignment padding of its pinned layers. A detach changes
// nothing (the pinned copies stay with the model until it leaves RAM). Run lock held.
void DeviceShares::count_pinned_ram(Entry& e) {
  const uint64_t host = e.needs.model_bytes + e.engine->residency().pinned_padding_bytes();
  if (host > e.ram_bytes) s_.ram.increase(static_cast<int64_t>(host - e.ram_bytes));
  if (host < e.ram_bytes) s_.ram.decrease(static_cast<int64_t>(e.ram_bytes - host));
  e.ram_bytes = host;
}

void DeviceShares::make_room(uint64_t bytes, const Entry* exclude) {
  std::vector<Entry*> victims;
  for (auto& p : s_.entries) {
    if (p.get() != exclude && p->attached && p->locks == 0) victims.push_back(p.get());
  }
  std::sort(victims.begin(), victims.end(), [](Entry* a, Entry* b) { return a->last_used < b->last_used; });
  uint64_t left = bytes;
  // Partial unloads first, least recently used first, each only as much as still needed.
  for (Entry* v : victims) {
    if (left == 0) return;
    const uint64_t can = v->share > v->needs.minimum ? v->share - v->needs.minimum : 0;
    const uint64_t take = std::min(can, left);
    if (take == 0) continue;
    resize(*v, v->share - take);
    left -= take;
    ++s_.device_unloads;
  }
  // Then whole models off the device (their RAM copy stays).
  for (Entry* v : victims) {
    if (left == 0) return;
    const uint64_t freed = v->share;
    detach(*v);
    left -= std::min(left, freed);
    ++s_.device_drops;
    log::info("Model '" + v->name + "' taken off " + s_.device->name() + " to make room (" + format_mib(freed) + ")");
  }
}

void DeviceShares::ensure_device(Entry& e, Guard& g, bool required) {
  TORCH_INTERNAL_ASSERT(e.in_ram(), "ensure_device: model not in RAM");
  if (e.needs.minimum > limit()) throw ResourceError(budget_error(e));
  const uint64_t desired = wanted_share(e);
  const uint64_t have = e.attached ? e.share : 0;
  if (e.attached && have >= desired) return;
  const uint64_t need = desired - have;
  uint64_t free = unreserved();
  if (free < need) make_room(need - free, &e);
  free = unreserved();
  const uint64_t grant = have + std::min(need, free);
  if (!e.attached) {
    if (grant < e.needs.minimum) {
      std::ostringstream msg;
      msg << "cannot put model '" << e.name << "' on " << s_.device->name() << ": it needs at least "
          << format_mib(e.needs.minimum) << " of device memory, but models in use hold "
          << format_mib(reserved()) << " of the " << format_mib(limit()) << " that the budget ("
          << format_mib(s_.budget) << ") leaves beside the working memory; unlock them or raise the budget";
      if (required) throw ResourceError(msg.str());
      log::info(msg.str() + " (it stays in RAM until it is locked)");
      return;
    }
    attach(e, grant);
  } else if (grant > have) {
    resize(e, grant);
  }
}

void DeviceShares::apply_max_resident(Entry& e, std::optional<double> fraction) {
  {
    offload::EngineOptions o = engine_options(e);
    o.max_resident = fraction;
    offload::WeightNeeds n = offload::StreamingEngine::needs(*e.module(), o);
    n.minimum += e.sidecar_bytes;  // as refresh_needs: the sidecars placed (Note [sidecar share])
    n.full += e.sidecar_bytes;
    n.wanted += e.sidecar_bytes;
    if (e.attached && e.share < n.minimum) {
      // A lower cap can raise the minimum (the ring may have to hold a larger layer): grow
      // the share first, under the old cap.
      if (n.minimum > limit()) throw ResourceError(budget_error(e));
      const uint64_t need = n.minimum - e.share;
      uint64_t free = unreserved();
      if (free < need) make_room(need - free, &e);
      free = unreserved();
      if (free < need) {
        throw ResourceError("set_max_resident: model '" + e.name + "' needs " + format_mib(n.minimum) +
                            " of device memory under that cap; models in use hold the rest of the budget");
      }
      resize(e, n.minimum);
    }
    if (e.attached) {
      e.engine->budget().set_max_resident(fraction);
      count_pinned_ram(e);
      locking_.publish(e);
    } else if (e.engine) {
      e.engine->budget().set_max_resident(fraction);  // kept for the next attach
    }
    e.max_resident = fraction;
    e.needs = n;
    e.target.reset();
    if (!e.attached) return;
    const uint64_t want = wanted_share(e);
    if (e.share > want) {
      resize(e, want);
    } else if (e.share < want) {
      const uint64_t free = unreserved();
      if (free > 0) resize(e, e.share + std::min(free, want - e.share));
    }
  }
}

// ---------------------------------------------------------------------------------------
// residency of one model (pinned and idle: ModelCache::with_pinned)

void DeviceShares::partial_load(Entry& e, uint64_t bytes, Guard& g) {
  const uint64_t have = e.attached ? e.share : 0;
  const uint64_t room = std::max(e.needs.minimum, e.needs.wanted);
  e.target = bytes >= room - std::min(room, have) ? room : have + bytes;
  ensure_device(e, g, /*required=*/true);
}

void DeviceShares::partial_unload(Entry& e, uint64_t bytes) {
  const uint64_t now = device_bytes_of(e);
  e.target = std::max(e.needs.minimum, now > bytes ? now - bytes : 0);
  if (e.attached && *e.target < e.share) resize(e, *e.target);
}

void DeviceShares::full_load(Entry& e, Guard& g) {
  if (e.needs.full > limit()) {
    throw ResourceError("full_load: model '" + e.name + "' needs " + format_mib(e.needs.full) +
                        " of device memory to be fully resident; the budget " + format_mib(s_.budget) +
                        " leaves " + format_mib(limit()) + " beside the working memory");
  }
  if (e.max_resident) {
    e.max_resident.reset();
    if (e.attached) {
      e.engine->budget().set_max_resident(std::nullopt);
      locking_.publish(e);
    }
    refresh_needs(e);
  }
  e.target = e.needs.full;
  ensure_device(e, g, /*required=*/true);
  if (e.share < e.needs.full) {
    throw ResourceError("full_load: model '" + e.name + "' needs " + format_mib(e.needs.full) +
                        " of device memory to be fully resident; models in use hold " +
                        format_mib(reserved() - e.share) + " of " + format_mib(limit()));
  }
}

void DeviceShares::full_unload(Entry& e) {
  e.target = e.needs.minimum;
  if (e.attached) resize(e, e.needs.minimum);
}

// ---------------------------------------------------------------------------------------
// the budget (these take the cache mutex)

void DeviceShares::set_budget(uint64_t budget_request, bool measured, const std::string& source) {
  Guard g(locking_.mutex());
  // Any attached model may be resized below: wait for every running forward first.
  locking_.wait_all_idle(g);
  const uint64_t budget = budget_request ? budget_request : s_.device->total_memory();
  if (budget == 0) {
    throw InvalidArgument("the memory of device " + s_.device->name() + " is unknown: give the vram budget in bytes");
  }
  const uint64_t wm = std::max(s_.options.working_memory ? *s_.options.working_memory
                                                         : default_working_memory(budget, s_.options.resolution),
                               s_.grown_working);
  if (budget <= wm) {
    throw ResourceError("vram budget " + format_mib(budget) + " leaves nothing beside the working memory of " +
                        format_mib(wm));
  }
  const uint64_t new_limit = budget - wm;
  uint64_t locked_min = 0;
  for (auto& e : s_.entries) {
    if (e->attached && e->locks > 0) locked_min += e->needs.minimum;
  }
  if (locked_min > new_limit) {
    throw ResourceError("vram budget " + format_mib(budget) + " is too small for the models in use: they need " +
                        format_mib(locked_min + wm) + " (" + std::to_string(locked_min + wm) +
                        " bytes, working memory included)");
  }
  const uint64_t old_budget = s_.budget, old_wm = s_.working_memory;
  s_.budget = budget;
  s_.working_memory = wm;
  uint64_t res = reserved();
  if (res > new_limit) {
    try {
      // Unlocked models first (partially, then whole), then locked ones partially.
      make_room(res - new_limit, nullptr);
      res = reserved();
      std::vector<Entry*> locked;
      for (auto& e : s_.entries) {
        if (e->attached && e->locks > 0) locked.push_back(e.get());
      }
      std::sort(locked.begin(), locked.end(), [](Entry* a, Entry* b) { return a->last_used < b->last_used; });
      for (Entry* e : locked) {
        if (res <= new_limit) break;
        const uint64_t take = std::min(res - new_limit, e->share - std::min(e->share, e->needs.minimum));
        if (take == 0) continue;
        resize(*e, e->share - take);  // not running: waited for above
        res -= take;
      }
    } catch (...) {
      s_.budget = old_budget;
      s_.working_memory = old_wm;
      throw;
    }
  }
  TORCH_INTERNAL_ASSERT(reserved() <= new_limit, "device shares over the new limit");
  if (!measured) s_.budget_source = source;
  // A budget cut: what the shrunk models freed leaves the process (Note [releasing cached
  // memory] in offload/device/device_allocator.h). Room made for another model stays cached for it.
  if (!measured && new_limit < old_budget - std::min(old_budget, old_wm)) s_.device->release_cached_memory();
  s_.device->set_memory_limit(new_limit);
  s_.device->reset_memory_peak();  // peaks count under the current budget
  if (!measured) {
    s_.device->reset_allocator_peak();
    log::info("vram budget " + format_mib(budget) + " on " + s_.device->name() + " (working memory " + format_mib(wm) +
              ")");
  }
  // More room: attached models grow towards what they want, most recently used first.
  std::vector<Entry*> grow;
  for (auto& e : s_.entries) {
    if (e->attached && e->in_ram()) grow.push_back(e.get());
  }
  std::sort(grow.begin(), grow.end(), [](Entry* a, Entry* b) { return a->last_used > b->last_used; });
  for (Entry* e : grow) {
    const uint64_t want = wanted_share(*e);
    if (e->share >= want) continue;
    const uint64_t free = unreserved();
    if (free == 0) break;
    resize(*e, e->share + std::min(free, want - e->share));
  }
}

void DeviceShares::grow_working_memory(uint64_t used, const std::string& model, const std::string& kind) {
  uint64_t budget = 0, before = 0, grown_before = 0;
  {
    Guard g(locking_.mutex());
    grown_before = s_.grown_working;
    s_.measured_working = std::max(s_.measured_working, used);
    if (used <= s_.working_memory || used <= s_.working_refused) return;
    before = s_.working_memory;
    s_.grown_working = std::max(s_.grown_working, used + used / 8);
    budget = s_.budget;
  }
  try {
    set_budget(budget, true);
  } catch (const ResourceError& e) {
    Guard g(locking_.mutex());
    s_.grown_working = grown_before;
    s_.working_refused = used;  // not tried again for this much
    if (!s_.working_warned) {
      s_.working_warned = true;
      log::warn("model '" + model + "': its first '" + kind + "' forward used " + format_mib(used) +
                " of device memory beyond the weights, more than the working memory of " + format_mib(before) +
                ", and the vram budget has no room to keep more: " + e.what());
    }
    return;
  }
  Guard g(locking_.mutex());
  log::info("model '" + model + "': its first '" + kind + "' forward used " + format_mib(used) +
            " of device memory beyond the weights, more than the working memory of " + format_mib(before) +
            ": working memory now " + format_mib(s_.working_memory) + " (measured plus a margin), vram limit " +
            format_mib(limit()));
}

}  // namespace sluice::cache
