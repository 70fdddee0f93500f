// ForwardRecorder (offload/engine/forward_recorder.h) on its own, without the streaming engine or
// a forward pass: forwards are opened, given spans and closed by hand over a toy model
// attached through a ModelResidency (which supplies the records, options and calibrator).
// Checks the records it keeps, the accumulators it hands over, the trace spans it writes
// and what reaches the calibrator. No assertion reads a time: spans that must be long
// are made so by a sleep between their events, and the one that must be short is
// recorded end first (Note [trace clock] in forward_recorder.h is about placing spans,
// not their lengths).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "offload/device/cpu_device.h"
#include "offload/device/device.h"
#include "offload/engine/engine_options.h"
#include "offload/engine/forward_recorder.h"
#include "offload/engine/model_residency.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice;
using namespace sluice::offload;
using sluice::testing::ToyModel;
using sluice::testing::ToyOptions;

namespace {

constexpr uint64_t MiB = 1ull << 20;

// Layer ids of the toy model with two blocks.
constexpr int64_t kEmbedder = 0;  // x_embedder
constexpr int64_t kUp0 = 1;       // blocks.0.up
constexpr int64_t kMid0 = 2;      // blocks.0.mid

struct Rig {
  std::shared_ptr<DeviceBackend> dev;
  EngineOptions options;  // the residency keeps a reference
  ToyModel model;
  ModelResidency residency;
  ForwardRecorder recorder;

  explicit Rig(std::shared_ptr<DeviceBackend> device, EngineOptions o = {})
      : dev(std::move(device)), options(make_options(dev, std::move(o))), model(toy()), residency(dev, options),
        recorder(residency) {
    // Half resident: the spans name layers of both kinds.
    residency.attach(*model, "toy", 64 * MiB, nullptr);
    residency.replan(residency.limits().weight_budget, 0.5);
  }
  ~Rig() {
    recorder.clear();
    residency.detach();
  }

  static EngineOptions make_options(std::shared_ptr<DeviceBackend> dev, EngineOptions o) {
    o.device = std::move(dev);
    o.log_attach = false;
    return resolve_engine_options(std::move(o));
  }
  static ToyModel toy() {
    ToyOptions t;
    t.blocks = 2;
    return ToyModel(t);
  }

  // A span into `acc` from two compute-stream marks; `sleep_ms` between them makes it
  // at least that long, and `reversed` records its end first (no longer than zero).
  void span(ForwardAcc& acc, TraceTrack track, SpanKind kind, int64_t layer, double sleep_ms = 0,
            bool reversed = false) {
    std::unique_ptr<DeviceEvent> a, b;
    if (reversed) {
      b = recorder.mark();
      a = recorder.mark();
    } else {
      a = recorder.mark();
      if (sleep_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(sleep_ms));
      b = recorder.mark();
    }
    recorder.add_span(acc, track, kind, layer, std::move(a), std::move(b));
  }

  // An empty forward: opened, anchored and closed as `record`.
  bool forward(uint64_t index, const std::string& kind, bool complete = true) {
    recorder.open(false, false);
    recorder.anchor();
    return recorder.close(record(index, kind), complete);
  }

  static ForwardRecord record(uint64_t index, const std::string& kind) {
    ForwardRecord rec;
    rec.index = index;
    rec.kind = kind;
    return rec;
  }
};

EngineOptions with_records(size_t n) {
  EngineOptions o;
  o.max_forward_records = n;
  return o;
}

EngineOptions traced() {
  EngineOptions o;
  o.trace = true;
  return o;
}

// The trace's complete ("X") spans.
std::vector<nlohmann::json> spans_of(TraceWriter& trace) {
  std::vector<nlohmann::json> out;
  const nlohmann::json doc = nlohmann::json::parse(trace.to_json());
  for (const auto& e : doc.at("traceEvents")) {
    if (e["ph"] == "X") out.push_back(e);
  }
  return out;
}

std::shared_ptr<DeviceBackend> cpu_device() { return std::shared_ptr<DeviceBackend>(make_cpu_device()); }

}  // namespace

