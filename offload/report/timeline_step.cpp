#include "offload/report/timeline_step.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <set>

#include "offload/report/trace.h"
#include "runtime/error.h"

namespace sluice::offload {
namespace {

struct ForwardSpan {
  int64_t index = -1;
  std::string kind;
  bool complete = false;
  double ts = 0, dur = 0;
  nlohmann::json args;
};

struct LayerSpan {
  TimelineLane lane;
  int64_t forward;
  std::string layer;
  bool resident;
  bool stall;
  double ts, dur;
};

}  // namespace

TimelineStep timeline_step_from_trace(const std::string& trace_json, const std::string& kind) {
  std::vector<ForwardSpan> forwards;
  std::vector<LayerSpan> spans;
  try {
    const nlohmann::json doc = nlohmann::json::parse(trace_json);
    if (!doc.is_object() || !doc.contains("traceEvents") || !doc.at("traceEvents").is_array())
      throw InvalidArgument("timeline: the trace has no \"traceEvents\" array");
    for (const auto& e : doc.at("traceEvents")) {
      if (e.value("ph", "") != "X" || !e.contains("args")) continue;
      const nlohmann::json& args = e.at("args");
      const int tid = e.at("tid").get<int>();
      if (tid == static_cast<int>(TraceTrack::forward)) {
        ForwardSpan f;
        f.index = args.at("forward").get<int64_t>();
        f.kind = args.value("kind", "");
        f.complete = args.value("complete", false);
        f.ts = e.at("ts").get<double>();
        f.dur = e.at("dur").get<double>();
        f.args = args;
        forwards.push_back(std::move(f));
        continue;
      }
      TimelineLane lane;
      if (tid == static_cast<int>(TraceTrack::copy))
        lane = TimelineLane::copy;
      else if (tid == static_cast<int>(TraceTrack::upcast))
        lane = TimelineLane::upcast;
      else if (tid == static_cast<int>(TraceTrack::compute))
        lane = TimelineLane::compute;
      else
        continue;
      const std::string name = e.at("name").get<std::string>();
      spans.push_back({lane, args.at("forward").get<int64_t>(), args.value("layer", name),
                       args.value("resident", false), lane == TimelineLane::compute && name.rfind("wait ", 0) == 0,
                       e.at("ts").get<double>(), e.at("dur").get<double>()});
    }
  } catch (const nlohmann::json::exception& ex) {
    throw InvalidArgument(std::string("timeline: the trace is not the JSON a trace writer writes: ") + ex.what());
  }

  // See Note [timeline forward] in timeline_step.h.
  std::sort(forwards.begin(), forwards.end(), [](const auto& a, const auto& b) { return a.index < b.index; });
  std::set<int64_t> present;
  for (const auto& f : forwards) present.insert(f.index);
  std::vector<const ForwardSpan*> candidates;
  for (const auto& f : forwards)
    if (f.complete && f.kind == kind) candidates.push_back(&f);
  if (candidates.empty()) {
    throw InvalidArgument("timeline: the trace has no complete '" + kind + "' forward (" +
                          std::to_string(forwards.size()) +
                          " forwards traced; is tracing on, and did a forward of that kind run to its end?)");
  }
  std::map<int64_t, std::map<std::string, bool>> residency;  // forward -> layer -> resident
  for (const auto& s : spans)
    if (s.lane == TimelineLane::compute && !s.stall) residency[s.forward][s.layer] = s.resident;
  const ForwardSpan* pick = candidates.back();
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    if (present.count((*it)->index + 1) && residency[(*it)->index] == residency[pick->index]) {
      pick = *it;
      break;
    }
  }

  TimelineStep step;
  step.kind = pick->kind;
  step.forward = pick->index;
  step.begin_us = pick->ts;
  step.end_us = pick->ts + pick->dur;
  step.wall_ms = pick->args.value("wall_ms", pick->dur / 1000.0);
  step.bytes_streamed = pick->args.value("bytes_streamed", uint64_t{0});
  step.stall_ms = pick->args.value("stall_ms", 0.0);
  step.stalls = pick->args.value("stalls", int64_t{0});
  step.upcast_ms = pick->args.value("upcast_ms", 0.0);
  // The window the renderer draws is this forward's begin..end widened to its own spans;
  // other forwards' spans are kept when they overlap that (it clips them).
  double t0 = step.begin_us, t1 = step.end_us;
  for (const auto& s : spans) {
    if (s.forward != step.forward) continue;
    t0 = std::min(t0, s.ts);
    t1 = std::max(t1, s.ts + s.dur);
  }
  for (const auto& s : spans) {
    TimelineSpan t;
    t.lane = s.lane;
    t.layer = s.layer;
    t.begin_us = s.ts;
    t.dur_us = s.dur;
    t.resident = s.resident;
    t.stall = s.stall;
    if (s.forward == step.forward) {
      step.spans.push_back(std::move(t));
      continue;
    }
    const bool overlaps = s.ts + s.dur > t0 && s.ts < t1;
    if (s.forward == step.forward + 1 && s.lane == TimelineLane::copy && s.ts < step.end_us) {
      t.next = true;  // a prefetch issued during this forward
    } else if (overlaps) {
      t.other = true;
    } else {
      continue;
    }
    step.spans.push_back(std::move(t));
  }
  return step;
}

}  // namespace sluice::offload
