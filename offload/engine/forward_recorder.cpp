#include "offload/engine/forward_recorder.h"

#include <sstream>

#include "runtime/logging.h"
#include "runtime/size_parse.h"

namespace sluice::offload {

double ForwardRecorder::now_us() const {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - epoch0_).count();
}

double ForwardRecorder::trace_us(const DeviceEvent& e) const {
  return trace_origin_->host_us + device_.elapsed_ms(*trace_origin_->event, e) * 1000.0;
}

void ForwardRecorder::open(bool fresh, bool detail) {
  cur_ = std::move(next_);
  next_ = ForwardAcc{};
  if (fresh) cur_ = ForwardAcc{};
  cur_.detail = detail;
}

void ForwardRecorder::anchor() {
  anchor_ = std::make_shared<Anchor>();
  anchor_->event = device_.create_event();
  device_.record(*anchor_->event, StreamKind::compute);
  anchor_->host_us = now_us();
  if (residency_.options().trace && !trace_origin_) trace_origin_ = anchor_;
}

void ForwardRecorder::note_acquire(int64_t layer) {
  if (!cur_.detail) return;
  cur_.ids.push_back(layer);
  cur_.marks.push_back(mark());
  cur_.stall_span.push_back(-1);
}

std::unique_ptr<DeviceEvent> ForwardRecorder::take_event() {
  if (event_pool_.empty()) return device_.create_event();
  std::unique_ptr<DeviceEvent> e = std::move(event_pool_.back());
  event_pool_.pop_back();
  return e;
}

std::unique_ptr<DeviceEvent> ForwardRecorder::mark() {
  std::unique_ptr<DeviceEvent> e = take_event();
  device_.record(*e, StreamKind::compute);
  return e;
}

void ForwardRecorder::add_span(ForwardAcc& acc, TraceTrack track, SpanKind kind, int64_t layer,
                               std::unique_ptr<DeviceEvent> a, std::unique_ptr<DeviceEvent> b) {
  const bool resident = residency_.records().at(layer).resident;
  acc.spans.push_back(ForwardAcc::Span{track, kind, layer, resident, std::move(a), std::move(b)});
  if (kind == SpanKind::stall && &acc == &cur_ && cur_.detail && !cur_.stall_span.empty()) {
    cur_.stall_span.back() = static_cast<int>(cur_.spans.size()) - 1;
  }
}

bool ForwardRecorder::close(const ForwardRecord& record, bool complete) {
  Unresolved u;
  u.record = record;
  u.acc = std::move(cur_);
  u.complete = complete;
  u.begin = anchor_;
  u.end = device_.create_event();
  device_.record(*u.end, StreamKind::compute);
  const bool detail = u.acc.detail;
  unresolved_.push_back(std::move(u));
  cur_ = ForwardAcc{};
  return detail;
}

void ForwardRecorder::clear() noexcept {
  cur_ = ForwardAcc{};
  next_ = ForwardAcc{};
  unresolved_.clear();
  anchor_.reset();
}

void ForwardRecorder::resolve(bool wait_all) {
  while (!unresolved_.empty()) {
    Unresolved& u = unresolved_.front();
    if (!wait_all && unresolved_.size() == 1 && !u.end->query()) break;
    resolve_one(u);
    records_.push_back(u.record);
    while (records_.size() > residency_.options().max_forward_records) records_.pop_front();
    unresolved_.pop_front();
  }
  if (event_pool_.size() > 4096) event_pool_.resize(4096);
}