TEST_CASE("forward recorder: closed forwards resolve into records in order with the kind and index given",
          "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu());
  CHECK(rig.recorder.records().empty());
  const std::vector<std::string> kinds = {"dit", "adapter", ""};
  for (uint64_t i = 0; i < kinds.size(); ++i) {
    rig.recorder.open(false, false);
    rig.recorder.anchor();
    ForwardRecord rec = Rig::record(10 + i, kinds[i]);
    rec.bytes_streamed = 1000 * (i + 1);
    rec.copies = i + 1;
    rec.demand_copies = i;
    rec.diverged = i == 1;
    rec.aborted = i == 2;
    CHECK_FALSE(rig.recorder.close(rec, !rec.aborted));  // not measured in detail
  }
  // Without waiting, everything but possibly the latest forward is read.
  rig.recorder.resolve(false);
  CHECK(rig.recorder.records().size() >= 2);
  rig.recorder.resolve(true);
  REQUIRE(rig.recorder.records().size() == 3);
  for (uint64_t i = 0; i < kinds.size(); ++i) {
    const ForwardRecord& r = rig.recorder.records()[i];
    INFO("forward " << i);
    CHECK(r.index == 10 + i);
    CHECK(r.kind == kinds[i]);
    CHECK(r.bytes_streamed == 1000 * (i + 1));
    CHECK(r.copies == i + 1);
    CHECK(r.demand_copies == i);
    CHECK(r.diverged == (i == 1));
    CHECK(r.aborted == (i == 2));
    CHECK(r.stalls == 0);  // no stall span
    CHECK(r.h2d_gbps == 0);  // no copy span
  }
  // Resolving again adds nothing.
  rig.recorder.resolve(true);
  CHECK(rig.recorder.records().size() == 3);
}

TEST_CASE("forward recorder: records keeps at most max_forward_records and drops the oldest", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu(), with_records(3));
  for (uint64_t i = 0; i < 5; ++i) {
    rig.forward(i, "dit");
    rig.recorder.resolve(true);
    CHECK(rig.recorder.records().size() == std::min<size_t>(i + 1, 3));
    CHECK(rig.recorder.records().back().index == i);
  }
  REQUIRE(rig.recorder.records().size() == 3);
  CHECK(rig.recorder.records()[0].index == 2);
  CHECK(rig.recorder.records()[1].index == 3);
  CHECK(rig.recorder.records()[2].index == 4);

  // Many resolved at once are capped the same way.
  for (uint64_t i = 5; i < 10; ++i) rig.forward(i, "dit");
  rig.recorder.resolve(true);
  REQUIRE(rig.recorder.records().size() == 3);
  CHECK(rig.recorder.records()[0].index == 7);
  CHECK(rig.recorder.records()[2].index == 9);
}

TEST_CASE("forward recorder: prefetches for the next forward become its own unless it opens fresh", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu());
  auto prefetch = [&](uint64_t bytes) {
    ForwardAcc& next = rig.recorder.next();
    next.bytes += bytes;
    next.copies += 1;
    rig.span(next, TraceTrack::copy, SpanKind::copy, kUp0);
  };

  SECTION("open(fresh=false) takes them over") {
    prefetch(300);
    prefetch(200);
    CHECK(rig.recorder.current().bytes == 0);
    rig.recorder.open(false, true);
    CHECK(rig.recorder.current().bytes == 500);
    CHECK(rig.recorder.current().copies == 2);
    CHECK(rig.recorder.current().spans.size() == 2);
    CHECK(rig.recorder.current().detail);
    CHECK(rig.recorder.next().bytes == 0);
    CHECK(rig.recorder.next().copies == 0);
    CHECK(rig.recorder.next().spans.empty());
    // Prefetches made during this forward are for the next one.
    rig.recorder.anchor();
    prefetch(50);
    CHECK(rig.recorder.current().bytes == 500);
    CHECK(rig.recorder.next().bytes == 50);
    CHECK(rig.recorder.close(Rig::record(0, "dit"), true));  // measured in detail
    CHECK(rig.recorder.current().bytes == 0);
    CHECK(rig.recorder.current().spans.empty());
    rig.recorder.open(false, false);
    CHECK(rig.recorder.current().bytes == 50);
    CHECK_FALSE(rig.recorder.current().detail);
    rig.recorder.anchor();
    CHECK_FALSE(rig.recorder.close(Rig::record(1, "dit"), true));
  }
  SECTION("open(fresh=true) drops them") {
    prefetch(300);
    rig.recorder.open(true, false);
    CHECK(rig.recorder.current().bytes == 0);
    CHECK(rig.recorder.current().copies == 0);
    CHECK(rig.recorder.current().spans.empty());
    CHECK(rig.recorder.next().bytes == 0);
    CHECK(rig.recorder.next().spans.empty());
    rig.recorder.anchor();
    rig.recorder.close(Rig::record(0, "adapter"), true);
  }
  rig.recorder.resolve(true);
  CHECK_FALSE(rig.recorder.records().empty());
}

