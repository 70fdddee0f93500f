#include "offload/device/hazard_tracker.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "runtime/logging.h"

namespace sluice::offload {

std::string HazardTracker::queue_name(Queue q) {
  if (q == kHost) return "host";
  if (q == kCopy) return "copy stream";
  return "compute stream " + std::to_string(q - 2);
}

HazardTracker::HazardTracker(Policy policy) : policy_(policy) {}

HazardTracker::VClock& HazardTracker::clock_of(Queue q) {
  if (clocks_.size() <= q) clocks_.resize(q + 1);
  VClock& c = clocks_[q];
  if (c.size() <= q) c.resize(q + 1, 0);
  return c;
}

namespace {

void merge_into(HazardTracker::VClock& into, const HazardTracker::VClock& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i) into[i] = std::max(into[i], from[i]);
}

uint64_t entry(const HazardTracker::VClock& c, size_t i) { return i < c.size() ? c[i] : 0; }

}  // namespace

uint64_t HazardTracker::tick(Queue q) {
  if (q != kHost) {
    const VClock host = clock_of(kHost);  // copy: clock_of may reallocate clocks_
    merge_into(clock_of(q), host);
  }
  return ++clock_of(q)[q];
}

bool HazardTracker::ordered(Queue by, const Rec& r) {
  if (r.q == by) return true;  // one queue runs its work in order
  if (r.open > 0) return false;  // a lease still running on another queue
  return entry(clock_of(by), r.q) >= r.tick;
}

HazardTracker::Block* HazardTracker::find(const void* p, const void** base) {
  const auto key = reinterpret_cast<uintptr_t>(p);
  auto it = blocks_.upper_bound(key);
  if (it == blocks_.begin()) return nullptr;
  --it;
  if (key >= it->first + std::max<uint64_t>(it->second.bytes, 1)) return nullptr;
  if (base) *base = reinterpret_cast<const void*>(it->first);
  return &it->second;
}

void HazardTracker::add_block(const void* base, uint64_t bytes, std::string what, Queue owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block b;
  b.bytes = bytes;
  b.what = std::move(what);
  b.owner = owner;
  blocks_[reinterpret_cast<uintptr_t>(base)] = std::move(b);
}

std::optional<HazardTracker::Queue> HazardTracker::owner_of(const void* p) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Block* b = const_cast<HazardTracker*>(this)->find(p);
  if (!b) return std::nullopt;
  return b->owner;
}

std::set<HazardTracker::Queue> HazardTracker::recorded_queues(const void* base) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = blocks_.find(reinterpret_cast<uintptr_t>(base));
  return it == blocks_.end() ? std::set<Queue>{} : it->second.recorded;
}

namespace {

std::string describe(const void* base, uint64_t bytes, const std::string& what) {
  std::ostringstream s;
  s << what << " (" << bytes << " bytes at " << base << ")";
  return s.str();
}

}  // namespace

void HazardTracker::remove_block(const void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = blocks_.find(reinterpret_cast<uintptr_t>(p));
  if (it == blocks_.end()) return;
  Block& b = it->second;
  const auto unsafe = [&](const Rec& r) {
    if (r.q == b.owner || b.recorded.count(r.q)) return false;
    return !(ordered(b.owner, r) || ordered(kHost, r));
  };
  std::vector<const Rec*> pending;
  if (b.has_write && unsafe(b.write)) pending.push_back(&b.write);
  for (const auto& [q, r] : b.reads) {
    if (unsafe(r)) pending.push_back(&r);
  }
  for (const Rec* r : pending) {
    report("free of " + describe(p, b.bytes, b.what) + " by the " + queue_name(b.owner) + " while the " +
           queue_name(r->q) + " may still " + (r == &b.write ? "write" : "read") + " it (" + r->op +
           "): no event orders it before the free and no use was recorded on the block");
  }
  blocks_.erase(it);
}

void HazardTracker::check(const void* base, Block& b, Queue q, Access a, const std::string& op) {
  if (b.has_write && !ordered(q, b.write)) {
    report(std::string(a == Access::read ? "read" : "overwrite") + " of " + describe(base, b.bytes, b.what) +
           " by the " + queue_name(q) + " (" + op + ") before its write by the " + queue_name(b.write.q) + " (" +
           b.write.op + ") completed");
  }
  if (a == Access::write) {
    for (const auto& [rq, r] : b.reads) {
      if (!ordered(q, r)) {
        report("overwrite of " + describe(base, b.bytes, b.what) + " by the " + queue_name(q) + " (" + op +
               ") while the " + queue_name(rq) + " may still read it (" + r.op + ")");
      }
    }
  }
}

void HazardTracker::access(const void* p, Queue q, Access a, const std::string& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  const void* base = nullptr;
  Block* b = find(p, &base);
  if (!b) return;
  const uint64_t t = tick(q);
  check(base, *b, q, a, op);
  if (a == Access::write) {
    b->reads.clear();
    b->has_write = true;
    b->write = Rec{q, t, op, 0};
  } else {
    Rec& r = b->reads[q];
    const int open = r.open;
    r = Rec{q, t, op, open};
  }
}

void HazardTracker::begin(const void* p, Queue q, Access a, const std::string& op) {
  std::lock_guard<std::mutex> lock(mutex_);
  const void* base = nullptr;
  Block* b = find(p, &base);
  if (!b) return;
  const uint64_t t = tick(q);
  check(base, *b, q, a, op);
  if (a == Access::write) {
    b->reads.clear();
    b->has_write = true;
    b->write = Rec{q, t, op, 1};
  } else {
    Rec& r = b->reads[q];
    const int open = r.open + 1;
    r = Rec{q, t, op, open};
  }
}

void HazardTracker::end(const void* p, Queue q) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block* b = find(p);
  if (!b) return;
  const uint64_t t = tick(q);
  Rec* r = nullptr;
  if (b->has_write && b->write.q == q && b->write.open > 0) {
    r = &b->write;
  } else if (auto it = b->reads.find(q); it != b->reads.end() && it->second.open > 0) {
    r = &it->second;
  }
  if (!r) return;
  r->open -= 1;
  r->tick = t;
}

void HazardTracker::record_use(const void* p, Queue q) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (Block* b = find(p)) b->recorded.insert(q);
}

HazardTracker::VClock HazardTracker::record(Queue q) {
  std::lock_guard<std::mutex> lock(mutex_);
  tick(q);
  return clock_of(q);
}

void HazardTracker::merge(Queue q, const VClock& clock) {
  std::lock_guard<std::mutex> lock(mutex_);
  merge_into(clock_of(q), clock);
}

void HazardTracker::host_waits_for(Queue q) {
  std::lock_guard<std::mutex> lock(mutex_);
  const VClock c = clock_of(q);
  merge_into(clock_of(kHost), c);
}

uint64_t HazardTracker::hazards() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hazards_;
}

std::vector<std::string> HazardTracker::reports() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reports_;
}

void HazardTracker::report(const std::string& message) {
  ++hazards_;
  reports_.push_back(message);
  const std::string line = "strict device: hazard: " + message;
  log::error(line);
  if (policy_ == Policy::abort) {
    std::fprintf(stderr, "%s\n(SLUICE_STRICT_DEVICE=1 aborts on the first hazard)\n", line.c_str());
    std::fflush(stderr);
    std::abort();
  }
}

}  // namespace sluice::offload
