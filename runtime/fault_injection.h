#pragma once
// Named fault points that tests and the stress driver arm to make sluice fail on purpose
// (device allocations, pinning, host->device copies, checkpoint and LoRA reads), so that
// every error path can be driven and checked. See Note [fault injection].
//
// Note [fault injection]
// ~~~~~~~~~~~~~~~~~~~~~~
// A fault point is a name checked at one place in the code:
//
//     if (fault::triggered("device.alloc.ring")) throw ResourceError("... (injected fault)");
//
// The code at the point decides what a failure there looks like (the same error the real
// failure raises, with "(injected fault)" in its message); this facility only answers
// "fail now?". Disarmed (the normal case), triggered() is one relaxed atomic load of a
// process-wide count of armed points, so points may sit on hot paths. When any point is
// armed, every check takes a mutex and, if its own name is armed, counts a hit (a test can
// arm a point with `count_only` to learn how many hits a run makes, then fail each hit in
// turn). Triggers:
//  - nth/count: fail hits nth .. nth+count-1 after arming (1-based);
//  - probability: fail each hit with probability p, from a generator seeded per arm, so a
//    single-threaded run fails at the same hits every time (several threads hitting one
//    point interleave nondeterministically, but the failure count stays seeded-random).
// Thread-safe: points may be hit and armed from any thread. Names are free-form; the ones
// wired into sluice are listed by known_points() (and in README.md).
#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace sluice::fault {

struct Trigger {
  uint64_t nth = 0;          // fail from the nth hit after arming (1-based); 0: no count trigger
  uint64_t count = 1;        // with nth: how many consecutive hits fail (UINT64_MAX: all from nth on)
  double probability = 0.0;  // fail each hit with this probability (0..1), seeded below
  uint64_t seed = 0;         // seed of the probability trigger's generator
  bool count_only = false;   // never fail: only count hits (arming makes hits counted at all)
};

// Arms `point` (replacing an earlier arming of it, counters reset). Throws InvalidArgument
// for an empty name, a probability outside [0, 1] or count 0.
void arm(const std::string& point, const Trigger& trigger);
void disarm(const std::string& point);
void disarm_all();

// Hits counted at `point` and failures it reported since it was last armed (also after
// disarm(), until it is armed again). 0 for a point never armed.
uint64_t hits(const std::string& point);
uint64_t fired(const std::string& point);
// Failures reported by all points since the process started (for the stress summary).
uint64_t total_fired();

// Arms points from a spec, e.g. "device.alloc.ring:nth=2;copy.h2d:p=0.01,seed=7" (what a
// stress driver reads from its command line or SLUICE_FAULTS). Keys: nth, count, p, seed,
// count_only (no value). Throws InvalidArgument naming `flag` and the bad part.
void arm_from_spec(std::string_view spec, const std::string& flag = "SLUICE_FAULTS");

// The fault points wired into sluice, with what failing each one simulates.
struct PointInfo {
  const char* name;
  const char* simulates;
};
const std::vector<PointInfo>& known_points();

namespace detail {
extern std::atomic<uint32_t> armed_points;
bool check(std::string_view point);
}  // namespace detail

// True when the armed trigger of `point` says this hit fails. See Note [fault injection].
inline bool triggered(std::string_view point) {
  if (detail::armed_points.load(std::memory_order_relaxed) == 0) return false;
  return detail::check(point);
}

// Arms a point for a scope (tests): disarms it on destruction.
class ScopedFault {
 public:
  ScopedFault(std::string point, const Trigger& trigger);
  ~ScopedFault();
  ScopedFault(const ScopedFault&) = delete;
  ScopedFault& operator=(const ScopedFault&) = delete;
  uint64_t hits() const { return fault::hits(point_); }
  uint64_t fired() const { return fault::fired(point_); }

 private:
  std::string point_;
};

}  // namespace sluice::fault
