// The cost model's simulation (Note [cost model] in offload/plan/cost_model.h) on cases small
// enough to work out by hand. Units: slots in MB (1e6 bytes) at 1 GB/s, so a copy takes
// exactly its size in MB as ms; each expected time is derived in the comment beside it.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "offload/plan/cost_model.h"
#include "offload/plan/residency_plan.h"
#include "runtime/error.h"

using namespace sluice::offload;

namespace {

constexpr uint64_t MB = 1000000;
constexpr double kEps = 1e-9;

PlanLayer layer(const std::string& name, uint64_t bytes) {
  PlanLayer l;
  l.name = name;
  l.stored_bytes = bytes;
  return l;
}

CostModel model(std::vector<size_t> order, std::vector<double> compute, double gbps = 1.0, double overhead = 0) {
  CostModel m;
  m.copy_gbps = gbps;
  m.copy_overhead_ms = overhead;
  KindProfile k;
  k.kind = "dit";
  k.order = std::move(order);
  k.compute_ms = std::move(compute);
  m.kinds.push_back(std::move(k));
  return m;
}

KindPrediction run(const std::vector<PlanLayer>& layers, const std::vector<bool>& resident, const CostModel& m,
                   uint64_t ring, uint32_t max_ahead = kPrefetchAuto) {
  REQUIRE(m.usable());
  return predict_kind(m.kinds.at(0), layers, resident, m, ring, max_ahead);
}

}  // namespace

TEST_CASE("cost model: everything resident runs at compute speed") {
  const std::vector<PlanLayer> layers{layer("a", 5 * MB), layer("b", 5 * MB), layer("c", 5 * MB)};
  const CostModel m = model({0, 1, 2}, {1.0, 2.0, 3.0});
  const KindPrediction p = run(layers, {true, true, true}, m, 0);
  CHECK(p.kind == "dit");
  CHECK(p.step_ms == Approx(6.0).margin(kEps));  // 1 + 2 + 3, nothing to wait for
  CHECK(p.compute_ms == Approx(6.0).margin(kEps));
  CHECK(p.copy_ms == 0.0);
  CHECK(p.floor_ms == Approx(6.0).margin(kEps));
  CHECK(p.stall_ms == Approx(0.0).margin(kEps));
  // No copy rate is needed when nothing streams.
  CostModel no_rate = m;
  no_rate.copy_gbps = 0;
  CHECK(predict_kind(no_rate.kinds[0], layers, {true, true, true}, no_rate, 0).step_ms == Approx(6.0).margin(kEps));
}

TEST_CASE("cost model: all streamed and copy-bound runs at the floor") {
  // 4 layers of 2 MB: copies of 2 ms back to back, copy k ending at 2(k+1); compute (1 ms)
  // of position k waits for it: [2k+2, 2k+3]. The third forward is positions 8..11:
  // 25 - 17 = 8 ms = 4 copies, the floor; stall 8 - 4 = 4.
  const std::vector<PlanLayer> layers{layer("a", 2 * MB), layer("b", 2 * MB), layer("c", 2 * MB), layer("d", 2 * MB)};
  const CostModel m = model({0, 1, 2, 3}, {1, 1, 1, 1});
  const KindPrediction p = run(layers, {false, false, false, false}, m, 100 * MB);
  CHECK(p.step_ms == Approx(8.0).margin(kEps));
  CHECK(p.copy_ms == Approx(8.0).margin(kEps));
  CHECK(p.compute_ms == Approx(4.0).margin(kEps));
  CHECK(p.floor_ms == Approx(8.0).margin(kEps));
  CHECK(p.stall_ms == Approx(4.0).margin(kEps));
  // A 0.5 ms overhead per copy: 2.5 ms copies, the same argument gives 4 x 2.5 = 10.
  const CostModel slow = model({0, 1, 2, 3}, {1, 1, 1, 1}, 1.0, 0.5);
  const KindPrediction q = run(layers, {false, false, false, false}, slow, 100 * MB);
  CHECK(q.step_ms == Approx(10.0).margin(kEps));
  CHECK(q.copy_ms == Approx(10.0).margin(kEps));
  CHECK(q.floor_ms == Approx(10.0).margin(kEps));
  // 4 GB/s: 2 MB take 0.5 ms, so the compute (1 ms each) is the bound: copy k+1 runs
  // while k computes and the ring (100 MB) never fills. 4 ms, no stall.
  const CostModel fast = model({0, 1, 2, 3}, {1, 1, 1, 1}, 4.0);
  const KindPrediction r = run(layers, {false, false, false, false}, fast, 100 * MB);
  CHECK(r.copy_ms == Approx(2.0).margin(kEps));
  CHECK(r.step_ms == Approx(4.0).margin(kEps));
  CHECK(r.stall_ms == Approx(0.0).margin(kEps));
}

