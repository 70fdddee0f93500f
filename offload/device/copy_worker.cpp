#include "offload/device/copy_worker.h"

#include <cstring>
#include <exception>

#include "runtime/logging.h"

namespace sluice::offload {

CopyWorker::CopyWorker() : thread_([this] { run(); }) {}

CopyWorker::~CopyWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void CopyWorker::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
    progress_->enqueued.fetch_add(1);
  }
  cv_.notify_one();
}

void CopyWorker::copy(Copy c) {
  enqueue([this, c = std::move(c)] {
    if (c.before) c.before();
    const size_t n = c.src.nbytes();
    if (c.fail || c.time_out) {
      // Like a DMA that dies part way: half the bytes land, the rest stay stale.
      if (n) std::memcpy(c.dst, c.src.data_ptr(), n / 2);
      if (c.time_out) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(c.timeout_ms));
      std::string what = "host->device copy of " + std::to_string(n) + " bytes ";
      what += c.time_out ? "timed out after " + std::to_string(c.timeout_ms) + " ms" : "failed";
      fail(what + " (injected fault)");
      return;
    }
    if (n) std::memcpy(c.dst, c.src.data_ptr(), n);
    double target_us = c.latency_us;
    if (c.bytes_per_second > 0) target_us += static_cast<double>(n) / c.bytes_per_second * 1e6;
    if (target_us <= 0) {
      bus_free_ = std::max(bus_free_, Clock::now());  // an unslowed copy took real time
      return;
    }
    // A slowed copy models a bus: it starts when both it and the bus are ready and takes
    // exactly its time, however late this thread got to it. So the modelled bandwidth
    // holds even when the host oversleeps.
    const auto start = std::max(bus_free_, c.enqueued);
    const auto until = start + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double, std::micro>(target_us));
    bus_free_ = until;
    // Sleep, then spin (yielding) for the last 150 us: a sleep can overshoot by the
    // timer slack. Spinning through whole copies would keep a core busy for as long as
    // copies are in flight, and on a 2-core machine whose cores share a physical core
    // that slows the compute the copies are meant to overlap (measured: anima-medium at
    // max_resident 0.5 computed ~20% slower while copies spun).
    if (until - Clock::now() > std::chrono::microseconds(300)) {
      std::this_thread::sleep_until(until - std::chrono::microseconds(150));
    }
    while (Clock::now() < until) std::this_thread::yield();
  });
}

std::vector<std::shared_ptr<CopyFailure>> CopyWorker::drain() {
  std::vector<std::shared_ptr<CopyFailure>> failures;
  std::unique_lock<std::mutex> lock(mutex_);
  idle_cv_.wait(lock, [&] { return jobs_.empty() && !busy_; });
  failures.swap(unreported_);
  // Copies not followed by a record (resident copies) left their failure pending:
  // reported by the caller now, it must not stick to the next event. Safe: the worker is
  // idle.
  failed_.reset();
  return failures;
}

void CopyWorker::fail(std::string message) {
  auto f = std::make_shared<CopyFailure>();
  f->message = std::move(message);
  if (!failed_) failed_ = f;
  std::lock_guard<std::mutex> lock(mutex_);
  unreported_.push_back(std::move(f));
}

void CopyWorker::run() {
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
    progress_->done.fetch_add(1);
    lock.lock();
    busy_ = false;
    if (jobs_.empty()) idle_cv_.notify_all();
  }
}

}  // namespace sluice::offload
