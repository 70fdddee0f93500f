#include "offload/cpu_device.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"

namespace sluice::offload {

namespace {

using Clock = std::chrono::steady_clock;

// A copy that failed on the copy stream. It is reported once by synchronize() unless an
// event wait reported it first; every wait on the event recorded after it throws it.
struct CopyFailure {
  std::string message;
  std::atomic<bool> reported{false};
};

// Shared between an event and the worker jobs that complete or wait on it, so a job never
// outlives what it touches.
struct CpuEventState {
  mutable std::mutex mutex;
  mutable std::condition_variable cv;
  uint64_t recorded = 0;   // sequence number of the latest record
  uint64_t completed = 0;  // highest sequence number completed
  Clock::time_point done_at{};
  std::shared_ptr<CopyFailure> failure;  // a copy before the latest completion failed

  uint64_t next_record() {
    std::lock_guard<std::mutex> lock(mutex);
    return ++recorded;
  }
  uint64_t latest_record() const {
    std::lock_guard<std::mutex> lock(mutex);
    return recorded;
  }
  // `when`: the time the recorded work finished (the modelled time for the copy stream).
  void complete(uint64_t seq, Clock::time_point when = Clock::now(), std::shared_ptr<CopyFailure> failed = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (seq > completed) {
        completed = seq;
        done_at = when;
        failure = std::move(failed);
      }
    }
    cv.notify_all();
  }
  // Waits for record `seq`; returns the failure of the copies it covers, if any.
  std::shared_ptr<CopyFailure> wait_for(uint64_t seq) const {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return completed >= seq; });
    return failure;
  }
};

class CpuEvent final : public DeviceEvent {
 public:
  bool query() const override {
    std::lock_guard<std::mutex> lock(state->mutex);
    return state->completed >= state->recorded;
  }
  void synchronize() const override { (void)state->wait_for(state->latest_record()); }

  std::shared_ptr<CpuEventState> state = std::make_shared<CpuEventState>();
};

const CpuEventState& state_of(const DeviceEvent& e) {
  const auto* ce = dynamic_cast<const CpuEvent*>(&e);
  TORCH_INTERNAL_ASSERT(ce, "CPU device given an event it did not create");
  return *ce->state;
}

class CpuDevice final : public DeviceBackend {
 public:
  explicit CpuDevice(const CpuDeviceOptions& options) : options_(options) {
    worker_ = std::thread([this] { run(); });
  }

  ~CpuDevice() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  c10::Device device() const override { return c10::Device(c10::kCPU); }
  DeviceMemoryInfo memory_info() const override {
    if (options_.memory_source) return options_.memory_source();
    const auto total = static_cast<int64_t>(options_.total_memory ? options_.total_memory : physical_ram_bytes());
    return {std::max<int64_t>(total - memory_stats().total.current, 0), total};
  }
  // Device tensors come straight from the CPU allocator, which keeps no statistics.
  AllocatorStats allocator_stats() const override { return {}; }
  bool pins_memory() const override { return false; }

  std::unique_ptr<DeviceEvent> create_event() override { return std::make_unique<CpuEvent>(); }

  void record(DeviceEvent& event, StreamKind stream) override {
    auto state = static_cast<CpuEvent&>(event).state;  // only CpuEvents reach here (see state_of)
    (void)state_of(event);
    const uint64_t seq = state->next_record();
    if (stream == StreamKind::compute) {
      state->complete(seq);  // the compute stream is the caller: its work so far is done
    } else {
      const auto enqueued = Clock::now();
      enqueue([this, state, seq, enqueued] {
        // Done when the modelled bus finished everything before it (see copy_to_device).
        bus_free_ = std::max(bus_free_, enqueued);
        state->complete(seq, std::min(bus_free_, Clock::now()), std::exchange(failed_, nullptr));
      });
    }
  }

  void wait(StreamKind stream, const DeviceEvent& event) override {
    auto state = static_cast<const CpuEvent&>(event).state;
    (void)state_of(event);
    const uint64_t target = state->latest_record();  // as recorded now, like cudaStreamWaitEvent
    if (stream == StreamKind::compute) {
      if (const auto failure = state->wait_for(target)) {
        failure->reported = true;
        throw DeviceError("cpu: " + failure->message);
      }
    } else {
      enqueue([this, state, target] {
        (void)state->wait_for(target);
        std::lock_guard<std::mutex> lock(state->mutex);
        bus_free_ = std::max(bus_free_, state->done_at);  // later copies start after the event
      });
    }
  }

  double elapsed_ms(const DeviceEvent& from, const DeviceEvent& to) const override {
    // One event's lock at a time: nesting them made elapsed_ms(a, b) and elapsed_ms(b, a)
    // a lock-order inversion (TSan), and elapsed_ms(e, e) a self-deadlock. A done event's
    // time no longer changes until it is recorded again, which only this thread does.
    const auto done_at = [](const CpuEventState& e, const char* which) {
      std::lock_guard<std::mutex> lock(e.mutex);
      TORCH_INTERNAL_ASSERT(e.recorded > 0 && e.completed >= e.recorded, "elapsed_ms: '", which, "' event not done");
      return e.done_at;
    };
    const auto ta = done_at(state_of(from), "from");
    const auto tb = done_at(state_of(to), "to");
    return std::chrono::duration<double, std::milli>(tb - ta).count();
  }

