#pragma once
// ForwardRecorder: what each forward of a streaming engine leaves behind for the stats, the
// trace and the calibrator. While a forward runs (forward_pass.h) it counts its copies and
// stalls and places device events around its copies, copy waits, upcasts and compute; when
// the forward ends its events wait, unresolved, until the device has run past them. They
// are then read into a ForwardRecord (stats.h), the trace's spans (trace.h) and, for the
// forwards measured in detail, the calibrator's samples (Note [calibration] in
// calibration.h). Reading never waits for the device unless asked to (stats(wait)).
//
// Note [trace clock]
// ~~~~~~~~~~~~~~~~~~
// Every forward records an anchor event on the compute stream at its start, with the host
// time it was recorded. While tracing, the first forward's anchor is the origin: every
// span is placed at the origin's host time plus the device time elapsed since the origin's
// event, so that forwards line up on the device's clock. (A host running ahead of its
// device, as with any GPU, records the next forward's anchor before the device has
// finished the last forward: host times alone would overlap the forwards.)
//
// Not thread-safe: the engine's single thread.
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/model_residency.h"
#include "offload/report/stats.h"
#include "offload/report/trace.h"

namespace sluice::offload {

enum class SpanKind { copy, stall, upcast, compute };

// A forward's counts and timing events, filled while it runs.
struct ForwardAcc {
  struct Span {
    TraceTrack track;
    SpanKind kind;
    int64_t layer;
    bool resident;  // the layer's residency when the work was issued (for the trace)
    std::unique_ptr<DeviceEvent> a, b;
  };
  uint64_t bytes = 0, copies = 0, demand = 0, stalls = 0;
  std::vector<Span> spans;
  // Measured in detail (Note [calibration]): per acquire, its layer, an event before its
  // copy wait, and the index of its stall span in `spans` (-1: none).
  bool detail = false;
  std::vector<int64_t> ids;
  std::vector<std::unique_ptr<DeviceEvent>> marks;
  std::vector<int> stall_span;
};

class ForwardRecorder {
 public:
  explicit ForwardRecorder(ModelResidency& residency) : residency_(residency), device_(residency.device()) {}

  // The open forward's accumulator, and the one prefetches for the next forward count in.
  ForwardAcc& current() { return cur_; }
  ForwardAcc& next() { return next_; }
  // A forward opens: what was prefetched for it becomes its own (none when `fresh`: the
  // prefetches were made for a forward of another kind); `detail`: measured in detail.
  void open(bool fresh, bool detail);
  // Its anchor on the compute stream, after the forward's waits (Note [trace clock]).
  void anchor();
  // An acquire of `layer` in a forward measured in detail: its mark before the copy wait.
  void note_acquire(int64_t layer);
  // A span from event `a` to `b` for `layer` (recorded by the caller) into `acc`; a stall
  // span of the current forward is also the stall of its latest acquire.
  void add_span(ForwardAcc& acc, TraceTrack track, SpanKind kind, int64_t layer, std::unique_ptr<DeviceEvent> a,
                std::unique_ptr<DeviceEvent> b);
  std::unique_ptr<DeviceEvent> take_event();  // from the pool of finished events
  std::unique_ptr<DeviceEvent> mark();        // take_event() recorded on the compute stream
  // The open forward ended as `record`; `complete`: not aborted and in the recorded order
  // (its measurements count). Returns whether it was measured in detail.
  bool close(const ForwardRecord& record, bool complete);
  // Reads the events of ended forwards the device has finished (all of them, waiting,
  // with `wait_all`) into records, trace spans and calibrator samples.
  void resolve(bool wait_all);
  // The model was detached: its forwards' events and accumulators go (records stay).
  void clear() noexcept;

  const std::deque<ForwardRecord>& records() const { return records_; }
  TraceWriter& trace() { return trace_; }

 private:
  struct Anchor {
    std::unique_ptr<DeviceEvent> event;  // recorded on the compute stream
    double host_us = 0;                  // host time it was recorded, since trace epoch
  };
  struct Unresolved {
    ForwardRecord record;
    ForwardAcc acc;
    bool complete = false;
    std::shared_ptr<Anchor> begin;
    std::unique_ptr<DeviceEvent> end;
  };
  // A compute-stream wait for a copy shorter than this is no stall (two events around a
  // wait that had nothing to wait for read a few microseconds).
  static constexpr double kStallMs = 0.02;

  double now_us() const;
  double trace_us(const DeviceEvent& e) const;  // Note [trace clock]
  void resolve_one(Unresolved& u);

  ModelResidency& residency_;
  DeviceStreams& device_;  // events only
  ForwardAcc cur_, next_;
  std::shared_ptr<Anchor> anchor_;
  std::shared_ptr<Anchor> trace_origin_;  // Note [trace clock]: the first forward's anchor while tracing
  std::deque<Unresolved> unresolved_;
  std::deque<ForwardRecord> records_;
  std::vector<std::unique_ptr<DeviceEvent>> event_pool_;
  std::chrono::steady_clock::time_point epoch0_ = std::chrono::steady_clock::now();
  TraceWriter trace_;
};

}  // namespace sluice::offload
