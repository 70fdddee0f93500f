#include <catch2/catch.hpp>

#include "offload/cpu_device.h"
#include "offload/staging_ring.h"
#include "runtime/error.h"

using namespace sluice::offload;

TEST_CASE("staging ring: slots are ring memory charged to the budget") {
  auto dev = make_cpu_device();
  auto budget = std::make_shared<MemoryLedger>("budget", 4096);
  {
    StagingRing ring(*dev, budget, 3, 1000);
    CHECK(ring.size() == 3);
    CHECK(ring.bytes() == 3000);
    CHECK(budget->stats().kind(MemoryKind::ring).current == 3000);
    ring.grow();
    CHECK(ring.size() == 4);
    CHECK_THROWS_AS(ring.grow(), sluice::ResourceError);  // 5000 > 4096
    CHECK(ring.size() == 4);
  }
  CHECK(budget->current() == 0);
}

TEST_CASE("staging ring: fill packs parts and views read them back") {
  auto dev = make_cpu_device();
  StagingRing ring(*dev, nullptr, 2, 4096);
  at::Tensor w = at::arange(12, at::kFloat).reshape({3, 4}).to(at::kFloat8_e4m3fn);
  at::Tensor b = at::arange(3, at::kFloat);
  const uint64_t off_b = align_up(w.nbytes());
  ring.fill(0, 7, 1, {{w, 0}, {b, off_b}}, nullptr, nullptr);
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  CHECK(ring.find(7, 1) == 0);
  CHECK(ring.find(7, 2) == -1);
  at::Tensor wv = ring.view(0, 0, at::kFloat8_e4m3fn, {3, 4});
  at::Tensor bv = ring.view(0, off_b, at::kFloat, {3});
  CHECK(at::equal(wv.to(at::kFloat), w.to(at::kFloat)));
  CHECK(at::equal(bv, b));
  CHECK(ring.violations() == 0);
}

TEST_CASE("staging ring: pick never returns a slot in use or an unread prefetch") {
  auto dev = make_cpu_device();
  StagingRing ring(*dev, nullptr, 3, 256);
  at::Tensor x = at::ones({8});
  ring.fill(0, 10, 5, {{x, 0}}, nullptr, nullptr);
  ring.fill(1, 11, 5, {{x, 0}}, nullptr, nullptr);
  dev->synchronize();
  ring.slot(0).consumed = true;
  ring.begin_use(0);
  // Slot 0 is leased, slot 1 holds an unread prefetch for forward 5, slot 2 is free.
  CHECK(ring.pick(5, true) == 2);
  CHECK(ring.pick(5, true) == 2);
  ring.fill(2, 12, 5, {{x, 0}}, nullptr, nullptr);
  dev->synchronize();
  CHECK(ring.pick(5, true) == -1);
  CHECK(ring.pick(5, false) == 1);  // a demand copy may evict an unread prefetch, never a leased slot
  // In forward 6, prefetches made for forward 5 and never read are stale.
  CHECK(ring.pick(6, true) == 2);
  ring.end_use(0);
  CHECK(ring.pick(5, true) == 0);
  ring.invalidate();
  CHECK(ring.find(11, 5) == -1);
  dev->synchronize();
  CHECK(ring.violations() == 0);
}

TEST_CASE("staging ring: a copy landing in a slot that is in use is detected") {
  CpuDeviceOptions opt;
  opt.copy_latency_us = 30000;
  auto dev = make_cpu_device(opt);
  StagingRing ring(*dev, nullptr, 2, 256);
  at::Tensor x = at::ones({8});
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

TEST_CASE("staging ring: overwriting waits for the slot's last reader") {
  // On the CPU device the reader is the calling thread, so its compute_done is complete
  // when recorded; the ring must still have the copy stream wait on it, which this checks
  // through the event's sequence: a fill after end_use must not finish before it.
  CpuDeviceOptions opt;
  opt.copy_latency_us = 10000;
  auto dev = make_cpu_device(opt);
  StagingRing ring(*dev, nullptr, 1, 256);
  at::Tensor a = at::full({8}, 1.0f), b = at::full({8}, 2.0f);
  ring.fill(0, 1, 1, {{a, 0}}, nullptr, nullptr);
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  ring.begin_use(0);
  at::Tensor seen = ring.view(0, 0, at::kFloat, {8}).clone();
  ring.end_use(0);
  ring.fill(0, 2, 1, {{b, 0}}, nullptr, nullptr);
  CHECK(at::equal(seen, a));
  dev->wait(StreamKind::compute, *ring.slot(0).copy_done);
  CHECK(at::equal(ring.view(0, 0, at::kFloat, {8}), b));
  CHECK(ring.violations() == 0);
}
