// ForwardBuffers (offload/engine/forward_buffers.h) on its own, without the streaming engine: the
// planned upcast scratch and the buffers made beyond it (Note [upcast scratch]), the
// staging ring it makes and retires, and what each charges to the model's ledger.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <memory>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/forward_buffers.h"
#include "offload/engine/layer_record.h"
#include "offload/device/staging_ring.h"
#include "runtime/error.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using namespace sluice::offload;

namespace {

constexpr uint64_t kScratch = 4096;

int64_t scratch_charged(const MemoryLedger& ledger) { return ledger.stats().kind(MemoryKind::scratch).current; }
int64_t ring_charged(const MemoryLedger& ledger) { return ledger.stats().kind(MemoryKind::ring).current; }

// Records as make_ring reads them: only residency and slot sizes matter.
LayerRecord layer(uint64_t slot_bytes, bool resident) {
  LayerRecord r;
  r.slot_bytes = slot_bytes;
  r.stored_bytes = slot_bytes;
  r.resident = resident;
  return r;
}

// Fills a free slot of `bytes` of the current ring with an unread copy for `layer_id`.
void unread_copy(DeviceBackend& dev, StagingRing& ring, int64_t layer_id, uint64_t bytes) {
  const at::Tensor src = at::zeros({static_cast<int64_t>(bytes)}, at::kByte);
  const int s = ring.pick(bytes, 1, true);
  REQUIRE(s >= 0);
  ring.fill(s, layer_id, 1, {{src, 0}}, nullptr, nullptr);
  dev.synchronize();
}

}  // namespace

TEST_CASE("forward buffers: the planned scratch is charged to the ledger and handed out first", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);
  CHECK(ledger->current() == kScratch);
  CHECK(scratch_charged(*ledger) == static_cast<int64_t>(kScratch));
  CHECK(buffers.beyond_plan_bytes() == 0);

  bool beyond = false;
  const int first = buffers.take_scratch(1000, beyond);
  CHECK(first == 0);
  CHECK_FALSE(beyond);
  CHECK(buffers.scratch(first).nbytes() == kScratch);
  CHECK(buffers.scratch(first).device() == dev->device());
  CHECK(ledger->current() == kScratch);  // nothing new was made

  // Given back, the same buffer serves the next lease.
  buffers.give_back_scratch(first);
  CHECK(buffers.take_scratch(kScratch, beyond) == first);
  CHECK_FALSE(beyond);
  buffers.give_back_scratch(first);

  buffers.end_model();
  CHECK(ledger->current() == 0);
}

TEST_CASE("forward buffers: a second lease makes a buffer beyond the plan until the scratch is trimmed",
          "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);

  bool beyond = false;
  const int outer = buffers.take_scratch(kScratch, beyond);
  REQUIRE_FALSE(beyond);
  // The planned buffer is in use: a nested lease needs another one (of its own size).
  const int inner = buffers.take_scratch(512, beyond);
  CHECK(beyond);
  CHECK(inner != outer);
  CHECK(buffers.scratch(inner).nbytes() == 512);
  CHECK(buffers.scratch(inner).data_ptr() != buffers.scratch(outer).data_ptr());
  CHECK(buffers.beyond_plan_bytes() == 512);
  CHECK(ledger->current() == kScratch + 512);
  CHECK(scratch_charged(*ledger) == static_cast<int64_t>(kScratch + 512));

  // Once made, the extra buffer is reused without counting as new.
  buffers.give_back_scratch(inner);
  beyond = false;
  CHECK(buffers.take_scratch(512, beyond) == inner);
  CHECK_FALSE(beyond);
  CHECK(ledger->current() == kScratch + 512);
  buffers.give_back_scratch(inner);
  buffers.give_back_scratch(outer);

  // Both free: the planned one comes first again.
  CHECK(buffers.take_scratch(512, beyond) == outer);
  CHECK_FALSE(beyond);
  buffers.give_back_scratch(outer);

  // A plan change drops what was made beyond the plan; the ledger gets it back.
  buffers.trim_scratch();
  CHECK(buffers.beyond_plan_bytes() == 0);
  CHECK(ledger->current() == kScratch);
  CHECK(buffers.take_scratch(512, beyond) == 0);
  CHECK_FALSE(beyond);
  buffers.give_back_scratch(0);

  buffers.end_model();
  CHECK(ledger->current() == 0);
}

