#include <catch2/catch.hpp>

#include "offload/plan/calibration.h"

using namespace sluice::offload;

namespace {

// Three layers acquired in order 0, 1, 2: acquires at 1, 4 and 6 ms, layer 1 waited
// 0.5 ms for its copy, the forward ended at 10 ms.
ForwardSample sample(const std::string& kind = "dit", double wall = 10) {
  ForwardSample s;
  s.kind = kind;
  s.order = {0, 1, 2};
  s.acquire_ms = {1, 4, 6};
  s.stall_ms = {0, 0.5, 0};
  s.wall_ms = wall;
  s.copies = {{1000000, 1.1}, {3000000, 3.1}};  // 1 ms per MB + 0.1 ms per copy
  return s;
}

}  // namespace

TEST_CASE("calibration: compute per position takes the waits out and wraps the head into the tail") {
  const std::vector<double> c = compute_times(sample());
  REQUIRE(c.size() == 3);
  CHECK(c[0] == Approx(3.0));        // 4 - 1
  CHECK(c[1] == Approx(1.5));        // 6 - 4 - 0.5 waiting for its copy
  CHECK(c[2] == Approx(4.0 + 1.0));  // 10 - 6, plus the 1 ms before the first acquire
  ForwardSample bad = sample();
  bad.stall_ms.pop_back();
  CHECK(compute_times(bad).empty());
  bad = sample();
  bad.wall_ms = 0;
  CHECK(compute_times(bad).empty());
}

TEST_CASE("calibration: the copy fit separates a per-copy latency from the bandwidth") {
  auto f = fit_copies({{1000000, 1.1}, {3000000, 3.1}, {2000000, 2.1}});
  REQUIRE(f);
  CHECK(f->gbps == Approx(1.0));  // 1 MB per ms = 1 GB/s
  CHECK(f->overhead_ms == Approx(0.1));
  // Sizes all alike: a plain rate, no intercept.
  f = fit_copies({{1000000, 2.0}, {1000000, 2.0}});
  REQUIRE(f);
  CHECK(f->gbps == Approx(0.5));
  CHECK(f->overhead_ms == 0);
  // A negative intercept is not a latency: a line through the origin.
  f = fit_copies({{1000000, 0.5}, {3000000, 3.5}});
  REQUIRE(f);
  CHECK(f->overhead_ms == 0);
  CHECK(f->gbps > 0);
  CHECK_FALSE(fit_copies({}));
  CHECK_FALSE(fit_copies({{1000, 0.0}}));
}

// One forward of `kind` through the calibrator as the engine drives it: begin, then resolve
// with the sample when begin() asked for detail (`sample` stands for the measurement).
bool step(Calibrator& c, const std::string& kind, const ForwardSample& sample) {
  const bool detail = c.begin(kind);
  c.forward(kind, detail, sample.wall_ms, &sample);
  return detail;
}

TEST_CASE("calibration: a profile makes a plan due, and a prediction off by more than 15% makes one more, once") {
  Calibrator c;
  CHECK_FALSE(step(c, "dit", sample("dit", 50.0)));  // the first forward of a kind pays one-time costs
  CHECK_FALSE(c.replan_due());
  CHECK_FALSE(c.model(3).usable());
  CHECK(step(c, "dit", sample()));  // the second is measured
  CHECK(c.replan_due());
  const CostModel m = c.model(3);
  REQUIRE(m.usable());
  REQUIRE(m.kinds.size() == 1);
  CHECK(m.kinds[0].order == std::vector<size_t>{0, 1, 2});
  CHECK(m.copy_gbps == Approx(1.0));
  CHECK(m.copy_overhead_ms == Approx(0.1));
  CHECK_FALSE(c.model(2).usable());  // an order naming a layer the model does not have is dropped

  c.planned({KindPrediction{"dit", 10.0}});
  CHECK_FALSE(c.replan_due());
  CHECK(c.measured_plans() == 1);
  CHECK_FALSE(step(c, "dit", sample("dit", 30.0)));  // the first forward under the plan: warm-up
  CHECK(c.measured_forwards("dit") == 0);
  CHECK(step(c, "dit", sample("dit", 12.0)));  // the check forward, 20% off
  CHECK(c.recomputed());
  CHECK(c.replan_due());
  CHECK(c.model(3).kinds[0].compute_ms[2] == Approx(7.0));  // the new profile: 12 - 6 + 1
  c.planned({KindPrediction{"dit", 10.0}});
  CHECK_FALSE(step(c, "dit", sample("dit", 10.0)));
  CHECK_FALSE(step(c, "dit", sample("dit", 20.0)));  // once per attach: no second check
  CHECK_FALSE(c.replan_due());
  step(c, "dit", sample("dit", 11.0));
  step(c, "dit", sample("dit", 12.0));
  CHECK(c.measured_forwards("dit") == 3);
  CHECK(c.measured_step_ms("dit") == Approx(12.0));  // median of 20, 11, 12
  CHECK(c.main_kind() == "dit");
}

TEST_CASE("calibration: detail is decided when a forward begins, before earlier ones resolve") {
  // An asynchronous device: forwards 0 and 1 begin before either is resolved.
  Calibrator c;
  const bool d0 = c.begin("dit");
  const bool d1 = c.begin("dit");
  CHECK_FALSE(d0);
  CHECK(d1);
  CHECK_FALSE(c.begin("dit"));  // one measured forward in flight is enough
  c.forward("dit", d0, 50.0, nullptr);  // aborted: counts for nothing
  c.forward("dit", d1, 10.0, nullptr);  // aborted too: a later forward is measured instead
  CHECK_FALSE(c.replan_due());
  c.forward("dit", false, 10.0, nullptr);
  const ForwardSample s = sample();
  CHECK(step(c, "dit", s));
  CHECK(c.replan_due());
}

TEST_CASE("calibration: a prediction within 15% keeps the plan") {
  Calibrator c;
  step(c, "dit", sample("dit", 50.0));
  step(c, "dit", sample());
  c.planned({KindPrediction{"dit", 10.0}});
  step(c, "dit", sample("dit", 10.0));
  CHECK(step(c, "dit", sample("dit", 11.0)));  // the check: 10% off
  CHECK_FALSE(c.recomputed());
  CHECK_FALSE(c.replan_due());
  // Kinds weigh by how often they ran to completion.
  step(c, "adapter", sample("adapter"));
  step(c, "adapter", sample("adapter"));
  const CostModel m = c.model(3);
  REQUIRE(m.kinds.size() == 2);
  CHECK(m.kinds[0].kind == "adapter");
  CHECK(m.kinds[0].weight == 2);
  CHECK(m.kinds[1].weight == 4);
}

TEST_CASE("calibration: copies timed later make a plan due when the profile forward streamed nothing") {
  Calibrator c;
  ForwardSample s = sample();
  s.copies.clear();
  step(c, "dit", s);
  step(c, "dit", s);
  CHECK(c.replan_due());  // due, but model() is not usable without a copy rate
  CHECK_FALSE(c.model(3).usable());
  c.planned({});
  CHECK_FALSE(c.replan_due());
  c.copies({{2000000, 2.0}});
  CHECK(c.replan_due());
  CHECK(c.model(3).usable());
}
