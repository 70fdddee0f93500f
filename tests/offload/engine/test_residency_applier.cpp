// ResidencyApplier (offload/engine/residency_applier.h) on its own, without the streaming engine:
// a small toy model's layers on the CPU device, plans given by hand, the ring a callback
// that records what it was asked for. Checks exact ledger bytes, where each layer's stored
// tensors point, the residency_h2d and pinned counters, and the degraded and undo paths of
// Note [residency applier].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "offload/device/cpu_device.h"
#include "offload/device/device.h"
#include "offload/engine/layer_record.h"
#include "offload/engine/residency_applier.h"
#include "runtime/error.h"
#include "runtime/fault_injection.h"
#include "runtime/logging.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice;
using namespace sluice::offload;

namespace {

constexpr uint32_t kRingSlots = 3;

uint64_t device_nbytes(const LayerRecord& r) {
  uint64_t n = r.host_w.nbytes();
  if (r.host_b.defined()) n += r.host_b.nbytes();
  if (r.host_s.defined()) n += r.host_s.nbytes();
  return n;
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

fault::Trigger from_nth(uint64_t n) {
  fault::Trigger t;
  t.nth = n;
  t.count = std::numeric_limits<uint64_t>::max();
  return t;
}

// Device first: it outlives the model and the records holding its tensors.
struct Rig {
  std::unique_ptr<DeviceBackend> device = make_cpu_device();
  testing::ToyModel model;
  std::vector<LayerRecord> layers;
  std::vector<const void*> host_w, host_b, host_s;  // where the stored tensors were before attaching
  std::vector<at::Tensor> bytes_w, bytes_b, bytes_s;  // and clones of their bytes
  std::shared_ptr<MemoryLedger> budget = std::make_shared<MemoryLedger>("test budget", std::nullopt);
  ResidencyApplier applier;
  std::vector<uint64_t> rings;  // capacities the applier asked for

  explicit Rig(ResidencyApplierOptions options = {false, nullptr, kRingSlots}, int blocks = 3)
      : model(toy(blocks)), applier(*device, options) {
    for (const auto& [name, layer] : managed_layers(*model)) {
      layers.push_back(describe_layer(name, *layer));
      host_w.push_back(layer->stored_weight().data_ptr());
      host_b.push_back(layer->has_bias() ? layer->stored_bias().data_ptr() : nullptr);
      host_s.push_back(layer->weight_scale().defined() ? layer->weight_scale().data_ptr() : nullptr);
      bytes_w.push_back(layer->stored_weight().clone());
      bytes_b.push_back(layer->has_bias() ? layer->stored_bias().clone() : at::Tensor());
      bytes_s.push_back(layer->weight_scale().defined() ? layer->weight_scale().clone() : at::Tensor());
    }
    applier.begin_model("toy", budget);
  }
  ~Rig() {
    for (auto& r : layers) applier.make_streamed(r);
  }
  static testing::ToyOptions toy(int blocks) {
    testing::ToyOptions o;
    o.blocks = blocks;
    return o;
  }

  ResidencyPlan plan(const std::vector<bool>& resident, uint64_t ring_bytes = 0) const {
    ResidencyPlan p;
    p.resident = resident;
    p.ring_bytes = ring_bytes;
    return p;
  }
  ResidencyApplier::Applied apply(const ResidencyPlan& p) {
    return applier.apply(layers, p, [this](uint64_t capacity) { rings.push_back(capacity); });
  }
  uint64_t resident_ledger() const { return static_cast<uint64_t>(budget->stats().kind(MemoryKind::resident).current); }

  // Every layer is where `resident` says, with the ledger holding exactly those layers.
  void check_placement(const std::vector<bool>& resident) const {
    uint64_t expected = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      const LayerRecord& r = layers[i];
      INFO("layer " << r.name);
      REQUIRE(r.resident == resident[i]);
      const at::Tensor& w = r.layer->stored_weight();
      if (r.resident) {
        expected += device_nbytes(r);
        CHECK(w.data_ptr() == r.dev_w.data_ptr());
        CHECK(w.data_ptr() != host_w[i]);
        CHECK(same_bytes(r.dev_w, r.host_w));
        if (r.host_b.defined()) {
          CHECK(r.layer->stored_bias().data_ptr() == r.dev_b.data_ptr());
          CHECK(same_bytes(r.dev_b, r.host_b));
        }
        if (r.host_s.defined()) {
          CHECK(r.layer->weight_scale().data_ptr() == r.dev_s.data_ptr());
          CHECK(same_bytes(r.dev_s, r.host_s));
        }
      } else {
        // The record's host copies: the original host tensors, or their copies in the
        // pinned arena; never device copies.
        CHECK(!r.dev_w.defined());
        CHECK(w.data_ptr() == r.host_w.data_ptr());
        CHECK(same_bytes(w, bytes_w[i]));
        const bool original = !r.pinned;
        CHECK(r.pinned == applier.arena().holds(r.host_w));
        if (original) CHECK(w.data_ptr() == host_w[i]);
        if (host_b[i]) {
          CHECK(r.layer->stored_bias().data_ptr() == r.host_b.data_ptr());
          CHECK(same_bytes(r.host_b, bytes_b[i]));
          if (original) CHECK(r.host_b.data_ptr() == host_b[i]);
        }
        if (host_s[i]) {
          CHECK(r.layer->weight_scale().data_ptr() == r.host_s.data_ptr());
          CHECK(same_bytes(r.host_s, bytes_s[i]));
          if (original) CHECK(r.host_s.data_ptr() == host_s[i]);
        }
      }
    }
    CHECK(resident_ledger() == expected);
    CHECK(budget->current() == expected);
  }

  uint64_t stored_bytes_where(const std::vector<bool>& a, const std::vector<bool>& not_b) const {
    uint64_t n = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      if (a[i] && !not_b[i]) n += layers[i].stored_bytes;
    }
    return n;
  }
  uint64_t largest_streamed_slot() const {
    uint64_t s = 0;
    for (const auto& r : layers) {
      if (!r.resident) s = std::max(s, r.slot_bytes);
    }
    return s;
  }
};

