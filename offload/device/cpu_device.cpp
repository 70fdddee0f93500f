#include "offload/device/cpu_device.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <cstdlib>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/host_memory_limit.h"
#include "runtime/logging.h"

namespace sluice::offload {

namespace {

void free_host(void* p) { std::free(p); }

// The strict device's pinned host block: known to its hazard tracker until freed.
struct PinnedBlock {
  void* p;
  std::shared_ptr<HazardTracker> tracker;
};

void free_pinned_block(void* ctx) {
  auto* b = static_cast<PinnedBlock*>(ctx);
  b->tracker->remove_block(b->p);
  std::free(b->p);
  delete b;
}

using Clock = std::chrono::steady_clock;
using Queue = HazardTracker::Queue;

thread_local uint32_t t_compute_stream = 0;  // CpuComputeStreamGuard

Queue compute_queue() { return HazardTracker::compute(t_compute_stream); }
Queue queue_of(StreamKind kind) { return kind == StreamKind::copy ? HazardTracker::kCopy : compute_queue(); }

// The strict device's caching allocator (Note [strict device]). A freed block is reused
// by the next allocation of the same size at once, poisoned; a block whose use by the
// copy stream was recorded waits until the copy worker has run every job enqueued before
// its free (`fence`).
struct StrictPool {
  static constexpr uint64_t kMaxCached = uint64_t{256} << 20;
  std::mutex mutex;
  std::multimap<size_t, std::pair<void*, uint64_t>> free;  // size -> (block, fence)
  uint64_t cached = 0;
  std::atomic<uint64_t> jobs_enqueued{0};
  std::atomic<uint64_t> jobs_done{0};
  // Allocator statistics: bytes handed out (current, peak) and held (reserved).
  int64_t current = 0, peak = 0, reserved = 0;

  ~StrictPool() {
    for (auto& [n, block] : free) std::free(block.first);
  }

  void* take(size_t n) {
    std::lock_guard<std::mutex> lock(mutex);
    current += static_cast<int64_t>(n);
    peak = std::max(peak, current);
    const auto [lo, hi] = free.equal_range(n);
    for (auto it = lo; it != hi; ++it) {
      if (it->second.second > jobs_done.load()) continue;
      void* p = it->second.first;
      if (it->second.second) std::memset(p, 0xFF, n);  // deferred: poisoned only now
      free.erase(it);
      cached -= n;
      return p;
    }
    void* p = std::aligned_alloc(64, (std::max<size_t>(n, 1) + 63) / 64 * 64);
    if (!p) {
      current -= static_cast<int64_t>(n);
      TORCH_CHECK(false, "strict cpu device: out of memory allocating ", n, " bytes");
    }
    reserved += static_cast<int64_t>(n);
    return p;
  }

  // Hands cached blocks back to the OS (release_cached_memory), except those still
  // waiting for the copy stream.
  void trim() {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = free.begin(); it != free.end();) {
      if (it->second.second > jobs_done.load()) {
        ++it;
        continue;
      }
      std::free(it->second.first);
      reserved -= static_cast<int64_t>(it->first);
      cached -= it->first;
      it = free.erase(it);
    }
  }