void ForwardRecorder::resolve_one(Unresolved& u) {
  const EngineOptions& options = residency_.options();
  const ModelRecords& layers = residency_.records();
  u.end->synchronize();
  ForwardRecord& rec = u.record;
  double copy_ms = 0;
  std::vector<double> span_ms;
  span_ms.reserve(u.acc.spans.size());
  std::vector<std::pair<uint64_t, double>> copies;
  for (auto& sp : u.acc.spans) {
    sp.a->synchronize();
    sp.b->synchronize();
    const double ms = device_.elapsed_ms(*sp.a, *sp.b);
    span_ms.push_back(ms);
    switch (sp.kind) {
      case SpanKind::copy:
        copy_ms += ms;
        copies.emplace_back(layers.at(sp.layer).stored_bytes, ms);
        break;
      case SpanKind::stall:
        rec.stall_ms += ms;
        if (ms >= kStallMs) rec.stalls += 1;
        break;
      case SpanKind::upcast: rec.upcast_ms += ms; break;
      case SpanKind::compute: break;
    }
    if (options.trace && !(sp.kind == SpanKind::stall && ms < kStallMs)) {
      const double ts = trace_us(*sp.a);
      const std::string& name = layers.at(sp.layer).name;
      trace_.add_span(sp.track, sp.kind == SpanKind::stall ? "wait " + name : name, ts, ms * 1000.0,
                      {{"forward", static_cast<int64_t>(rec.index)}, {"layer", name}, {"resident", sp.resident}});
    }
    event_pool_.push_back(std::move(sp.a));  // done: reusable
    event_pool_.push_back(std::move(sp.b));
  }
  rec.wall_ms = device_.elapsed_ms(*u.begin->event, *u.end);
  rec.h2d_gbps = copy_ms > 0 ? static_cast<double>(rec.bytes_streamed) / (copy_ms * 1e6) : 0.0;
  if (options.trace) {
    // The forward as a whole, begin to end on the compute stream, with its totals.
    const std::string title = "forward " + std::to_string(rec.index) + (rec.kind.empty() ? "" : " " + rec.kind);
    trace_.add_span(TraceTrack::forward, title, trace_us(*u.begin->event), rec.wall_ms * 1000.0,
                    {{"forward", static_cast<int64_t>(rec.index)},
                     {"kind", rec.kind},
                     {"complete", u.complete},
                     {"wall_ms", rec.wall_ms},
                     {"bytes_streamed", static_cast<int64_t>(rec.bytes_streamed)},
                     {"stall_ms", rec.stall_ms},
                     {"upcast_ms", rec.upcast_ms},
                     {"stalls", static_cast<int64_t>(rec.stalls)},
                     {"copies", static_cast<int64_t>(rec.copies)}});
  }
  if (options.timed() && options.plan_from_measurements) {
    Calibrator& calib = residency_.calibrator();
    ForwardSample sample;
    if (u.acc.detail && u.complete) {
      sample.kind = rec.kind;
      sample.order = u.acc.ids;
      sample.wall_ms = rec.wall_ms;
      sample.copies = std::move(copies);
      for (size_t i = 0; i < u.acc.marks.size(); ++i) {
        u.acc.marks[i]->synchronize();
        sample.acquire_ms.push_back(device_.elapsed_ms(*u.begin->event, *u.acc.marks[i]));
        const int k = u.acc.stall_span[i];
        sample.stall_ms.push_back(k >= 0 ? span_ms[static_cast<size_t>(k)] : 0.0);
        event_pool_.push_back(std::move(u.acc.marks[i]));
      }
    }
    if (!u.acc.detail && u.complete) calib.copies(copies);
    calib.forward(rec.kind, u.acc.detail, rec.wall_ms, u.complete ? &sample : nullptr);
  }
  if (log::enabled(log::Level::debug)) {
    std::ostringstream line;
    line.setf(std::ios::fixed);
    line.precision(2);
    line << "Forward " << rec.index << " of '" << residency_.model_name() << "': streamed "
         << format_mib(rec.bytes_streamed) << " in " << rec.copies << " copies (" << rec.demand_copies
         << " on demand) at " << rec.h2d_gbps << " GB/s, " << rec.stalls << " stalls " << rec.stall_ms
         << " ms, upcast " << rec.upcast_ms << " ms, wall " << rec.wall_ms << " ms" << (rec.diverged ? ", diverged" : "")
         << (rec.aborted ? ", aborted" : "");
    log::debug(line.str());
  }
}

}  // namespace sluice::offload
