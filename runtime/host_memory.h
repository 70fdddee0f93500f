#pragma once
// Host (CPU) memory that holds model weights: mimalloc for small blocks, mappings of
// their own for large ones.
//
// Weights loaded from a checkpoint are copied out of the read-only file mapping into
// memory sluice owns (see to_host_owned), so the mapping can be dropped after loading
// and the weights can be downcast, pinned or streamed freely. mimalloc stays behind this
// header; callers see plain CPU tensors whose deleter returns the memory to mimalloc or
// unmaps it.
#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>

namespace sluice {

// Byte counters for memory handed out by host_empty(), modelled on c10's DeviceStats:
// current and peak live bytes, plus accumulated totals since the last reset.
// Thread-safe; tensors may be freed on any thread.
class HostMemoryStats {
 public:
  int64_t current_bytes() const { return current_.load(std::memory_order_relaxed); }
  int64_t peak_bytes() const { return peak_.load(std::memory_order_relaxed); }
  int64_t allocated_bytes() const { return allocated_.load(std::memory_order_relaxed); }  // accumulated
  int64_t freed_bytes() const { return freed_.load(std::memory_order_relaxed); }          // accumulated
  int64_t allocation_count() const { return count_.load(std::memory_order_relaxed); }     // accumulated

  // Sets the peak to the current value, so the next peak covers only what follows.
  void reset_peak();
  // Zeroes allocated/freed bytes and the allocation count.
  void reset_accumulated();

  // Called by the allocator only.
  void record_alloc(int64_t nbytes);
  void record_free(int64_t nbytes);

 private:
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> allocated_{0};
  std::atomic<int64_t> freed_{0};
  std::atomic<int64_t> count_{0};
};

// The process-wide counters for host_empty() memory.
HostMemoryStats& host_memory_stats();

// Alignment of every host_empty() buffer: a cache line, enough for any vector load.
constexpr size_t kHostAlignment = 64;

// Blocks of at least this many bytes are mapped on their own, 2 MiB aligned (on
// transparent huge pages with SLUICE_HOST_HUGE_PAGES=1, Note [host huge pages] in
// host_memory.cpp); smaller ones come from mimalloc.
constexpr size_t kHugeBlockMin = size_t{2} << 20;

// An uninitialised, contiguous CPU tensor (64-byte aligned), in mimalloc memory freed with
// mi_free, or for kHugeBlockMin bytes and more in its own mapping, unmapped when its
// storage dies. Throws InvalidArgument for negative or overflowing sizes and ResourceError
// when the memory cannot be had.
at::Tensor host_empty(at::IntArrayRef sizes, at::ScalarType dtype);

// Faults in the whole pages of [p, p + n) with one call (MADV_POPULATE_WRITE, Linux 5.14)
// instead of one trap per 4 KiB page as the memory is first written. Best effort: an older
// kernel says EINVAL and the pages fault in as they are written.
void populate_pages(void* p, uint64_t n);

// Gives the pages of freed host_empty() blocks back to the system now: mimalloc keeps the
// pages of small blocks it freed for a while (its purge delay), so a model freed layer by
// layer (sluice.offload's remove()) would otherwise keep its freed small layers in the RSS.
// Also glibc's malloc_trim(0), for the blocks the C library's heap keeps.
void return_freed_host_memory();

// Copies `t` (any device, any strides, e.g. a zero-copy view on a mapped checkpoint)
// into a new contiguous host_empty() tensor of `dtype`, converting if needed. Always
// copies, so the result never aliases `t`.
at::Tensor to_host_owned(const at::Tensor& t, at::ScalarType dtype);

}  // namespace sluice
