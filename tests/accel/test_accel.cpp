// The torch test accelerator (tests/accel/): each CUDA contract of Note [test accelerator
// contracts] checked on its own, and TorchDevice's first steps on it. ctest runs every
// TEST_CASE in a process of its own, so "before init" really is before init.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <dlfcn.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "offload/device/device.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"

using namespace sluice::offload;

namespace {

constexpr c10::DeviceType kAccel = c10::DeviceType::PrivateUse1;

// Loads the accelerator as a host would (SLUICE_DEVICE_LIBRARY, read once per process).
void load_accel() {
  static const bool loaded = [] {
    setenv("SLUICE_DEVICE_LIBRARY", SLUICE_TEST_ACCEL_LIBRARY, 1);
    load_device_libraries();
    return true;
  }();
  REQUIRE(loaded);
}

c10::Device accel() { return c10::Device(kAccel, 0); }

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The 4-byte int at `p` (device memory is host memory on the accelerator).
int32_t first_int(const at::Tensor& t) { return *static_cast<const int32_t*>(t.data_ptr()); }

}  // namespace

TEST_CASE("accel: the allocator and its statistics refuse before init, as CUDA's do") {
  load_accel();
  CHECK(c10::DeviceTypeName(kAccel, /*lower_case=*/true) == "testaccel");
  c10::DeviceAllocator* alloc = c10::getDeviceAllocator(kAccel);
  CHECK_FALSE(alloc->initialized());
  CHECK(message_of([&] { alloc->allocate(64); }).find("did you call init?") != std::string::npos);
  CHECK(message_of([&] { at::accelerator::getDeviceStats(0); }).find("did you call init?") != std::string::npos);
  // What CUDA answers before init: memory, and pinned queries (always false).
  const auto [free_bytes, total_bytes] = at::accelerator::getMemoryInfo(0);
  CHECK(total_bytes > 0);
  CHECK(free_bytes == total_bytes);
  at::globalContext().lazyInitDevice(kAccel);
  CHECK(alloc->initialized());
  c10::DataPtr p = alloc->allocate(64);
  CHECK(p.get() != nullptr);
  CHECK(at::accelerator::getDeviceStats(0).allocated_bytes[0].current == 512);  // rounded as CUDA's
}

TEST_CASE("accel: TorchDevice initialises the device before its first allocation") {
  load_accel();
  // Nothing in this process has touched the device: no tensor was made on it.
  auto dev = make_device("testaccel");
  at::Tensor t = dev->allocate({256}, at::kFloat, MemoryKind::resident, "first allocation");
  CHECK(t.device() == accel());
  const DeviceBackend::AllocatorStats stats = dev->allocator_stats();
  REQUIRE(stats.available);
  CHECK(stats.current_bytes >= 1024);
  // Pinned memory comes from the backend's pinned allocator and reads as pinned.
  at::Tensor host = dev->pin(at::arange(256, at::kFloat));
  REQUIRE(host.defined());
  CHECK(dev->is_pinned(host));
  CHECK_FALSE(dev->is_pinned(at::arange(256, at::kFloat)));
  dev->copy_to_device(t, host);
  dev->synchronize();
  CHECK(at::equal(t.cpu(), at::arange(256, at::kFloat)));
}

TEST_CASE("accel: a freed block goes to the next allocation of its size on its stream at once, poisoned") {
  load_accel();
  const auto opts = at::TensorOptions().dtype(at::kInt).device(accel());
  at::Tensor a = at::zeros({1 << 16}, opts);
  void* first = a.data_ptr();
  a.reset();
  at::Tensor b = at::empty({1 << 16}, opts);
  CHECK(b.data_ptr() == first);
  CHECK(first_int(b) == -1);  // 0xFF bytes: a stale read shows up
  // Another stream does not get it: blocks belong to the stream they were made on.
  c10::impl::VirtualGuardImpl impl(kAccel);
  b.reset();
  c10::StreamGuard guard(impl.getStreamFromGlobalPool(accel()));
  at::Tensor c = at::empty({1 << 16}, opts);
  CHECK(c.data_ptr() != first);
}

