// The engine's fences, each under the strict CPU device (Note [strict device]), which
// aborts the process on the first hazard: a fence removed makes one of these tests die
// (scripts/fence_mutations.sh checks exactly that, fence by fence). Every test builds its
// strict device explicitly, so it is strict with or without SLUICE_STRICT_DEVICE.
#include <catch2/catch.hpp>

#include "offload/cpu_device.h"
#include "offload/engine.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"
#include "tests/toy_model.h"
#include "tests/device_env.h"

using namespace sluice::offload;
using sluice::testing::ToyModel;

namespace {

constexpr uint64_t MiB = 1ull << 20;

const bool kSingleThread = [] {
  at::set_num_threads(1);
  return true;
}();

std::shared_ptr<DeviceBackend> strict_cpu() {
  CpuDeviceOptions o;
  o.strict = true;
  o.hazard_policy = HazardTracker::Policy::abort;
  o.copy_latency_us = 30;
  return sluice::testing::test_device_or_cpu(o);
}

EngineOptions options(double max_resident) {
  EngineOptions o;
  o.device = strict_cpu();
  o.budget_bytes = 64 * MiB;
  o.working_memory_bytes = 1 * MiB;
  o.max_resident = max_resident;
  return o;
}

at::Tensor input() {
  at::Generator gen = at::detail::createCPUGenerator(42);
  return at::randn({4, 64}, gen);
}

at::Tensor run(StreamingEngine& e, ToyModel& m, const at::Tensor& x) {
  ForwardScope scope(e);
  return m->forward(x.to(e.device().device())).cpu();  // any SLUICE_TEST_DEVICE
}

}  // namespace

// F1 (compute waits for a slot's copy), F2 (a copy waits for the slot's last reader), F3
// (each release records that reader).
TEST_CASE("streams: streamed forwards through a wrapping ring match the model") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const EngineOptions o = options(0.0);
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  REQUIRE(engine.plan().streamed_count() > 3 * engine.plan().ring_slots);
  for (int f = 0; f < 3; ++f) CHECK(at::equal(run(engine, model, x), ref));
  CHECK(engine.stats().slot_violations == 0);
  CHECK(hazard_tracker(*o.device)->hazards() == 0);
}

// F7: resident copies are done before compute reads them. Half resident, the first layer
// (x_embedder) among them: the forward right after attach reads it at once.
TEST_CASE("streams: a forward right after attach reads resident layers after their copies") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  EngineOptions o = options(0.5);
  o.required_patterns = {"^x_embedder$", "^final_layer(\\.|$)"};
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  REQUIRE(engine.is_resident("x_embedder"));
  REQUIRE(engine.plan().streamed_count() > 0);
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(hazard_tracker(*o.device)->hazards() == 0);
}

// F4: detach frees the ring while the next forward's prefetches are still being copied.
TEST_CASE("streams: detach right after a forward with prefetches in flight") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  StreamingEngine engine(options(0.0));
  engine.attach(*model, "toy");
  CHECK(at::equal(run(engine, model, x), ref));
  engine.detach();  // no stats() before: nothing has waited for the device
  CHECK(at::equal(model->forward(x), ref));
}

// F5: a forward the host ran on a stream of its own, then freed from the default stream.
TEST_CASE("streams: a forward on a host-provided stream then detach on the default stream") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  StreamingEngine engine(options(0.5));
  engine.attach(*model, "toy");
  REQUIRE(engine.plan().streamed_count() > 0);
  REQUIRE(engine.plan().resident_bytes > 0);
  {
    CpuComputeStreamGuard stream(1);
    CHECK(at::equal(run(engine, model, x), ref));
  }
  engine.detach();
}

// F6: forwards alternating between streams reuse the upcast scratch.
TEST_CASE("streams: forwards alternate between two host streams") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  StreamingEngine engine(options(0.5));
  engine.attach(*model, "toy");
  for (uint32_t f = 0; f < 4; ++f) {
    CpuComputeStreamGuard stream(f % 2);
    CHECK(at::equal(run(engine, model, x), ref));
  }
  engine.detach();
}

// F8: pageable layers go through the pinned bounce ring; each slot is refilled only after
// its previous copy read it.
TEST_CASE("streams: pageable layers stream through the bounce ring") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  EngineOptions o = options(0.0);
  o.pin = PinMode::off;
  o.bounce_slots = 2;
  o.bounce_slot_bytes = 4096;  // a toy block layer (8 KiB of fp8) takes two pieces
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  for (int f = 0; f < 2; ++f) CHECK(at::equal(run(engine, model, x), ref));
  const EngineStats s = engine.stats();
  CHECK(s.pinned.current == 0);
  CHECK(s.bounce_bytes == 2 * 4096);
  CHECK(s.bounce_copies >= 2 * s.forward_records.at(0).copies);
  CHECK(s.sync_copies == 0);
  engine.detach();
}

TEST_CASE("streams: without a pinned bounce ring copies are synchronous and said once and counted") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  EngineOptions o = options(0.0);
  o.pin = PinMode::off;
  sluice::fault::ScopedFault fault("host.pin.bounce", sluice::fault::Trigger{1, 1});
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  const uint64_t warnings = sluice::log::message_count(sluice::log::Level::warn);
  for (int f = 0; f < 2; ++f) CHECK(at::equal(run(engine, model, x), ref));
  CHECK(sluice::log::message_count(sluice::log::Level::warn) == warnings + 1);
  const EngineStats s = engine.stats();
  CHECK(s.bounce_bytes == 0);
  CHECK(s.bounce_copies == 0);
  CHECK(s.sync_copies >= 2 * s.forward_records.at(0).copies);
  const auto j = s.to_json();
  CHECK(j.find("\"synchronous_copies\"") != std::string::npos);
}

TEST_CASE("streams: stalls are counted from compute-stream events and labelled so") {
  ToyModel model;
  const at::Tensor x = input();
  CpuDeviceOptions d;
  d.strict = true;
  d.copy_bytes_per_second = 20e6;  // slow copies: compute waits
  EngineOptions o = options(0.0);
  o.device = std::shared_ptr<DeviceBackend>(make_cpu_device(d));
  o.prefetch_depth = 1;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  for (int f = 0; f < 2; ++f) run(engine, model, x);
  const EngineStats s = engine.stats();
  for (const auto& f : s.forward_records) {
    CHECK(f.stalls_timed);
    CHECK(f.stalls > 0);
    CHECK(f.stalls <= f.copies);
    CHECK(f.stall_ms > 0);
  }
  CHECK(s.to_json().find("compute-stream events") != std::string::npos);
}
