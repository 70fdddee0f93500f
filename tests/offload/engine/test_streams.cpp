// The engine's fences, each under the strict CPU device (Note [strict device]), which
// aborts the process on the first hazard: a fence removed makes one of these tests die
// (scripts/fence_mutations.sh checks exactly that, fence by fence). Every test builds its
// strict device explicitly, so it is strict with or without SLUICE_STRICT_DEVICE.
#include <catch2/catch.hpp>

#include "offload/device/bounce_ring.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "models/lora.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice::offload;
using sluice::testing::ToyModel;

namespace {

constexpr uint64_t MiB = 1ull << 20;

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
// With device timing and without (acquire() waits on two paths).
TEST_CASE("streams: streamed forwards through a wrapping ring match the model") {
  for (const bool timing : {true, false}) {
    ToyModel model;
    const at::Tensor x = input();
    const at::Tensor ref = model->forward(x);
    EngineOptions o = options(0.0);
    o.timing = timing;
    StreamingEngine engine(o);
    engine.attach(*model, "toy");
    REQUIRE(engine.plan().streamed_count() > 3 * engine.plan().ring_slots);
    for (int f = 0; f < 3; ++f) CHECK(at::equal(run(engine, model, x), ref));
    CHECK(engine.stats().slot_violations == 0);
    CHECK(hazard_tracker(*o.device)->hazards() == 0);
  }
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

// F4: detach frees the ring while the next forward's prefetches are still being copied,
// from pinned layers and, gathered through the bounce ring, from pageable ones.
TEST_CASE("streams: detach right after a forward with prefetches in flight") {
  for (const PinMode pin : {PinMode::auto_, PinMode::off}) {
    ToyModel model;
    const at::Tensor x = input();
    const at::Tensor ref = model->forward(x);
    EngineOptions o = options(0.0);
    o.pin = pin;
    StreamingEngine engine(o);
    engine.attach(*model, "toy");
    CHECK(at::equal(run(engine, model, x), ref));
    engine.detach();  // no stats() before: nothing has waited for the device
    CHECK(at::equal(model->forward(x), ref));
  }
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
  CHECK(s.bounce_bytes >= 2 * 4096);  // grows rather than wait (Note [bounce ring sizing])
  CHECK(s.bounce_bytes <= s.bounce_limit_bytes);
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

// F9: LoRA sidecars are copied to the device before a forward reads them. Each forward
// declares the sidecars as compute reads, so a forward right after placing them reads
// bytes still in flight unless place_sidecars waited for their copies.
TEST_CASE("streams: a forward right after placing LoRA sidecars reads them after their copies") {
  ToyModel model;
  const at::Tensor x = input();
  std::vector<std::pair<std::string, at::Tensor>> pairs;
  at::Generator gen = at::detail::createCPUGenerator(7);
  for (const char* name : {"blocks.0.up", "blocks.3.mid", "final_layer"}) {
    for (auto& [n, l] : managed_layers(*model)) {
      if (n != name) continue;
      const auto sz = l->stored_weight().sizes();
      pairs.emplace_back(std::string(name) + ".lora_A.weight", at::randn({4, sz[1]}, gen) * 0.1);
      pairs.emplace_back(std::string(name) + ".lora_B.weight", at::randn({sz[0], 4}, gen) * 0.1);
    }
  }
  const sluice::LoraAdapter adapter = sluice::lora_from_tensors(pairs, *model, "toy lora");
  at::Tensor patched;
  {
    sluice::LoraScope reference(*model, adapter, 0.7);
    patched = model->forward(x);
  }
  REQUIRE_FALSE(at::equal(patched, model->forward(x)));
  EngineOptions o = options(0.5);
  o.plan_from_measurements = false;  // no forward waited for in detail (Note [calibration]): nothing orders by accident
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  {
    sluice::LoraScope scope(*model, adapter, 0.7, std::nullopt, &engine);
    REQUIRE(engine.residency().limits().sidecar_bytes > 0);
    CHECK(at::equal(run(engine, model, x), patched));
    // F10: a forward on a stream of the host's reads the sidecars, which the scope then
    // frees from the default stream: the free waits for that forward.
    CpuComputeStreamGuard stream(1);
    CHECK(at::equal(run(engine, model, x), patched));
  }
  CHECK(hazard_tracker(*o.device)->hazards() == 0);
  engine.detach();
}

// Note [bounce ring sizing]: a bounce slot is reused only after its copy ran, and that copy
// sits behind the copy stream's wait for its staging slot's last reader. The modelled
// device runs compute two records behind the host (CpuDeviceOptions::compute_lag, Note
// [host waits on compute]): a host wait for a slot whose copy follows the compute of
// either of the last two readers is counted. A ring of three staging slots filled two
// layers ahead, as the engine's ring is: a ring of two bounce slots waits for the reader
// the host has just queued at every fill; a ring that grows to its sizing never does. On
// the plain and the strict CPU device.
TEST_CASE("streams: a bounce slot's reuse never waits for compute the device is still running") {
  for (const bool strict : {false, true}) {
    for (const bool sized : {false, true}) {
      INFO((strict ? "strict" : "plain") << " device, " << (sized ? "sized" : "two-slot") << " bounce ring");
      CpuDeviceOptions d;
      d.strict = strict;
      d.compute_lag = 2;
      auto dev = std::shared_ptr<DeviceBackend>(make_cpu_device(d));
      constexpr int64_t kSlot = 8192, kPiece = 4096, kAhead = 2;
      std::vector<at::Tensor> slots;
      std::vector<std::unique_ptr<DeviceEvent>> read, copied;
      for (int i = 0; i < 3; ++i) {
        slots.push_back(dev->allocate({kSlot}, at::kByte, MemoryKind::ring, "staging slot"));
        read.push_back(dev->create_event());
        copied.push_back(dev->create_event());
      }
      const at::Tensor host = at::arange(kSlot, at::kInt).to(at::kByte);  // pageable on the strict device
      BounceRing ring(*dev, 2, kPiece);
      REQUIRE(ring.pinned());
      // ceil(capacity / piece) + fills the ring holds + 2 * pieces of a layer.
      ring.set_limit(sized ? (3 * kSlot / kPiece) + 3 + 2 * (kSlot / kPiece) : 2);
      const auto fill = [&](int layer) {
        const size_t k = static_cast<size_t>(layer % 3);
        dev->wait(StreamKind::copy, *read[k]);  // the slot's last reader (FENCE(F2) of the staging ring)
        ring.copy(slots[k], host);
        dev->record(*copied[k], StreamKind::copy);
      };
      for (int layer = 0; layer < kAhead; ++layer) fill(layer);
      for (int layer = 0; layer < 30; ++layer) {
        if (layer + kAhead < 30) fill(layer + kAhead);  // the prefetch, queued before the layer's compute
        const size_t k = static_cast<size_t>(layer % 3);
        dev->wait(StreamKind::compute, *copied[k]);
        dev->begin_access(slots[k], StreamKind::compute, Access::read, "layer " + std::to_string(layer));
        CHECK(at::equal(slots[k], host));
        dev->end_access(slots[k], StreamKind::compute);
        dev->record(*read[k], StreamKind::compute);
      }
      dev->synchronize();
      INFO(last_host_compute_wait(*dev));
      if (sized) {
        CHECK(host_compute_waits(*dev) == 0);
        CHECK(ring.bytes() <= ring.limit() * static_cast<uint64_t>(kPiece));
      } else {
        CHECK(host_compute_waits(*dev) > 0);  // the model sees the waits a too small ring makes
      }
      if (strict) CHECK(hazard_tracker(*dev)->hazards() == 0);
    }
  }
}

// The same through the engine: pageable layers (pinning off, strict device) stream through
// a bounce ring the engine sizes (Note [bounce ring sizing]); with compute running two
// records behind the host, queuing the next layers' copies never waits for it.
TEST_CASE("streams: queuing pageable layers' copies does not wait for the compute just queued") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  CpuDeviceOptions d;
  d.strict = true;
  d.copy_latency_us = 30;
  d.compute_lag = 2;
  EngineOptions o = options(0.0);
  o.device = std::shared_ptr<DeviceBackend>(make_cpu_device(d));
  o.pin = PinMode::off;
  o.timing = false;  // compute records: one per streamed layer's release, and the forward's ends
  o.bounce_slots = 1;
  o.bounce_slot_bytes = 4096;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  REQUIRE(engine.plan().streamed_count() > 3 * engine.plan().ring_slots);
  for (int f = 0; f < 3; ++f) {
    CHECK(at::equal(run(engine, model, x), ref));
    INFO(last_host_compute_wait(*o.device));
    CHECK(host_compute_waits(*o.device) == 0);
  }
  const EngineStats s = engine.stats();
  CHECK(s.sync_copies == 0);
  CHECK(s.bounce_copies > 0);
  CHECK(s.bounce_bytes <= s.bounce_limit_bytes);
  CHECK(s.bounce_waits == 0);  // queuing the copies never blocked on a slot: the ring grew instead
  CHECK(hazard_tracker(*o.device)->hazards() == 0);
  engine.detach();
}
