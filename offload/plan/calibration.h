#pragma once
// Calibration: the measurements the balanced plan is made from (Note [cost model]), and
// the check that its prediction holds.
//
// Note [calibration]
// ~~~~~~~~~~~~~~~~~~
// The engine measures the second complete forward of each kind in detail (the first pays
// one-time costs: the allocator's first blocks, kernel and library initialisation, and on
// the CPU cold caches, which made predictions from it 20% high): one compute-
// stream event at every acquire, before its copy wait. Position i then computed for the
// time from its acquire to the next one, minus its own wait for a copy; the last position
// runs to the end of the forward, and the time before the first acquire (work outside
// managed layers: embeddings, RoPE) is added to it as well, since in the steady state it
// sits between the last layer of one forward and the first of the next, where copies run
// under it. Every streamed copy is timed on the copy stream; the copy model is the least
// squares line ms = overhead + bytes / rate over those copies (a plain bytes / time rate
// when their sizes are all alike), so a per-copy latency is not mistaken for bandwidth.
//
// Once a kind has a profile the engine replans with it (ModelResidency::replan_if_measured,
// between forwards, never during one; the host waits for the end of a forward measured in
// detail, so the plan follows it at once on an asynchronous device too). Under the new
// plan the first forward of each kind warms the ring up
// and the second is compared with the prediction: when it is more than 15% off, that
// forward (measured in detail as well) replaces the kind's profile and the plan is made
// again, once per attach. The stats report the prediction, the floor and the median
// measured step of the forwards under the plan.
//
// The calibrator knows no devices: the engine hands it times in milliseconds.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "offload/plan/cost_model.h"

namespace sluice::offload {

// One forward, measured in detail.
struct ForwardSample {
  std::string kind;
  std::vector<int64_t> order;       // layer ids in acquire order
  std::vector<double> acquire_ms;   // per acquire: device time from the forward's begin to the acquire
  std::vector<double> stall_ms;     // per acquire: its wait for a copy
  double wall_ms = 0;               // begin to end of the forward
  std::vector<std::pair<uint64_t, double>> copies;  // stored bytes and copy-stream ms of each copy
};

// compute_ms per position of `s` (Note [calibration]); empty when the sample is inconsistent.
std::vector<double> compute_times(const ForwardSample& s);

// ms = overhead + bytes / (gbps * 1e6) fitted to `copies`; nullopt when there are none or
// they took no time. `gbps` is in GB/s (1e9 bytes per second).
struct CopyFit {
  double gbps = 0;
  double overhead_ms = 0;
};
std::optional<CopyFit> fit_copies(const std::vector<std::pair<uint64_t, double>>& copies);

class Calibrator {
 public:
  static constexpr double kTolerance = 0.15;  // relative error of a prediction that triggers a new plan

  // A forward of `kind` begins: should it be measured in detail? (Decided when it begins,
  // since on an asynchronous device earlier forwards may not be resolved yet.)
  bool begin(const std::string& kind);
  // A forward of `kind` was resolved, in the order they began: `detailed` when begin()
  // said so. `sample` is its measurement, null when it was aborted or left the recorded
  // order (then it counts for nothing, and a later forward is measured instead).
  void forward(const std::string& kind, bool detailed, double wall_ms, const ForwardSample* sample);
  // Copies timed in a forward not measured in detail: used while no copy was timed yet
  // (the profile forward streamed nothing, and a residency change made layers stream).
  void copies(const std::vector<std::pair<uint64_t, double>>& timed);

  // A new plan should be made from measurements (a kind got its first profile, or a check
  // found the prediction off by more than kTolerance).
  bool replan_due() const { return replan_due_; }
  // The costs as measured so far (usable() once a kind has a profile and copies were timed).
  CostModel model(size_t layers) const;
  // A plan was made from model(): its predictions, to check against what comes next.
  void planned(const std::vector<KindPrediction>& predictions);
  // Plans not from measurements (a residency change without costs): stop checking.
  void unplanned();

  bool recomputed() const { return recomputed_; }
  uint64_t measured_plans() const { return measured_plans_; }
  const std::optional<CopyFit>& copy_fit() const { return copy_; }
  // Median wall time of the forwards of `kind` under the current plan, after the first
  // (0 with none), and how many there were.
  double measured_step_ms(const std::string& kind) const;
  uint64_t measured_forwards(const std::string& kind) const;
  // The kind with the most forwards ("" with none).
  std::string main_kind() const;
  // Forgets everything (a new attach).
  void reset() { *this = Calibrator(); }

 private:
  struct Kind {
    std::vector<int64_t> order;
    std::vector<double> compute_ms;   // empty: no profile yet
    uint64_t forwards = 0;
    std::optional<double> predicted;  // step under the current plan
    uint64_t started = 0;             // forwards begun
    uint64_t started_under_plan = 0;  // of which since the plan
    bool pending = false;             // a forward measured in detail is not resolved yet
    uint64_t under_plan = 0;          // forwards of this kind resolved since the plan
    std::vector<double> steps;        // their wall times, after the first
  };
  void take_profile(Kind& k, const ForwardSample& s);

  std::map<std::string, Kind> kinds_;
  std::vector<std::pair<uint64_t, double>> copies_;  // every timed copy of the profiles
  std::optional<CopyFit> copy_;
  bool replan_due_ = false;
  bool recomputed_ = false;
  uint64_t measured_plans_ = 0;
};

}  // namespace sluice::offload