  void copy_to_device(const at::Tensor& dst, const at::Tensor& src, std::function<void()> before) override {
    TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy_to_device: tensors must be contiguous");
    TORCH_CHECK(dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel(),
                "copy_to_device: dtype/numel mismatch: ", dst.scalar_type(), "[", dst.numel(), "] <- ",
                src.scalar_type(), "[", src.numel(), "]");
    if (fault::triggered("copy.h2d.enqueue")) {
      throw DeviceError("cpu: enqueuing a host->device copy of " + std::to_string(src.nbytes()) +
                        " bytes failed (injected fault)");
    }
    // Decided here, on the caller's thread, so "fail the Nth copy" counts in issue order.
    const bool fail = fault::triggered("copy.h2d");
    const bool time_out = !fail && fault::triggered("copy.h2d.timeout");
    const double latency_us = options_.copy_latency_us;
    const double rate = options_.copy_bytes_per_second;
    const auto enqueued = Clock::now();
    enqueue([this, dst, src, before = std::move(before), latency_us, rate, enqueued, fail, time_out] {
      if (before) before();
      const size_t n = src.nbytes();
      if (fail || time_out) {
        // Like a DMA that dies part way: half the bytes land, the rest stay stale.
        if (n) std::memcpy(dst.data_ptr(), src.data_ptr(), n / 2);
        if (time_out) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(options_.copy_timeout_ms));
        std::string what = "host->device copy of " + std::to_string(n) + " bytes ";
        what += time_out ? "timed out after " + std::to_string(options_.copy_timeout_ms) + " ms" : "failed";
        fail_copy(what + " (injected fault)");
        return;
      }
      if (n) std::memcpy(dst.data_ptr(), src.data_ptr(), n);
      double target_us = latency_us;
      if (rate > 0) target_us += static_cast<double>(n) / rate * 1e6;
      if (target_us <= 0) {
        bus_free_ = std::max(bus_free_, Clock::now());  // an unslowed copy took real time
        return;
      }
      // A slowed copy models a bus: it starts when both it and the bus are ready and takes
      // exactly its time, however late this thread got to it. So the modelled bandwidth
      // holds even when the host oversleeps.
      const auto start = std::max(bus_free_, enqueued);
      const auto until = start + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double, std::micro>(target_us));
      bus_free_ = until;
      // Short waits spin (yielding): a sleep can overshoot by a scheduler tick.
      if (until - Clock::now() > std::chrono::milliseconds(2)) {
        std::this_thread::sleep_until(until - std::chrono::milliseconds(1));
      }
      while (Clock::now() < until) std::this_thread::yield();
    });
  }

  // Like cudaDeviceSynchronize, reports a copy failure that no event wait has reported.
  void synchronize() override {
    std::vector<std::shared_ptr<CopyFailure>> failures;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      idle_cv_.wait(lock, [&] { return jobs_.empty() && !busy_; });
      failures.swap(unreported_);
      // Copies not followed by a record (resident copies) left their failure pending:
      // reported here, it must not stick to the next event. Safe: the worker is idle.
      failed_.reset();
    }
    std::shared_ptr<CopyFailure> first;
    size_t count = 0;
    for (const auto& f : failures) {
      if (f->reported.exchange(true)) continue;
      if (!first) first = f;
      ++count;
    }
    if (first) {
      throw DeviceError("cpu: " + first->message +
                        (count > 1 ? " (and " + std::to_string(count - 1) + " more failed copies)" : std::string()));
    }
  }

  at::Tensor pin(const at::Tensor& src) override { return src; }

 protected:
  c10::DataPtr raw_allocate(size_t nbytes) override { return c10::GetCPUAllocator()->allocate(nbytes); }

 private:
  void enqueue(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

  // Worker thread: the next event recorded on the copy stream carries the failure.
  void fail_copy(std::string message) {
    auto f = std::make_shared<CopyFailure>();
    f->message = std::move(message);
    if (!failed_) failed_ = f;
    std::lock_guard<std::mutex> lock(mutex_);
    unreported_.push_back(std::move(f));
  }

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) {
        if (stop_) return;
        continue;
      }
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      busy_ = true;
      lock.unlock();
      try {
        job();
      } catch (const std::exception& e) {
        log::error(std::string("cpu device copy stream: job failed: ") + e.what());
      }
      job = nullptr;  // drop tensor references outside the lock
      lock.lock();
      busy_ = false;
      if (jobs_.empty()) idle_cv_.notify_all();
    }
  }

  CpuDeviceOptions options_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> jobs_;
  bool busy_ = false;
  bool stop_ = false;
  Clock::time_point bus_free_{};  // when the modelled bus finishes its last copy (worker only)
  std::shared_ptr<CopyFailure> failed_;  // failed since the last copy-stream record (worker only)
  std::vector<std::shared_ptr<CopyFailure>> unreported_;  // for synchronize() (under mutex_)
  std::thread worker_;
};

}  // namespace

std::unique_ptr<DeviceBackend> make_cpu_device(const CpuDeviceOptions& options) {
  TORCH_CHECK(options.copy_latency_us >= 0 && options.copy_bytes_per_second >= 0,
              "CpuDeviceOptions: copy slowdowns must be >= 0");
  return std::make_unique<CpuDevice>(options);
}

}  // namespace sluice::offload