TEST_CASE("cost model: a one-slot ring serialises copy and compute") {
  // 3 streamed layers of 1 MB (copy 1 ms), compute 2 ms each, ring 1 MB: a copy waits for
  // the previous layer's compute to end (the ring is empty only then):
  // copy0 [0,1] comp0 [1,3] copy1 [3,4] comp1 [4,6] copy2 [6,7] comp2 [7,9] ...
  // 3 ms per position, 9 ms per forward of 3; compute 6, stall 3, floor max(6, 3) = 6.
  const std::vector<PlanLayer> layers{layer("a", MB), layer("b", MB), layer("c", MB)};
  const CostModel m = model({0, 1, 2}, {2, 2, 2});
  const std::vector<bool> streamed{false, false, false};
  const KindPrediction one = run(layers, streamed, m, MB);
  CHECK(one.step_ms == Approx(9.0).margin(kEps));
  CHECK(one.stall_ms == Approx(3.0).margin(kEps));
  CHECK(one.floor_ms == Approx(6.0).margin(kEps));
  // Two slots: copy1 [1,2] runs under comp0 [1,3]; copy2 waits for comp0's end: [3,4]
  // under comp1 [3,5]; from then on every copy hides: compute-bound, 6 ms.
  const KindPrediction two = run(layers, streamed, m, 2 * MB);
  CHECK(two.step_ms == Approx(6.0).margin(kEps));
  CHECK(two.stall_ms == Approx(0.0).margin(kEps));
}

TEST_CASE("cost model: max_ahead bounds how far copies run ahead") {
  // R (resident, 4 ms) then S1 S2 S3 (streamed 1 MB: copy 1 ms; compute 0.5 ms), big ring.
  const std::vector<PlanLayer> layers{layer("r", 9 * MB), layer("s1", MB), layer("s2", MB), layer("s3", MB)};
  const std::vector<bool> resident{true, false, false, false};
  const CostModel m = model({0, 1, 2, 3}, {4, 0.5, 0.5, 0.5});
  // Auto: in forward 1, R computes [5.5, 9.5]; the copies of S1..S3 start as soon as the
  // same positions of forward 0 have computed (4.5, 5, 5.5) and end by 7.5, all under R.
  // Step = compute = 4 + 1.5 = 5.5.
  const KindPrediction any = run(layers, resident, m, 100 * MB);
  CHECK(any.step_ms == Approx(5.5).margin(kEps));
  CHECK(any.stall_ms == Approx(0.0).margin(kEps));
  CHECK(run(layers, resident, m, 100 * MB, 3).step_ms == Approx(5.5).margin(kEps));  // 3 ahead is enough
  // max_ahead 1: while R computes only S1 (one streamed position ahead) is copied; S2's
  // copy waits for S1's acquire (= R's end), S3's for S2's. Forward 2: R [13, 17];
  // S1's copy [12.5, 13.5] (issued at S3's acquire of forward 1), comp [17, 17.5];
  // S2 copy [17, 18], comp [18, 18.5]; S3 copy [18, 19] (its acquire-bound is S2's acquire,
  // 17.5; the stream is busy until 18), comp [19, 19.5]. Step 19.5 - 13 = 6.5, stall 1.
  const KindPrediction one = run(layers, resident, m, 100 * MB, 1);
  CHECK(one.step_ms == Approx(6.5).margin(kEps));
  CHECK(one.stall_ms == Approx(1.0).margin(kEps));
  // max_ahead 0: every copy on demand, at its own acquire: 4 + 3 x (1 + 0.5) = 8.5.
  const KindPrediction none = run(layers, resident, m, 100 * MB, 0);
  CHECK(none.step_ms == Approx(8.5).margin(kEps));
  CHECK(none.stall_ms == Approx(3.0).margin(kEps));
}

