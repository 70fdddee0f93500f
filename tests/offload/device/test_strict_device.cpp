// The strict CPU device (Note [strict device]) and the bounce ring (Note [bounce ring]):
// what it makes observable that the plain CPU device hides.
#include <catch2/catch.hpp>

#include <cstring>

#include "offload/device/bounce_ring.h"
#include "offload/device/cpu_device.h"
#include "runtime/fault_injection.h"

using namespace sluice::offload;

namespace {

std::shared_ptr<DeviceBackend> strict_cpu(HazardTracker::Policy policy = HazardTracker::Policy::count) {
  CpuDeviceOptions o;
  o.strict = true;
  o.hazard_policy = policy;
  o.copy_latency_us = 200;
  return std::shared_ptr<DeviceBackend>(make_cpu_device(o));
}

at::Tensor host_bytes(int64_t n, uint8_t seed) {
  at::Tensor t = at::empty({n}, at::kByte);
  auto* p = t.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(seed + i * 7);
  return t;
}

}  // namespace

TEST_CASE("strict_device: is strict only when asked") {
  CpuDeviceOptions plain;
  plain.strict = false;
  auto dev = make_cpu_device(plain);
  CHECK(hazard_tracker(*dev) == nullptr);
  CHECK_FALSE(dev->pins_memory());
  auto strict = strict_cpu();
  REQUIRE(hazard_tracker(*strict) != nullptr);
  CHECK(strict->pins_memory());
}

TEST_CASE("strict_device: reading a copy destination before waiting for the copy is a hazard") {
  auto dev = strict_cpu();
  HazardTracker& t = *hazard_tracker(*dev);
  at::Tensor dst = dev->allocate({4096}, at::kByte, MemoryKind::ring, "staging slot");
  at::Tensor src = dev->pin(host_bytes(4096, 1));
  dev->copy_to_device(dst, src);
  SECTION("no wait") {
    dev->begin_access(dst, StreamKind::compute, Access::read, "layer 3");
    dev->end_access(dst, StreamKind::compute);
    REQUIRE(t.hazards() == 1);
    CHECK(t.reports().at(0).find("staging slot") != std::string::npos);
    dev->synchronize();
  }
  SECTION("waited") {
    auto done = dev->create_event();
    dev->record(*done, StreamKind::copy);
    dev->wait(StreamKind::compute, *done);
    dev->begin_access(dst, StreamKind::compute, Access::read, "layer 3");
    dev->end_access(dst, StreamKind::compute);
    CHECK(t.hazards() == 0);
    CHECK(std::memcmp(dst.data_ptr(), src.data_ptr(), 4096) == 0);
  }
}

TEST_CASE("strict_device: compute events read as done only once the host waited for them") {
  auto dev = strict_cpu();
  auto e = dev->create_event();
  dev->record(*e, StreamKind::compute);
  CHECK_FALSE(e->query());
  e->synchronize();
  CHECK(e->query());
  auto c = dev->create_event();
  dev->record(*c, StreamKind::copy);
  c->synchronize();
  CHECK(c->query());
}

TEST_CASE("strict_device: a freed block goes to the next allocation at once and poisoned unless the copy stream used it") {
  auto dev = strict_cpu();
  HazardTracker& t = *hazard_tracker(*dev);
  SECTION("compute-only block: reused at once") {
    at::Tensor a = dev->allocate({1000}, at::kByte, MemoryKind::scratch, "scratch");
    const void* p = a.data_ptr();
    a.fill_(7);
    a = at::Tensor();
    at::Tensor b = dev->allocate({1000}, at::kByte, MemoryKind::scratch, "scratch");
    CHECK(b.data_ptr() == p);
    CHECK(b[0].item<uint8_t>() == 0xFF);
  }
  SECTION("copy destination, use recorded: no hazard, and not reused before the copy stream got past it") {
    CpuDeviceOptions o;
    o.strict = true;
    o.hazard_policy = HazardTracker::Policy::count;
    o.copy_latency_us = 20000;  // the copy is still queued when the block is freed
    auto slow = std::shared_ptr<DeviceBackend>(make_cpu_device(o));
    at::Tensor src = slow->pin(host_bytes(1000, 3));
    at::Tensor a = slow->allocate({1000}, at::kByte, MemoryKind::ring, "slot");
    const void* p = a.data_ptr();
    slow->copy_to_device(a, src);
    slow->record_use(a, StreamKind::copy);
    a = at::Tensor();
    at::Tensor b = slow->allocate({1000}, at::kByte, MemoryKind::ring, "slot");
    CHECK(b.data_ptr() != p);
    CHECK(hazard_tracker(*slow)->hazards() == 0);
    slow->synchronize();
  }
  SECTION("copy destination freed without a recorded use or a wait: a hazard") {
    at::Tensor src = dev->pin(host_bytes(1000, 3));
    at::Tensor a = dev->allocate({1000}, at::kByte, MemoryKind::ring, "slot");
    dev->copy_to_device(a, src);
    a = at::Tensor();
    REQUIRE(t.hazards() == 1);
    CHECK(t.reports().at(0).find("free of slot") != std::string::npos);
    dev->synchronize();
  }
}