  void give(void* p, size_t n, uint64_t fence) {
    if (!fence) std::memset(p, 0xFF, n);
    std::lock_guard<std::mutex> lock(mutex);
    current -= static_cast<int64_t>(n);
    if (cached + n > kMaxCached) {
      std::free(p);
      reserved -= static_cast<int64_t>(n);
      return;
    }
    free.emplace(n, std::make_pair(p, fence));
    cached += n;
  }
};

// The plain device's allocation counter: bytes alive (handed out and not yet freed) and
// their peak, counted at the allocator, independently of the ledgers that charge them.
struct AliveCounter {
  std::mutex mutex;
  int64_t current = 0, peak = 0;
  void add(int64_t n) {
    std::lock_guard<std::mutex> lock(mutex);
    current += n;
    peak = std::max(peak, current);
  }
};

struct PlainBlock {
  std::shared_ptr<AliveCounter> counter;
  c10::DataPtr inner;
  int64_t n;
};

void plain_free(void* ctx) {
  auto* b = static_cast<PlainBlock*>(ctx);
  b->counter->add(-b->n);
  delete b;  // frees `inner`
}

struct StrictBlock {
  std::shared_ptr<StrictPool> pool;
  std::shared_ptr<HazardTracker> tracker;
  void* p;
  size_t n;
};

void strict_free(void* ctx) {
  auto* b = static_cast<StrictBlock*>(ctx);
  const bool by_copy = b->tracker->recorded_queues(b->p).count(HazardTracker::kCopy) > 0;
  b->tracker->remove_block(b->p);
  b->pool->give(b->p, b->n, by_copy ? b->pool->jobs_enqueued.load() : 0);
  delete b;
}


// A copy that failed on the copy stream. It is reported once by synchronize() unless an
// event wait reported it first; every wait on the event recorded after it throws it.
struct CopyFailure {
  std::string message;
  std::atomic<bool> reported{false};
};

// Note [host waits on compute]: which compute work the copy stream waits for, and which of
// it the host knows to be finished, per compute stream. Host-side bookkeeping only (the
// CPU device's compute really is done when recorded): it finds host waits that, on a GPU,
// would block until the device finished compute.
struct ComputeLag {
  std::mutex mutex;
  std::map<uint32_t, uint64_t> recorded;    // compute records per stream so far
  std::map<uint32_t, uint64_t> host_known;  // per stream: the host waited for the record of this index
  std::map<uint32_t, uint64_t> copy_deps;   // per stream: the latest compute record the copy stream waits for
  std::optional<uint64_t> lag;              // CpuDeviceOptions::compute_lag
  uint64_t waits = 0;
  std::string last;

  uint64_t on_record(uint32_t stream) {
    std::lock_guard<std::mutex> l(mutex);
    return ++recorded[stream];
  }
  // Whether compute record `index` of `stream` is still running on the modelled device.
  bool running(uint32_t stream, uint64_t index) {
    auto known = host_known.find(stream);
    if (known != host_known.end() && known->second >= index) return false;
    return !lag || recorded[stream] - index < *lag;
  }
  bool pending(const std::map<uint32_t, uint64_t>& deps) {
    std::lock_guard<std::mutex> l(mutex);
    for (const auto& [stream, index] : deps) {
      if (running(stream, index)) return true;
    }
    return false;
  }
  // The host blocks until copy-stream work depending on `deps` is done: `what` names it.
  void host_waits(const std::map<uint32_t, uint64_t>& deps, const char* what) {
    std::lock_guard<std::mutex> l(mutex);
    for (const auto& [stream, index] : deps) {
      if (running(stream, index)) {
        ++waits;
        last = std::string(what) + " waited for compute record " + std::to_string(index) + " of compute stream " +
               std::to_string(stream) + " (" + std::to_string(recorded[stream]) + " recorded)";
      }
      uint64_t& known = host_known[stream];
      known = std::max(known, index);
    }
  }
  void host_knows(uint32_t stream, uint64_t index) {
    std::lock_guard<std::mutex> l(mutex);
    uint64_t& known = host_known[stream];
    known = std::max(known, index);
  }
  void host_knows_all() {
    std::lock_guard<std::mutex> l(mutex);
    for (const auto& [stream, n] : recorded) host_known[stream] = n;
  }
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
  // Strict device: the recording queue's clock, and whether the host may see it as done.
  HazardTracker::VClock clock;
  bool lazy = false;        // recorded on a compute stream: done only once the host waited
  bool host_knows = false;  // the host waited for the latest record
  // Note [host waits on compute]: a compute record's stream and index, or what a copy
  // record follows of compute (the copy stream's waits on compute events before it).
  int64_t compute_stream = -1;
  uint64_t compute_index = 0;
  std::map<uint32_t, uint64_t> deps;

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
  CpuEvent(std::shared_ptr<HazardTracker> t, std::shared_ptr<ComputeLag> l, bool model_lag)
      : tracker(std::move(t)), lag(std::move(l)), model_lag(model_lag) {}

  bool query() const override {
    HazardTracker::VClock clock;
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      bool done = state->completed >= state->recorded;
      // With a modelled compute lag a copy behind running compute is not done yet.
      if (done && model_lag && state->compute_stream < 0 && lag->pending(state->deps)) done = false;
      if (!tracker || !done) return done;
      if (state->lazy && !state->host_knows) return false;  // Note [strict device]
      clock = state->clock;
    }
    tracker->merge(HazardTracker::kHost, clock);  // a query that reads done is a host wait
    return true;
  }
  void synchronize() const override {
    (void)state->wait_for(state->latest_record());
    if (lag) {
      std::map<uint32_t, uint64_t> deps;
      int64_t stream;
      uint64_t index;
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        deps = state->deps;
        stream = state->compute_stream;
        index = state->compute_index;
      }
      if (stream >= 0) {
        lag->host_knows(static_cast<uint32_t>(stream), index);
      } else {
        lag->host_waits(deps, "a host wait for a copy-stream event");
      }
    }
    if (!tracker) return;
    HazardTracker::VClock clock;
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->host_knows = true;
      clock = state->clock;
    }
    tracker->merge(HazardTracker::kHost, clock);
  }

  std::shared_ptr<CpuEventState> state = std::make_shared<CpuEventState>();
  std::shared_ptr<HazardTracker> tracker;  // strict device only
  std::shared_ptr<ComputeLag> lag;         // null: not counted (the pageable copy's own staging event)
  bool model_lag = false;                  // CpuDeviceOptions::compute_lag is set
};

