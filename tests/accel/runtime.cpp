#include "tests/accel/runtime.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

namespace sluice::accel {

namespace {

// Everything below lives for the whole process and is never destroyed: stream workers
// may still be parked at exit, and allocations may be freed by static destructors.
template <typename T>
T& leaked() {
  static T* t = new T();
  return *t;
}

// ----------------------------------------------------------------------------- streams

class Queue {
 public:
  Queue() : worker_([this] { run(); }) { worker_.detach(); }

  uint64_t push(std::function<void()> job) {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(std::move(job));
    work_.notify_one();
    return ++queued_;
  }
  void wait_for(uint64_t position) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ >= position; });
  }
  uint64_t queued() {
    std::lock_guard<std::mutex> lock(mutex_);
    return queued_;
  }
  bool idle() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ == queued_;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_.wait(lock, [&] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      try {
        job();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "testaccel: a stream job failed: %s\n", e.what());
        std::abort();
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++done_;
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_, done_cv_;
  std::deque<std::function<void()>> jobs_;
  uint64_t queued_ = 0, done_ = 0;
  std::thread worker_;
};

struct Streams {
  std::mutex mutex;
  std::map<StreamId, std::unique_ptr<Queue>> queues;
  std::atomic<StreamId> next_new{100};
  std::atomic<uint32_t> next_pool{0};
  std::mutex rng_mutex;
  std::mt19937 rng{[] {
    const char* s = std::getenv("SLUICE_TEST_ACCEL_SEED");
    return s && *s ? static_cast<uint32_t>(std::strtoul(s, nullptr, 10)) : 1u;
  }()};
};

Queue& queue(StreamId id) {
  Streams& s = leaked<Streams>();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto& q = s.queues[id];
  if (!q) q = std::make_unique<Queue>();
  return *q;
}

thread_local StreamId t_current = 0;
constexpr uint32_t kPoolSize = 8;  // CUDA keeps 32 per priority; a few are enough to share

}  // namespace

StreamId current_stream() { return t_current; }
void set_current_stream(StreamId id) { t_current = id; }
StreamId pool_stream() { return 1 + leaked<Streams>().next_pool.fetch_add(1) % kPoolSize; }
StreamId new_stream() { return leaked<Streams>().next_new.fetch_add(1); }

uint64_t enqueue(StreamId id, std::function<void()> job) { return queue(id).push(std::move(job)); }
void wait_for(StreamId id, uint64_t position) { queue(id).wait_for(position); }
void synchronize_stream(StreamId id) {
  Queue& q = queue(id);
  q.wait_for(q.queued());
}
bool query_stream(StreamId id) { return queue(id).idle(); }

void synchronize_device() {
  std::vector<Queue*> all;
  {
    Streams& s = leaked<Streams>();
    std::lock_guard<std::mutex> lock(s.mutex);
    for (auto& [id, q] : s.queues) all.push_back(q.get());
  }
  for (Queue* q : all) q->wait_for(q->queued());
}

std::chrono::microseconds copy_latency() {
  Streams& s = leaked<Streams>();
  std::lock_guard<std::mutex> lock(s.rng_mutex);
  return std::chrono::microseconds(std::uniform_int_distribution<int>(0, 200)(s.rng));
}

// ------------------------------------------------------------------------------ events

void record_event(const std::shared_ptr<Event>& e, StreamId stream) {
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    generation = ++e->recorded;
  }
  enqueue(stream, [e, generation] {
    {
      std::lock_guard<std::mutex> lock(e->mutex);
      e->completed = std::max(e->completed, generation);
      e->completed_at = std::chrono::steady_clock::now();
    }
    e->cv.notify_all();
  });
}

void block_on_event(const std::shared_ptr<Event>& e, StreamId stream) {
  uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    target = e->recorded;
  }
  if (target == 0) return;  // never recorded: nothing to wait for
  enqueue(stream, [e, target] {
    std::unique_lock<std::mutex> lock(e->mutex);
    e->cv.wait(lock, [&] { return e->completed >= target; });
  });
}

bool query_event(const std::shared_ptr<Event>& e) {
  std::lock_guard<std::mutex> lock(e->mutex);
  return e->completed >= e->recorded;
}

void synchronize_event(const std::shared_ptr<Event>& e) {
  std::unique_lock<std::mutex> lock(e->mutex);
  const uint64_t target = e->recorded;
  e->cv.wait(lock, [&] { return e->completed >= target; });
}