std::vector<size_t> indices(const std::vector<bool>& v, const std::vector<bool>& except) {
  std::vector<size_t> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] && !except[i]) out.push_back(i);
  }
  return out;
}

}  // namespace

TEST_CASE("residency applier: a plan makes exactly its layers resident with exact ledger bytes", "[strict]") {
  Rig rig;
  const size_t n = rig.layers.size();
  REQUIRE(n == 11);  // x_embedder, 3 blocks of 3, final_layer
  std::vector<bool> resident(n, false);
  for (size_t i = 0; i < n; i += 2) resident[i] = true;
  const std::vector<bool> none(n, false);

  const auto applied = rig.apply(rig.plan(resident, 12345));
  CHECK_FALSE(applied.is_degraded());
  CHECK(applied.degraded.empty());
  CHECK(applied.promoted == indices(resident, none));
  rig.check_placement(resident);
  REQUIRE(rig.rings == std::vector<uint64_t>{12345});  // the plan's ring, once

  const uint64_t bytes = rig.stored_bytes_where(resident, none);
  CHECK(bytes == rig.resident_ledger());  // stored bytes are what the device holds
  CHECK(rig.applier.residency_h2d().current == static_cast<int64_t>(bytes));
  CHECK(rig.applier.residency_h2d().allocated == static_cast<int64_t>(bytes));
  CHECK(rig.applier.residency_h2d().freed == 0);
  CHECK(rig.applier.pinned().current == 0);  // pinning off

  // Streamed slot size and a plan rebuilt from the records.
  CHECK(streamed_slot_bytes(rig.layers) == rig.largest_streamed_slot());
  ResidencyPlan p = rig.plan(std::vector<bool>(n, true));
  plan_from_layers(p, rig.layers, 1000, kRingSlots);
  CHECK(p.resident == resident);
  CHECK(p.resident_bytes == 1000 + bytes);
  CHECK(p.streamed_bytes == rig.stored_bytes_where(std::vector<bool>(n, true), resident));
  CHECK(p.slot_bytes == rig.largest_streamed_slot());
  CHECK(p.ring_slots == kRingSlots);
  CHECK(p.ring_bytes == kRingSlots * rig.largest_streamed_slot());

  // Nothing streams: no ring asked for.
  rig.rings.clear();
  const auto all = rig.apply(rig.plan(std::vector<bool>(n, true), 0));
  CHECK(rig.rings.empty());
  CHECK(all.promoted == indices(std::vector<bool>(n, true), resident));
  rig.check_placement(std::vector<bool>(n, true));
  CHECK(streamed_slot_bytes(rig.layers) == 0);
}

