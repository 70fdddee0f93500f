// The fault-injection facility itself (runtime/fault_injection.h): triggers, counters,
// specs, thread safety. Its wiring into sluice is tested in test_faults.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "runtime/error.h"
#include "runtime/fault_injection.h"

using namespace sluice;

namespace {

struct DisarmAll {
  ~DisarmAll() { fault::disarm_all(); }
};

// Which of `n` hits of `point` fail, as a string of '.' and 'x'.
std::string pattern(const std::string& point, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += fault::triggered(point) ? 'x' : '.';
  return s;
}

}  // namespace

TEST_CASE("fault injection: disarmed points never fire and count nothing", "[strict]") {
  DisarmAll guard;
  CHECK(pattern("test.never", 5) == ".....");
  CHECK(fault::hits("test.never") == 0);
  fault::arm("test.other", fault::Trigger{1, 1});
  CHECK(pattern("test.never", 5) == ".....");  // armed points elsewhere do not count hits here
  CHECK(fault::hits("test.never") == 0);
}

TEST_CASE("fault injection: nth and count fail exactly those hits", "[strict]") {
  DisarmAll guard;
  fault::Trigger t;
  t.nth = 3;
  fault::arm("test.nth", t);
  CHECK(pattern("test.nth", 6) == "..x...");
  CHECK(fault::hits("test.nth") == 6);
  CHECK(fault::fired("test.nth") == 1);
  t.nth = 2;
  t.count = 3;
  fault::arm("test.nth", t);  // re-arming resets the counters
  CHECK(fault::hits("test.nth") == 0);
  CHECK(pattern("test.nth", 7) == ".xxx...");
  t.nth = 4;
  t.count = std::numeric_limits<uint64_t>::max();
  fault::arm("test.nth", t);
  CHECK(pattern("test.nth", 7) == "...xxxx");
  fault::disarm("test.nth");
  CHECK(pattern("test.nth", 3) == "...");
  CHECK(fault::fired("test.nth") == 4);  // counters survive disarm
}

TEST_CASE("fault injection: count_only counts without failing", "[strict]") {
  DisarmAll guard;
  fault::Trigger t;
  t.count_only = true;
  t.nth = 1;
  fault::arm("test.count", t);
  CHECK(pattern("test.count", 9) == ".........");
  CHECK(fault::hits("test.count") == 9);
  CHECK(fault::fired("test.count") == 0);
}

TEST_CASE("fault injection: probability triggers are seeded and near their rate", "[strict]") {
  DisarmAll guard;
  fault::Trigger t;
  t.probability = 0.2;
  t.seed = 42;
  fault::arm("test.p", t);
  const std::string a = pattern("test.p", 2000);
  fault::arm("test.p", t);
  const std::string b = pattern("test.p", 2000);
  CHECK(a == b);
  const auto fails = std::count(a.begin(), a.end(), 'x');
  CHECK(fails > 300);
  CHECK(fails < 500);
  t.seed = 43;
  fault::arm("test.p", t);
  CHECK(pattern("test.p", 2000) != a);
  t.probability = 1.0;
  fault::arm("test.p", t);
  CHECK(pattern("test.p", 4) == "xxxx");
}

TEST_CASE("fault injection: bad triggers and specs are InvalidArgument naming the part", "[strict]") {
  DisarmAll guard;
  fault::Trigger t;
  t.probability = 1.5;
  CHECK_THROWS_AS(fault::arm("test.bad", t), InvalidArgument);
  t.probability = 0;
  t.count = 0;
  CHECK_THROWS_AS(fault::arm("test.bad", t), InvalidArgument);
  CHECK_THROWS_AS(fault::arm("", fault::Trigger{}), InvalidArgument);
  CHECK_THROWS_WITH(fault::arm_from_spec("a:nth=2;b:bogus=1", "--faults"),
                    Catch::Contains("--faults") && Catch::Contains("b:bogus=1"));
  CHECK_THROWS_WITH(fault::arm_from_spec("a:p=2"), Catch::Contains("a:p=2"));
  CHECK_THROWS_WITH(fault::arm_from_spec("a:nth=-1"), Catch::Contains("whole number"));
  CHECK_THROWS_WITH(fault::arm_from_spec("a"), Catch::Contains("give nth="));
  CHECK_THROWS_WITH(fault::arm_from_spec(":nth=1"), Catch::Contains("no fault point name"));
  // All or nothing: the good part of a bad spec was not armed.
  CHECK(pattern("a", 3) == "...");
}

TEST_CASE("fault injection: specs arm several points", "[strict]") {
  DisarmAll guard;
  fault::arm_from_spec(" test.s1:nth=2 ; test.s2:nth=1,count=all;test.s3:count_only;test.s4:p=1,seed=3");
  CHECK(pattern("test.s1", 3) == ".x.");
  CHECK(pattern("test.s2", 3) == "xxx");
  CHECK(pattern("test.s3", 3) == "...");
  CHECK(fault::hits("test.s3") == 3);
  CHECK(pattern("test.s4", 2) == "xx");
  const uint64_t before = fault::total_fired();
  CHECK(fault::triggered("test.s2"));
  CHECK(fault::total_fired() == before + 1);
}

TEST_CASE("fault injection: hits from many threads are all counted and nth fires once", "[strict]") {
  DisarmAll guard;
  fault::Trigger t;
  t.nth = 5000;
  fault::arm("test.mt", t);
  std::atomic<int> fired{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&] {
      for (int i = 0; i < 2500; ++i) fired += fault::triggered("test.mt") ? 1 : 0;
    });
  }
  for (auto& th : threads) th.join();
  CHECK(fault::hits("test.mt") == 10000);
  CHECK(fired == 1);
  CHECK(fault::fired("test.mt") == 1);
}

TEST_CASE("fault injection: every wired point is listed with what it simulates", "[strict]") {
  std::vector<std::string> names;
  for (const auto& p : fault::known_points()) {
    CHECK(std::string(p.simulates).size() > 10);
    names.emplace_back(p.name);
  }
  for (const char* n : {"device.alloc.resident", "device.alloc.ring", "device.alloc.scratch", "device.alloc.params",
                        "host.pin", "copy.h2d.enqueue", "copy.h2d", "copy.h2d.timeout", "safetensors.read",
                        "lora.read", "lora.patch"}) {
    CHECK(std::find(names.begin(), names.end(), n) != names.end());
  }
}
