// The device shares of the model cache (cache/device_shares.h) on their own: the share a
// model asks for, the smallest budget a model can run under, the default working memory
// (Note [working memory default]), and how room is made: partial unloads least recently
// used first and each only as much as still needed, then whole models off the device,
// never a locked or excluded model. Generated anima-tiny models on the test device.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/device_shares.h"
#include "runtime/error.h"
#include "tests/support/cache_parts.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using namespace sluice::cache;
using sluice::testing::cache_spec;
using sluice::testing::CacheParts;

namespace {

constexpr uint64_t MiB = 1ull << 20;
constexpr uint64_t GiB = 1ull << 30;

CacheOptions options(uint64_t budget, uint64_t working = 1 * MiB) {
  CacheOptions o;
  o.vram_budget = budget;
  o.working_memory = working;
  return o;
}

}  // namespace

TEST_CASE("device_shares: the wanted share is the target clamped to the model's minimum and wants and never more than the limit",
          "[strict][accel]") {
  CacheParts p(options(2000 * MiB, 500 * MiB));
  const DeviceShares& shares = p.shares;
  REQUIRE(shares.limit() == 1500 * MiB);
  Entry e;
  e.needs.minimum = 100 * MiB;
  e.needs.wanted = 1000 * MiB;
  e.needs.full = 1200 * MiB;
  CHECK(shares.wanted_share(e) == 1000 * MiB);  // no target: what it wants
  e.target = 50 * MiB;
  CHECK(shares.wanted_share(e) == 100 * MiB);  // never below its minimum
  e.target = 700 * MiB;
  CHECK(shares.wanted_share(e) == 700 * MiB);
  e.target = 5000 * MiB;
  CHECK(shares.wanted_share(e) == 1000 * MiB);  // never above what it wants
  e.needs.wanted = 1400 * MiB;
  CHECK(shares.wanted_share(e) == 1400 * MiB);
  e.needs.wanted = 1600 * MiB;
  CHECK(shares.wanted_share(e) == 1500 * MiB);  // never above the limit
  e.target.reset();
  CHECK(shares.wanted_share(e) == 1500 * MiB);
  // A minimum above what the model wants (a cap that raised the ring): the minimum wins.
  e.needs.minimum = 300 * MiB;
  e.needs.wanted = 200 * MiB;
  e.target = 250 * MiB;
  CHECK(shares.wanted_share(e) == 300 * MiB);
}

TEST_CASE("device_shares: the minimum budget leaves exactly the model's minimum beside the working memory",
          "[strict][accel]") {
  CacheOptions o;
  o.working_memory = 64 * MiB;
  CHECK(minimum_vram_budget(300 * MiB, o) == 364 * MiB);
  o.working_memory.reset();  // the default grows with the budget: the smallest that works
  for (int64_t resolution : {256, 1024, 2048}) {
    o.resolution = resolution;
    for (uint64_t m : {1 * MiB, 300 * MiB + 7, 3 * GiB, 10 * GiB + 12345}) {
      INFO(resolution << " px, minimum " << m);
      const uint64_t b = minimum_vram_budget(m, o);
      CHECK(b - default_working_memory(b, resolution) >= m);
      CHECK(b - 1 - default_working_memory(b - 1, resolution) < m);
    }
  }
}

TEST_CASE("device_shares: the default working memory is 1 GiB at 1024 px and scales with the pixels between 256 MiB and a quarter of the budget",
          "[strict][accel]") {
  CHECK(default_working_memory(64 * GiB, 1024) == 1 * GiB);
  CHECK(default_working_memory(64 * GiB, 2048) == 4 * GiB);
  CHECK(default_working_memory(64 * GiB, 1448) == static_cast<uint64_t>(static_cast<double>(GiB) * (1448.0 / 1024) * (1448.0 / 1024)));
  CHECK(default_working_memory(64 * GiB, 256) == 256 * MiB);  // 64 MiB by the pixels: the floor
  CHECK(default_working_memory(64 * GiB, 0) == 256 * MiB);
  CHECK(default_working_memory(2 * GiB, 1024) == 512 * MiB);  // a quarter of a small budget
  CHECK(default_working_memory(512 * MiB, 256) == 128 * MiB);  // the quarter goes below the floor
}