TEST_CASE("residency applier: a different plan moves only the difference", "[strict]") {
  Rig rig;
  const size_t n = rig.layers.size();
  std::vector<bool> a(n, false), b(n, false);
  for (size_t i = 0; i < n; ++i) {
    a[i] = i < 6;
    b[i] = i >= 3 && i < 9;
  }
  rig.apply(rig.plan(a, 100));
  rig.check_placement(a);
  std::vector<const void*> dev_before(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    if (rig.layers[i].resident) dev_before[i] = rig.layers[i].dev_w.data_ptr();
  }
  const Stat h2d = rig.applier.residency_h2d();

  const auto applied = rig.apply(rig.plan(b, 200));
  CHECK_FALSE(applied.is_degraded());
  CHECK(applied.promoted == indices(b, a));  // only the layers new to the device
  rig.check_placement(b);
  const Stat& now = rig.applier.residency_h2d();
  CHECK(now.allocated - h2d.allocated == static_cast<int64_t>(rig.stored_bytes_where(b, a)));
  CHECK(now.freed - h2d.freed == static_cast<int64_t>(rig.stored_bytes_where(a, b)));
  CHECK(now.current == static_cast<int64_t>(rig.stored_bytes_where(b, std::vector<bool>(n, false))));
  for (size_t i = 0; i < n; ++i) {
    if (a[i] && b[i]) CHECK(rig.layers[i].dev_w.data_ptr() == dev_before[i]);  // kept, not copied again
  }
  CHECK(rig.rings == std::vector<uint64_t>{100, 200});

  // The same plan again moves nothing.
  const Stat before = rig.applier.residency_h2d();
  const auto again = rig.apply(rig.plan(b, 200));
  CHECK(again.promoted.empty());
  CHECK(rig.applier.residency_h2d().allocated == before.allocated);
  CHECK(rig.applier.residency_h2d().freed == before.freed);
  rig.check_placement(b);
}

TEST_CASE("residency applier: out of device memory while promoting degrades to the layers that made it", "[strict]") {
  Rig rig;
  const size_t n = rig.layers.size();
  const std::vector<bool> all(n, true);
  // Allocations are made layer by layer (weight, bias, scale): the 4th fails, the bias of
  // the second layer, after its weight was allocated.
  uint64_t hits = 0;
  size_t made = 0;
  for (const auto& r : rig.layers) {
    hits += 1 + (r.host_b.defined() ? 1 : 0) + (r.host_s.defined() ? 1 : 0);
    if (hits >= 4) break;
    ++made;
  }
  REQUIRE(made == 1);
  std::vector<bool> expected(n, false);
  for (size_t i = 0; i < made; ++i) expected[i] = true;

  const uint64_t warnings = log::message_count(log::Level::warn);
  ResidencyApplier::Applied applied;
  {
    fault::ScopedFault f("device.alloc.resident", from_nth(4));
    applied = rig.apply(rig.plan(all, 0));
    CHECK(f.fired() == 1);  // the first failure stops the promotions
  }
  REQUIRE(applied.is_degraded());
  CHECK(applied.degraded.find("injected fault") != std::string::npos);
  CHECK(applied.promoted == std::vector<size_t>{0});
  rig.check_placement(expected);
  CHECK(rig.applier.residency_h2d().current == static_cast<int64_t>(rig.layers[0].stored_bytes));
  // The ring is sized for what streams instead of the plan's (none).
  CHECK(rig.rings == std::vector<uint64_t>{kRingSlots * rig.largest_streamed_slot()});
  CHECK(log::message_count(log::Level::warn) == warnings);  // the caller warns, with its plan

  ResidencyPlan p = rig.plan(all);
  plan_from_layers(p, rig.layers, 0, kRingSlots);
  CHECK(p.resident == expected);
}

