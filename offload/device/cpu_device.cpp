#include "offload/device/cpu_device.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "offload/device/copy_worker.h"
#include "offload/device/strict_tracking.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/host_memory_limit.h"
#include "runtime/logging.h"

namespace sluice::offload {

namespace {

void free_host(void* p) { std::free(p); }

using Clock = CopyWorker::Clock;

thread_local uint32_t t_compute_stream = 0;  // CpuComputeStreamGuard

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
    if (options_.strict) strict_ = std::make_unique<StrictTracking>(options_.hazard_policy, worker_.progress());
  }

  HazardTracker* tracker() const { return strict_ ? strict_->tracker() : nullptr; }

  uint64_t host_compute_waits() const {
    std::lock_guard<std::mutex> lock(lag_->mutex);
    return lag_->waits;
  }
  std::string last_host_compute_wait() const {
    std::lock_guard<std::mutex> lock(lag_->mutex);
    return lag_->last;
  }

  // DeviceAllocator

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
    if (strict()) return strict_->allocator_stats();
    AllocatorStats a;
    std::lock_guard<std::mutex> lock(alive_->mutex);
    a.available = true;
    a.current_bytes = a.reserved_bytes = alive_->current;
    a.peak_bytes = alive_->peak;
    return a;
  }
  void reset_allocator_peak() override {
    if (strict()) {
      strict_->reset_allocator_peak();
      return;
    }
    std::lock_guard<std::mutex> lock(alive_->mutex);
    alive_->peak = alive_->current;
  }
  void release_cached_memory() override {
    if (strict()) strict_->release_cached_memory();
  }
  bool pins_memory() const override { return strict(); }
  bool is_pinned(const at::Tensor& src) const override { return !strict() || strict_->is_pinned(src); }

  // Plain: aligned host memory (the arena's accounting runs as on a GPU). Strict: a block
  // the hazard tracker knows as pinned host memory (StrictTracking::allocate_pinned).
  c10::DataPtr allocate_pinned(size_t bytes) override {
    if (strict()) return strict_->allocate_pinned(bytes);
    void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 1) + 63) / 64 * 64);
    if (!p) return {};
    return c10::DataPtr(p, p, &free_host, c10::Device(c10::kCPU));
  }

  // DeviceStreams

  uint64_t compute_stream_id() const override { return t_compute_stream; }

  std::unique_ptr<DeviceEvent> create_event() override {
    return std::make_unique<CpuEvent>(strict() ? strict_->shared_tracker() : std::shared_ptr<HazardTracker>(), lag_,
                                      options_.compute_lag.has_value());
  }

  void begin_access(const at::Tensor& t, StreamKind stream, Access a, const std::string& op) override {
    if (strict()) strict_->begin_access(t, stream, a, op);
  }
  void end_access(const at::Tensor& t, StreamKind stream) override {
    if (strict()) strict_->end_access(t, stream);
  }
  void host_access(const at::Tensor& t, Access a, const std::string& op) override {
    if (strict()) strict_->host_access(t, a, op);
  }

  void record(DeviceEvent& event, StreamKind stream) override {
    auto state = static_cast<CpuEvent&>(event).state;  // only CpuEvents reach here (see state_of)
    (void)state_of(event);
    if (strict()) {
      HazardTracker::VClock clock = strict_->record(stream);
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
      CopyWorker* const worker = &worker_;
      worker_.enqueue([worker, state, seq, enqueued] {
        // Done when the modelled bus finished everything before it (see CopyWorker::copy).
        worker->bus_after(enqueued);
        state->complete(seq, std::min(worker->bus_free(), Clock::now()), worker->take_failure());
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
      strict_->wait(stream, clock);
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
      CopyWorker* const worker = &worker_;
      worker_.enqueue([worker, state, target] {
        (void)state->wait_for(target);
        std::lock_guard<std::mutex> lock(state->mutex);
        worker->bus_after(state->done_at);  // later copies start after the event
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
    CopyWorker::Copy c;
    // Decided here, on the caller's thread, so "fail the Nth copy" counts in issue order.
    c.fail = fault::triggered("copy.h2d");
    c.time_out = !c.fail && fault::triggered("copy.h2d.timeout");
    c.timeout_ms = options_.copy_timeout_ms;
    c.latency_us = options_.copy_latency_us;
    c.bytes_per_second = options_.copy_bytes_per_second;
    const bool pageable = !is_pinned(src);
    // The strict device keeps nothing alive for a queued copy but its host source (as
    // torch's pinned host allocator does): a destination freed too early is a hazard the
    // tracker reports, not a reference that hides it.
    c.keep_dst = strict() ? at::Tensor() : dst;
    c.dst = dst.data_ptr();
    if (strict()) {
      strict_->copy(c.dst, src);
      std::lock_guard<std::mutex> lock(rng_mutex_);
      c.latency_us += std::uniform_real_distribution<double>(0.0, 200.0)(rng_);
    }
    c.src = src;
    c.before = std::move(before);
    c.enqueued = Clock::now();
    worker_.copy(std::move(c));
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
    const std::vector<std::shared_ptr<CopyFailure>> failures = worker_.drain();
    if (strict()) strict_->synchronize();
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

 protected:
  // Plain: CPU memory counted as alive until freed. Strict: a block of the caching pool
  // that the hazard tracker knows (StrictTracking::allocate).
  c10::DataPtr raw_allocate(size_t nbytes, const std::string& what) override {
    if (strict()) return strict_->allocate(nbytes, what);
    auto* b = new PlainBlock{alive_, c10::GetCPUAllocator()->allocate(nbytes), static_cast<int64_t>(nbytes)};
    alive_->add(b->n);
    void* p = b->inner.get();
    return c10::DataPtr(p, b, &plain_free, c10::Device(c10::kCPU));
  }
  void record_stream(const c10::DataPtr& raw, StreamKind stream) override {
    if (strict()) strict_->record_stream(raw, stream);
  }

 private:
  bool strict() const { return strict_ != nullptr; }

  CpuDeviceOptions options_;
  std::mutex rng_mutex_;
  std::mt19937 rng_;                                                       // strict copy latencies (under rng_mutex_)
  std::shared_ptr<AliveCounter> alive_ = std::make_shared<AliveCounter>();  // plain device
  std::shared_ptr<ComputeLag> lag_ = std::make_shared<ComputeLag>();      // Note [host waits on compute]
  std::unique_ptr<StrictTracking> strict_;  // strict device only (Note [strict device])
  // The copy stream, last: destroyed first, it runs the jobs still queued and joins its
  // thread while everything above is alive.
  CopyWorker worker_;
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

uint32_t CpuComputeStreamGuard::current() { return t_compute_stream; }

}  // namespace sluice::offload
