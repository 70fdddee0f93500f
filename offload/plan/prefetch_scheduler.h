#pragma once
// PrefetchScheduler: which streamed layers to copy ahead of compute, and when.
//
// Note [prefetch order]
// ~~~~~~~~~~~~~~~~~~~~~
// The order in which layers are acquired is recorded during a forward (per forward kind)
// and replayed by the next one of that kind. At each acquire the scheduler offers the
// engine the next streamed layers of the recorded order, in order, until the engine
// refuses one (its staging ring has no room: the ring's bytes bound how far copies run
// ahead, Note [staging ring]) or `max_ahead` streamed layers are in flight or ready
// (the user's --prefetch; kPrefetchAuto: no bound). Resident layers are skipped, so the
// copies run on under stretches of resident compute. Near the end of a forward the offers
// wrap around: the first streamed layers of the next forward are copied during the tail of
// this one and at its end, but never more than one full cycle ahead.
//
// Note [repeated calls]
// ~~~~~~~~~~~~~~~~~~~~~
// A layer may be called more than once in one forward (a Linear a host's forward calls
// twice, a shared projection). Each call is a position of its own in the recorded order and
// is offered on its own, tagged with its occurrence (0 for the layer's first call in the
// forward, 1 for its second, ...): the staging ring keeps one copy per call (find() by
// layer, forward and occurrence), so the second call reads its own prefetched copy instead
// of a demand copy of a slot the first call gave back.
//
// A call that differs from the prediction stays correct (the engine copies the layer on
// demand and waits, counted as a stall); the scheduler resynchronizes with the recorded
// order if it can, and the new order is recorded at end(). Offers are made once per
// position: a frontier remembers how far offers went, so an acquire costs O(new offers),
// not a rescan of the order.
//
// The scheduler knows nothing of devices: the engine says which layers stream, answers
// offers, and tags copies with the forward (epoch) that will read them.
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "offload/plan/cost_model.h"

namespace sluice::offload {

// "--prefetch": "auto" (kPrefetchAuto: as far as the ring's bytes allow) or a number of
// streamed layers, 0 (copies on demand only) to 65536. Throws InvalidArgument naming `flag`
// (when not empty: CLI11 names the flag itself).
uint32_t parse_prefetch(std::string_view text, const std::string& flag = "--prefetch");
// "auto" or the number.
std::string prefetch_name(uint32_t max_ahead);

class PrefetchScheduler {
 public:
  static constexpr size_t kNone = static_cast<size_t>(-1);

  // What an offer's answer means for the scheduler.
  enum class Offer {
    issued,   // copied or in flight now (or already there): count it as ahead
    full,     // no room now: stop, and offer it again at the next acquire
    failed,   // the copy failed: stop offering for this acquire, retry later
  };
  // The engine's answer to "copy layer `id` for call `occurrence` of it in forward `epoch`"
  // (Note [repeated calls]).
  using OfferFn = std::function<Offer(int64_t id, uint64_t epoch, uint32_t occurrence)>;

  explicit PrefetchScheduler(uint32_t max_ahead = kPrefetchAuto) : max_ahead_(max_ahead) {}

  uint32_t max_ahead() const { return max_ahead_; }

  // Which layers stream (indexed by layer id); refreshes every recorded order.
  void set_streamed(std::vector<bool> streamed);

  // A forward of `kind` begins; `epoch` is its number (copies for it are tagged with it).
  // `implicit`: opened by an acquire outside any forward (no wrap-around offers).
  void begin(const std::string& kind, uint64_t epoch, bool implicit);
  // Layer `id` is acquired: its position in the recorded order, or kNone when unknown.
  size_t acquired(int64_t id);
  // Which call of its layer the latest acquire is in this forward (Note [repeated calls]).
  uint32_t occurrence() const { return occurrence_; }
  // Offers copies after position `pos` of the current forward (kNone: nothing known).
  // `at_end`: the forward has ended; offers are for the next one of the same kind.
  void top_up(size_t pos, bool at_end, const OfferFn& offer);

  struct Ended {
    bool diverged = false;              // the acquires did not follow the recorded order
    bool overflow = false;              // too many acquires to record (no forward boundaries)
    std::vector<int64_t> acquires;      // this forward's acquires, in order (unless overflow)
  };
  // The forward ends; its order is recorded unless `aborted`.
  Ended end(bool aborted);

  // The recorded order of `kind` (empty if none).
  const std::vector<int64_t>& order(const std::string& kind) const;
  std::vector<std::string> kinds() const;
  // Forgets offers made so far (the copies were dropped: a new ring, another kind).
  void reset_frontier() { frontier_epoch_ = 0; frontier_ = 0; }
  // Forgets every recorded order.
  void clear();

 private:
  struct Kind {
    std::vector<int64_t> order;         // layer ids in acquire order
    std::vector<size_t> next_streamed;  // index of the first streamed position >= i
    std::vector<size_t> streamed_before;  // streamed positions < i
    std::vector<uint32_t> occurrence;   // how many times order[i] comes before position i
  };
  void refresh(Kind& k) const;
  bool streamed(int64_t id) const;

  uint32_t max_ahead_;
  std::vector<bool> streamed_;
  std::map<std::string, Kind> kinds_;
  Kind* kind_ = nullptr;
  uint64_t epoch_ = 0;
  bool implicit_ = false;
  bool known_ = false;
  size_t cursor_ = 0;
  bool diverged_ = false;
  std::vector<int64_t> recording_;
  std::map<int64_t, uint32_t> calls_;  // this forward's acquires per layer
  uint32_t occurrence_ = 0;
  bool overflow_ = false;
  // Offers were made for every position before (frontier_epoch_, frontier_).
  uint64_t frontier_epoch_ = 0;
  size_t frontier_ = 0;
};

}  // namespace sluice::offload