TEST_CASE("residency applier: a degraded ring that does not fit gives back residency until it does", "[strict]") {
  Rig rig;
  const size_t n = rig.layers.size();
  std::vector<bool> plan(n, false);
  for (size_t i = 0; i < 6; ++i) plan[i] = true;
  // Two allocations per layer (weight and bias, or weight and scale); fail from the 12th
  // on: layers 0..4 fit (10 allocations), the scale of layer 5 (blocks.1.mid) fails.
  ResidencyApplier::Applied applied;
  int refusals = 2;
  std::vector<uint64_t> asked;
  {
    fault::ScopedFault f("device.alloc.resident", from_nth(12));
    applied = rig.applier.apply(rig.layers, rig.plan(plan, 0), [&](uint64_t capacity) {
      asked.push_back(capacity);
      if (refusals-- > 0) throw ResourceError("ring of " + std::to_string(capacity) + " does not fit (test)");
    });
  }
  REQUIRE(applied.is_degraded());
  REQUIRE(asked.size() == 3);
  // Five layers made it before the fault; two were given back for the ring.
  CHECK(applied.promoted == std::vector<size_t>{0, 1, 2});
  std::vector<bool> expected(n, false);
  expected[0] = expected[1] = expected[2] = true;
  rig.check_placement(expected);
  CHECK(asked.back() == kRingSlots * rig.largest_streamed_slot());
  CHECK(rig.applier.residency_h2d().current ==
        static_cast<int64_t>(rig.stored_bytes_where(expected, std::vector<bool>(n, false))));
}

TEST_CASE("residency applier: a ring that never fits undoes the promotions and throws", "[strict]") {
  Rig rig;
  const size_t n = rig.layers.size();
  std::vector<bool> first(n, false), plan(n, false);
  first[0] = true;
  rig.apply(rig.plan(first, 10));
  for (size_t i = 0; i < 5; ++i) plan[i] = true;
  const Stat h2d = rig.applier.residency_h2d();
  CHECK_THROWS_AS(rig.applier.apply(rig.layers, rig.plan(plan, 50),
                                    [](uint64_t) { throw ResourceError("no room for a ring (test)"); }),
                  ResourceError);
  // What this call promoted is streamed again; layer 0, resident before, stays.
  rig.check_placement(first);
  CHECK(rig.applier.residency_h2d().current == h2d.current);
  CHECK(rig.applier.residency_h2d().allocated - h2d.allocated == rig.applier.residency_h2d().freed - h2d.freed);
}

TEST_CASE("residency applier: a failed copy while promoting undoes the promotions and throws", "[strict]") {
  Rig rig;
  const size_t n = rig.layers.size();
  std::vector<bool> first(n, false), plan(n, false);
  first[n - 1] = true;
  rig.apply(rig.plan(first, 10));
  plan[n - 1] = true;  // stays resident
  for (size_t i = 0; i < 4; ++i) plan[i] = true;
  {
    fault::ScopedFault f("copy.h2d", from_nth(2));
    CHECK_THROWS_AS(rig.apply(rig.plan(plan, 20)), DeviceError);
    CHECK(f.fired() >= 1);
  }
  rig.check_placement(first);
  CHECK(rig.rings == std::vector<uint64_t>{10});  // no ring for the failed plan
  // Usable afterwards.
  rig.apply(rig.plan(plan, 30));
  rig.check_placement(plan);
}

TEST_CASE("residency applier: pinning stops at the arena's limit, counted, with one warning", "[strict]") {
  Rig probe;
  const size_t n = probe.layers.size();
  std::vector<bool> resident(n, false);
  resident[0] = resident[n - 1] = true;  // never pinned
  // A limit that holds some of the streamed layers and not all.
  uint64_t streamed = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!resident[i]) streamed += probe.layers[i].stored_bytes;
  }
  const uint64_t limit = streamed / 2;
  auto arena = std::make_shared<PinnedArena>(limit);
  Rig rig({true, arena, kRingSlots});
  REQUIRE(rig.applier.pinning());

  const uint64_t warnings = log::message_count(log::Level::warn);
  rig.apply(rig.plan(resident, 10));
  uint64_t pinned = 0;
  size_t unpinned_streamed = 0;
  bool stopped = false;
  for (size_t i = 0; i < n; ++i) {
    const LayerRecord& r = rig.layers[i];
    INFO("layer " << r.name);
    if (resident[i]) {
      CHECK_FALSE(r.pinned);
      continue;
    }
    const uint64_t footprint =
        PinnedArena::footprint(r.host_w) + PinnedArena::footprint(r.host_b) + PinnedArena::footprint(r.host_s);
    stopped = stopped || pinned + footprint > limit;  // in order: the first that passes stops the rest
    CHECK(r.pinned == !stopped);
    if (!stopped) {
      pinned += r.stored_bytes;
    } else {
      ++unpinned_streamed;
    }
  }
  REQUIRE(unpinned_streamed > 0);
  REQUIRE(pinned > 0);
  CHECK(rig.applier.pinned().current == static_cast<int64_t>(pinned));
  CHECK(static_cast<uint64_t>(arena->pinned().current) <= limit);
  CHECK(arena->used_bytes() == pinned);
  CHECK(rig.applier.pinned_bytes() == static_cast<uint64_t>(arena->pinned().current));  // only this model's
  CHECK(log::message_count(log::Level::warn) == warnings + 1);  // the limit, once
  rig.check_placement(resident);

  // Again: nothing pinned twice, no second warning.
  rig.apply(rig.plan(resident, 10));
  CHECK(rig.applier.pinned().current == static_cast<int64_t>(pinned));
  CHECK(rig.applier.pinned().allocated == static_cast<int64_t>(pinned));
  CHECK(arena->used_bytes() == pinned);
  CHECK(log::message_count(log::Level::warn) == warnings + 1);

  // The model is detached: the counters of the applier go, the pinned copies stay with the model.
  rig.applier.end_model();
  CHECK(rig.applier.pinned().current == 0);
  CHECK(rig.applier.pinned_bytes() == 0);
  CHECK(arena->used_bytes() == pinned);
}