double elapsed_ms(const std::shared_ptr<Event>& from, const std::shared_ptr<Event>& to) {
  TORCH_CHECK(from && to, "testaccel: elapsedTime of an event that was never recorded");
  TORCH_CHECK(from->timing && to->timing,
              "testaccel: both events must be created with timing enabled (EventFlag::BACKEND_DEFAULT) "
              "to measure elapsed time");
  // (The same event twice: one lock, and 0 ms once it is recorded and complete.)
  std::unique_lock<std::mutex> lock_from(from->mutex, std::defer_lock), lock_to(to->mutex, std::defer_lock);
  if (from == to) {
    lock_from.lock();
  } else {
    std::lock(lock_from, lock_to);
  }
  TORCH_CHECK(from->recorded > 0 && to->recorded > 0,
              "testaccel: both events must be recorded before calculating elapsed time");
  TORCH_CHECK(from->completed >= from->recorded && to->completed >= to->recorded,
              "testaccel: device not ready (elapsedTime of an event that has not completed)");
  return std::chrono::duration<double, std::milli>(to->completed_at - from->completed_at).count();
}

// ------------------------------------------------------------------------------ memory

namespace {

constexpr size_t kBlockRound = 512;  // CUDA's allocator rounds every block to 512 bytes
constexpr size_t kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);

struct Block {
  void* ptr = nullptr;
  size_t size = 0;       // rounded
  size_t requested = 0;  // asked for
  StreamId stream = 0;   // allocated on
  std::set<StreamId> uses;  // other streams recorded on it (recordStream)
  size_t pending = 0;       // streams still to pass the free
};

struct Memory {
  std::mutex mutex;
  std::atomic<bool> initialized{false};
  uint64_t capacity = [] {
    const char* s = std::getenv("SLUICE_TEST_ACCEL_MEMORY");
    return s && *s ? parse_bytes(s, "SLUICE_TEST_ACCEL_MEMORY") : (8ull << 30);
  }();
  uint64_t reserved = 0;                               // blocks held (in use, pending, cached)
  std::map<uintptr_t, Block*> live;                    // in use, by address
  std::multimap<std::pair<StreamId, size_t>, Block*> cached;  // free, by (stream, size)
  c10::CachingDeviceAllocator::DeviceStats stats;
};

Memory& memory() { return leaked<Memory>(); }

void free_block_locked(Memory& m, Block* b) {
  std::free(b->ptr);
  m.reserved -= b->size;
  m.stats.reserved_bytes[kAggregate].decrease(b->size);
  m.stats.segment[kAggregate].decrease(1);
  ++m.stats.num_device_free;
  delete b;
}

void release_cache_locked(Memory& m) {
  for (auto& [key, b] : m.cached) free_block_locked(m, b);
  m.cached.clear();
}

// A free block (every stream that used it is past the free) joins the cache, poisoned.
void cache_block(Block* b) {
  std::memset(b->ptr, 0xFF, b->size);
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.stats.active_bytes[kAggregate].decrease(b->size);
  m.stats.active[kAggregate].decrease(1);
  m.cached.emplace(std::make_pair(b->stream, b->size), b);
}

void raw_delete(void* ptr) {
  if (!ptr) return;
  Memory& m = memory();
  Block* b = nullptr;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    auto it = m.live.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == m.live.end()) {
      std::fprintf(stderr, "testaccel: free of %p, which is not a live device block\n", ptr);
      std::abort();
    }
    b = it->second;
    m.live.erase(it);
    m.stats.allocated_bytes[kAggregate].decrease(b->size);
    m.stats.requested_bytes[kAggregate].decrease(b->requested);
    m.stats.allocation[kAggregate].decrease(1);
    b->pending = b->uses.size();
  }
  if (b->uses.empty()) {
    cache_block(b);
    return;
  }
  // Reusable only once every recorded stream has finished what it had queued at the free.
  for (StreamId s : b->uses) {
    enqueue(s, [b] {
      bool last;
      {
        std::lock_guard<std::mutex> lock(memory().mutex);
        last = --b->pending == 0;
      }
      if (last) cache_block(b);
    });
  }
}

std::string mib(uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

void check_device(c10::DeviceIndex device) {
  TORCH_CHECK(memory().initialized.load() && device == 0, "Invalid device argument ", static_cast<int>(device),
              ": did you call init?");
}

}  // namespace

bool initialized() { return memory().initialized.load(); }
void initialize() { memory().initialized.store(true); }