TEST_CASE("forward recorder: note_acquire marks acquires only in a forward measured in detail", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu());
  rig.recorder.open(false, false);
  rig.recorder.anchor();
  rig.recorder.note_acquire(kUp0);
  CHECK(rig.recorder.current().ids.empty());
  CHECK(rig.recorder.current().marks.empty());
  rig.recorder.close(Rig::record(0, "dit"), true);

  rig.recorder.open(false, true);
  rig.recorder.anchor();
  rig.recorder.note_acquire(kUp0);
  rig.recorder.note_acquire(kMid0);
  rig.span(rig.recorder.current(), TraceTrack::compute, SpanKind::stall, kMid0);
  const ForwardAcc& acc = rig.recorder.current();
  CHECK(acc.ids == std::vector<int64_t>{kUp0, kMid0});
  CHECK(acc.marks.size() == 2);
  // The stall span is the latest acquire's; the first had none.
  CHECK(acc.stall_span == std::vector<int>{-1, 0});
  // A span that is not a stall leaves them alone.
  rig.span(rig.recorder.current(), TraceTrack::compute, SpanKind::compute, kMid0);
  CHECK(acc.stall_span == std::vector<int>{-1, 0});
  CHECK(acc.spans.size() == 2);
  CHECK(acc.spans[0].layer == kMid0);
  CHECK(acc.spans[0].kind == SpanKind::stall);
  CHECK(acc.spans[0].resident == rig.residency.records().at(kMid0).resident);
  rig.recorder.close(Rig::record(1, "dit"), true);
  rig.recorder.resolve(true);
  CHECK(rig.recorder.records().size() == 2);
}

TEST_CASE("forward recorder: resolved events go back to the pool", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu());
  rig.recorder.open(false, false);
  rig.recorder.anchor();
  std::set<const DeviceEvent*> used;
  for (int i = 0; i < 2; ++i) {
    std::unique_ptr<DeviceEvent> a = rig.recorder.mark();
    std::unique_ptr<DeviceEvent> b = rig.recorder.mark();
    used.insert(a.get());
    used.insert(b.get());
    rig.recorder.add_span(rig.recorder.current(), TraceTrack::compute, SpanKind::compute, kUp0, std::move(a),
                          std::move(b));
  }
  rig.recorder.close(Rig::record(0, "dit"), true);
  rig.recorder.resolve(true);
  for (int i = 0; i < 4; ++i) {
    std::unique_ptr<DeviceEvent> e = rig.recorder.take_event();
    CHECK(used.count(e.get()) == 1);
  }
  // The pool is empty again: a new event.
  std::unique_ptr<DeviceEvent> fresh = rig.recorder.take_event();
  CHECK(used.count(fresh.get()) == 0);
}

TEST_CASE("forward recorder: clear drops the unresolved forwards and keeps the records", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu());
  rig.forward(0, "dit");
  rig.recorder.resolve(true);
  rig.forward(1, "dit");
  rig.recorder.next().bytes = 123;
  rig.recorder.clear();
  CHECK(rig.recorder.next().bytes == 0);
  rig.recorder.resolve(true);
  REQUIRE(rig.recorder.records().size() == 1);
  CHECK(rig.recorder.records()[0].index == 0);
}

