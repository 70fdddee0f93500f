// The locking of the model cache (cache/cache_locking.h, Note [cache locking]) on its own,
// with generated anima-tiny models on the test device: an operation waiting for a model's
// forward is not starved by that model's next forward, a budget change holds back the
// forwards of every model until it is done, and the published snapshot is what queries
// read: it follows attach, resize and detach, and a query's refresh leaves it alone while
// a forward runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cache/cache_locking.h"
#include "tests/support/cache_parts.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using namespace sluice::cache;
using sluice::testing::cache_spec;
using sluice::testing::CacheParts;
using sluice::testing::roomy_cache_options;

namespace {

// Events in the order threads record them.
struct Order {
  std::mutex m;
  std::vector<std::string> events;
  void add(const std::string& e) {
    std::lock_guard<std::mutex> g(m);
    events.push_back(e);
  }
  std::vector<std::string> get() {
    std::lock_guard<std::mutex> g(m);
    return events;
  }
};

// Sleeps until `pred` holds under the cache mutex, for at most 30 s.
template <class Pred>
bool eventually(CacheLocking& locking, Pred pred) {
  for (int i = 0; i < 3000; ++i) {
    {
      Guard g(locking.mutex());
      if (pred()) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

}  // namespace

TEST_CASE("cache_locking: an operation waiting for a model's forward goes before that model's next forward",
          "[strict][accel]") {
  CacheParts p(roomy_cache_options());
  auto e = p.attached(cache_spec());
  // When the running forward ends, the operation and the next forward wake together; the
  // next forward must let the operation go first however the mutex falls. Several rounds,
  // so that a protocol without the hold-back loses one.
  for (int round = 0; round < 100; ++round) {
    INFO("round " << round);
    p.locking.begin_forward(*e);  // the running forward
    Order order;
    std::thread op([&] {
      Guard g(p.locking.mutex());
      p.locking.wait_idle(*e, g);
      order.add("operation");
    });
    REQUIRE(eventually(p.locking, [&] { return e->run_waiters == 1; }));
    std::atomic<bool> next_started{false};
    std::thread next([&] {
      next_started = true;
      p.locking.begin_forward(*e);
      order.add("forward");
      p.locking.end_forward(*e);
    });
    while (!next_started) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // the next forward waits too
    CHECK(order.get().empty());
    p.locking.end_forward(*e);
    op.join();
    next.join();
    CHECK(order.get() == std::vector<std::string>{"operation", "forward"});
    Guard g(p.locking.mutex());
    CHECK_FALSE(e->running);
    CHECK(e->run_waiters == 0);
  }
}

TEST_CASE("cache_locking: waiting for every forward holds back new forwards of all models", "[strict][accel]") {
  CacheParts p(roomy_cache_options());
  auto a = p.attached(cache_spec("anima-tiny", 1));
  auto b = p.attached(cache_spec("anima-tiny", 2));
  p.locking.begin_forward(*a);
  Order order;
  std::atomic<bool> waiting{false};
  std::thread budget([&] {
    Guard g(p.locking.mutex());
    waiting = true;
    p.locking.wait_all_idle(g);
    order.add("budget");
  });
  while (!waiting) std::this_thread::yield();
  // b runs nothing, yet its new forward waits for the budget change, which waits for a.
  std::thread forward_b([&] {
    p.locking.begin_forward(*b);
    order.add("forward b");
    p.locking.end_forward(*b);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(order.get().empty());
  {
    Guard g(p.locking.mutex());
    CHECK_FALSE(b->running);
  }
  p.locking.end_forward(*a);
  budget.join();
  forward_b.join();
  CHECK(order.get() == std::vector<std::string>{"budget", "forward b"});
}

TEST_CASE("cache_locking: the published snapshot follows residency changes and a refresh leaves it alone during a forward",
          "[strict][accel]") {
  CacheParts p(roomy_cache_options());
  auto e = p.attached(cache_spec());
  const auto published = [&] {
    std::lock_guard<std::mutex> g(e->published_mutex);
    return e->published;
  };
  Guard g(p.locking.mutex());
  {
    const Entry::Published s = published();
    CHECK(s.stats);
    CHECK(s.device_bytes == e->engine->device_bytes());
    CHECK(s.residency == e->engine->plan().residency_map());
    CHECK(s.streamed_dit == 0);  // everything resident
  }
  p.shares.resize(*e, e->needs.minimum);  // published by the change
  {
    const Entry::Published s = published();
    CHECK(s.device_bytes == e->engine->device_bytes());
    CHECK(s.residency == e->engine->plan().residency_map());
    CHECK(s.streamed_dit + s.streamed_adapter > 0);
  }
  g.unlock();

  // During a forward a query's refresh keeps the snapshot from before.
  p.locking.begin_forward(*e);
  g.lock();
  {
    std::lock_guard<std::mutex> pg(e->published_mutex);
    e->published.residency = "from before";
  }
  p.locking.refresh_published(*e);
  CHECK(published().residency == "from before");
  g.unlock();
  p.locking.end_forward(*e);
  g.lock();
  p.locking.refresh_published(*e);  // idle: settled from the engine again
  CHECK(published().residency == e->engine->plan().residency_map());

  p.shares.detach(*e);
  const Entry::Published s = published();
  CHECK(s.device_bytes == 0);
  CHECK(s.residency.empty());
  CHECK(s.stats);  // the engine's stats stay for queries
}