TEST_CASE("cost model: copies for the next forward hide under this one's resident tail") {
  // S1 S2 (streamed 1 MB, compute 0.5) then R (resident, 3 ms). Forward 0: copies [0,1]
  // [1,2], S1 [1,1.5] S2 [2,2.5] R [2.5,5.5] (stalled 1.5 waiting for the first copies).
  // Forward 1's copies start at 2 and 3 (the copy stream, and forward 0's S1, S2 have
  // computed), end by 4, under forward 0's R: forward 1 is [5.5, 9.5], 4 ms = compute.
  const std::vector<PlanLayer> layers{layer("s1", MB), layer("s2", MB), layer("r", 9 * MB)};
  const std::vector<bool> resident{false, false, true};
  const CostModel m = model({0, 1, 2}, {0.5, 0.5, 3});
  const KindPrediction p = run(layers, resident, m, 100 * MB);
  CHECK(p.step_ms == Approx(4.0).margin(kEps));
  CHECK(p.stall_ms == Approx(0.0).margin(kEps));
  CHECK(p.floor_ms == Approx(4.0).margin(kEps));
  // With a one-slot ring S2's copy waits for S1's compute, in every forward: S1's copy
  // hides under the previous R (it starts once the previous S2 has computed), then
  // S1 [t, t+0.5], S2 copy [t+0.5, t+1.5], S2 [t+1.5, t+2], R [t+2, t+5]: 5 ms, stall 1.
  const KindPrediction small = run(layers, resident, m, MB);
  CHECK(small.step_ms == Approx(5.0).margin(kEps));
  CHECK(small.stall_ms == Approx(1.0).margin(kEps));
}

TEST_CASE("cost model: a slot larger than the ring is copied alone") {
  // A (1 MB) and B (3 MB), both streamed, compute 1 ms each, ring 2 MB. B does not fit
  // beside A, so it waits for an empty ring (A's compute end), and the next A waits for
  // B's: copy A 1, comp A 1, copy B 3, comp B 1 in series: 6 ms; compute 2, copy 4.
  const std::vector<PlanLayer> layers{layer("a", MB), layer("b", 3 * MB)};
  const CostModel m = model({0, 1}, {1, 1});
  const KindPrediction p = run(layers, {false, false}, m, 2 * MB);
  CHECK(p.step_ms == Approx(6.0).margin(kEps));
  CHECK(p.copy_ms == Approx(4.0).margin(kEps));
  CHECK(p.floor_ms == Approx(4.0).margin(kEps));
  CHECK(p.stall_ms == Approx(4.0).margin(kEps));
  // A ring of 0 bytes (nothing fits) serialises the same way.
  CHECK(run(layers, {false, false}, m, 0).step_ms == Approx(6.0).margin(kEps));
}