c10::DataPtr DeviceAllocator::allocate(size_t nbytes) {
  Memory& m = memory();
  const c10::Device device(c10::DeviceType::PrivateUse1, 0);
  // Contract 1: CUDA's caching allocator asserts this before anything else.
  TORCH_CHECK(m.initialized.load(), "Allocator not initialized for device 0: did you call init?");
  if (nbytes == 0) return {nullptr, nullptr, &raw_delete, device};
  const size_t size = (nbytes + kBlockRound - 1) / kBlockRound * kBlockRound;
  const StreamId stream = current_stream();
  std::unique_lock<std::mutex> lock(m.mutex);
  Block* b = nullptr;
  auto it = m.cached.find({stream, size});
  if (it != m.cached.end()) {
    b = it->second;
    m.cached.erase(it);
  } else {
    if (m.reserved + size > m.capacity) {
      // As CUDA: wait for frees behind other streams, hand the cache back, try again.
      ++m.stats.num_alloc_retries;
      lock.unlock();
      synchronize_device();
      lock.lock();
      release_cache_locked(m);
    }
    if (m.reserved + size > m.capacity) {
      ++m.stats.num_ooms;
      const uint64_t allocated = static_cast<uint64_t>(m.stats.allocated_bytes[kAggregate].current);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "testaccel out of memory. Tried to allocate ", mib(size),
                       ". Device 0 has a total capacity of ", mib(m.capacity), " of which ",
                       mib(m.capacity - m.reserved), " is free. Of the allocated memory ", mib(allocated),
                       " is allocated by the caching allocator, and ", mib(m.reserved - allocated),
                       " is reserved but unallocated.");
    }
    void* p = std::aligned_alloc(kBlockRound, size);
    TORCH_CHECK(p, "testaccel: host memory for a ", mib(size), " device block could not be allocated");
    std::memset(p, 0xFF, size);
    b = new Block{p, size, 0, stream, {}, 0};
    m.reserved += size;
    m.stats.reserved_bytes[kAggregate].increase(size);
    m.stats.segment[kAggregate].increase(1);
    ++m.stats.num_device_alloc;
  }
  b->requested = nbytes;
  b->uses.clear();
  m.live.emplace(reinterpret_cast<uintptr_t>(b->ptr), b);
  m.stats.allocated_bytes[kAggregate].increase(size);
  m.stats.requested_bytes[kAggregate].increase(nbytes);
  m.stats.allocation[kAggregate].increase(1);
  m.stats.active_bytes[kAggregate].increase(size);
  m.stats.active[kAggregate].increase(1);
  return {b->ptr, b->ptr, &raw_delete, device};
}

void DeviceAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  synchronize_stream(current_stream());
  std::memcpy(dest, src, count);
}

c10::DeleterFnPtr DeviceAllocator::raw_deleter() const { return &raw_delete; }

bool DeviceAllocator::initialized() { return memory().initialized.load(); }

void DeviceAllocator::emptyCache(c10::MempoolId_t) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  release_cache_locked(m);
}

void DeviceAllocator::recordStream(const c10::DataPtr& ptr, c10::Stream stream) {
  // As CUDA: memory this allocator did not hand out (another deleter) is ignored.
  if (!ptr.get() || ptr.get_deleter() != &raw_delete) return;
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  auto it = m.live.find(reinterpret_cast<uintptr_t>(ptr.get()));
  TORCH_INTERNAL_ASSERT(it != m.live.end(), "testaccel: recordStream on a block that is not live");
  if (stream.id() != it->second->stream) it->second->uses.insert(stream.id());
}

c10::CachingDeviceAllocator::DeviceStats DeviceAllocator::getDeviceStats(c10::DeviceIndex device) {
  check_device(device);
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  return m.stats;
}

namespace {
// `reset` applied to every statistic the allocator keeps, under its lock.
template <typename Reset>
void reset_stats(c10::DeviceIndex device, Reset reset) {
  check_device(device);
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  for (auto* arr : {&m.stats.allocation, &m.stats.segment, &m.stats.active, &m.stats.allocated_bytes,
                    &m.stats.reserved_bytes, &m.stats.active_bytes, &m.stats.requested_bytes}) {
    for (auto& s : *arr) reset(s);
  }
}
}  // namespace

void DeviceAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  reset_stats(device, [](c10::CachingAllocator::Stat& s) { s.reset_accumulated(); });
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.stats.num_alloc_retries = m.stats.num_ooms = m.stats.num_device_alloc = m.stats.num_device_free = 0;
}

