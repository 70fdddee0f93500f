#include <catch2/catch.hpp>

#include <cstdint>
#include <thread>
#include <vector>

#include "runtime/error.h"
#include "runtime/host_memory.h"

using sluice::host_empty;
using sluice::host_memory_stats;
using sluice::to_host_owned;

TEST_CASE("host memory: host_empty returns 64-byte aligned mimalloc memory of the right shape") {
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kFloat8_e4m3fn, at::kBool, at::kLong}) {
    at::Tensor t = host_empty({3, 5, 7}, dtype);
    CHECK(t.device().is_cpu());
    CHECK(t.scalar_type() == dtype);
    CHECK(t.sizes() == at::IntArrayRef({3, 5, 7}));
    CHECK(t.is_contiguous());
    CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64 == 0);
    // No mi_is_in_heap_region check: it is true for any heap pointer when Debian's
    // libmimalloc.so replaces malloc, and false under ASan. The exact byte accounting in
    // the next test is what shows the memory comes from host_empty's allocator.
  }
  // 0-d and zero-size tensors are valid too.
  CHECK(host_empty({}, at::kFloat).numel() == 1);
  CHECK(host_empty({4, 0}, at::kFloat).numel() == 0);
}

TEST_CASE("host memory: stats follow allocations and frees exactly") {
  auto& stats = host_memory_stats();
  const int64_t base = stats.current_bytes();
  const int64_t base_allocated = stats.allocated_bytes();
  const int64_t base_freed = stats.freed_bytes();
  const int64_t base_count = stats.allocation_count();
  {
    at::Tensor a = host_empty({1000}, at::kFloat);      // 4000 bytes
    at::Tensor b = host_empty({10, 10}, at::kBFloat16);  // 200 bytes
    CHECK(stats.current_bytes() == base + 4200);
    CHECK(stats.peak_bytes() >= base + 4200);
    CHECK(stats.allocated_bytes() == base_allocated + 4200);
    CHECK(stats.allocation_count() == base_count + 2);

    // A view keeps the storage (and its bytes) alive after the owner is gone.
    at::Tensor view = a.slice(0, 10, 20);
    a.reset();
    CHECK(stats.current_bytes() == base + 4200);
    view.reset();
    CHECK(stats.current_bytes() == base + 200);
  }
  CHECK(stats.current_bytes() == base);
  CHECK(stats.freed_bytes() == base_freed + 4200);

  stats.reset_peak();
  CHECK(stats.peak_bytes() == stats.current_bytes());
  {
    at::Tensor c = host_empty({256}, at::kDouble);
    CHECK(stats.peak_bytes() == base + 2048);
  }
  CHECK(stats.peak_bytes() == base + 2048);  // peak survives the free
  stats.reset_peak();
  CHECK(stats.peak_bytes() == base);

  stats.reset_accumulated();
  CHECK(stats.allocated_bytes() == 0);
  CHECK(stats.freed_bytes() == 0);
  CHECK(stats.allocation_count() == 0);
  CHECK(stats.current_bytes() == base);  // reset_accumulated leaves live bytes alone
}

TEST_CASE("host memory: memory freed on other threads is accounted for") {
  auto& stats = host_memory_stats();
  const int64_t base = stats.current_bytes();
  std::vector<at::Tensor> tensors;
  for (int i = 0; i < 16; ++i) {
    tensors.push_back(host_empty({1024}, at::kFloat));
  }
  CHECK(stats.current_bytes() == base + 16 * 4096);
  std::vector<std::thread> threads;
  for (auto& t : tensors) {
    threads.emplace_back([t = std::move(t)]() mutable { t.reset(); });
  }
  for (auto& th : threads) {
    th.join();
  }
  tensors.clear();
  CHECK(stats.current_bytes() == base);
}

TEST_CASE("host memory: host_empty rejects bad sizes with InvalidArgument") {
  CHECK_THROWS_AS(host_empty({2, -1}, at::kFloat), sluice::InvalidArgument);
  CHECK_THROWS_AS(host_empty({int64_t{1} << 40, int64_t{1} << 40}, at::kFloat), sluice::InvalidArgument);
  // A zero dim does not hide an overflowing product.
  CHECK_THROWS_AS(host_empty({int64_t{1} << 40, int64_t{1} << 40, 0}, at::kFloat), sluice::InvalidArgument);
}

TEST_CASE("host memory: to_host_owned copies and converts into owned mimalloc memory") {
  at::manual_seed(7);
  const at::Tensor src = at::randn({6, 10}).to(at::kBFloat16).t();  // non-contiguous
  REQUIRE_FALSE(src.is_contiguous());
  auto& stats = host_memory_stats();
  const int64_t base = stats.current_bytes();

  SECTION("same dtype: bit-exact copy that does not alias") {
    at::Tensor out = to_host_owned(src, at::kBFloat16);
    CHECK(out.is_contiguous());
    CHECK(out.sizes() == src.sizes());
    CHECK(out.scalar_type() == at::kBFloat16);
    CHECK(at::equal(out, src));
    CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 64 == 0);
    CHECK(stats.current_bytes() == base + 60 * 2);
    const at::Tensor before = out.clone();
    src.fill_(0);  // src is a temporary view of its own storage; the copy must not follow
    CHECK(at::equal(out, before));
  }
  SECTION("conversion bf16 -> f32 matches ATen's conversion") {
    at::Tensor out = to_host_owned(src, at::kFloat);
    CHECK(out.scalar_type() == at::kFloat);
    CHECK(at::equal(out, src.to(at::kFloat)));
    CHECK(stats.current_bytes() == base + 60 * 4);
  }
  SECTION("conversion to fp8 matches ATen's conversion") {
    at::Tensor out = to_host_owned(src, at::kFloat8_e4m3fn);
    CHECK(at::equal(out.view(at::kByte), src.to(at::kFloat8_e4m3fn).contiguous().view(at::kByte)));
  }
  SECTION("undefined input is an InvalidArgument") {
    CHECK_THROWS_AS(to_host_owned(at::Tensor(), at::kFloat), sluice::InvalidArgument);
  }
}

TEST_CASE("host memory: large host blocks are mappings of their own, 2 MiB aligned, counted exactly") {
  auto& stats = host_memory_stats();
  const int64_t base = stats.current_bytes();
  const int64_t big = static_cast<int64_t>(sluice::kHugeBlockMin) + 12345;  // not a page multiple
  {
    at::Tensor t = host_empty({big}, at::kByte);
    CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % (uintptr_t{2} << 20) == 0);
    CHECK(stats.current_bytes() == base + big);
    // Every byte is writable and keeps what was written.
    t.fill_(7);
    t.narrow(0, big - 1, 1).fill_(9);
    CHECK(t.sum().item<int64_t>() == 7 * (big - 1) + 9);
    // Just under the threshold stays in mimalloc (64-byte aligned, the prefix block).
    at::Tensor s = host_empty({static_cast<int64_t>(sluice::kHugeBlockMin) - 1}, at::kByte);
    CHECK(stats.current_bytes() == base + big + static_cast<int64_t>(sluice::kHugeBlockMin) - 1);
  }
  CHECK(stats.current_bytes() == base);
  // Many allocate/free rounds neither leak mappings nor drift the counters.
  for (int i = 0; i < 64; ++i) {
    at::Tensor t = host_empty({4, static_cast<int64_t>(sluice::kHugeBlockMin)}, at::kByte);
    t[3][0] = 1;
  }
  CHECK(stats.current_bytes() == base);
}