TEST_CASE("cost model: a layer called twice is copied at each position") {
  // Order X R X with X streamed (3 MB: copy 3 ms, compute 1) and R resident (2 ms): two
  // copies of X per forward, 6 ms against 4 ms of compute. Ring 10 MB (three X slots).
  // Forward 1: copy [6,9] for position 3 (after forward 0's copy [3,6]), X [9,10],
  // R [10,12], copy [9,12], X [12,13]; forward 2 from 13: copies [12,15] and [15,18],
  // X [15,16], R [16,18], X [18,19]: 19 - 13 = 6 = the copies, the floor. Stall 2.
  const std::vector<PlanLayer> layers{layer("x", 3 * MB), layer("r", 9 * MB)};
  const CostModel m = model({0, 1, 0}, {1, 2, 1});
  const KindPrediction p = run(layers, {false, true}, m, 10 * MB);
  CHECK(p.copy_ms == Approx(6.0).margin(kEps));
  CHECK(p.compute_ms == Approx(4.0).margin(kEps));
  CHECK(p.step_ms == Approx(6.0).margin(kEps));
  CHECK(p.floor_ms == Approx(6.0).margin(kEps));
  CHECK(p.stall_ms == Approx(2.0).margin(kEps));
}

TEST_CASE("cost model: predict covers every kind and weights them") {
  const std::vector<PlanLayer> layers{layer("a", MB), layer("b", MB)};
  CostModel m = model({0, 1}, {1, 2});
  KindProfile adapter;
  adapter.kind = "adapter";
  adapter.order = {1};
  adapter.compute_ms = {4};
  adapter.weight = 0.5;
  m.kinds.push_back(adapter);
  REQUIRE(m.usable());
  const auto all = predict(layers, {true, true}, m, 0);
  REQUIRE(all.size() == 2);
  CHECK(all[0].kind == "dit");
  CHECK(all[0].step_ms == Approx(3.0).margin(kEps));
  CHECK(all[1].kind == "adapter");
  CHECK(all[1].step_ms == Approx(4.0).margin(kEps));
  CHECK(weighted_step_ms(all, m) == Approx(3.0 + 0.5 * 4.0).margin(kEps));
  CHECK_THROWS_AS(weighted_step_ms({all[0]}, m), sluice::InvalidArgument);
  // An empty order predicts nothing.
  KindProfile empty;
  CHECK(predict_kind(empty, layers, {true, true}, m, 0).step_ms == 0.0);
}

TEST_CASE("cost model: usable and bad input") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_FALSE(CostModel{}.usable());
  CHECK(model({0}, {1}).usable());
  CHECK_FALSE(model({0}, {1}, 0.0).usable());
  CHECK_FALSE(model({0}, {1}, -1.0).usable());
  CHECK_FALSE(model({0}, {1}, nan).usable());
  CHECK_FALSE(model({0}, {1}, inf).usable());
  CHECK_FALSE(model({0}, {1}, 1.0, -0.1).usable());
  CHECK_FALSE(model({0}, {1}, 1.0, nan).usable());
  CHECK_FALSE(model({0, 1}, {1}).usable());  // lengths disagree
  CHECK_FALSE(model({0}, {-1}).usable());
  CHECK_FALSE(model({0}, {nan}).usable());
  CHECK_FALSE(model({0}, {inf}).usable());
  CostModel weightless = model({0}, {1});
  weightless.kinds[0].weight = 0;
  CHECK_FALSE(weightless.usable());
  weightless.kinds[0].weight = -1;
  CHECK_FALSE(weightless.usable());
  CostModel no_kinds = model({0}, {1});
  no_kinds.kinds.clear();
  CHECK_FALSE(no_kinds.usable());

  const std::vector<PlanLayer> layers{layer("a", MB)};
  const CostModel m = model({0}, {1});
  CHECK_THROWS_AS(predict_kind(m.kinds[0], layers, {false, false}, m, MB), sluice::InvalidArgument);
  const CostModel out_of_range = model({3}, {1});
  CHECK_THROWS_WITH(predict_kind(out_of_range.kinds[0], layers, {false}, out_of_range, MB),
                    Catch::Contains("names layer 3"));
  const CostModel negative = model({0}, {-2});
  CHECK_THROWS_AS(predict_kind(negative.kinds[0], layers, {true}, negative, MB), sluice::InvalidArgument);
  const CostModel no_rate = model({0}, {1}, 0.0);
  CHECK_THROWS_WITH(predict_kind(no_rate.kinds[0], layers, {false}, no_rate, MB), Catch::Contains("copy rate"));
}
