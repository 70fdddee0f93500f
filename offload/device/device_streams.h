#pragma once
// DeviceStreams: the streams part of the device interface (DeviceBackend, device.h), as
// c10 keeps streams and events (DeviceGuardImplInterface.h) apart from allocation
// (Allocator.h): the two streams the engine uses, events recorded on them and waited for,
// host->device copies on the copy stream, and the hooks through which the engine declares
// what a stream's work reads and writes (the strict CPU device's hazard tracker checks
// them). The memory that work uses comes from the other part, DeviceAllocator
// (device_allocator.h).
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "offload/device/hazard_tracker.h"

namespace sluice::offload {

// The two streams the engine uses. On a GPU: the caller's current stream and a copy stream
// from the pool. On the CPU device: the calling thread and a worker thread.
enum class StreamKind : uint8_t { compute, copy };

// A marker in a stream's work, like a CUDA event. A never-recorded event counts as done.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // True when the work recorded before it (the latest record) has finished.
  virtual bool query() const = 0;
  // Blocks the host until query() would return true.
  virtual void synchronize() const = 0;
};

class DeviceStreams {
 public:
  DeviceStreams() = default;
  virtual ~DeviceStreams();
  DeviceStreams(const DeviceStreams&) = delete;
  DeviceStreams& operator=(const DeviceStreams&) = delete;

  virtual std::unique_ptr<DeviceEvent> create_event() = 0;
  // Marks the current end of `stream`'s work with `event`.
  virtual void record(DeviceEvent& event, StreamKind stream) = 0;
  // Makes later work on `stream` wait until `event` (as recorded now) is done. For the
  // compute stream of the CPU device this blocks the calling thread, and throws DeviceError
  // when a copy recorded before the event failed (its destination holds stale bytes).
  virtual void wait(StreamKind stream, const DeviceEvent& event) = 0;
  // Milliseconds from `from` to `to`; both must have been recorded and be done.
  virtual double elapsed_ms(const DeviceEvent& from, const DeviceEvent& to) const = 0;

  // Enqueues a copy of host `src` into device `dst` (same dtype and numel, both
  // contiguous) on the copy stream. The caller keeps `src` alive and `dst` unused until an
  // event recorded on the copy stream after it is done. `before`, when given, runs right
  // before the bytes move on backends whose copy stream is a host thread (the CPU device),
  // and is ignored elsewhere; tests use it to check that a slot is not in use.
  virtual void copy_to_device(const at::Tensor& dst, const at::Tensor& src, std::function<void()> before = {}) = 0;

  // Blocks until both streams have finished everything enqueued so far. Throws
  // DeviceError for a copy that failed asynchronously and that no wait() reported yet.
  virtual void synchronize() = 0;

  // The compute stream of the calling thread: the current stream on a GPU (a host may run
  // forwards on a stream of its own), CpuComputeStreamGuard's on the CPU device. 0 is the
  // default stream.
  virtual uint64_t compute_stream_id() const = 0;

  // The access hooks: what a stream's work (or the host) reads and writes, declared by
  // whoever enqueues it (the engine's forward: its leases of a layer's slot, its upcast
  // buffer, the parameters and LoRA sidecars; the bounce ring: its host fills), for the
  // sanitizer. They sit with the streams, not in an interface of their own, because an
  // access is checked against the order this interface makes (events recorded and waited
  // for, copies, synchronize), and every caller is one that records and waits.
  // Declares that work on `stream` reads or writes device tensor `t` from now until
  // end_access(); `op` names it in hazard reports. Only the strict CPU device
  // (SLUICE_STRICT_DEVICE=1) checks these; elsewhere they cost a virtual call.
  virtual void begin_access(const at::Tensor& /*t*/, StreamKind /*stream*/, Access /*a*/, const std::string& /*op*/) {}
  virtual void end_access(const at::Tensor& /*t*/, StreamKind /*stream*/) {}
  // The host itself reads or writes `t` now (a pinned bounce slot, an output).
  virtual void host_access(const at::Tensor& /*t*/, Access /*a*/, const std::string& /*op*/) {}
};

}  // namespace sluice::offload
