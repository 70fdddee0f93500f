#pragma once
// CopyWorker: the CPU device's copy stream (cpu_device.h), a thread that runs a FIFO of
// jobs: host->device copies, and the device's event records and waits on the copy stream.
//  - A copy can be slowed down (a latency per copy, a byte rate) to model a bus: the bus
//    model (bus_free()) is the worker's, and a record or a wait job moves it too.
//  - A copy that fails (fault points copy.h2d, copy.h2d.timeout) is kept for the device to
//    report like a CUDA error: the next event record on the copy stream takes it
//    (take_failure()), and the next synchronize gets every failure no wait reported
//    (drain()).
//  - It counts the jobs enqueued and run (CopyProgress), so that the strict device's
//    caching pool (cpu_pool.h) can hold a freed block until the jobs enqueued before its
//    free have run.
// The worker needs a core of its own (Note [host waits on compute] in cpu_device.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace sluice::offload {

// A copy that failed on the copy stream. It is reported once by synchronize() unless an
// event wait reported it first; every wait on the event recorded after it throws it.
struct CopyFailure {
  std::string message;
  std::atomic<bool> reported{false};
};

// Jobs the worker was given and jobs it has run, in order: job k (1-based) has run when
// done >= k.
struct CopyProgress {
  std::atomic<uint64_t> enqueued{0};
  std::atomic<uint64_t> done{0};
};

class CopyWorker {
 public:
  using Clock = std::chrono::steady_clock;

  // Starts the thread.
  CopyWorker();
  // Runs the jobs still queued, then stops the thread.
  ~CopyWorker();
  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;

  const std::shared_ptr<CopyProgress>& progress() const { return progress_; }

  // Runs `job` after every job enqueued before it. A job that throws is logged.
  void enqueue(std::function<void()> job);

  // A host->device copy of src's bytes into `dst`.
  struct Copy {
    void* dst = nullptr;
    at::Tensor src;
    at::Tensor keep_dst;  // held until the copy ran (undefined: nothing keeps `dst` alive)
    std::function<void()> before;  // runs right before the bytes move
    double latency_us = 0;         // the copy's modelled time: this plus
    double bytes_per_second = 0;   // its bytes at this rate (0: memcpy speed)
    Clock::time_point enqueued;    // when the device was given it
    bool fail = false;             // fault copy.h2d: half the bytes land, then it fails
    bool time_out = false;         // fault copy.h2d.timeout: the same after a stall of
    double timeout_ms = 0;         // this long
  };
  void copy(Copy c);

  // Blocks until every job enqueued so far has run and the thread is idle. Returns the
  // failures no drain() returned yet (some may have been reported by an event wait since),
  // and drops the failure pending for the next record (reported by the caller now).
  std::vector<std::shared_ptr<CopyFailure>> drain();

  // For jobs, on the worker thread only:
  // when the modelled bus finishes its last copy;
  Clock::time_point bus_free() const { return bus_free_; }
  // the bus is busy until at least `t` (work ordered before it finished then);
  void bus_after(Clock::time_point t) { bus_free_ = std::max(bus_free_, t); }
  // the copies that failed since the last record on the copy stream (the first of them).
  std::shared_ptr<CopyFailure> take_failure() { return std::exchange(failed_, nullptr); }

 private:
  // Worker thread: the next event recorded on the copy stream carries the failure.
  void fail(std::string message);
  void run();

  std::shared_ptr<CopyProgress> progress_ = std::make_shared<CopyProgress>();
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> jobs_;
  bool busy_ = false;
  bool stop_ = false;
  Clock::time_point bus_free_{};  // when the modelled bus finishes its last copy (worker only)
  std::shared_ptr<CopyFailure> failed_;  // failed since the last copy-stream record (worker only)
  std::vector<std::shared_ptr<CopyFailure>> unreported_;  // for drain() (under mutex_)
  std::thread thread_;  // last: started once everything above is
};

}  // namespace sluice::offload
