#pragma once
// The torch test accelerator's "driver": the device that sluice's TorchDevice drives when
// no GPU is lent, registered with torch as the PrivateUse1 backend "testaccel"
// (registration.cpp) with its kernels in kernels.cpp. Its device memory is host memory.
//
// Note [test accelerator contracts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// It reproduces, strictly, the CUDA contracts sluice relies on, so that code which breaks
// one fails here instead of on a user's card:
//  1. Lazy initialisation. The caching allocator refuses to allocate before the device is
//     initialised (at::globalContext().lazyInitDevice, which tensor factories call), with
//     CUDA's message "Allocator not initialized for device 0: did you call init?";
//     getDeviceStats/resetPeakStats refuse likewise; torch's pinned-pointer query answers
//     false before init. getMemoryInfo, streams and emptyCache work before init, as on CUDA.
//  2. Streams are queues. Each stream has a worker thread running its work in order; copies
//     take a random latency (0-200 us, seeded), so a stream that was not waited for lags.
//     Compute (every other operator) runs on the calling thread after the current stream
//     has finished what was queued before it: stream order, as a kernel launch has.
//  3. Events record a point in a stream and can be waited for by another stream or the
//     host; a never-recorded event counts as done; elapsed time needs both events created
//     with timing (EventFlag::BACKEND_DEFAULT), recorded and complete.
//  4. Stream-ordered frees. A freed block is reused at once for the next allocation of that
//     size on the stream that allocated it, unless other streams were recorded on it
//     (recordStream): then only after each of them has passed the point of the free. A
//     recordStream on memory this allocator did not make does nothing (as on CUDA). A block
//     entering the cache is filled with 0xFF, so stale reads show up as NaN.
//  5. Capacity. The device has SLUICE_TEST_ACCEL_MEMORY bytes (default 8 GiB); the cache
//     counts as used in getMemoryInfo's free bytes; an allocation past it first releases
//     the cache, then throws torch's OutOfMemoryError; emptyCache hands cached blocks back.
//  6. Host memory. Pinned host memory comes from the backend's pinned allocator (exact
//     size); a copy from pageable memory blocks the host until it is done, as a pageable
//     cudaMemcpyAsync does, while one from pinned memory is asynchronous. Freeing pinned
//     memory synchronizes the device first, as cudaFreeHost does.
//  7. Devices do not mix: an operator given device tensors and non-scalar CPU tensors is
//     refused, as CUDA kernels refuse them.
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

namespace sluice::accel {

constexpr const char* kBackendName = "testaccel";

// ----------------------------------------------------------------------------- streams

// A stream's id; 0 is the device's default stream.
using StreamId = c10::StreamId;

// The stream the calling thread's work goes to (thread-local, like CUDA's current stream).
StreamId current_stream();
void set_current_stream(StreamId id);
// A stream from the pool (round robin over a fixed set, as CUDA's pool) or a new one.
StreamId pool_stream();
StreamId new_stream();

// Queues `job` on stream `id`; returns its position in the stream (1, 2, ...).
uint64_t enqueue(StreamId id, std::function<void()> job);
// Blocks until stream `id` has run its first `position` jobs.
void wait_for(StreamId id, uint64_t position);
// Blocks until stream `id` has run everything queued so far.
void synchronize_stream(StreamId id);
// True when stream `id` has nothing left to run.
bool query_stream(StreamId id);
// Every stream.
void synchronize_device();
// The random latency of the next copy (0-200 us, seeded by SLUICE_TEST_ACCEL_SEED).
std::chrono::microseconds copy_latency();

// ------------------------------------------------------------------------------ events

struct Event {
  explicit Event(bool timing) : timing(timing) {}
  const bool timing;
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t recorded = 0;   // records so far
  uint64_t completed = 0;  // the latest record whose stream reached it
  std::chrono::steady_clock::time_point completed_at{};
};

void record_event(const std::shared_ptr<Event>& e, StreamId stream);
// Makes `stream` wait for `e` as recorded now (nothing if never recorded).
void block_on_event(const std::shared_ptr<Event>& e, StreamId stream);
bool query_event(const std::shared_ptr<Event>& e);
void synchronize_event(const std::shared_ptr<Event>& e);
double elapsed_ms(const std::shared_ptr<Event>& from, const std::shared_ptr<Event>& to);

// ------------------------------------------------------------------------------ memory

// Whether lazy initialisation has run (hooks' init()).
bool initialized();
void initialize();

// The device caching allocator (contracts 1, 4, 5).
class DeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
  c10::DeleterFnPtr raw_deleter() const override;
  bool initialized() override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;
};
DeviceAllocator& device_allocator();
// Whether `p` lies in a live device block (for the kernels' sanity checks).
bool is_device_pointer(const void* p);

// Exact-size page-locked host memory (contract 6).
class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;
};
PinnedAllocator& pinned_allocator();
bool is_pinned(const void* p);
// Frees of pinned memory that had to wait for copies still reading it (contract 6).
int64_t pinned_free_waits();
// A copy reading pinned `p` was queued / has finished (contract 6's bookkeeping).
void pinned_read_begin(const void* p);
void pinned_read_end(const void* p);

// Bytes for SLUICE_TEST_ACCEL_MEMORY-style values: "8GiB", "512MiB", "1073741824".
uint64_t parse_bytes(const char* text, const char* what);

}  // namespace sluice::accel
