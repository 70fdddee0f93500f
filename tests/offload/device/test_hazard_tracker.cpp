// The strict device's hazard tracker on its own: each rule of Note [strict device
// hazards], with the count policy so that a hazard is observable instead of fatal.
#include <catch2/catch.hpp>

#include <vector>

#include "offload/device/hazard_tracker.h"

using sluice::offload::Access;
using sluice::offload::HazardTracker;

namespace {

constexpr HazardTracker::Queue kHost = HazardTracker::kHost;
constexpr HazardTracker::Queue kCopy = HazardTracker::kCopy;
const HazardTracker::Queue kCompute = HazardTracker::compute(0);
const HazardTracker::Queue kOther = HazardTracker::compute(1);

struct Fixture {
  HazardTracker t{HazardTracker::Policy::count};
  std::vector<char> mem = std::vector<char>(1024);
  const void* block = mem.data();
  const void* inside = mem.data() + 100;
  Fixture() { t.add_block(block, 512, "slot", kCompute); }
};

}  // namespace

TEST_CASE("hazard tracker: a read before the copy that writes it is ordered is a hazard") {
  Fixture f;
  f.t.access(f.block, kCopy, Access::write, "copy");
  f.t.access(f.inside, kCompute, Access::read, "matmul");
  REQUIRE(f.t.hazards() == 1);
  const std::string r = f.t.reports().at(0);
  CHECK(r.find("read of slot") != std::string::npos);
  CHECK(r.find("compute stream 0 (matmul)") != std::string::npos);
  CHECK(r.find("copy stream (copy)") != std::string::npos);
}

TEST_CASE("hazard tracker: an event wait orders the read after the copy") {
  Fixture f;
  f.t.access(f.block, kCopy, Access::write, "copy");
  const auto done = f.t.record(kCopy);
  f.t.merge(kCompute, done);
  f.t.access(f.inside, kCompute, Access::read, "matmul");
  CHECK(f.t.hazards() == 0);
}

TEST_CASE("hazard tracker: a stale event does not cover a later copy") {
  Fixture f;
  const auto early = f.t.record(kCopy);
  f.t.access(f.block, kCopy, Access::write, "copy");
  f.t.merge(kCompute, early);
  f.t.access(f.block, kCompute, Access::read, "matmul");
  CHECK(f.t.hazards() == 1);
}

TEST_CASE("hazard tracker: overwriting a block a lease reads is a hazard until the lease ends and is waited for") {
  Fixture f;
  f.t.begin(f.block, kCompute, Access::read, "layer forward");
  SECTION("lease open") {
    f.t.access(f.block, kCopy, Access::write, "next copy");
    CHECK(f.t.hazards() == 1);
  }
  SECTION("lease ended, the copy stream did not wait for it") {
    f.t.end(f.block, kCompute);
    f.t.access(f.block, kCopy, Access::write, "next copy");
    CHECK(f.t.hazards() == 1);
  }
  SECTION("lease ended, an event before its end is not enough") {
    const auto before_end = f.t.record(kCompute);
    f.t.end(f.block, kCompute);
    f.t.merge(kCopy, before_end);
    f.t.access(f.block, kCopy, Access::write, "next copy");
    CHECK(f.t.hazards() == 1);
  }
  SECTION("lease ended and waited for") {
    f.t.end(f.block, kCompute);
    f.t.merge(kCopy, f.t.record(kCompute));
    f.t.access(f.block, kCopy, Access::write, "next copy");
    CHECK(f.t.hazards() == 0);
  }
}

TEST_CASE("hazard tracker: work the host enqueues after it waited is ordered after what it waited for") {
  Fixture f;
  f.t.access(f.block, kCopy, Access::write, "copy");
  f.t.host_waits_for(kCopy);  // synchronize
  f.t.access(f.block, kOther, Access::read, "matmul on another stream");
  CHECK(f.t.hazards() == 0);
}

TEST_CASE("hazard tracker: a free while another stream may use the block needs a recorded use or a wait") {
  SECTION("copy stream, nothing recorded") {
    Fixture f;
    f.t.access(f.block, kCopy, Access::write, "copy");
    f.t.remove_block(f.block);
    REQUIRE(f.t.hazards() == 1);
    CHECK(f.t.reports().at(0).find("free of slot") != std::string::npos);
  }
  SECTION("copy stream, use recorded") {
    Fixture f;
    f.t.access(f.block, kCopy, Access::write, "copy");
    f.t.record_use(f.block, kCopy);
    CHECK(f.t.recorded_queues(f.block).count(kCopy) == 1);
    f.t.remove_block(f.block);
    CHECK(f.t.hazards() == 0);
  }
  SECTION("copy stream, host synchronized") {
    Fixture f;
    f.t.access(f.block, kCopy, Access::write, "copy");
    f.t.host_waits_for(kCopy);
    f.t.remove_block(f.block);
    CHECK(f.t.hazards() == 0);
  }
  SECTION("the owner's own stream needs nothing") {
    Fixture f;
    f.t.begin(f.block, kCompute, Access::read, "forward");
    f.t.end(f.block, kCompute);
    f.t.remove_block(f.block);
    CHECK(f.t.hazards() == 0);
  }
  SECTION("another compute stream, synchronizing the owner's stream is not enough") {
    Fixture f;
    f.t.begin(f.block, kOther, Access::read, "forward on a host stream");
    f.t.end(f.block, kOther);
    f.t.host_waits_for(kCompute);
    f.t.remove_block(f.block);
    CHECK(f.t.hazards() == 1);
  }
}

TEST_CASE("hazard tracker: unknown addresses are ignored and blocks are found by any address inside") {
  Fixture f;
  char elsewhere = 0;
  f.t.access(&elsewhere, kCopy, Access::write, "copy");
  CHECK(f.t.hazards() == 0);
  CHECK(f.t.owner_of(f.inside) == kCompute);
  CHECK_FALSE(f.t.owner_of(&elsewhere).has_value());
  CHECK_FALSE(f.t.owner_of(static_cast<const char*>(f.block) + 512).has_value());
  CHECK(HazardTracker::queue_name(kOther) == "compute stream 1");
}