TEST_CASE("accel: a recordStream keeps a block from reuse while the stream still writes it") {
  load_accel();
  at::globalContext().lazyInitDevice(kAccel);
  c10::impl::VirtualGuardImpl impl(kAccel);
  const c10::Stream copy = impl.getStreamFromGlobalPool(accel());
  const c10::Stream compute = impl.getDefaultStream(accel());
  auto* alloc = c10::getDeviceAllocator(kAccel);
  c10::Allocator* pinned = at::globalContext().getPinnedMemoryAllocator(kAccel);
  constexpr int64_t n = 1 << 20;
  c10::DataPtr src_mem = pinned->allocate(n * 4);
  at::Tensor src = at::from_blob(src_mem.get(), {n}, at::kInt);
  src.fill_(5);
  for (bool record : {false, true}) {
    INFO("recordStream " << record);
    at::Tensor slot = at::empty({n}, at::TensorOptions().dtype(at::kInt).device(accel()));
    void* address = slot.data_ptr();
    {
      // Fifty queued copies (0-200 us each): the copy stream is still writing `slot` when
      // the host frees it.
      c10::StreamGuard guard(copy);
      for (int i = 0; i < 50; ++i) slot.copy_(src, /*non_blocking=*/true);
      if (record) alloc->recordStream(slot.storage().data_ptr(), copy);
    }
    slot.reset();
    at::Tensor next = at::empty({n}, at::TensorOptions().dtype(at::kInt).device(accel()));
    CHECK((next.data_ptr() == address) == !record);
    impl.synchronizeStream(copy);
    if (record) {  // past the free now: the block is reusable (`next` still holds the other)
      CHECK(at::empty({n}, at::TensorOptions().dtype(at::kInt).device(accel())).data_ptr() == address);
    }
    impl.synchronizeStream(compute);
  }
}

TEST_CASE("accel: copies from pageable memory block the host, from pinned memory they do not") {
  load_accel();
  at::globalContext().lazyInitDevice(kAccel);
  c10::impl::VirtualGuardImpl impl(kAccel);
  const c10::Stream copy = impl.getStreamFromGlobalPool(accel());
  constexpr int64_t n = 1 << 16;
  at::Tensor dst = at::empty({n}, at::TensorOptions().dtype(at::kInt).device(accel()));
  c10::DataPtr mem = at::globalContext().getPinnedMemoryAllocator(kAccel)->allocate(n * 4);
  at::Tensor pinned = at::from_blob(mem.get(), {n}, at::kInt);
  CHECK(pinned.is_pinned());
  const at::Tensor pageable = at::full({n}, 3, at::kInt);
  CHECK_FALSE(pageable.is_pinned());
  c10::StreamGuard guard(copy);
  // Many pinned copies queue up (each takes up to 200 us) and return at once; the stream
  // is still busy after the last enqueue.
  pinned.fill_(1);
  bool busy = false;
  for (int i = 0; i < 50 && !busy; ++i) {
    dst.copy_(pinned, /*non_blocking=*/true);
    busy = !impl.queryStream(copy);
  }
  CHECK(busy);
  // A pageable copy returns only when it (and everything before it) is done.
  dst.copy_(pageable, /*non_blocking=*/true);
  CHECK(impl.queryStream(copy));
  CHECK(at::equal(dst.cpu(), pageable));
}

TEST_CASE("accel: events order streams, and elapsed time needs timing events that completed") {
  load_accel();
  at::globalContext().lazyInitDevice(kAccel);
  c10::impl::VirtualGuardImpl impl(kAccel);
  const c10::Stream copy = impl.getStreamFromGlobalPool(accel());
  const c10::Stream compute = impl.getDefaultStream(accel());
  c10::Event never(kAccel);
  CHECK(never.query());  // a never-recorded event counts as done
  c10::Event a(kAccel, c10::EventFlag::BACKEND_DEFAULT), b(kAccel, c10::EventFlag::BACKEND_DEFAULT);
  a.record(copy);
  {
    c10::StreamGuard guard(copy);
    at::Tensor dst = at::empty({1 << 20}, at::TensorOptions().dtype(at::kFloat).device(accel()));
    c10::DataPtr mem = at::globalContext().getPinnedMemoryAllocator(kAccel)->allocate(4 << 20);
    at::Tensor src = at::from_blob(mem.get(), {1 << 20}, at::kFloat).fill_(2);
    dst.copy_(src, true);
    b.record(copy);
    b.block(compute);  // compute waits for the copy
    c10::StreamGuard back(compute);
    CHECK(dst.sum().item<float>() == 2.0f * (1 << 20));  // runs after the wait: sees the copy
  }
  b.synchronize();
  CHECK(a.elapsedTime(b) >= 0.0);
  CHECK(b.elapsedTime(b) == 0.0);  // an event against itself, as CUDA allows
  c10::Event untimed(kAccel, c10::EventFlag::PYTORCH_DEFAULT);
  untimed.record(copy);
  untimed.synchronize();
  CHECK(message_of([&] { a.elapsedTime(untimed); }).find("timing") != std::string::npos);
}

