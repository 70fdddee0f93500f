#include "runtime/fault_injection.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <random>

#include "runtime/error.h"

namespace sluice::fault {

namespace detail {
std::atomic<uint32_t> armed_points{0};
}  // namespace detail

namespace {

struct PointState {
  Trigger trigger;
  bool armed = false;
  uint64_t hits = 0;
  uint64_t fired = 0;
  std::mt19937_64 rng;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, PointState, std::less<>> points;
  std::atomic<uint64_t> total_fired{0};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: points may be hit during exit
  return *r;
}

bool decide(PointState& s) {
  const Trigger& t = s.trigger;
  if (t.count_only) return false;
  // Draw on every hit, also those the count trigger fails, so the probabilistic failures
  // depend on the seed and the hit index only.
  const bool by_chance =
      t.probability > 0.0 && std::uniform_real_distribution<double>(0.0, 1.0)(s.rng) < t.probability;
  bool by_count = false;
  if (t.nth > 0 && s.hits >= t.nth) {
    const uint64_t past = s.hits - t.nth;  // 0 for the nth hit itself
    by_count = t.count == std::numeric_limits<uint64_t>::max() || past < t.count;
  }
  return by_count || by_chance;
}

}  // namespace

bool detail::check(std::string_view point) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.points.find(point);
  if (it == r.points.end() || !it->second.armed) return false;
  PointState& s = it->second;
  ++s.hits;
  if (!decide(s)) return false;
  ++s.fired;
  r.total_fired.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void arm(const std::string& point, const Trigger& trigger) {
  if (point.empty()) throw InvalidArgument("fault injection: empty fault point name");
  if (!(trigger.probability >= 0.0 && trigger.probability <= 1.0)) {
    throw InvalidArgument("fault injection: probability for '" + point + "' must be in [0, 1]");
  }
  if (trigger.count == 0) throw InvalidArgument("fault injection: count for '" + point + "' must be at least 1");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  PointState& s = r.points[point];
  if (!s.armed) detail::armed_points.fetch_add(1, std::memory_order_relaxed);
  s.trigger = trigger;
  s.armed = true;
  s.hits = 0;
  s.fired = 0;
  s.rng.seed(trigger.seed);
}

void disarm(const std::string& point) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.points.find(point);
  if (it == r.points.end() || !it->second.armed) return;
  it->second.armed = false;
  detail::armed_points.fetch_sub(1, std::memory_order_relaxed);
}

void disarm_all() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto& [name, s] : r.points) {
    if (s.armed) detail::armed_points.fetch_sub(1, std::memory_order_relaxed);
    s.armed = false;
  }
}

uint64_t hits(const std::string& point) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.points.find(point);
  return it == r.points.end() ? 0 : it->second.hits;
}

uint64_t fired(const std::string& point) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.points.find(point);
  return it == r.points.end() ? 0 : it->second.fired;
}

uint64_t total_fired() { return registry().total_fired.load(std::memory_order_relaxed); }

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

uint64_t parse_u64(std::string_view v, const std::string& flag, std::string_view part) {
  const std::string s(v);
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 19) {
    throw InvalidArgument(flag + ": '" + std::string(part) + "': expected a whole number");
  }
  return std::stoull(s);
}

}  // namespace

void arm_from_spec(std::string_view spec, const std::string& flag) {
  std::vector<std::pair<std::string, Trigger>> parsed;
  while (!spec.empty()) {
    const size_t semi = spec.find(';');
    const std::string_view part = trim(spec.substr(0, semi));
    spec = semi == std::string_view::npos ? std::string_view() : spec.substr(semi + 1);
    if (part.empty()) continue;
    const size_t colon = part.find(':');
    const std::string name(trim(part.substr(0, colon)));
    if (name.empty()) throw InvalidArgument(flag + ": '" + std::string(part) + "': no fault point name");
    Trigger t;
    std::string_view opts = colon == std::string_view::npos ? std::string_view() : part.substr(colon + 1);
    bool any = false;
    while (!opts.empty()) {
      const size_t comma = opts.find(',');
      const std::string_view kv = trim(opts.substr(0, comma));
      opts = comma == std::string_view::npos ? std::string_view() : opts.substr(comma + 1);
      if (kv.empty()) continue;
      const size_t eq = kv.find('=');
      const std::string_view key = trim(kv.substr(0, eq));
      const std::string_view value = eq == std::string_view::npos ? std::string_view() : trim(kv.substr(eq + 1));
      if (key == "count_only" && eq == std::string_view::npos) {
        t.count_only = true;
      } else if (key == "nth") {
        t.nth = parse_u64(value, flag, part);
      } else if (key == "count") {
        t.count = value == "all" ? std::numeric_limits<uint64_t>::max() : parse_u64(value, flag, part);
      } else if (key == "seed") {
        t.seed = parse_u64(value, flag, part);
      } else if (key == "p") {
        const std::string v(value);
        char* end = nullptr;
        t.probability = v.empty() ? -1.0 : std::strtod(v.c_str(), &end);
        if (v.empty() || end != v.c_str() + v.size() || !(t.probability >= 0.0 && t.probability <= 1.0)) {
          throw InvalidArgument(flag + ": '" + std::string(part) + "': p must be a number in [0, 1]");
        }
      } else {
        throw InvalidArgument(flag + ": '" + std::string(part) + "': unknown key '" + std::string(key) +
                              "' (use nth, count, p, seed or count_only)");
      }
      any = true;
    }
    if (!any) throw InvalidArgument(flag + ": '" + std::string(part) + "': give nth=, p= or count_only");
    if (t.count == 0) throw InvalidArgument(flag + ": '" + std::string(part) + "': count must be at least 1");
    parsed.emplace_back(name, t);
  }
  for (const auto& [name, t] : parsed) arm(name, t);  // all or nothing
}

const std::vector<PointInfo>& known_points() {
  static const std::vector<PointInfo> points = {
      {"device.alloc.resident", "device out of memory allocating a resident layer's weights"},
      {"device.alloc.ring", "device out of memory allocating a staging slot"},
      {"device.alloc.scratch", "device out of memory allocating upcast scratch"},
      {"device.alloc.params", "device out of memory allocating norms, biases and buffers"},
      {"device.alloc.lora", "device out of memory allocating a LoRA sidecar"},
      {"host.pin", "page-locking (pinning) host memory fails: a chunk of the pinned arena for streamed layers"},
      {"host.pin.bounce", "page-locking the bounce ring for pageable copies fails (copies become synchronous)"},
      {"copy.h2d.enqueue", "enqueuing a host->device copy fails at once"},
      {"copy.h2d", "a host->device copy fails on the copy stream (reported at the next event)"},
      {"copy.h2d.timeout", "a host->device copy stalls and is reported as timed out"},
      {"safetensors.read", "reading a tensor's bytes from a checkpoint fails (I/O error)"},
      {"lora.read", "reading a LoRA file's tensor fails"},
      {"lora.patch", "converting a LoRA sidecar for a layer fails while a LoraScope is built"},
      {"layer.forward", "a Linear's forward throws while it holds its weight lease"},
  };
  return points;
}

ScopedFault::ScopedFault(std::string point, const Trigger& trigger) : point_(std::move(point)) {
  arm(point_, trigger);
}

ScopedFault::~ScopedFault() { disarm(point_); }

}  // namespace sluice::fault
