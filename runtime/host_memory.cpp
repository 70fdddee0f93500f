#include "runtime/host_memory.h"

#include <ATen/core/grad_mode.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/DispatchKeySet.h>
#include <mimalloc.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "runtime/error.h"

namespace sluice {
namespace {

// Note [host block prefix]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The deleter must know the block's size to keep the byte counters exact (mimalloc's
// usable size may be larger than what was asked). Each block therefore starts with one
// alignment unit holding the requested size; the tensor's data begins right after it, so
// it stays 64-byte aligned. The DataPtr's context is the block start, passed to mi_free.
constexpr size_t kPrefix = kHostAlignment;
static_assert(kPrefix >= sizeof(uint64_t), "prefix must hold the size");

// Note [host huge pages]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A load writes every weight byte into memory the process has never touched, so its time
// is bounded by how fast the kernel hands out fresh pages. Blocks of at least kHugeBlockMin
// bytes are therefore mapped on their own: munmap gives them back to the system at once,
// and each is 2 MiB aligned so that, with SLUICE_HOST_HUGE_PAGES=1, MADV_HUGEPAGE lets the
// kernel back every whole 2 MiB extent with one transparent huge page. That advice is off
// by default because it measured both ways on the 2-core development VM (docs/BENCHMARKS.md,
// "Load"): faulting in 2 GB took 0.12 s per thread on huge pages against 0.25 s on 4 KiB
// pages in one session, and 0.25-0.49 s against 0.24 s an hour later, when a whole
// anima-2b load went from 0.85 s to 1.4-4.3 s. A VM that hands free 2 MiB blocks back to its
// host (free page reporting) must fault each huge page in again from the host. On a host
// that keeps its memory, huge pages should help, the upcast's TLB misses as well. Smaller
// blocks stay in mimalloc.
constexpr size_t kHugePage = size_t{2} << 20;

bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("SLUICE_HOST_HUGE_PAGES");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return wanted;
}

// A mapped block: what the deleter needs to unmap it and keep the counters exact.
struct MappedBlock {
  void* base;
  size_t length;
  uint64_t nbytes;
};

void free_mapped(void* context) {
  auto* b = static_cast<MappedBlock*>(context);
  host_memory_stats().record_free(static_cast<int64_t>(b->nbytes));
  ::munmap(b->base, b->length);
  delete b;
}

// n bytes at a 2 MiB boundary, or nullptr when the mapping fails.
void* map_aligned(size_t n, size_t& length) {
  const auto page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  length = (n + page - 1) / page * page;
  // Over-map by one huge page, then trim the unaligned head and the tail.
  const size_t over = length + kHugePage;
  void* raw = ::mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) ::munmap(raw, aligned - start);
  const uintptr_t end = aligned + length;
  if (start + over > end) ::munmap(reinterpret_cast<void*>(end), start + over - end);
  return reinterpret_cast<void*>(aligned);
}

void free_block(void* block) {
  uint64_t nbytes = 0;
  std::memcpy(&nbytes, block, sizeof nbytes);
  host_memory_stats().record_free(static_cast<int64_t>(nbytes));
  mi_free(block);
}

class MimallocHostAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n > std::numeric_limits<size_t>::max() - kPrefix ||
        n > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
      throw ResourceError(c10::str("host memory: cannot allocate ", n, " bytes"));
    }
    if (n >= kHugeBlockMin) return allocate_mapped(n);
    void* block = mi_malloc_aligned(n + kPrefix, kHostAlignment);
    if (block == nullptr) {
      throw ResourceError(c10::str("host memory: out of memory allocating ", n, " bytes (",
                                   host_memory_stats().current_bytes(), " bytes in use)"));
    }
    const uint64_t size = n;
    std::memcpy(block, &size, sizeof size);
    host_memory_stats().record_alloc(static_cast<int64_t>(n));
    void* data = static_cast<uint8_t*>(block) + kPrefix;
    return {data, block, &free_block, c10::Device(c10::DeviceType::CPU)};
  }

  // Note [host huge pages].
  static c10::DataPtr allocate_mapped(size_t n) {
    size_t length = 0;
    void* data = map_aligned(n, length);
    if (data == nullptr) {
      throw ResourceError(c10::str("host memory: cannot map ", n, " bytes (", std::strerror(errno), "; ",
                                   host_memory_stats().current_bytes(), " bytes in use)"));
    }
    if (huge_pages_wanted()) {
#ifdef MADV_HUGEPAGE
      (void)::madvise(data, length, MADV_HUGEPAGE);  // advice only: EINVAL without THP
#endif
    }
    auto* block = new MappedBlock{data, length, n};
    host_memory_stats().record_alloc(static_cast<int64_t>(n));
    return {data, block, &free_mapped, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

MimallocHostAllocator& host_allocator() {
  static MimallocHostAllocator allocator;
  return allocator;
}

}  // namespace

void HostMemoryStats::reset_peak() {
  peak_.store(current_.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

void HostMemoryStats::reset_accumulated() {
  allocated_.store(0, std::memory_order_relaxed);
  freed_.store(0, std::memory_order_relaxed);
  count_.store(0, std::memory_order_relaxed);
}

void HostMemoryStats::record_alloc(int64_t nbytes) {
  const int64_t now = current_.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  allocated_.fetch_add(nbytes, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  int64_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void HostMemoryStats::record_free(int64_t nbytes) {
  current_.fetch_sub(nbytes, std::memory_order_relaxed);
  freed_.fetch_add(nbytes, std::memory_order_relaxed);
}

HostMemoryStats& host_memory_stats() {
  static HostMemoryStats stats;
  return stats;
}

at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  // Checked here so a bad shape is a typed error, not a c10::Error from deep inside ATen.
  uint64_t bytes = c10::elementSize(dtype);
  // Zero dims are skipped so that [huge, huge, 0] is still rejected as ATen would.
  for (const int64_t d : sizes) {
    if (d < 0) {
      throw InvalidArgument(c10::str("host_empty: negative size in ", sizes));
    }
    if (d != 0 && (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes) ||
               bytes > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))) {
      throw InvalidArgument(c10::str("host_empty: size ", sizes, " of ", dtype, " overflows"));
    }
  }
  return at::detail::empty_generic(sizes, &host_allocator(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   dtype, std::nullopt);
}

void populate_pages(void* p, uint64_t n) {
#ifdef MADV_POPULATE_WRITE
  static std::atomic<bool> unsupported{false};
  if (unsupported.load(std::memory_order_relaxed)) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) / page * page;
  if (end <= begin) return;
  if (::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) {
    unsupported.store(true, std::memory_order_relaxed);
  }
#else
  (void)p;
  (void)n;
#endif
}

at::Tensor to_host_owned(const at::Tensor& t, at::ScalarType dtype) {
  if (!t.defined()) {
    throw InvalidArgument("to_host_owned: undefined tensor");
  }
  at::NoGradGuard no_grad;
  at::Tensor out = host_empty(t.sizes(), dtype);
  out.copy_(t);
  return out;
}

void return_freed_host_memory() {
  mi_collect(/*force=*/true);
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

}  // namespace sluice
