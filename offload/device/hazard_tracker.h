#pragma once
// HazardTracker: the strict CPU device's stream sanitizer, the CPU analogue of PyTorch's
// CUDA stream sanitizer (CSAN) and compute-sanitizer's racecheck.
//
// Note [strict device hazards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU the host only enqueues work; each stream runs it later, in order, and two
// streams are ordered only by events. The CPU device hides most of that (its compute
// stream is the calling thread), so code that forgets a fence can pass every CPU test and
// race on a GPU. The tracker decides hazards by happens-before, not by timing:
//  - Every queue (the host, the copy stream, each compute stream) has a vector clock.
//    Each operation enqueued on a queue ticks its own entry. Recording an event snapshots
//    the queue's clock; waiting on an event merges the snapshot into the waiter's clock
//    (cudaStreamWaitEvent). The host merges a queue's clock when it blocks on that queue
//    (event synchronize, device synchronize). Work enqueued by the host inherits what the
//    host knows at that moment: a kernel launched after the host saw a copy finish is
//    ordered after it.
//  - Every device block (one allocation) remembers its last write and, per queue, its
//    latest read since: which queue, at which tick, by which operation. Leases (a layer's
//    forward reading a slot) stay open from begin() to end().
//  - An access by queue Q is a hazard when a conflicting access by another queue is not
//    ordered before it: Q's clock has not reached that access's tick. Reads conflict with
//    writes; writes conflict with everything.
//  - A free is a hazard when the caching allocator could hand the block to the next
//    allocation while a queue may still touch it: an access by a queue other than the one
//    the block was allocated on, neither ordered before the owner's or the host's clock
//    nor recorded on the block (record_use(), the allocator's recordStream).
// Hazards do not depend on how the threads happen to be scheduled: a missing fence is
// found on every run, not only when a copy is slow. Each report names the block, both
// queues and both operations.
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace sluice::offload {

enum class Access : uint8_t { read, write };

class HazardTracker {
 public:
  using Queue = uint32_t;
  static constexpr Queue kHost = 0;
  static constexpr Queue kCopy = 1;
  // The queue of compute stream `stream` (0 is the default stream).
  static Queue compute(uint32_t stream) { return 2 + stream; }
  static std::string queue_name(Queue q);

  using VClock = std::vector<uint64_t>;

  // What happens on a hazard: abort the process after logging it (the strict device's
  // default: nothing can ignore it), or only count and log it (the tracker's own tests).
  enum class Policy { abort, count };
  explicit HazardTracker(Policy policy = Policy::abort);

  // A block [base, base + bytes) allocated on queue `owner`; `what` names it in reports.
  void add_block(const void* base, uint64_t bytes, std::string what, Queue owner);
  // Frees the block at `base` (checks first). Unknown bases are ignored.
  void remove_block(const void* base);
  // Queues that recorded a use of the block at `base` (for a deferred free).
  std::set<Queue> recorded_queues(const void* base) const;
  // The queue that owns the block holding `p`, if it is tracked.
  std::optional<Queue> owner_of(const void* p) const;

  // One access of the block containing `p` by queue `q`, enqueued now.
  void access(const void* p, Queue q, Access a, const std::string& op);
  // An access that lasts from begin() to end() (a lease); end() stamps it with the tick
  // `q` has reached by then.
  void begin(const void* p, Queue q, Access a, const std::string& op);
  void end(const void* p, Queue q);
  // The allocator's recordStream: a free of the block waits for `q`'s work at free time.
  void record_use(const void* p, Queue q);

  // Event record on `q`: ticks `q` and returns its clock.
  VClock record(Queue q);
  // `q` waits for `clock` (an event's snapshot).
  void merge(Queue q, const VClock& clock);
  // The host blocks until `q` has finished everything enqueued so far.
  void host_waits_for(Queue q);

  uint64_t hazards() const;
  std::vector<std::string> reports() const;

 private:
  struct Rec {
    Queue q = 0;
    uint64_t tick = 0;
    std::string op;
    int open = 0;  // leases still running
  };
  struct Block {
    uint64_t bytes = 0;
    std::string what;
    Queue owner = 0;
    bool has_write = false;
    Rec write;
    std::map<Queue, Rec> reads;
    std::set<Queue> recorded;
  };

  VClock& clock_of(Queue q);
  uint64_t tick(Queue q);  // an operation on q: inherits the host's clock, ticks q
  bool ordered(Queue by, const Rec& r);
  Block* find(const void* p, const void** base = nullptr);
  void check(const void* base, Block& b, Queue q, Access a, const std::string& op);
  void report(const std::string& message);

  Policy policy_;
  mutable std::mutex mutex_;
  std::vector<VClock> clocks_;
  std::map<uintptr_t, Block> blocks_;
  uint64_t hazards_ = 0;
  std::vector<std::string> reports_;
};

}  // namespace sluice::offload