TEST_CASE("residency applier: a pinning failure turns pinning off with one warning", "[strict]") {
  Rig rig({true, nullptr, kRingSlots});
  const size_t n = rig.layers.size();
  const uint64_t warnings = log::message_count(log::Level::warn);
  {
    fault::ScopedFault f("host.pin", from_nth(1));
    rig.apply(rig.plan(std::vector<bool>(n, false), 10));
    CHECK(f.fired() == 1);  // one chunk asked for (the toy's layers fit one), then pinning is off
    rig.apply(rig.plan(std::vector<bool>(n, false), 10));
    CHECK(f.fired() == 1);
  }
  CHECK_FALSE(rig.applier.pinning());
  CHECK(log::message_count(log::Level::warn) == warnings + 1);
  for (const auto& r : rig.layers) CHECK_FALSE(r.pinned);
  CHECK(rig.applier.pinned().current == 0);
  CHECK(rig.applier.arena().pinned().current == 0);  // the reservation was given back
  rig.check_placement(std::vector<bool>(n, false));
}

TEST_CASE("residency applier: promotion, demotion and a new model's records copy no pinned layer again", "[strict]") {
  auto arena = std::make_shared<PinnedArena>(std::numeric_limits<uint64_t>::max());
  Rig rig({true, arena, kRingSlots});
  const size_t n = rig.layers.size();
  std::vector<bool> none(n, false), some(n, false);
  for (size_t i = 0; i < n; i += 3) some[i] = true;
  rig.apply(rig.plan(none, 10));
  const uint64_t chunks = arena->chunks();
  const Stat pinned = arena->pinned();
  REQUIRE(chunks >= 1);
  std::vector<const void*> where;
  for (const auto& r : rig.layers) {
    REQUIRE(r.pinned);
    where.push_back(r.host_w.data_ptr());
  }
  // Promotion: the host copies stay pinned and counted. (check_placement() would compare
  // with the original host pointers, which were freed when the layers were pinned.)
  rig.apply(rig.plan(some, 10));
  for (size_t i = 0; i < n; ++i) {
    const LayerRecord& r = rig.layers[i];
    CHECK(r.resident == some[i]);
    CHECK(r.pinned);
    CHECK(r.host_w.data_ptr() == where[i]);
    CHECK(r.layer->stored_weight().data_ptr() == (some[i] ? r.dev_w.data_ptr() : where[i]));
  }
  CHECK(arena->pinned().allocated == pinned.allocated);
  rig.apply(rig.plan(none, 10));  // demotion: back to the same pinned copies
  rig.check_placement(none);
  // A re-attach: new records of the same model find their layers in the arena.
  rig.applier.end_model();
  rig.applier.begin_model("toy", rig.budget);
  for (auto& r : rig.layers) r = describe_layer(r.name, *r.layer);
  rig.apply(rig.plan(some, 10));
  for (size_t i = 0; i < n; ++i) {
    CHECK(rig.layers[i].pinned);
    CHECK(rig.layers[i].host_w.data_ptr() == where[i]);
  }
  CHECK(arena->chunks() == chunks);
  CHECK(arena->pinned().allocated == pinned.allocated);  // nothing pinned again
  CHECK(rig.applier.pinned_bytes() == static_cast<uint64_t>(pinned.current));
  uint64_t stored = 0;
  for (const auto& r : rig.layers) stored += r.stored_bytes;
  CHECK(rig.applier.pinned().current == static_cast<int64_t>(stored));  // resident ones keep theirs
}