TEST_CASE("forward buffers: a nested lease's buffer is made of the lease's size, not the planned one",
          "[strict][accel]") {
  // The planned buffer is the largest layer's (Note [upcast scratch]); a nested lease of a
  // smaller layer charges the ledger only what it asked for.
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);
  bool beyond = false;
  const int outer = buffers.take_scratch(kScratch, beyond);
  const int small = buffers.take_scratch(512, beyond);
  CHECK(beyond);
  CHECK(buffers.scratch(small).nbytes() == 512);
  CHECK(buffers.beyond_plan_bytes() == 512);
  CHECK(ledger->current() == kScratch + 512);

  // Free, the small one cannot serve a larger nested lease: that one gets a buffer of its own size.
  buffers.give_back_scratch(small);
  beyond = false;
  const int larger = buffers.take_scratch(1024, beyond);
  CHECK(beyond);
  CHECK(larger != small);
  CHECK(buffers.scratch(larger).nbytes() == 1024);
  CHECK(buffers.beyond_plan_bytes() == 512 + 1024);
  CHECK(ledger->current() == kScratch + 512 + 1024);
  CHECK(scratch_charged(*ledger) == static_cast<int64_t>(kScratch + 512 + 1024));
  // And a smaller one takes the free buffer that fits it.
  beyond = false;
  CHECK(buffers.take_scratch(256, beyond) == small);
  CHECK_FALSE(beyond);

  buffers.give_back_scratch(small);
  buffers.give_back_scratch(larger);
  buffers.give_back_scratch(outer);
  buffers.end_model();
  CHECK(ledger->current() == 0);
}

TEST_CASE("forward buffers: a nested buffer that does not fit the budget leaves the beyond-plan flag alone",
          "[strict][accel]") {
  // The flag tells the forward that it holds more than the plan now (Note [upcast
  // scratch]); a failed allocation made nothing, so it must stay unset.
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget", kScratch + kScratch / 2);
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);
  bool beyond = false;
  const int outer = buffers.take_scratch(kScratch, beyond);
  REQUIRE_FALSE(beyond);
  CHECK_THROWS_AS(buffers.take_scratch(kScratch, beyond), ResourceError);
  CHECK_FALSE(beyond);
  CHECK(buffers.beyond_plan_bytes() == 0);
  CHECK(ledger->current() == kScratch);
  // A nested lease that fits beside the planned buffer still gets one, and says so.
  const int inner = buffers.take_scratch(kScratch / 2, beyond);
  CHECK(beyond);
  CHECK(buffers.beyond_plan_bytes() == kScratch / 2);
  buffers.give_back_scratch(inner);
  buffers.give_back_scratch(outer);
  buffers.end_model();
  CHECK(ledger->current() == 0);
}

TEST_CASE("forward buffers: trimming the scratch keeps the buffers that leases still hold", "[strict][accel]") {
  // A plan change (trim_scratch) may come while a lease holds a nested buffer: that buffer
  // stays at the lease's index, with its memory; only the free ones go.
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);
  bool beyond = false;
  const int outer = buffers.take_scratch(kScratch, beyond);
  const int free_one = buffers.take_scratch(512, beyond);
  const int held = buffers.take_scratch(1024, beyond);
  REQUIRE(free_one != held);
  const void* held_data = buffers.scratch(held).data_ptr();
  buffers.give_back_scratch(free_one);
  REQUIRE(ledger->current() == kScratch + 512 + 1024);

  buffers.trim_scratch();
  // Checked first: had the held buffer been dropped, scratch(held) would read past the end.
  REQUIRE(buffers.beyond_plan_bytes() == 1024);
  CHECK(ledger->current() == kScratch + 1024);
  CHECK(buffers.scratch(held).nbytes() == 1024);
  CHECK(buffers.scratch(held).data_ptr() == held_data);
  CHECK(buffers.scratch(outer).nbytes() == kScratch);

  // The next nested buffer fills the place the free one left; the held one is not handed out.
  beyond = false;
  const int again = buffers.take_scratch(512, beyond);
  CHECK(beyond);
  CHECK(again == free_one);
  CHECK(again != held);
  CHECK(buffers.beyond_plan_bytes() == 512 + 1024);
  buffers.give_back_scratch(again);

  // Given back, the held one goes at the next trim.
  buffers.give_back_scratch(held);
  buffers.trim_scratch();
  CHECK(buffers.beyond_plan_bytes() == 0);
  CHECK(ledger->current() == kScratch);
  buffers.give_back_scratch(outer);
  beyond = false;
  CHECK(buffers.take_scratch(kScratch, beyond) == outer);
  CHECK_FALSE(beyond);
  buffers.give_back_scratch(outer);
  buffers.end_model();
  CHECK(ledger->current() == 0);
}