void DeviceAllocator::resetPeakStats(c10::DeviceIndex device) {
  reset_stats(device, [](c10::CachingAllocator::Stat& s) { s.reset_peak(); });
}

std::pair<size_t, size_t> DeviceAllocator::getMemoryInfo(c10::DeviceIndex device) {
  TORCH_CHECK(device == 0, "testaccel: invalid device index ", static_cast<int>(device));
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  return {m.capacity - m.reserved, m.capacity};
}

DeviceAllocator& device_allocator() { return leaked<DeviceAllocator>(); }

bool is_device_pointer(const void* p) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  auto it = m.live.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == m.live.begin()) return false;
  --it;
  return reinterpret_cast<uintptr_t>(p) < it->first + it->second->size;
}

// ------------------------------------------------------------------------- pinned memory

namespace {

struct Pinned {
  std::mutex mutex;
  struct Range {
    size_t size;
    int readers;  // copies in flight from it
  };
  std::map<uintptr_t, Range> ranges;
};

Pinned& pinned() { return leaked<Pinned>(); }

Pinned::Range* find_range_locked(Pinned& pm, const void* p) {
  auto it = pm.ranges.upper_bound(reinterpret_cast<uintptr_t>(p));
  if (it == pm.ranges.begin()) return nullptr;
  --it;
  return reinterpret_cast<uintptr_t>(p) < it->first + it->second.size ? &it->second : nullptr;
}

std::atomic<int64_t> g_pinned_free_waits{0};

void pinned_delete(void* p) {
  if (!p) return;
  Pinned& pm = pinned();
  bool in_flight;
  {
    std::lock_guard<std::mutex> lock(pm.mutex);
    auto it = pm.ranges.find(reinterpret_cast<uintptr_t>(p));
    if (it == pm.ranges.end()) {
      std::fprintf(stderr, "testaccel: free of %p, which is not pinned host memory\n", p);
      std::abort();
    }
    in_flight = it->second.readers > 0;
  }
  // As cudaFreeHost: freeing page-locked memory synchronizes the device, so copies still
  // reading it finish first (counted: a hidden wait of the whole device).
  if (in_flight) ++g_pinned_free_waits;
  synchronize_device();
  {
    std::lock_guard<std::mutex> lock(pm.mutex);
    pm.ranges.erase(reinterpret_cast<uintptr_t>(p));
  }
  std::free(p);
}

}  // namespace

c10::DataPtr PinnedAllocator::allocate(size_t nbytes) {
  const size_t size = std::max<size_t>((nbytes + 63) / 64 * 64, 64);
  void* p = std::aligned_alloc(64, size);
  TORCH_CHECK(p, "testaccel: pinned host allocation of ", nbytes, " bytes failed");
  {
    std::lock_guard<std::mutex> lock(pinned().mutex);
    pinned().ranges[reinterpret_cast<uintptr_t>(p)] = {nbytes, 0};
  }
  return {p, p, &pinned_delete, c10::Device(c10::kCPU)};
}

void PinnedAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  std::memcpy(dest, src, count);
}

PinnedAllocator& pinned_allocator() { return leaked<PinnedAllocator>(); }

int64_t pinned_free_waits() { return g_pinned_free_waits.load(); }

bool is_pinned(const void* p) {
  std::lock_guard<std::mutex> lock(pinned().mutex);
  return find_range_locked(pinned(), p) != nullptr;
}

void pinned_read_begin(const void* p) {
  std::lock_guard<std::mutex> lock(pinned().mutex);
  if (auto* r = find_range_locked(pinned(), p)) ++r->readers;
}

void pinned_read_end(const void* p) {
  std::lock_guard<std::mutex> lock(pinned().mutex);
  if (auto* r = find_range_locked(pinned(), p)) --r->readers;
}

uint64_t parse_bytes(const char* text, const char* what) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  const std::string unit = end ? std::string(end) : std::string();
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "KiB") scale = 1ull << 10;
  else if (unit == "MiB") scale = 1ull << 20;
  else if (unit == "GiB") scale = 1ull << 30;
  if (end == text || !(v > 0) || scale == 0) {
    std::fprintf(stderr, "testaccel: %s='%s': expected a positive size such as 8GiB, 512MiB or 1048576\n", what,
                 text);
    std::exit(2);
  }
  return static_cast<uint64_t>(v * scale);
}

}  // namespace sluice::accel
