#include <catch2/catch.hpp>

#include <set>
#include <utility>
#include <vector>

#include "offload/plan/prefetch_scheduler.h"
#include "runtime/error.h"

using namespace sluice::offload;
using Offer = PrefetchScheduler::Offer;

namespace {

// A fake ring: holds up to `room` copies; consumed ones are freed by the test.
struct FakeRing {
  size_t room = 1000;
  std::vector<std::pair<int64_t, uint64_t>> offers;  // every offer, in order
  std::set<std::pair<int64_t, uint64_t>> held;
  Offer operator()(int64_t id, uint64_t epoch, uint32_t /*occurrence*/ = 0) {
    offers.emplace_back(id, epoch);
    if (held.count({id, epoch})) return Offer::issued;
    if (held.size() >= room) return Offer::full;
    held.insert({id, epoch});
    return Offer::issued;
  }
};

// Runs one forward of `order` (every acquire tops up), freeing each layer's copy after use.
void forward(PrefetchScheduler& s, FakeRing& ring, const std::vector<int64_t>& order, uint64_t epoch,
             bool at_end = true) {
  s.begin("dit", epoch, false);
  for (int64_t id : order) {
    const size_t pos = s.acquired(id);
    s.top_up(pos, false, std::ref(ring));
    ring.held.erase({id, epoch});
  }
  s.end(false);
  if (at_end) s.top_up(0, true, std::ref(ring));
}

}  // namespace

TEST_CASE("prefetch scheduler: offers follow the recorded order, skip resident layers, and wrap") {
  PrefetchScheduler s;
  s.set_streamed({true, false, true, false, true});  // layers 0, 2, 4 stream
  FakeRing ring;
  forward(s, ring, {0, 1, 2, 3, 4}, 1);  // records the order; nothing is known yet
  CHECK(ring.offers.empty() == false);   // at the end: the next forward's streamed layers
  CHECK(ring.offers == std::vector<std::pair<int64_t, uint64_t>>{{0, 2}, {2, 2}, {4, 2}});
  ring.offers.clear();
  forward(s, ring, {0, 1, 2, 3, 4}, 2);
  // Every copy of forward 2 was made at the end of forward 1; during forward 2 the offers
  // run into forward 3, never more than one cycle ahead, each position once.
  for (const auto& [id, epoch] : ring.offers) CHECK(epoch == 3);
  std::set<int64_t> ids;
  for (const auto& o : ring.offers) CHECK(ids.insert(o.first).second);
  CHECK(ids == std::set<int64_t>{0, 2, 4});
}

TEST_CASE("prefetch scheduler: a full ring stops the offers and the next acquire resumes them") {
  PrefetchScheduler s;
  s.set_streamed(std::vector<bool>(6, true));
  FakeRing ring;
  ring.room = 2;
  forward(s, ring, {0, 1, 2, 3, 4, 5}, 1, /*at_end=*/false);
  ring.held.clear();
  ring.offers.clear();
  s.begin("dit", 2, false);
  size_t pos = s.acquired(0);
  s.top_up(pos, false, std::ref(ring));
  // 1 and 2 fit; 3 is refused.
  CHECK(ring.offers == std::vector<std::pair<int64_t, uint64_t>>{{1, 2}, {2, 2}, {3, 2}});
  ring.offers.clear();
  ring.held.erase({1, 2});
  pos = s.acquired(1);
  s.top_up(pos, false, std::ref(ring));
  // Resumes at 3 (no rescan of 2), which now fits, then 4 is refused.
  CHECK(ring.offers == std::vector<std::pair<int64_t, uint64_t>>{{3, 2}, {4, 2}});
}

TEST_CASE("prefetch scheduler: max_ahead bounds the streamed layers in flight") {
  PrefetchScheduler s(2);
  s.set_streamed(std::vector<bool>(6, true));
  FakeRing ring;
  forward(s, ring, {0, 1, 2, 3, 4, 5}, 1, /*at_end=*/false);
  ring.offers.clear();
  s.begin("dit", 2, false);
  s.top_up(s.acquired(0), false, std::ref(ring));
  CHECK(ring.offers == std::vector<std::pair<int64_t, uint64_t>>{{1, 2}, {2, 2}});
  ring.offers.clear();
  s.top_up(s.acquired(1), false, std::ref(ring));
  CHECK(ring.offers == std::vector<std::pair<int64_t, uint64_t>>{{3, 2}});
}

TEST_CASE("prefetch scheduler: depth 0 offers nothing, a changed order is recorded, implicit forwards do not wrap") {
  PrefetchScheduler none(0);
  none.set_streamed({true, true});
  FakeRing ring;
  forward(none, ring, {0, 1}, 1);
  forward(none, ring, {0, 1}, 2);
  CHECK(ring.offers.empty());

  PrefetchScheduler s;
  s.set_streamed({true, true, true});
  forward(s, ring, {0, 1, 2}, 1, false);
  s.begin("dit", 2, false);
  s.acquired(2);
  s.acquired(0);
  const auto ended = s.end(false);
  CHECK(ended.diverged);
  CHECK(s.order("dit") == std::vector<int64_t>{2, 0});

  PrefetchScheduler imp;
  imp.set_streamed({true, true});
  FakeRing r2;
  imp.begin("", 1, true);
  imp.acquired(0);
  imp.acquired(1);
  imp.end(false);
  imp.top_up(0, true, std::ref(r2));
  imp.begin("", 2, true);
  imp.top_up(imp.acquired(0), false, std::ref(r2));
  imp.top_up(imp.acquired(1), false, std::ref(r2));
  CHECK(r2.offers == std::vector<std::pair<int64_t, uint64_t>>{{1, 2}});
}

TEST_CASE("prefetch scheduler: --prefetch parses auto or a number of layers and names the flag") {
  CHECK(parse_prefetch("auto") == kPrefetchAuto);
  CHECK(parse_prefetch("0") == 0);
  CHECK(parse_prefetch("65536") == 65536);
  CHECK(prefetch_name(kPrefetchAuto) == "auto");
  CHECK(prefetch_name(3) == "3");
  for (const char* bad : {"", "-1", "65537", "2x", "1e3", "AUTO", "99999999999"}) {
    INFO(bad);
    try {
      parse_prefetch(bad, "--prefetch");
      FAIL("accepted");
    } catch (const sluice::InvalidArgument& e) {
      CHECK(std::string(e.what()).find("--prefetch") != std::string::npos);
    }
  }
}
