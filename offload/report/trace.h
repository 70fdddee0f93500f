#pragma once
// Chrome/Perfetto trace writer (the JSON "traceEvents" format that chrome://tracing and
// ui.perfetto.dev open). One process, one track (tid) per stream of work: the copy
// stream, upcasts, and compute; one "X" (complete) span per layer and per wait; and a
// "forward" track with one span per forward, begin to end on the compute stream.
//
// What the timestamps mean: microseconds since the trace's epoch (steady clock).
//  - CPU device: wall-clock times taken on the copy worker and the calling thread when
//    the work ran.
//  - Real devices: device event times (c10::Event elapsed times, timing enabled) placed
//    on the host clock at the host time their forward began. Spans are exact relative to
//    each other within a forward; across forwards they are aligned only as well as the
//    host's begin_forward() call is to the device's.
//
// Each span carries its "args" (shown by Perfetto when a span is selected; read by the
// timeline SVG, offload/report/timeline_svg.h). The engine gives (offload/engine/engine.cpp, resolve):
//  - layer spans (copy, upcast, compute, "wait <layer>"): forward (the index of the
//    forward the work is for: a prefetch issued during forward N for forward N+1 says
//    N+1), layer (its name), resident (whether the layer was resident when the work was
//    issued; copies are always of streamed layers);
//  - forward spans: forward, kind, complete (not aborted, in the recorded order),
//    wall_ms, bytes_streamed, stall_ms, upcast_ms, stalls, copies (as in ForwardRecord).
//
// Tested by (indirectly, through the traces the engine and its forward recorder write and the
// timeline reads): tests/offload/engine/test_engine.cpp ("engine: trace JSON has copy and upcast and compute
// tracks"), tests/offload/engine/test_forward_recorder.cpp ("forward recorder: a trace gets a forward span per
// forward and a span per layer"), tests/cli/test_run.cpp ("run: the trace is valid JSON with copy and
// upcast and compute tracks"), tests/api/test_api.cpp ("api: handles outlive the cache and the trace is
// written"), tests/offload/report/test_timeline.cpp ("timeline: the forward drawn is the last complete dit one, or
// an earlier one that shows its prefetches"), tests/python/test_offload.py
// (test_trace_and_timeline_of_an_offloaded_module).
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace sluice::offload {

enum class TraceTrack : int { copy = 1, upcast = 2, compute = 3, forward = 4 };
const char* trace_track_name(TraceTrack track);

using TraceArg = std::variant<int64_t, double, bool, std::string>;
using TraceArgs = std::vector<std::pair<std::string, TraceArg>>;

class TraceWriter {
 public:
  // Adds a span of `dur_us` starting at `ts_us`, with `args` for its "args" object.
  void add_span(TraceTrack track, std::string name, double ts_us, double dur_us, TraceArgs args = {});
  size_t size() const;
  void clear();
  // {"traceEvents": [...], "displayTimeUnit": "ms"} with thread_name metadata per track.
  std::string to_json() const;
  // Writes to_json() to `path`; throws FileError naming it.
  void write(const std::string& path) const;
  // Writes trace JSON rendered earlier (to_json() of some writer) to `path`, as write() does.
  static void write_json(const std::string& json, const std::string& path);

 private:
  struct Span {
    TraceTrack track;
    std::string name;
    double ts_us;
    double dur_us;
    TraceArgs args;
  };
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
};

}  // namespace sluice::offload
