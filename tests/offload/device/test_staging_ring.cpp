#include <catch2/catch.hpp>

#include "offload/device/cpu_device.h"
#include "offload/device/staging_ring.h"
#include "runtime/error.h"
#include "tests/support/device_env.h"

using namespace sluice::offload;

namespace {
// Makes `n` slots of `bytes` each: an unfilled or read slot is free, so each is filled
// before the next pick, as the engine does, and all are marked read at the end.
void make_slots(DeviceBackend& dev, StagingRing& ring, int n, uint64_t bytes) {
  at::Tensor x = at::zeros({static_cast<int64_t>(bytes)}, at::kByte);
  for (int i = 0; i < n; ++i) {
    const int s = ring.pick(bytes, 0, true);
    REQUIRE(s == i);
    ring.fill(s, 1000 + i, 0, {{x, 0}}, nullptr, nullptr);
  }
  dev.synchronize();
  for (int i = 0; i < n; ++i) ring.slot(static_cast<size_t>(i)).consumed = true;
}
}  // namespace

TEST_CASE("staging ring: slots are ring memory charged to the budget, within the capacity", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  auto budget = std::make_shared<MemoryLedger>("budget", 4096);
  {
    StagingRing ring(*dev, budget, 3072);
    CHECK(ring.live_slots() == 0);
    at::Tensor x = at::zeros({1000}, at::kByte);
    std::vector<int> made;
    for (int i = 0; i < 3; ++i) {
      const int s = ring.pick(1000, 1, true);
      REQUIRE(s >= 0);
      for (int m : made) CHECK(m != s);  // the earlier ones hold unread copies
      ring.fill(s, i, 1, {{x, 0}}, nullptr, nullptr);
      made.push_back(s);
    }
    dev->synchronize();
    CHECK(ring.bytes() == 3 * 1024);  // each slot is its layer's size, aligned
    CHECK(budget->stats().kind(MemoryKind::ring).current == 3 * 1024);
    // Full of unread copies: no room for a prefetch.
    CHECK(ring.pick(1000, 1, true) == -1);
    // Once read, every slot is free, and the least recently filled one is reused.
    for (int m : made) ring.slot(static_cast<size_t>(m)).consumed = true;
    CHECK(ring.pick(1000, 1, true) == made[0]);
    CHECK(ring.live_slots() == 3);
    // Beyond the capacity only through overflow, and the budget still holds.
    CHECK(ring.overflow(1000) >= 0);
    CHECK_THROWS_AS(ring.overflow(1000), sluice::ResourceError);  // 5 x 1024 > 4096
  }
  CHECK(budget->current() == 0);
}

TEST_CASE("staging ring: small layers share the capacity and a large one frees others", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  StagingRing ring(*dev, nullptr, 4096);
  at::Tensor x = at::ones({64});  // 256 bytes
  std::vector<int> small;
  for (int i = 0; i < 16; ++i) {
    const int s = ring.pick(256, 1, true);
    REQUIRE(s >= 0);
    ring.fill(s, i, 1, {{x, 0}}, nullptr, nullptr);
    small.push_back(s);
  }
  // Sixteen unread prefetches fill the capacity: a seventeenth does not fit.
  CHECK(ring.pick(256, 1, true) == -1);
  dev->synchronize();
  // Read them all; a 2 KiB layer then takes the place of the eight least recently filled.
  for (int s : small) ring.slot(static_cast<size_t>(s)).consumed = true;
  const int big = ring.pick(2048, 1, true);
  REQUIRE(big >= 0);
  CHECK(ring.slot(static_cast<size_t>(big)).bytes() == 2048);
  CHECK(ring.bytes() == 4096);
  CHECK(ring.find(0, 1) == -1);  // the oldest went
  CHECK(ring.find(15, 1) >= 0);  // the newest stayed
  CHECK(ring.wasted_copies() == 0);  // everything dropped had been read
}

TEST_CASE("staging ring: dropping unread copies counts them as wasted", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  StagingRing ring(*dev, nullptr, 1024);
  at::Tensor x = at::ones({64});
  const int s = ring.pick(256, 2, true);
  ring.fill(s, 5, 2, {{x, 0}}, nullptr, nullptr);
  dev->synchronize();
  ring.drop_unread(2);
  CHECK(ring.find(5, 2) == -1);
  CHECK(ring.wasted_copies() == 1);
  CHECK(ring.wasted_bytes() == 256);
  ring.fill(s, 6, 2, {{x, 0}}, nullptr, nullptr);
  dev->synchronize();
  ring.slot(static_cast<size_t>(s)).consumed = true;
  ring.invalidate();  // read before: not wasted
  CHECK(ring.wasted_copies() == 1);
}

TEST_CASE("staging ring: fill packs parts and views read them back", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  StagingRing ring(*dev, nullptr, 8192);
  REQUIRE(ring.pick(4096, 1, true) == 0);
  at::Tensor w = at::arange(12, at::kFloat).reshape({3, 4}).to(at::kFloat8_e4m3fn);
  at::Tensor b = at::arange(3, at::kFloat);
  const uint64_t off_b = align_up(w.nbytes());
  ring.fill(0, 7, 1, {{w, 0}, {b, off_b}}, nullptr, nullptr);
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  CHECK(ring.find(7, 1) == 0);
  CHECK(ring.find(7, 2) == -1);
  at::Tensor wv = ring.view(0, 0, at::kFloat8_e4m3fn, {3, 4});
  at::Tensor bv = ring.view(0, off_b, at::kFloat, {3});
  CHECK(at::equal(wv.to(at::kFloat).cpu(), w.to(at::kFloat)));
  CHECK(at::equal(bv.cpu(), b));
  CHECK(ring.violations() == 0);
}