TEST_CASE("accel: out of memory is torch's OutOfMemoryError, and emptyCache hands the cache back") {
  load_accel();
  at::globalContext().lazyInitDevice(kAccel);
  const auto [free0, total] = at::accelerator::getMemoryInfo(0);
  const auto opts = at::TensorOptions().dtype(at::kByte).device(accel());
  {
    at::Tensor big = at::empty({static_cast<int64_t>(free0 / 2)}, opts);
    CHECK(at::accelerator::getMemoryInfo(0).first <= free0 - free0 / 2);
    CHECK_THROWS_AS(at::empty({static_cast<int64_t>(free0)}, opts), c10::OutOfMemoryError);
  }
  // The freed block stays reserved (cached) until emptyCache.
  CHECK(at::accelerator::getMemoryInfo(0).first < free0);
  at::accelerator::emptyCache();
  CHECK(at::accelerator::getMemoryInfo(0).first == free0);
  CHECK(at::accelerator::getDeviceStats(0).num_ooms == 1);
  (void)total;
}

TEST_CASE("accel: operators run on the device, views stay views, devices do not mix") {
  load_accel();
  const at::Tensor host = at::randn({4, 6});
  at::Tensor d = host.to(accel());
  CHECK(d.device() == accel());
  CHECK(at::allclose((d * 2 + 1).cpu(), host * 2 + 1));
  CHECK(at::allclose(at::matmul(d, d.t()).cpu(), at::matmul(host, host.t())));
  // A view made by the fallback (unfold has no generic kernel) writes through to its base.
  at::Tensor u = d.unfold(1, 2, 2);
  CHECK(u.device() == accel());
  u.zero_();
  CHECK(d.abs().sum().item<float>() == 0.0f);
  // In-place and out= results are the device tensors passed in.
  at::Tensor out = at::empty({4, 6}, d.options());
  at::Tensor& r = at::add_out(out, d, d);
  CHECK(&r == &out);
  const std::string mixed = message_of([&] { (void)(d + host); });
  CHECK(mixed.find("same device") != std::string::npos);
  CHECK(mixed.find("testaccel") != std::string::npos);
  // A 0-dim CPU tensor is a scalar, as on CUDA.
  CHECK_NOTHROW(d + at::scalar_tensor(1.0));
}

TEST_CASE("accel: a convolution runs on the device, bit-identical to the CPU's, and devices do not mix") {
  load_accel();
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, 4, 13, 10}), w = at::randn({6, 2, 3, 3}), b = at::randn({6});
  // Strided, padded and grouped, as the LLLite trunk's convolutions are; then transposed.
  const at::Tensor host = at::conv2d(x, w, b, /*stride=*/{2, 2}, /*padding=*/{1, 1}, /*dilation=*/{1, 1}, /*groups=*/2);
  const at::Tensor dev = at::conv2d(x.to(accel()), w.to(accel()), b.to(accel()), {2, 2}, {1, 1}, {1, 1}, 2);
  CHECK(dev.device() == accel());
  CHECK(at::equal(dev.cpu(), host));
  const at::Tensor wt = at::randn({4, 3, 2, 2});
  CHECK(at::equal(at::conv_transpose2d(x.to(accel()), wt.to(accel()), {}, {2, 2}).cpu(),
                  at::conv_transpose2d(x, wt, {}, {2, 2})));
  const std::string mixed = message_of([&] { (void)at::conv2d(x.to(accel()), w, b, {1, 1}, {1, 1}, {1, 1}, 2); });
  CHECK(mixed.find("same device") != std::string::npos);
}

TEST_CASE("accel: compute auto asks the backend's dtypes: bf16 where reported and fp16 only for a model fit for it") {
  load_accel();
  const sluice::Fp16Verdict fit{true, "measured fit"};
  const sluice::Fp16Verdict unfit{false, "activations pass 65504"};
  unsetenv("SLUICE_TEST_ACCEL_NO_DTYPES");
  CHECK(sluice::choose_compute_dtype("auto", accel(), unfit).dtype == at::kBFloat16);
  setenv("SLUICE_TEST_ACCEL_NO_DTYPES", "BFloat16", 1);  // a GPU before Ampere
  const sluice::ComputeChoice f16 = sluice::choose_compute_dtype("auto", accel(), fit);
  CHECK(f16.dtype == at::kHalf);
  CHECK(f16.reason.find("does not report BFloat16") != std::string::npos);
  const sluice::ComputeChoice f32 = sluice::choose_compute_dtype("auto", accel(), unfit);
  CHECK(f32.dtype == at::kFloat);
  CHECK(f32.reason.find("fp16 is native but not chosen: activations pass 65504") != std::string::npos);
  setenv("SLUICE_TEST_ACCEL_NO_DTYPES", "BFloat16,Half", 1);
  CHECK(sluice::choose_compute_dtype("auto", accel(), fit).dtype == at::kFloat);
  CHECK(sluice::choose_compute_dtype("bfloat16", accel(), fit).dtype == at::kBFloat16);  // explicit wins
  unsetenv("SLUICE_TEST_ACCEL_NO_DTYPES");
}