TEST_CASE("forward buffers: a scratch beyond the budget throws ResourceError", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  SECTION("the planned one at begin_model") {
    auto ledger = std::make_shared<MemoryLedger>("model budget", kScratch - 1);
    ForwardBuffers buffers(*dev);
    CHECK_THROWS_AS(buffers.begin_model(ledger, kScratch), ResourceError);
    CHECK(ledger->current() == 0);
  }
  SECTION("one for a nested lease") {
    auto ledger = std::make_shared<MemoryLedger>("model budget", kScratch + kScratch / 2);
    ForwardBuffers buffers(*dev);
    buffers.begin_model(ledger, kScratch);
    bool beyond = false;
    const int outer = buffers.take_scratch(kScratch, beyond);
    CHECK_THROWS_AS(buffers.take_scratch(kScratch, beyond), ResourceError);
    CHECK(ledger->current() == kScratch);
    CHECK(buffers.beyond_plan_bytes() == 0);
    buffers.give_back_scratch(outer);
    buffers.end_model();
    CHECK(ledger->current() == 0);
  }
}

TEST_CASE("forward buffers: no planned scratch holds nothing", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, 0);
  CHECK(ledger->current() == 0);
  CHECK(buffers.ring() == nullptr);
  CHECK(buffers.unmade_ring_bytes() == 0);
  CHECK(buffers.beyond_plan_bytes() == 0);
  buffers.end_model();
}

TEST_CASE("forward buffers: make_ring charges its capacity and makes the streamed layers' slots in order",
          "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);
  // Streamed: 1024, 1024, 2048 (resident ones get no slot).
  const std::vector<LayerRecord> layers = {layer(1024, false), layer(8192, true), layer(1024, false),
                                           layer(2048, false)};
  buffers.make_ring(8192, layers);
  REQUIRE(buffers.ring() != nullptr);
  CHECK(buffers.ring()->capacity() == 8192);
  CHECK(buffers.ring()->live_slots() == 3);
  CHECK(buffers.ring()->slot(0).bytes() == 1024);
  CHECK(buffers.ring()->slot(1).bytes() == 1024);
  CHECK(buffers.ring()->slot(2).bytes() == 2048);
  // The capacity is reserved whole; what is not a slot yet is the unmade part.
  CHECK(ring_charged(*ledger) == 8192);
  CHECK(ledger->current() == kScratch + 8192);
  CHECK(buffers.unmade_ring_bytes() == 8192 - 4096);
  CHECK(buffers.beyond_plan_bytes() == 0);

  SECTION("slots stop at the capacity") {
    buffers.make_ring(3072, layers);
    CHECK(buffers.ring()->capacity() == 3072);
    CHECK(buffers.ring()->live_slots() == 2);  // 1024 + 1024; the 2048 one does not fit
    CHECK(buffers.unmade_ring_bytes() == 1024);
    CHECK(ring_charged(*ledger) == 3072);  // the old ring went first
    CHECK(ledger->current() == kScratch + 3072);
  }
  SECTION("an overflow slot counts beyond the plan") {
    StagingRing& ring = *buffers.ring();
    const int s = ring.overflow(512);
    REQUIRE(s >= 0);
    CHECK(buffers.beyond_plan_bytes() == 512);
    CHECK(ledger->current() == kScratch + 8192 + 512);
  }
  SECTION("a ring beyond the budget throws ResourceError") {
    ledger->set_limit(kScratch + 8192);
    CHECK_THROWS_AS(buffers.make_ring(8193, layers), ResourceError);
    // The old ring was dropped first (make_ring's contract); nothing more is held.
    CHECK(buffers.ring() == nullptr);
    CHECK(ledger->current() == kScratch);
  }

  buffers.end_model();
  CHECK(buffers.ring() == nullptr);
  CHECK(buffers.unmade_ring_bytes() == 0);
  CHECK(ledger->current() == 0);
}