TEST_CASE("forward recorder: a trace gets a forward span per forward and a span per layer", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu(), traced());
  const std::string up = rig.residency.records().at(kUp0).name;
  const std::string embedder = rig.residency.records().at(kEmbedder).name;
  rig.recorder.open(false, false);
  rig.recorder.anchor();
  rig.span(rig.recorder.current(), TraceTrack::copy, SpanKind::copy, kUp0);
  rig.span(rig.recorder.current(), TraceTrack::upcast, SpanKind::upcast, kUp0);
  rig.span(rig.recorder.current(), TraceTrack::compute, SpanKind::compute, kEmbedder);
  ForwardRecord rec = Rig::record(0, "dit");
  rec.bytes_streamed = 4096;
  rec.copies = 1;
  rig.recorder.close(rec, true);
  rig.forward(1, "");
  rig.recorder.resolve(true);

  const std::vector<nlohmann::json> spans = spans_of(rig.recorder.trace());
  REQUIRE(spans.size() == 5);
  // The layers' spans first, then their forward's, in resolve order.
  CHECK(spans[0]["name"] == up);
  CHECK(spans[0]["tid"] == static_cast<int>(TraceTrack::copy));
  CHECK(spans[0]["args"]["forward"] == 0);
  CHECK(spans[0]["args"]["layer"] == up);
  CHECK(spans[0]["args"]["resident"] == rig.residency.records().at(kUp0).resident);
  CHECK(spans[1]["name"] == up);
  CHECK(spans[1]["tid"] == static_cast<int>(TraceTrack::upcast));
  CHECK(spans[2]["name"] == embedder);
  CHECK(spans[2]["tid"] == static_cast<int>(TraceTrack::compute));
  CHECK(spans[3]["name"] == "forward 0 dit");
  CHECK(spans[3]["tid"] == static_cast<int>(TraceTrack::forward));
  CHECK(spans[3]["args"]["kind"] == "dit");
  CHECK(spans[3]["args"]["complete"] == true);
  CHECK(spans[3]["args"]["bytes_streamed"] == 4096);
  CHECK(spans[3]["args"]["copies"] == 1);
  CHECK(spans[4]["name"] == "forward 1");  // no kind
  CHECK(spans[4]["args"]["forward"] == 1);
}

TEST_CASE("forward recorder: without tracing nothing is traced", "[strict][accel]") {
  Rig rig(sluice::testing::test_device_or_cpu());
  rig.recorder.open(false, false);
  rig.recorder.anchor();
  rig.span(rig.recorder.current(), TraceTrack::copy, SpanKind::copy, kUp0);
  rig.recorder.close(Rig::record(0, "dit"), true);
  rig.recorder.resolve(true);
  CHECK(rig.recorder.records().size() == 1);
  CHECK(rig.recorder.trace().size() == 0);
}

TEST_CASE("forward recorder: the calibrator hears of complete forwards only when planning from measurements",
          "[strict][accel]") {
  SECTION("planning from measurements") {
    Rig rig(sluice::testing::test_device_or_cpu());
    CHECK(rig.recorder.records().empty());
    CHECK(rig.residency.calibrator().main_kind().empty());
    rig.forward(0, "a", /*complete=*/true);
    rig.forward(1, "b", /*complete=*/false);
    rig.forward(2, "b", /*complete=*/false);
    rig.recorder.resolve(true);
    // "b" had more forwards, none of them complete.
    CHECK(rig.residency.calibrator().main_kind() == "a");
  }
  SECTION("not planning from measurements") {
    EngineOptions o;
    o.plan_from_measurements = false;
    Rig rig(sluice::testing::test_device_or_cpu(), o);
    rig.forward(0, "a");
    rig.recorder.resolve(true);
    CHECK(rig.recorder.records().size() == 1);
    CHECK(rig.residency.calibrator().main_kind().empty());
  }
  SECTION("without timing") {
    EngineOptions o;
    o.timing = false;
    Rig rig(sluice::testing::test_device_or_cpu(), o);
    rig.forward(0, "a");
    rig.recorder.resolve(true);
    CHECK(rig.recorder.records().size() == 1);
    CHECK(rig.residency.calibrator().main_kind().empty());
  }
}