TEST_CASE("device_shares: making room unloads the least recently used partially before taking any model off the device",
          "[strict][accel]") {
  CacheParts probe(options(4 * GiB));
  const offload::WeightNeeds n = probe.loaded(cache_spec())->needs;
  REQUIRE(n.minimum < n.wanted);
  const uint64_t give = n.wanted - n.minimum;  // what one model can give without leaving the device

  CacheParts p(options(3 * n.wanted + 1 * MiB));
  auto a = p.attached(cache_spec("anima-tiny", 1));
  auto b = p.attached(cache_spec("anima-tiny", 2));
  auto c = p.attached(cache_spec("anima-tiny", 3));
  Guard g(p.locking.mutex());
  for (const auto& e : {a, b, c}) {
    REQUIRE(e->attached);
    REQUIRE(e->share == n.wanted);
    p.ram.touch(*e);  // a is the least recently used, c the most
  }
  REQUIRE(p.shares.reserved() == 3 * n.wanted);

  // Half of what a can give: only a shrinks, by exactly that.
  p.shares.make_room(give / 2, nullptr);
  CHECK(a->share == n.wanted - give / 2);
  CHECK(b->share == n.wanted);
  CHECK(c->share == n.wanted);
  CHECK(p.state.device_unloads == 1);
  CHECK(a->engine->device_bytes() <= a->share);

  // The rest of a's, all of b's and one byte: a and b down to their minimum, c by one byte.
  p.shares.make_room(give - give / 2 + give + 1, nullptr);
  CHECK(a->share == n.minimum);
  CHECK(b->share == n.minimum);
  CHECK(c->share == n.wanted - 1);
  CHECK(p.state.device_unloads == 4);
  CHECK(p.state.device_drops == 0);
  for (const auto& e : {a, b, c}) CHECK(e->attached);

  // Locked and excluded models give nothing: only a is left to take off the device.
  b->locks = 1;
  p.shares.make_room(n.minimum, c.get());
  CHECK_FALSE(a->attached);
  CHECK(a->share == 0);
  CHECK(a->model);  // its RAM copy stays
  CHECK(b->share == n.minimum);
  CHECK(c->share == n.wanted - 1);
  CHECK(p.state.device_drops == 1);
  b->locks = 0;

  // More than every partial unload frees: the rest of c's first, then whole models, least
  // recently used first.
  p.shares.make_room(2 * n.wanted, nullptr);
  CHECK_FALSE(b->attached);
  CHECK_FALSE(c->attached);
  CHECK(p.state.device_unloads == 5);
  CHECK(p.state.device_drops == 3);
  CHECK(p.shares.reserved() == 0);
  CHECK(p.shares.unreserved() == p.shares.limit());
}

TEST_CASE("device_shares: a budget cut takes room from unlocked models before locked ones and a raise gives it back",
          "[strict][accel]") {
  CacheParts probe(options(4 * GiB));
  const offload::WeightNeeds n = probe.loaded(cache_spec())->needs;
  REQUIRE(n.minimum < n.wanted);
  const uint64_t W = 1 * MiB;

  CacheParts p(options(2 * n.wanted + W, W));
  auto a = p.attached(cache_spec("anima-tiny", 1));
  auto b = p.attached(cache_spec("anima-tiny", 2));
  {
    Guard g(p.locking.mutex());
    p.ram.touch(*b);
    p.ram.touch(*a);  // b is the least recently used
    a->locks = 1;
  }
  // Room for a fully resident and b at its minimum: b, unlocked, gives it all.
  p.shares.set_budget(n.wanted + n.minimum + W, /*measured=*/false);
  {
    Guard g(p.locking.mutex());
    CHECK(a->share == n.wanted);
    CHECK(b->share == n.minimum);
  }
  // Less still: b leaves the device, then the locked a shrinks, but never below its minimum.
  p.shares.set_budget(n.minimum + W, /*measured=*/false);
  {
    Guard g(p.locking.mutex());
    CHECK_FALSE(b->attached);
    CHECK(a->share == n.minimum);
  }
  CHECK_THROWS_AS(p.shares.set_budget(n.minimum + W - 1, /*measured=*/false), ResourceError);
  {
    Guard g(p.locking.mutex());
    CHECK(p.state.budget == n.minimum + W);  // a refused budget changes nothing
    CHECK(a->share == n.minimum);
  }
  // A raise: the attached model grows back to what it wants.
  p.shares.set_budget(2 * n.wanted + W, /*measured=*/false);
  Guard g(p.locking.mutex());
  CHECK(a->share == n.wanted);
  CHECK_FALSE(b->attached);  // off the device until it is asked for
  a->locks = 0;
}
