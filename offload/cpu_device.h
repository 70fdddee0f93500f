#pragma once
// The CPU as a device ("--device cpu"): the host plays both sides, so that the budget,
// the residency plan, the staging ring, prefetch and event ordering are enforced exactly
// as on a GPU and can be tested anywhere.
//  - Device tensors are real copies in separately allocated CPU memory, with their own
//    accounting.
//  - The copy stream is a worker thread running a FIFO of jobs (copies, event records,
//    waits). Copies can be slowed down (latency per copy, bytes per second) to model a bus.
//  - The compute stream is the calling thread: recording on it completes at once, and
//    making it wait on an event blocks the caller until the copy is done.
//  - Events are completion counters with the wall-clock time they completed; elapsed
//    times between them are wall-clock.
//  - pin() is a no-op (the engine's pinned-bytes cap accounting still runs).
//  - A copy that fails on the copy stream (fault points copy.h2d, copy.h2d.timeout) is
//    reported like a CUDA error: as DeviceError from a compute-stream wait() on the next
//    event recorded on the copy stream after it, else from the next synchronize().
// The copy worker needs a core of its own: with OpenMP intra-op threads on every core,
// their spin-waiting between parallel regions starves it (tests and benches on small
// machines run with at::set_num_threads(1)).
#include <cstdint>
#include <functional>
#include <memory>

#include "offload/device.h"

namespace sluice::offload {

struct CpuDeviceOptions {
  uint64_t total_memory = 0;         // reported device memory in bytes; 0: physical RAM
  // What memory_info() reports. Unset: total = total_memory above, free = total minus
  // what the device's ledger holds. Tests set it to play a device shared with others.
  std::function<DeviceBackend::DeviceMemoryInfo()> memory_source;
  double copy_latency_us = 0;        // fixed time added to every host->device copy
  double copy_bytes_per_second = 0;  // copy rate cap ("slowed copy"); 0: memcpy speed
  double copy_timeout_ms = 20;       // how long a copy hit by fault point copy.h2d.timeout stalls before it fails
};

std::unique_ptr<DeviceBackend> make_cpu_device(const CpuDeviceOptions& options = {});

}  // namespace sluice::offload
