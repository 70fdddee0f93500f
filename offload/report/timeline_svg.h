#pragma once
// A self-contained SVG timeline of one forward: what `sluice run --timeline FILE.svg`
// and Model::write_timeline_svg() write. Rendering only: the input is a plain struct
// (offload/report/timeline_step.h picks the forward out of a trace and fills it).
//
// Note [timeline svg]
// ~~~~~~~~~~~~~~~~~~~
// The trace (offload/report/trace.h) holds every span of every forward: right for Perfetto,
// too much to read at a glance. The timeline draws one steady-state step, the forward
// the run repeats (a denoising step is one "dit" forward; with CFG, one forward of batch
// 2), on three lanes that share one time axis in ms since the forward began:
//  - copy: host->device copies of streamed layers on the copy stream. Copies for this
//    forward may start before it (prefetches issued during the previous one); copies for
//    the *next* forward issued during this one are drawn lighter ("prefetch for next
//    forward"), so the copy stream's whole occupancy is visible and none are dropped;
//  - upcast: storage -> compute dtype conversions (fp8/bf16 -> compute) on the compute
//    stream;
//  - compute: each layer's forward, and the stalls: compute waiting for a layer's copy
//    (the trace's "wait <layer>" spans), red hatched boxes, counted in the caption.
// Layer boxes are coloured by residency (resident or streamed, the legend says which);
// each is labelled with as much of its layer name as fits (Note [timeline labels] in
// timeline_svg.cpp) and carries the full name in a <title> (a browser shows it on hover).
// Work of other forwards inside the window (the previous forward's compute beside the
// early copies) is drawn grey, and the time outside this forward's begin..end shaded.
// The caption gives the step's totals: wall time, bytes streamed, stalls, upcast time,
// and the plan's floor and predicted step when the plan is from measurements; the plan
// predicts a steady state, so the picture beside it is one steady-state forward, not a
// sum over the run (whose first forwards are measured in detail and run under a plan
// not yet made from measurements, Note [calibration]).
//
// Structure, for tests and tools (stable):
//   <svg data-forward="N" ...>
//     <text id="title">, <text id="caption" data-bytes-streamed= data-wall-ms=
//       data-stall-ms= data-upcast-ms= data-stalls= [data-floor-ms=]
//       [data-predicted-step-ms=]>
//     <g id="lane-copy" class="lane">, <g id="lane-upcast" class="lane">,
//     <g id="lane-compute" class="lane">: one
//       <rect class="span resident|streamed|stall [next]|other" data-layer="NAME"
//             data-begin-ms= data-dur-ms= x= width=...><title>...</title></rect>
//       per span (class "next": a copy for the next forward; "other": another forward's
//       work, no residency class), labels in <text class="label">;
//     <g id="axis" data-x0= data-x1= data-t0-ms= data-t1-ms=> ticks in ms;
//     <g id="legend">.
// No scripts, no external fonts, images or links: it opens in any browser offline.
//
// Tested by (directly through render_timeline_svg on a hand-built step, and through `sluice run
// --timeline` and the API): tests/offload/report/test_timeline.cpp ("timeline: the renderer puts known spans at
// known positions and escapes names", "timeline: sluice run --timeline draws one forward's layers
// on three lanes", "timeline: bad paths and a model without a traced forward are one-line errors"),
// tests/python/test_offload.py (test_trace_and_timeline_of_an_offloaded_module),
// tests/python/test_timeline_browser.py (a script: headless Chromium draws the SVG and its pixels
// are checked).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace sluice::offload {

enum class TimelineLane { copy, upcast, compute };

struct TimelineSpan {
  TimelineLane lane = TimelineLane::compute;
  std::string layer;    // full layer name
  double begin_us = 0;  // on the trace's clock
  double dur_us = 0;
  bool resident = false;  // the layer was resident (copies: always false)
  bool stall = false;     // compute waiting for this layer's copy (lane compute)
  bool next = false;      // a copy for the next forward, issued during this one
  bool other = false;     // work of another forward that falls inside the window
};

struct TimelineStep {
  std::string model;
  std::string kind;      // "dit"
  int64_t forward = -1;  // the forward's index
  double begin_us = 0;   // the forward's begin and end on the compute stream
  double end_us = 0;
  std::vector<TimelineSpan> spans;
  double wall_ms = 0;
  uint64_t bytes_streamed = 0;
  double stall_ms = 0;  // all waits for copies (stalls: those long enough to count)
  int64_t stalls = 0;
  double upcast_ms = 0;
  std::optional<double> floor_ms;           // the plan's, for this kind
  std::optional<double> predicted_step_ms;  // the plan's, for this kind
};

// The SVG document (UTF-8). InvalidArgument if end_us <= begin_us.
std::string render_timeline_svg(const TimelineStep& step);
// Writes `svg` to `path`; FileError naming it.
void write_timeline_svg_file(const std::string& svg, const std::string& path);

}  // namespace sluice::offload
