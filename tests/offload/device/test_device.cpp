#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <limits>
#include <thread>
#include <vector>

#include "offload/device/cpu_device.h"
#include "offload/device/device.h"
#include "offload/device/pinned_arena.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/host_memory_limit.h"
#include "tests/support/device_env.h"

using namespace sluice::offload;

namespace {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {
// The plain CPU device, also when the strict one is asked for (SLUICE_STRICT_DEVICE=1):
// these cases test its own semantics (events done at once, pin() a no-op, pageable copies
// asynchronous); tests/offload/device/test_strict_device.cpp tests the strict ones.
CpuDeviceOptions plain() {
  CpuDeviceOptions o;
  o.strict = false;
  return o;
}
}  // namespace

TEST_CASE("device: cpu device: allocations are accounted until their last reference goes", "[strict]") {
  auto dev = make_cpu_device();
  auto budget = std::make_shared<MemoryLedger>("test budget", 10000);
  {
    at::Tensor a = dev->allocate({100}, at::kFloat, MemoryKind::resident, "a", budget);
    at::Tensor b = dev->allocate({10, 10}, at::kByte, MemoryKind::ring, "b", budget);
    CHECK(a.device().is_cpu());
    CHECK(a.nbytes() == 400);
    CHECK(budget->current() == 500);
    const auto s = dev->memory_stats();
    CHECK(s.total.current == 500);
    CHECK(s.kind(MemoryKind::resident).current == 400);
    CHECK(s.kind(MemoryKind::ring).current == 100);
    at::Tensor view = a.narrow(0, 10, 10);
    a = at::Tensor();
    CHECK(budget->current() == 500);  // the view keeps the storage alive
    view = at::Tensor();
    CHECK(budget->current() == 100);
  }
  const auto s = budget->stats();
  CHECK(s.total.current == 0);
  CHECK(s.total.peak == 500);
  CHECK(s.total.allocated == 500);
  CHECK(s.total.freed == 500);
}

TEST_CASE("device: cpu device: a limit or an injected fault fails the allocation and changes nothing", "[strict]") {
  auto dev = make_cpu_device();
  auto budget = std::make_shared<MemoryLedger>("test budget", 1000);
  at::Tensor a = dev->allocate({900}, at::kByte, MemoryKind::resident, "a", budget);
  CHECK_THROWS_WITH(dev->allocate({200}, at::kByte, MemoryKind::ring, "slot 7", budget),
                    Catch::Contains("slot 7") && Catch::Contains("test budget"));
  CHECK(budget->current() == 900);
  CHECK(dev->memory_stats().total.current == 900);

  dev->set_allocation_fault([](uint64_t bytes, MemoryKind kind) { return kind == MemoryKind::scratch; });
  CHECK_THROWS_AS(dev->allocate({10}, at::kByte, MemoryKind::scratch, "s", budget), sluice::ResourceError);
  CHECK(budget->current() == 900);
  CHECK(dev->memory_stats().total.current == 900);
  at::Tensor b = dev->allocate({10}, at::kByte, MemoryKind::ring, "r", budget);
  CHECK(budget->current() == 910);
}

TEST_CASE("device: cpu device: copies run on the copy stream and events order them", "[strict]") {
  CpuDeviceOptions opt = plain();
  opt.copy_latency_us = 30000;  // 30 ms per copy
  auto dev = make_cpu_device(opt);
  at::Tensor src = at::arange(1000, at::kFloat);
  at::Tensor dst = dev->allocate({1000}, at::kFloat, MemoryKind::ring, "dst");
  dst.zero_();
  auto done = dev->create_event();
  CHECK(done->query());  // never recorded counts as done
  // The copy's `before` hook holds it on the copy worker until the test lets it go, so
  // "enqueued, not run" is an ordering fact, not a time window on a busy machine.
  std::promise<void> go;
  std::shared_future<void> gate = go.get_future().share();
  std::atomic<bool> started{false};
  const auto t0 = std::chrono::steady_clock::now();
  dev->copy_to_device(dst, src, [&started, gate] {
    started = true;
    gate.wait_for(std::chrono::seconds(10));  // bounded: a copy run inline fails below instead of hanging
  });
  dev->record(*done, StreamKind::copy);
  CHECK_FALSE(done->query());  // enqueued; copy_to_device returned before the copy ran
  CHECK(dst.sum().item<float>() == 0.0f);
  go.set_value();
  dev->wait(StreamKind::compute, *done);  // the compute stream is the caller: blocks
  CHECK(started);
  CHECK(ms_since(t0) >= 29);  // a lower bound: the copy's latency was spent
  CHECK(done->query());
  CHECK(at::equal(dst, src));
}

TEST_CASE("device: cpu device: the copy stream is FIFO and elapsed times are measured", "[strict]") {
  CpuDeviceOptions opt = plain();
  opt.copy_bytes_per_second = 1e6;  // 1 MB/s: 20 KB takes 20 ms
  auto dev = make_cpu_device(opt);
  at::Tensor src = at::ones({5000}, at::kFloat);  // 20 KB
  at::Tensor d1 = dev->allocate({5000}, at::kFloat, MemoryKind::ring, "d1");
  at::Tensor d2 = dev->allocate({5000}, at::kFloat, MemoryKind::ring, "d2");
  auto start = dev->create_event(), mid = dev->create_event(), end = dev->create_event();
  dev->record(*start, StreamKind::copy);
  dev->copy_to_device(d1, src);
  dev->record(*mid, StreamKind::copy);
  dev->copy_to_device(d2, src * 2);
  dev->record(*end, StreamKind::copy);
  end->synchronize();
  CHECK(mid->query());
  const double first = dev->elapsed_ms(*start, *mid);
  const double second = dev->elapsed_ms(*mid, *end);
  CHECK(first >= 19.5);
  CHECK(second >= 19.5);
  CHECK(at::equal(d2, src * 2));
}

TEST_CASE("device: cpu device: the copy stream waits on events before later copies", "[strict]") {
  CpuDeviceOptions opt = plain();
  opt.copy_latency_us = 20000;
  auto dev = make_cpu_device(opt);
  at::Tensor src = at::full({16}, 3.0f);
  at::Tensor dst = dev->allocate({16}, at::kFloat, MemoryKind::ring, "dst");
  auto compute_done = dev->create_event();
  auto copy_done = dev->create_event();
  dev->record(*compute_done, StreamKind::compute);  // done at once on the CPU device
  CHECK(compute_done->query());
  dev->wait(StreamKind::copy, *compute_done);
  dev->copy_to_device(dst, src);
  dev->record(*copy_done, StreamKind::copy);
  // A second copy that waits on the first's event finishes after it.
  auto copy2_done = dev->create_event();
  at::Tensor dst2 = dev->allocate({16}, at::kFloat, MemoryKind::ring, "dst2");
  dev->wait(StreamKind::copy, *copy_done);
  dev->copy_to_device(dst2, src);
  dev->record(*copy2_done, StreamKind::copy);
  copy2_done->synchronize();
  CHECK(copy_done->query());
  CHECK(dev->elapsed_ms(*copy_done, *copy2_done) >= 19.5);
  dev->synchronize();
  CHECK(at::equal(dst2, src));
}

TEST_CASE("device: cpu device: pinning is a no-op and total memory defaults to RAM", "[strict]") {
  auto dev = make_cpu_device(plain());
  CHECK_FALSE(dev->pins_memory());
  at::Tensor t = at::ones({4});
  CHECK(dev->pin(t).data_ptr() == t.data_ptr());
  // RAM as the process's container sees it: min(physical RAM, cgroup limit) (Note [host memory limit]).
  CHECK(dev->total_memory() == sluice::host_memory_limit().capacity_bytes());
  CHECK(dev->total_memory() <= sluice::physical_ram_bytes());
  CHECK(sluice::physical_ram_bytes() > 0);
  CpuDeviceOptions opt;
  opt.total_memory = 12345;
  CHECK(make_cpu_device(opt)->total_memory() == 12345);
}

TEST_CASE("device: make_device: cpu and errors naming the flag", "[strict]") {
  auto cpu = make_device("cpu", 4096);
  CHECK(cpu->device().is_cpu());
  CHECK(cpu->total_memory() == 4096);
  CHECK_THROWS_WITH(make_device("tpu:x", 0, "--dev"), Catch::Contains("--dev") && Catch::Contains("tpu:x"));
  // No accelerator here: asking for one fails with the flag named, it does not crash.
  if (!at::hasCUDA()) CHECK_THROWS_AS(make_device("cuda:0"), sluice::InvalidArgument);
}

TEST_CASE("device: cpu device: a failed copy is reported once by the next event wait or by synchronize", "[strict]") {
  struct Disarm {
    ~Disarm() { sluice::fault::disarm_all(); }
  } disarm;
  auto dev = make_cpu_device(plain());
  at::Tensor src = at::arange(256, at::kFloat);
  at::Tensor dst = dev->allocate({256}, at::kFloat, MemoryKind::ring, "dst");
  dst.zero_();
  auto done = dev->create_event();
  sluice::fault::Trigger once;
  once.nth = 1;

  // Reported by a compute-stream wait on the event recorded after it, on every such wait
  // (the bytes it guards are bad), and then no longer by synchronize().
  sluice::fault::arm("copy.h2d", once);
  dev->copy_to_device(dst, src);
  dev->record(*done, StreamKind::copy);
  CHECK_THROWS_WITH(dev->wait(StreamKind::compute, *done), Catch::Contains("injected fault"));
  CHECK_THROWS_AS(dev->wait(StreamKind::compute, *done), sluice::DeviceError);
  CHECK_NOTHROW(dev->synchronize());
  CHECK_FALSE(at::equal(dst, src));  // part of the bytes never arrived
  // The next copy and event are clean.
  dev->copy_to_device(dst, src);
  dev->record(*done, StreamKind::copy);
  CHECK_NOTHROW(dev->wait(StreamKind::compute, *done));
  CHECK(at::equal(dst, src));

  // With no event after it (resident copies), synchronize() reports it, once, and the
  // next event does not inherit it.
  dst.zero_();
  sluice::fault::arm("copy.h2d.timeout", once);
  dev->copy_to_device(dst, src);
  CHECK_THROWS_WITH(dev->synchronize(), Catch::Contains("timed out"));
  CHECK_NOTHROW(dev->synchronize());
  dev->copy_to_device(dst, src);
  dev->record(*done, StreamKind::copy);
  CHECK_NOTHROW(dev->wait(StreamKind::compute, *done));
  CHECK(at::equal(dst, src));

  // An enqueue failure throws at once and enqueues nothing.
  sluice::fault::arm("copy.h2d.enqueue", once);
  dst.zero_();
  CHECK_THROWS_AS(dev->copy_to_device(dst, src), sluice::DeviceError);
  dev->synchronize();
  CHECK(dst.sum().item<float>() == 0.0f);
}

// --- On the device SLUICE_TEST_DEVICE names (tests/support/device_env.h) -------------

TEST_CASE("device: env device: copies from pinned and pageable memory arrive, in order, and the ledger returns to zero",
          "[env-device][strict][accel]") {
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  if (!dev->device().is_cpu()) CHECK(dev->total_memory() > 0);
  constexpr int64_t n = 1 << 20;  // 4 MiB of float
  const at::Tensor host = at::arange(n, at::kFloat);
  {
    at::Tensor pinned = dev->pin(host);
    REQUIRE(pinned.defined());
    CHECK(pinned.is_pinned() == (dev->pins_memory() && !dev->device().is_cpu()));
    at::Tensor a = dev->allocate({n}, at::kFloat, MemoryKind::ring, "pinned dst");
    at::Tensor b = dev->allocate({n}, at::kFloat, MemoryKind::scratch, "pageable dst");
    CHECK(a.device() == dev->device());
    CHECK(static_cast<uint64_t>(dev->memory_stats().total.current) == 2 * n * sizeof(float));
    auto done = dev->create_event();
    auto reused = dev->create_event();
    for (int round = 0; round < 3; ++round) {
      // The copy stream overwrites a and b only after the compute stream is done with them.
      dev->record(*reused, StreamKind::compute);
      dev->wait(StreamKind::copy, *reused);
      dev->copy_to_device(a, pinned);
      dev->copy_to_device(b, host);
      dev->record(*done, StreamKind::copy);
      // Compute-stream work after the wait sees both copies complete.
      dev->wait(StreamKind::compute, *done);
      const at::Tensor sum = (a + b).cpu();
      CHECK(at::equal(sum, host * 2));
      a.zero_();
      b.zero_();
    }
    dev->synchronize();
    CHECK(done->query());
  }
  dev->synchronize();
  CHECK(dev->memory_stats().total.current == 0);
}

TEST_CASE("device: env device: events time device work and an injected enqueue fault leaves the device usable",
          "[env-device][strict][accel]") {
  struct Disarm {
    ~Disarm() { sluice::fault::disarm_all(); }
  } disarm;
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  const at::Tensor host = at::ones({1 << 18}, at::kFloat);
  at::Tensor dst = dev->allocate({1 << 18}, at::kFloat, MemoryKind::ring, "dst");
  auto start = dev->create_event();
  auto stop = dev->create_event();
  dev->record(*start, StreamKind::copy);
  dev->copy_to_device(dst, host);
  dev->record(*stop, StreamKind::copy);
  stop->synchronize();
  CHECK(dev->elapsed_ms(*start, *stop) >= 0.0);

  sluice::fault::Trigger once;
  once.nth = 1;
  sluice::fault::arm("copy.h2d.enqueue", once);
  dst.zero_();
  CHECK_THROWS_AS(dev->copy_to_device(dst, host), sluice::DeviceError);
  dev->synchronize();
  CHECK(dst.sum().item<float>() == 0.0f);
  dev->copy_to_device(dst, host);
  dev->record(*stop, StreamKind::copy);
  dev->wait(StreamKind::compute, *stop);
  CHECK(dst.sum().item<float>() == static_cast<float>(1 << 18));
}

TEST_CASE("device: env device: the pinned arena gets exact-size page-locked chunks and streams from them",
          "[env-device][strict][accel]") {
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  // Three 24 MiB tensors with odd sizes: two chunks (48 MiB + 24 MiB and their tails), never
  // rounded to a power of two; on a GPU the memory comes from the driver, page-locked.
  PinnedArena arena(std::numeric_limits<uint64_t>::max());
  std::vector<PinnedArena::Group> groups;
  std::vector<at::Tensor> originals;
  uint64_t stored = 0;
  for (int i = 0; i < 3; ++i) {
    at::Tensor t = at::arange((24 << 20) / 4 - 3 + i, at::kFloat) * static_cast<float>(i + 1);
    originals.push_back(t.clone());
    stored += t.nbytes();
    groups.push_back({t});
  }
  const auto placed = arena.place(*dev, groups);
  REQUIRE(placed.groups == 3);
  CHECK(arena.chunks() == 2);
  const double ratio = static_cast<double>(arena.pinned().current) / static_cast<double>(stored);
  INFO("pinned " << arena.pinned().current << " / placed " << stored);
  CHECK(ratio <= 1.01);
  for (size_t i = 0; i < groups.size(); ++i) {
    const at::Tensor& h = groups[i][0];
    CHECK(arena.holds(h));
    CHECK(dev->is_pinned(h));
    if (!dev->device().is_cpu()) CHECK(h.is_pinned());  // the driver knows it as page-locked
    at::Tensor d = dev->allocate(h.sizes(), h.scalar_type(), MemoryKind::ring, "arena copy");
    dev->copy_to_device(d, h);
    dev->synchronize();
    CHECK(at::equal(d.cpu(), originals[i]));
  }
  groups.clear();
  CHECK(arena.pinned().current == 0);
  CHECK(dev->memory_stats().total.current == 0);
}