TEST_CASE("strict_device: compute streams are told apart by CpuComputeStreamGuard") {
  auto dev = strict_cpu();
  HazardTracker& t = *hazard_tracker(*dev);
  CHECK(dev->compute_stream_id() == 0);
  at::Tensor a = dev->allocate({256}, at::kByte, MemoryKind::scratch, "scratch");
  {
    CpuComputeStreamGuard guard(3);
    CHECK(dev->compute_stream_id() == 3);
    dev->begin_access(a, StreamKind::compute, Access::write, "upcast on stream 3");
    dev->end_access(a, StreamKind::compute);
  }
  CHECK(dev->compute_stream_id() == 0);
  SECTION("synchronize covers the current stream only") {
    dev->synchronize();
    a = at::Tensor();
    CHECK(t.hazards() == 1);
  }
  SECTION("a recorded use covers the other stream") {
    {
      CpuComputeStreamGuard guard(3);
      dev->record_use(a, StreamKind::compute);
    }
    a = at::Tensor();
    CHECK(t.hazards() == 0);
  }
}

TEST_CASE("strict_device: only pin() makes pinned memory") {
  auto dev = strict_cpu();
  const at::Tensor pageable = host_bytes(64, 0);
  CHECK_FALSE(dev->is_pinned(pageable));
  const at::Tensor pinned = dev->pin(pageable);
  CHECK(dev->is_pinned(pinned));
  CHECK(dev->is_pinned(pinned.narrow(0, 8, 8)));
  CHECK(at::equal(pinned, pageable));
}

TEST_CASE("strict_device: bounce ring: pageable copies land exactly piece by piece through pinned slots") {
  auto dev = strict_cpu(HazardTracker::Policy::abort);
  BounceRing ring(*dev, 2, 1000);
  REQUIRE(ring.pinned());
  CHECK(ring.bytes() == 2000);
  const at::Tensor src = host_bytes(4500, 9);
  at::Tensor dst = dev->allocate({4500}, at::kByte, MemoryKind::ring, "slot");
  ring.copy(dst, src);
  CHECK(ring.copies() == 5);
  CHECK(ring.sync_copies() == 0);
  dev->record_use(dst, StreamKind::copy);
  dev->synchronize();
  CHECK(at::equal(dst, src));
  // Again into the same slots: each reuse waits for the slot's previous copy (F8).
  const at::Tensor src2 = host_bytes(4500, 77);
  ring.copy(dst, src2);
  dev->synchronize();
  CHECK(at::equal(dst, src2));
  CHECK(hazard_tracker(*dev)->hazards() == 0);
}

TEST_CASE("strict_device: bounce ring: without pinned slots copies are synchronous and counted") {
  auto dev = strict_cpu(HazardTracker::Policy::abort);
  sluice::fault::ScopedFault fault("host.pin.bounce", sluice::fault::Trigger{1, 1});
  BounceRing ring(*dev, 2, 1000);
  CHECK_FALSE(ring.pinned());
  CHECK(ring.bytes() == 0);
  const at::Tensor src = host_bytes(3000, 5);
  at::Tensor dst = dev->allocate({3000}, at::kByte, MemoryKind::ring, "slot");
  ring.copy(dst, src);
  CHECK(ring.sync_copies() == 1);
  CHECK(ring.copies() == 0);
  CHECK(at::equal(dst, src));  // done when copy() returns
}