const CpuEventState& state_of(const DeviceEvent& e) {
  const auto* ce = dynamic_cast<const CpuEvent*>(&e);
  TORCH_INTERNAL_ASSERT(ce, "CPU device given an event it did not create");
  return *ce->state;
}

class CpuDevice final : public DeviceBackend {
 public:
  explicit CpuDevice(const CpuDeviceOptions& options) : options_(options), rng_(options.strict_seed) {
    lag_->lag = options_.compute_lag;
    if (options_.strict) {
      tracker_ = std::make_shared<HazardTracker>(options_.hazard_policy);
      pool_ = std::make_shared<StrictPool>();
    }
    worker_ = std::thread([this] { run(); });
  }

  HazardTracker* tracker() const { return tracker_.get(); }

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
    const int64_t held = memory_stats().total.current;
    if (options_.total_memory) {
      const auto total = static_cast<int64_t>(options_.total_memory);
      return {std::max<int64_t>(total - held, 0), total};
    }
    // Note [host memory limit]: the host's memory as a container sees it, and of that what
    // is available now (MemAvailable does not count what this device already holds).
    const HostMemoryLimit host = host_memory_limit();
    const auto total = static_cast<int64_t>(host.capacity_bytes());
    int64_t free = std::max<int64_t>(total - held, 0);
    if (host.mem_available_bytes) free = std::min(free, static_cast<int64_t>(*host.mem_available_bytes));
    return {free, total};
  }
  // Counted where the memory is handed out, not by the ledgers: on the plain device every
  // block alive (nothing is cached, so reserved = current), on the strict one its caching
  // allocator's own.
  AllocatorStats allocator_stats() const override {
    AllocatorStats a;
    if (!strict()) {
      std::lock_guard<std::mutex> lock(alive_->mutex);
      a.available = true;
      a.current_bytes = a.reserved_bytes = alive_->current;
      a.peak_bytes = alive_->peak;
      return a;
    }
    std::lock_guard<std::mutex> lock(pool_->mutex);
    a.available = true;
    a.current_bytes = pool_->current;
    a.peak_bytes = pool_->peak;
    a.reserved_bytes = pool_->reserved;
    return a;
  }
  void reset_allocator_peak() override {
    if (!strict()) {
      std::lock_guard<std::mutex> lock(alive_->mutex);
      alive_->peak = alive_->current;
      return;
    }
    std::lock_guard<std::mutex> lock(pool_->mutex);
    pool_->peak = pool_->current;
  }
  void release_cached_memory() override {
    if (strict()) pool_->trim();
  }
  bool pins_memory() const override { return strict(); }
  bool is_pinned(const at::Tensor& src) const override {
    if (!strict() || src.numel() == 0) return true;
    return tracker_->owner_of(src.data_ptr()) == HazardTracker::kHost;
  }
  uint64_t compute_stream_id() const override { return t_compute_stream; }

  std::unique_ptr<DeviceEvent> create_event() override {
    return std::make_unique<CpuEvent>(tracker_, lag_, options_.compute_lag.has_value());
  }
  uint64_t host_compute_waits() const {
    std::lock_guard<std::mutex> lock(lag_->mutex);
    return lag_->waits;
  }
  std::string last_host_compute_wait() const {
    std::lock_guard<std::mutex> lock(lag_->mutex);
    return lag_->last;
  }

  void begin_access(const at::Tensor& t, StreamKind stream, Access a, const std::string& op) override {
    if (strict() && t.defined() && t.numel() > 0) tracker_->begin(t.data_ptr(), queue_of(stream), a, op);
  }
  void end_access(const at::Tensor& t, StreamKind stream) override {
    if (strict() && t.defined() && t.numel() > 0) tracker_->end(t.data_ptr(), queue_of(stream));
  }
  void host_access(const at::Tensor& t, Access a, const std::string& op) override {
    if (strict() && t.defined() && t.numel() > 0) tracker_->access(t.data_ptr(), HazardTracker::kHost, a, op);
  }

  void record(DeviceEvent& event, StreamKind stream) override {
    auto state = static_cast<CpuEvent&>(event).state;  // only CpuEvents reach here (see state_of)
    (void)state_of(event);
    if (strict()) {
      HazardTracker::VClock clock = tracker_->record(queue_of(stream));
      std::lock_guard<std::mutex> lock(state->mutex);
      state->clock = std::move(clock);
      state->lazy = stream == StreamKind::compute;
      state->host_knows = false;
    }
    {
      // See Note [host waits on compute] in cpu_device.h.
      const uint64_t index = stream == StreamKind::compute ? lag_->on_record(t_compute_stream) : 0;
      std::map<uint32_t, uint64_t> deps;
      if (stream == StreamKind::copy) {
        std::lock_guard<std::mutex> lock(lag_->mutex);
        deps = lag_->copy_deps;
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      state->compute_stream = stream == StreamKind::compute ? static_cast<int64_t>(t_compute_stream) : -1;
      state->compute_index = index;
      state->deps = std::move(deps);
    }
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
    if (strict()) {
      HazardTracker::VClock clock;
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        clock = state->clock;
      }
      tracker_->merge(queue_of(stream), clock);
    }
    if (stream == StreamKind::compute) {
      if (const auto failure = state->wait_for(target)) {
        failure->reported = true;
        throw DeviceError("cpu: " + failure->message);
      }
    } else {
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (state->compute_stream >= 0) {
          // The copy stream now follows that compute record (Note [host waits on compute]).
          std::lock_guard<std::mutex> l(lag_->mutex);
          uint64_t& dep = lag_->copy_deps[static_cast<uint32_t>(state->compute_stream)];
          dep = std::max(dep, state->compute_index);
        }
      }
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
    double latency_us = options_.copy_latency_us;
    const double rate = options_.copy_bytes_per_second;
    const bool pageable = !is_pinned(src);
    // The strict device keeps nothing alive for a queued copy but its host source (as
    // torch's pinned host allocator does): a destination freed too early is a hazard the
    // tracker reports, not a reference that hides it.
    at::Tensor keep_dst = strict() ? at::Tensor() : dst;
    void* const dst_ptr = dst.data_ptr();
    if (strict()) {
      const std::string op = "host->device copy of " + std::to_string(src.nbytes()) + " bytes";
      tracker_->access(dst_ptr, HazardTracker::kCopy, Access::write, op);
      if (src.numel() > 0 && tracker_->owner_of(src.data_ptr())) {
        tracker_->access(src.data_ptr(), HazardTracker::kCopy, Access::read, op);
        tracker_->record_use(src.data_ptr(), HazardTracker::kCopy);
      }
      std::lock_guard<std::mutex> lock(mutex_);
      latency_us += std::uniform_real_distribution<double>(0.0, 200.0)(rng_);
    }
    const auto enqueued = Clock::now();
    enqueue([this, keep_dst, dst_ptr, src, before = std::move(before), latency_us, rate, enqueued, fail, time_out] {
      if (before) before();
      const size_t n = src.nbytes();
      if (fail || time_out) {
        // Like a DMA that dies part way: half the bytes land, the rest stay stale.
        if (n) std::memcpy(dst_ptr, src.data_ptr(), n / 2);
        if (time_out) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(options_.copy_timeout_ms));
        std::string what = "host->device copy of " + std::to_string(n) + " bytes ";
        what += time_out ? "timed out after " + std::to_string(options_.copy_timeout_ms) + " ms" : "failed";
        fail_copy(what + " (injected fault)");
        return;
      }
      if (n) std::memcpy(dst_ptr, src.data_ptr(), n);
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
    if (pageable) {
      // From pageable memory a GPU copy returns only once the bytes are staged, i.e. when
      // the copy stream got to it (Note [strict device]). That tells the host its source
      // was read, not that the destination is written: the tracker learns nothing.
      CpuEvent staged(nullptr, nullptr, false);
      record(staged, StreamKind::copy);
      staged.synchronize();
      std::map<uint32_t, uint64_t> deps;
      {
        std::lock_guard<std::mutex> lock(staged.state->mutex);
        deps = staged.state->deps;
      }
      lag_->host_waits(deps, "a copy from pageable host memory");
    }
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
    if (strict()) {
      tracker_->host_waits_for(HazardTracker::kCopy);
      tracker_->host_waits_for(compute_queue());
    }
    lag_->host_knows_all();  // a device synchronize is an explicit wait for everything
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

  // Plain: aligned host memory (the arena's accounting runs as on a GPU). Strict: a block
  // the hazard tracker knows as pinned host memory, so that is_pinned() tells it apart
  // from pageable memory as a GPU's driver would.
  c10::DataPtr allocate_pinned(size_t bytes) override {
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
    if (!p) return {};
    if (!strict()) return c10::DataPtr(p, p, &free_host, c10::Device(c10::kCPU));
    tracker_->add_block(p, bytes, "pinned host memory", HazardTracker::kHost);
    auto* ctx = new PinnedBlock{p, tracker_};
    return c10::DataPtr(p, ctx, &free_pinned_block, c10::Device(c10::kCPU));
  }

 protected:
  c10::DataPtr raw_allocate(size_t nbytes, const std::string& what) override {
    if (!strict()) {
      auto* b = new PlainBlock{alive_, c10::GetCPUAllocator()->allocate(nbytes), static_cast<int64_t>(nbytes)};
      alive_->add(b->n);
      void* p = b->inner.get();
      return c10::DataPtr(p, b, &plain_free, c10::Device(c10::kCPU));
    }
    void* p = pool_->take(nbytes);
    tracker_->add_block(p, nbytes, what, compute_queue());
    return c10::DataPtr(p, new StrictBlock{pool_, tracker_, p, nbytes}, &strict_free, c10::Device(c10::kCPU));
  }
  void record_stream(const c10::DataPtr& raw, StreamKind stream) override {
    if (strict()) tracker_->record_use(raw.get(), queue_of(stream));
  }

 private:
  bool strict() const { return tracker_ != nullptr; }

  void enqueue(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
      if (pool_) pool_->jobs_enqueued.fetch_add(1);
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
      if (pool_) pool_->jobs_done.fetch_add(1);
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
  std::mt19937 rng_;                                       // strict copy latencies (under mutex_)
  std::shared_ptr<HazardTracker> tracker_;                 // strict device only
  std::shared_ptr<StrictPool> pool_;                       // strict device only
  std::shared_ptr<AliveCounter> alive_ = std::make_shared<AliveCounter>();  // plain device
  std::shared_ptr<ComputeLag> lag_ = std::make_shared<ComputeLag>();      // Note [host waits on compute]
  std::thread worker_;
};

}  // namespace

std::unique_ptr<DeviceBackend> make_cpu_device(const CpuDeviceOptions& options) {
  TORCH_CHECK(options.copy_latency_us >= 0 && options.copy_bytes_per_second >= 0,
              "CpuDeviceOptions: copy slowdowns must be >= 0");
  auto device = std::make_unique<CpuDevice>(options);
  if (options.strict) {
    static std::once_flag once;
    std::call_once(once, [] {
      log::info("strict CPU device: asynchronous compute events, random copy latencies, an immediately reusing "
                "allocator and a hazard tracker that aborts on the first hazard (SLUICE_STRICT_DEVICE)");
    });
  }
  return device;
}

bool strict_device_requested() {
  const char* v = std::getenv("SLUICE_STRICT_DEVICE");
  return v && std::string(v) == "1";
}

HazardTracker* hazard_tracker(DeviceBackend& device) {
  auto* cpu = dynamic_cast<CpuDevice*>(&device);
  return cpu ? cpu->tracker() : nullptr;
}

uint64_t host_compute_waits(const DeviceBackend& device) {
  const auto* cpu = dynamic_cast<const CpuDevice*>(&device);
  TORCH_CHECK(cpu, "host_compute_waits: not a CPU device");
  return cpu->host_compute_waits();
}

std::string last_host_compute_wait(const DeviceBackend& device) {
  const auto* cpu = dynamic_cast<const CpuDevice*>(&device);
  TORCH_CHECK(cpu, "last_host_compute_wait: not a CPU device");
  return cpu->last_host_compute_wait();
}

CpuComputeStreamGuard::CpuComputeStreamGuard(uint32_t stream) : previous_(t_compute_stream) {
  t_compute_stream = stream;
}

CpuComputeStreamGuard::~CpuComputeStreamGuard() { t_compute_stream = previous_; }

}  // namespace sluice::offload
