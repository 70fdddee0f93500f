#pragma once
// Picks the forward a timeline draws (Note [timeline svg] in timeline_svg.h) out of a
// trace's JSON (TraceWriter::to_json, with the span args of offload/report/trace.h) and fills a
// TimelineStep with its spans, the spans of other forwards that overlap it, and its
// totals. The caller adds what the trace does not hold: the model's name and the plan's
// floor and prediction.
//
// Note [timeline forward]
// ~~~~~~~~~~~~~~~~~~~~~~~
// The forward is the last complete one of `kind` (not aborted, in the recorded order),
// with one refinement: the copies a forward issues for the next one are in the trace only
// once that next forward has run (they are its spans), so the run's last forward never
// shows them. When an earlier complete forward of the kind ran under the same residency
// as the last (every layer resident or streamed alike) and was followed by another
// forward, that one is drawn instead: the same steady state, with its prefetches for the
// next forward on the copy lane.
#include <string>

#include "offload/report/timeline_svg.h"

namespace sluice::offload {

// InvalidArgument when the trace has no complete forward of `kind` (tracing was off,
// or no such forward ran), or when `trace_json` is not a trace.
TimelineStep timeline_step_from_trace(const std::string& trace_json, const std::string& kind = "dit");

}  // namespace sluice::offload