// [cpu-device]: span lengths come from sleeps between compute-stream records, which the CPU
// device times by the host's clock.
TEST_CASE("forward recorder: a stall shorter than the threshold is no stall and a longer one is",
          "[cpu-device][strict]") {
  const bool trace = GENERATE(false, true);
  INFO("trace " << trace);
  EngineOptions o;
  o.trace = trace;
  Rig rig(cpu_device(), o);
  const std::string up = rig.residency.records().at(kUp0).name;
  const std::string mid = rig.residency.records().at(kMid0).name;
  rig.recorder.open(false, false);
  rig.recorder.anchor();
  rig.span(rig.recorder.current(), TraceTrack::compute, SpanKind::stall, kUp0, 0, /*reversed=*/true);
  rig.span(rig.recorder.current(), TraceTrack::compute, SpanKind::stall, kMid0, /*sleep_ms=*/2);
  ForwardRecord rec = Rig::record(0, "dit");
  rec.stalls = 0;
  rig.recorder.close(rec, true);
  rig.recorder.resolve(true);
  REQUIRE(rig.recorder.records().size() == 1);
  CHECK(rig.recorder.records()[0].stalls == 1);
  if (trace) {
    // Only the real wait is traced, named for its layer.
    std::vector<std::string> waits;
    for (const auto& s : spans_of(rig.recorder.trace())) {
      const std::string name = s["name"];
      if (name.rfind("wait ", 0) == 0) waits.push_back(name);
    }
    CHECK(waits == std::vector<std::string>{"wait " + mid});
  } else {
    CHECK(rig.recorder.trace().size() == 0);
  }
}

TEST_CASE("forward recorder: timed copies give the record a rate and the calibrator a copy fit",
          "[cpu-device][strict]") {
  SECTION("a complete forward") {
    Rig rig(cpu_device());
    CHECK_FALSE(rig.residency.calibrator().copy_fit().has_value());
    rig.recorder.open(false, false);
    rig.recorder.anchor();
    rig.span(rig.recorder.current(), TraceTrack::copy, SpanKind::copy, kUp0, /*sleep_ms=*/1);
    ForwardRecord rec = Rig::record(0, "dit");
    rec.bytes_streamed = rig.residency.records().at(kUp0).stored_bytes;
    rig.recorder.close(rec, true);
    rig.recorder.resolve(true);
    REQUIRE(rig.recorder.records().size() == 1);
    CHECK(rig.recorder.records()[0].h2d_gbps > 0);
    CHECK(rig.residency.calibrator().copy_fit().has_value());
  }
  SECTION("an aborted forward's copies are not used") {
    Rig rig(cpu_device());
    rig.recorder.open(false, false);
    rig.recorder.anchor();
    rig.span(rig.recorder.current(), TraceTrack::copy, SpanKind::copy, kUp0, /*sleep_ms=*/1);
    ForwardRecord rec = Rig::record(0, "dit");
    rec.bytes_streamed = rig.residency.records().at(kUp0).stored_bytes;
    rec.aborted = true;
    rig.recorder.close(rec, false);
    rig.recorder.resolve(true);
    REQUIRE(rig.recorder.records().size() == 1);
    CHECK(rig.recorder.records()[0].h2d_gbps > 0);  // the record still says what the bus did
    CHECK_FALSE(rig.residency.calibrator().copy_fit().has_value());
  }
}

TEST_CASE("forward recorder: a complete forward measured in detail gives the calibrator a profile",
          "[cpu-device][strict]") {
  const bool complete = GENERATE(true, false);
  INFO("complete " << complete);
  Rig rig(cpu_device());
  CHECK_FALSE(rig.residency.calibrator().replan_due());
  rig.recorder.open(false, /*detail=*/true);
  rig.recorder.anchor();
  rig.recorder.note_acquire(kUp0);
  rig.span(rig.recorder.current(), TraceTrack::compute, SpanKind::stall, kUp0, 0, /*reversed=*/true);
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  rig.recorder.note_acquire(kMid0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  CHECK(rig.recorder.close(Rig::record(0, "dit"), complete));
  rig.recorder.resolve(false);  // a forward measured in detail is waited for by its caller; either way it resolves
  rig.recorder.resolve(true);
  REQUIRE(rig.recorder.records().size() == 1);
  CHECK(rig.residency.calibrator().replan_due() == complete);
  CHECK(rig.residency.calibrator().main_kind() == (complete ? "dit" : ""));
}
