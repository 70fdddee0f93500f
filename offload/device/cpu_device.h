#pragma once
// The CPU as a device ("--device cpu"): the host plays both sides, so that the budget,
// the residency plan, the staging ring, prefetch and event ordering are enforced exactly
// as on a GPU and can be tested anywhere.
//  - Device tensors are real copies in separately allocated CPU memory, with their own
//    accounting, and the allocator counts the bytes alive (allocator_stats()): a count
//    independent of the ledgers, which tests hold against the budget.
//  - The copy stream is a worker thread running a FIFO of jobs (copies, event records,
//    waits): copy_worker.h. Copies can be slowed down (latency per copy, bytes per
//    second) to model a bus.
//  - The compute stream is the calling thread: recording on it completes at once, and
//    making it wait on an event blocks the caller until the copy is done.
//  - Events are completion counters with the wall-clock time they completed; elapsed
//    times between them are wall-clock.
//  - pins_memory() is false: allocate_pinned() hands out ordinary aligned host memory (the
//    pinned arena's packing, limit and accounting run as on a GPU) and pin() is a no-op.
//    The strict device's pinned memory is tracked as such (below).
//  - A copy that fails on the copy stream (fault points copy.h2d, copy.h2d.timeout) is
//    reported like a CUDA error: as DeviceError from a compute-stream wait() on the next
//    event recorded on the copy stream after it, else from the next synchronize().
//
// Note [strict device]
// ~~~~~~~~~~~~~~~~~~~~
// With SLUICE_STRICT_DEVICE=1 (or CpuDeviceOptions::strict) the CPU device behaves like a
// hostile GPU, so that a missing fence fails CI instead of racing on a user's card:
//  - copies take a random extra latency (0-200 us, seeded), so the copy stream lags;
//  - an event recorded on a compute stream reads as not done until the host waits for
//    it (a GPU's host runs ahead of its kernels): nothing may rely on compute finishing
//    by itself;
//  - a copy from host memory allocate_pinned() did not make blocks the host until it is
//    done, as a pageable cudaMemcpyAsync does;
//  - device memory comes from a caching allocator that hands a freed block to the next
//    allocation of that size at once, filled with 0xFF, unless its use by the copy stream
//    was recorded (DeviceAllocator::record_use), in which case it waits for the copy
//    stream's work at the free;
//  - every device block and pinned host block is tracked by a HazardTracker
//    (hazard_tracker.h): a read before its copy is ordered, an overwrite or free while
//    another queue may still use it, aborts the process with the block, both queues and
//    both operations named. Compute-stream accesses are those the engine declares
//    (begin_access/end_access); copies and frees are seen by the device itself.
// Forwards on several compute streams are modelled by CpuComputeStreamGuard: the
// calling thread's work belongs to that stream until the guard ends.
// The strict device's parts: its glue to the hazard tracker (strict_tracking.h) and its
// caching allocator (cpu_pool.h); the plain device (cpu_device.cpp) holds them when strict.
//
// Note [host waits on compute]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A GPU's host only enqueues compute; it learns that compute finished only by waiting for
// it. A host wait for the copy stream (an event's synchronize(), a copy from pageable
// memory) also waits for every compute event the copy stream was made to wait for before
// it: the thread that queues the forward then blocks until the device finished that
// compute, and the forward loses its lead. Both CPU devices (plain and strict) count such
// waits, host_compute_waits(): a host wait on copy-stream work that follows a copy-stream
// wait() on a compute record that is still running on the modelled device. A compute
// record runs until the host waited for it (its event's synchronize(), a later record's
// of the same stream through a copy event, a device synchronize) or, with
// CpuDeviceOptions::compute_lag = n, until n later records were made on its stream (the
// device runs n compute records behind the host). Unset: compute never finishes on its
// own, and copy events behind it still read as done to query() (the CPU device's own
// timing); set, they read as not done while it runs.
// The copy worker needs a core of its own: with OpenMP intra-op threads on every core,
// their spin-waiting between parallel regions starves it (tests and benches on small
// machines run with at::set_num_threads(1)).
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "offload/device/device.h"
#include "offload/device/hazard_tracker.h"

namespace sluice::offload {

// Whether the environment asks for the strict device (SLUICE_STRICT_DEVICE=1).
bool strict_device_requested();

struct CpuDeviceOptions {
  uint64_t total_memory = 0;         // reported device memory in bytes; 0: the host's (below)
  // What memory_info() reports. Unset: total = total_memory above, free = total minus
  // what the device's ledger holds. Tests set it to play a device shared with others.
  // With total_memory 0 too: total = the host's memory as the process's container sees it,
  // min(physical RAM, cgroup limit), and free = total minus what the device holds, at most
  // MemAvailable (HostMemoryLimit::capacity_bytes(), Note [host memory limit] in
  // runtime/host_memory_limit.h), so that `auto` takes no more than is available now.
  std::function<DeviceBackend::DeviceMemoryInfo()> memory_source;
  double copy_latency_us = 0;        // fixed time added to every host->device copy
  double copy_bytes_per_second = 0;  // copy rate cap ("slowed copy"); 0: memcpy speed
  double copy_timeout_ms = 20;       // how long a copy hit by fault point copy.h2d.timeout stalls before it fails
  bool strict = strict_device_requested();  // Note [strict device]
  HazardTracker::Policy hazard_policy = HazardTracker::Policy::abort;
  uint32_t strict_seed = 1;          // of the strict device's random copy latencies
  // Note [host waits on compute]: compute records the modelled device runs behind the host
  // (unset: compute finishes only when the host waits for it).
  std::optional<uint64_t> compute_lag;
};

std::unique_ptr<DeviceBackend> make_cpu_device(const CpuDeviceOptions& options = {});

// The strict CPU device's hazard tracker; nullptr for any other backend.
HazardTracker* hazard_tracker(DeviceBackend& device);

// Host waits of a CPU device (plain or strict) that waited for compute still running on
// the modelled device (Note [host waits on compute]), and a description of the latest.
// Throws for any other backend.
uint64_t host_compute_waits(const DeviceBackend& device);
std::string last_host_compute_wait(const DeviceBackend& device);

// The CPU device's stand-in for a host-provided stream: while it lives, compute work of
// the calling thread runs on compute stream `stream` (0 is the default stream).
class CpuComputeStreamGuard {
 public:
  explicit CpuComputeStreamGuard(uint32_t stream);
  ~CpuComputeStreamGuard();
  // The calling thread's compute stream now (0 outside every guard).
  static uint32_t current();
  CpuComputeStreamGuard(const CpuComputeStreamGuard&) = delete;
  CpuComputeStreamGuard& operator=(const CpuComputeStreamGuard&) = delete;

 private:
  uint32_t previous_;
};

}  // namespace sluice::offload