TEST_CASE("staging ring: pick never returns a slot in use or an unread prefetch", "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  StagingRing ring(*dev, nullptr, 3 * 256);
  make_slots(*dev, ring, 3, 256);
  at::Tensor x = at::ones({8});
  ring.fill(0, 10, 5, {{x, 0}}, nullptr, nullptr);
  ring.fill(1, 11, 5, {{x, 0}}, nullptr, nullptr);
  dev->synchronize();
  ring.slot(0).consumed = true;
  ring.begin_use(0);
  // Slot 0 is leased, slot 1 holds an unread prefetch for forward 5, slot 2 is free.
  CHECK(ring.pick(256, 5, true) == 2);
  CHECK(ring.pick(256, 5, true) == 2);
  ring.fill(2, 12, 5, {{x, 0}}, nullptr, nullptr);
  dev->synchronize();
  CHECK(ring.pick(256, 5, true) == -1);
  CHECK(ring.pick(256, 5, false) == 1);  // a demand copy may evict an unread prefetch, never a leased slot
  // In forward 6, prefetches made for forward 5 and never read are stale.
  CHECK(ring.pick(256, 6, true) == 1);  // the least recently filled
  ring.end_use(0);
  CHECK(ring.pick(256, 5, true) == 0);
  ring.invalidate();
  CHECK(ring.find(11, 5) == -1);
  dev->synchronize();
  CHECK(ring.violations() == 0);
}

TEST_CASE("staging ring: a copy landing in a slot that is in use is detected", "[strict][accel]") {
  CpuDeviceOptions opt;
  opt.copy_latency_us = 30000;
  auto dev = make_cpu_device(opt);
  StagingRing ring(*dev, nullptr, 2 * 256);
  make_slots(*dev, ring, 2, 256);
  // Pinned where the device pins (the strict device copies pageable memory synchronously,
  // as CUDA does, and then no copy could land late).
  at::Tensor x = at::ones({8});
  if (at::Tensor p = dev->pin(x); p.defined()) x = p;
  ring.fill(0, 1, 1, {{x, 0}}, nullptr, nullptr);  // keeps the copy worker busy for 30 ms
  ring.fill(1, 2, 1, {{x, 0}}, nullptr, nullptr);  // queued behind it
  // A reader that starts on slot 1 without waiting for its copy: the worker sees the lease
  // when the copy starts writing.
  ring.begin_use(1);
  dev->synchronize();
  CHECK(ring.violations() == 1);
  ring.end_use(1);
  // Used the right way (wait for the copy first) there is no violation.
  ring.fill(0, 3, 2, {{x, 0}}, nullptr, nullptr);
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  ring.begin_use(0);
  ring.end_use(0);
  dev->synchronize();
  CHECK(ring.violations() == 1);
}

TEST_CASE("staging ring: overwriting waits for the slot's last reader", "[strict][accel]") {
  // FENCE(F2) in staging_ring.cpp. On the plain CPU device the reader is the calling thread
  // and its compute_done is complete when recorded, so a missing wait would go unseen. The
  // strict device's hazard tracker decides by happens-before instead: a fill of a slot whose
  // reader the copy stream did not wait for is an overwrite while compute may still read it.
  CpuDeviceOptions opt;
  opt.strict = true;
  opt.hazard_policy = HazardTracker::Policy::count;
  auto dev = make_cpu_device(opt);
  HazardTracker* tracker = hazard_tracker(*dev);
  REQUIRE(tracker);
  StagingRing ring(*dev, nullptr, 256);
  REQUIRE(ring.pick(256, 1, true) == 0);
  at::Tensor a = dev->pin(at::full({8}, 1.0f)), b = dev->pin(at::full({8}, 2.0f));
  ring.fill(0, 1, 1, {{a, 0}}, nullptr, nullptr);
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  ring.begin_use(0);
  const at::Tensor& slot = ring.slot(0).buffer;
  dev->begin_access(slot, StreamKind::compute, Access::read, "reader of slot 0");
  at::Tensor seen = ring.view(0, 0, at::kFloat, {8}).clone();
  dev->end_access(slot, StreamKind::compute);
  ring.end_use(0);
  ring.fill(0, 2, 1, {{b, 0}}, nullptr, nullptr);
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  dev->begin_access(slot, StreamKind::compute, Access::read, "reader of slot 0");
  CHECK(at::equal(ring.view(0, 0, at::kFloat, {8}), b));
  dev->end_access(slot, StreamKind::compute);
  dev->synchronize();
  CHECK(at::equal(seen, a));
  INFO((tracker->reports().empty() ? std::string() : tracker->reports().front()));
  CHECK(tracker->hazards() == 0);
  CHECK(ring.violations() == 0);
}
