#include "offload/report/trace.h"

#include <nlohmann/json.hpp>

#include <variant>

#include "runtime/text_file.h"

namespace sluice::offload {

const char* trace_track_name(TraceTrack track) {
  switch (track) {
    case TraceTrack::copy: return "copy stream";
    case TraceTrack::upcast: return "upcast";
    case TraceTrack::compute: return "compute";
    case TraceTrack::forward: return "forward";
  }
  return "?";
}

void TraceWriter::add_span(TraceTrack track, std::string name, double ts_us, double dur_us, TraceArgs args) {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.push_back({track, std::move(name), ts_us, dur_us < 0 ? 0 : dur_us, std::move(args)});
}

size_t TraceWriter::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return spans_.size();
}

void TraceWriter::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  spans_.clear();
}

std::string TraceWriter::to_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 1}, {"args", {{"name", "sluice"}}}});
  for (TraceTrack t : {TraceTrack::copy, TraceTrack::upcast, TraceTrack::compute, TraceTrack::forward}) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", static_cast<int>(t)},
                      {"args", {{"name", trace_track_name(t)}}}});
    events.push_back({{"name", "thread_sort_index"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", static_cast<int>(t)},
                      {"args", {{"sort_index", static_cast<int>(t)}}}});
  }
  for (const auto& s : spans_) {
    nlohmann::json e = {{"name", s.name},
                        {"cat", trace_track_name(s.track)},
                        {"ph", "X"},
                        {"ts", s.ts_us},
                        {"dur", s.dur_us},
                        {"pid", 1},
                        {"tid", static_cast<int>(s.track)}};
    if (!s.args.empty()) {
      nlohmann::json args = nlohmann::json::object();
      for (const auto& [key, value] : s.args) std::visit([&](const auto& v) { args[key] = v; }, value);
      e["args"] = std::move(args);
    }
    events.push_back(std::move(e));
  }
  nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  return doc.dump();
}

void TraceWriter::write(const std::string& path) const { write_json(to_json(), path); }

void TraceWriter::write_json(const std::string& json, const std::string& path) {
  write_text_file(path, json, "trace");
}

}  // namespace sluice::offload