TEST_CASE("forward buffers: retire_ring says whether there was a ring and keeps its counters", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  ForwardBuffers buffers(*dev);
  buffers.begin_model(ledger, kScratch);
  CHECK_FALSE(buffers.retire_ring());
  CHECK(buffers.wasted_copies() == 0);

  buffers.make_ring(4096, {});
  CHECK(buffers.ring()->live_slots() == 0);
  CHECK(buffers.unmade_ring_bytes() == 4096);
  unread_copy(*dev, *buffers.ring(), 7, 1024);
  CHECK(buffers.unmade_ring_bytes() == 4096 - 1024);
  CHECK(buffers.wasted_copies() == 0);  // unread, but still in the ring

  CHECK(buffers.retire_ring());
  CHECK(buffers.ring() == nullptr);
  CHECK(ledger->current() == kScratch);
  // Its unread copy was wasted, and the count outlives the ring.
  CHECK(buffers.wasted_copies() == 1);
  CHECK(buffers.wasted_bytes() == 1024);
  CHECK_FALSE(buffers.retire_ring());
  CHECK(buffers.wasted_copies() == 1);

  // A second ring adds to them, while live and once retired.
  buffers.make_ring(4096, {});
  unread_copy(*dev, *buffers.ring(), 8, 2048);
  CHECK(buffers.wasted_copies() == 1);
  buffers.ring()->invalidate();
  CHECK(buffers.wasted_copies() == 2);
  CHECK(buffers.wasted_bytes() == 1024 + 2048);
  CHECK(buffers.retire_ring());
  CHECK(buffers.wasted_copies() == 2);  // not counted twice
  CHECK(buffers.wasted_bytes() == 1024 + 2048);
  CHECK(buffers.violations() == 0);

  // Making a ring retires the old one the same way.
  buffers.make_ring(4096, {});
  unread_copy(*dev, *buffers.ring(), 9, 256);
  buffers.make_ring(4096, {});
  CHECK(buffers.wasted_copies() == 3);
  CHECK(ring_charged(*ledger) == 4096);

  // end_model drops the ring and scratch; the counters stay.
  buffers.end_model();
  CHECK(ledger->current() == 0);
  CHECK(buffers.wasted_copies() == 3);
  CHECK(buffers.wasted_bytes() == 1024 + 2048 + 256);
}

TEST_CASE("forward buffers: end_model gives the ledger back to zero with a nested scratch and a ring",
          "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto ledger = std::make_shared<MemoryLedger>("model budget");
  {
    ForwardBuffers buffers(*dev);
    buffers.begin_model(ledger, kScratch);
    bool beyond = false;
    const int a = buffers.take_scratch(kScratch, beyond);
    const int b = buffers.take_scratch(kScratch, beyond);
    REQUIRE(beyond);
    buffers.make_ring(8192, {layer(1024, false), layer(4096, false)});
    unread_copy(*dev, *buffers.ring(), 3, 1024);
    CHECK(ledger->current() == 2 * kScratch + 8192);
    buffers.give_back_scratch(a);
    buffers.give_back_scratch(b);
    buffers.end_model();
    CHECK(ledger->current() == 0);
    CHECK(buffers.ring() == nullptr);

    // The buffers serve the next model with its own ledger.
    auto next = std::make_shared<MemoryLedger>("next model");
    buffers.begin_model(next, 2 * kScratch);
    CHECK(next->current() == 2 * kScratch);
    CHECK(ledger->current() == 0);
    beyond = false;
    CHECK(buffers.take_scratch(2 * kScratch, beyond) == 0);
    CHECK_FALSE(beyond);
    buffers.give_back_scratch(0);
    buffers.end_model();
    CHECK(next->current() == 0);
  }
  dev->synchronize();
  CHECK(dev->memory_stats().total.current == 0);
}
