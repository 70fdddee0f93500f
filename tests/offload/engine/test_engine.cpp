#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <map>
#include <regex>
#include <set>

#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "runtime/error.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"
#include "tests/support/counting_device.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice::offload;
using sluice::testing::ToyModel;
using sluice::testing::ToyOptions;

namespace {

constexpr uint64_t MiB = 1ull << 20;

at::Tensor input(int64_t dim = 64, uint64_t seed = 42) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn({4, dim}, gen);
}

// Per-layer facts of the plain model, to compare against after the engine ran.
struct Snapshot {
  std::map<std::string, at::ScalarType> dtype;
  std::map<std::string, const void*> data;
  std::map<std::string, at::Tensor> value;
  uint64_t stored_bytes = 0;
};

Snapshot snapshot(ToyModel& m) {
  Snapshot s;
  for (auto& [name, l] : managed_layers(*m)) {
    s.dtype[name] = l->stored_weight().scalar_type();
    s.data[name] = l->stored_weight().data_ptr();
    s.value[name] = l->stored_weight().clone();
    s.stored_bytes += static_cast<uint64_t>(l->stored_bytes());
  }
  return s;
}

void check_stored_dtypes(ToyModel& m, const Snapshot& s) {
  for (auto& [name, l] : managed_layers(*m)) {
    INFO(name);
    CHECK(l->stored_weight().scalar_type() == s.dtype.at(name));
  }
}

std::shared_ptr<DeviceBackend> slowed_cpu(double latency_us = 50, double bytes_per_second = 400e6) {
  CpuDeviceOptions o;
  o.copy_latency_us = latency_us;
  o.copy_bytes_per_second = bytes_per_second;
  return sluice::testing::test_device_or_cpu(o);
}

// A fixed plan: these tests count bytes per forward against engine.plan(), which a plan
// from measurements would change after the first forward (tested on its own below).
EngineOptions options(std::shared_ptr<DeviceBackend> dev, uint64_t budget = 64 * MiB) {
  EngineOptions o;
  o.device = std::move(dev);
  o.budget_bytes = budget;
  o.working_memory_bytes = 1 * MiB;
  o.plan_from_measurements = false;
  return o;
}

at::Tensor run(StreamingEngine& e, ToyModel& m, const at::Tensor& x, std::string_view kind = "") {
  ForwardScope scope(e, kind);
  // Inputs go to the engine's device and the output comes back, so that references
  // computed on the host compare on any device (SLUICE_TEST_DEVICE).
  return m->forward(x.to(e.device().device())).cpu();
}

uint64_t streamed_bytes(const StreamingEngine& e) { return e.plan().streamed_bytes; }

// The most device memory alive at once since the device was made (or its peak reset), as
// the CPU device's allocator counts it: independent of the ledgers that enforce budgets.
uint64_t alive_peak(const DeviceBackend& dev) {
  const DeviceBackend::AllocatorStats a = dev.allocator_stats();
  REQUIRE(a.available);
  return static_cast<uint64_t>(a.peak_bytes);
}

// The "(N bytes" of a budget error.
uint64_t minimum_from(const std::string& msg) {
  std::smatch m;
  REQUIRE(std::regex_search(msg, m, std::regex(R"(\((\d+) bytes)")));
  return std::stoull(m[1].str());
}

}  // namespace

TEST_CASE("engine: outputs are bit-identical to the plain model for every depth and cap and policy",
          "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const Snapshot before = snapshot(model);
  for (uint32_t depth : {0u, 1u, 2u, 3u, 4u, kPrefetchAuto}) {
    for (double cap : {0.0, 0.25, 0.5, 1.0}) {
      for (auto policy : {ResidencyPolicy::balanced, ResidencyPolicy::spread, ResidencyPolicy::front_first}) {
        INFO("depth " << prefetch_name(depth) << " max_resident " << cap << " policy " << residency_policy_name(policy));
        EngineOptions o = options(slowed_cpu());
        o.prefetch_depth = depth;
        o.max_resident = cap;
        o.policy = policy;
        StreamingEngine engine(o);
        engine.attach(*model, "toy");
        if (cap == 1.0) CHECK(engine.plan().streamed_count() == 0);
        if (cap == 0.0) CHECK(engine.plan().streamed_count() == 25);  // every block layer and x_embedder
        for (int f = 0; f < 3; ++f) {
          const at::Tensor out = run(engine, model, x);
          CHECK(at::equal(out, ref));
          check_stored_dtypes(model, before);
        }
        const EngineStats s = engine.stats();
        REQUIRE(s.forward_records.size() == 3);
        for (const auto& r : s.forward_records) {
          CHECK(r.bytes_streamed == streamed_bytes(engine));
          CHECK_FALSE(r.diverged);
        }
        if (depth > 0 && engine.plan().streamed_count() > 0) {
          // Once the order is recorded every copy is a prefetch.
          CHECK(s.forward_records[1].demand_copies == 0);
          CHECK(s.forward_records[2].demand_copies == 0);
        }
        if (depth == 0) CHECK(s.forward_records[2].demand_copies == engine.plan().streamed_count());
        CHECK(s.slot_violations == 0);
        CHECK(alive_peak(engine.device()) <= o.budget_bytes - o.working_memory_bytes);
        engine.detach();
        CHECK(at::equal(model->forward(x), ref));
      }
    }
  }
}

TEST_CASE("engine: bf16, fp16 and fp32 storage stream like fp8, bit-identical", "[strict][accel]") {
  // The toy computes in fp32: fp32 storage streams the weights themselves (no upcast, the
  // slot is read directly); bf16 and fp16 are upcast from the slot like fp8.
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    ToyOptions to;
    to.storage = dtype;
    ToyModel model(to);
    const at::Tensor x = input();
    const at::Tensor ref = model->forward(x);
    const Snapshot before = snapshot(model);
    for (double cap : {0.0, 0.5}) {
      for (uint32_t depth : {kPrefetchAuto, 1u}) {
        INFO(c10::toString(dtype) << " max_resident " << cap << " prefetch " << prefetch_name(depth));
        EngineOptions o = options(slowed_cpu());
        o.max_resident = cap;
        o.prefetch_depth = depth;
        StreamingEngine engine(o);
        engine.attach(*model, "toy");
        // Only the declared layer (final_layer) is required: the block layers and the
        // unconverted x_embedder stream.
        if (cap == 0.0) {
          CHECK(engine.plan().streamed_count() == 25);
          CHECK_FALSE(engine.is_resident("x_embedder"));
        } else {
          CHECK(engine.plan().streamed_count() >= 10);
        }
        for (int f = 0; f < 3; ++f) {
          CHECK(at::equal(run(engine, model, x), ref));
          check_stored_dtypes(model, before);
        }
        const EngineStats s = engine.stats();
        for (const auto& r : s.forward_records) CHECK(r.bytes_streamed == streamed_bytes(engine));
        CHECK(s.forward_records.back().demand_copies == 0);
        CHECK(s.slot_violations == 0);
        engine.detach();
      }
    }
  }
}

TEST_CASE("engine: device use stays within budget minus working memory at tight budgets", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  uint64_t minimum = 0;
  {
    StreamingEngine probe(options(slowed_cpu()));
    probe.attach(*model, "toy");
    minimum = probe.minimum_budget();
  }
  const Snapshot before = snapshot(model);
  for (uint64_t extra : {0ull, 10000ull, 40000ull, 100000ull, 1000000ull}) {
    INFO("budget minimum + " << extra);
    auto dev = slowed_cpu();
    EngineOptions o = options(dev, minimum + extra);
    StreamingEngine engine(o);
    engine.attach(*model, "toy");
    for (int f = 0; f < 3; ++f) CHECK(at::equal(run(engine, model, x), ref));
    const uint64_t limit = o.budget_bytes - o.working_memory_bytes;
    const EngineStats s = engine.stats();
    // Counted by the allocator, not by the ledger that refuses allocations past the limit.
    CHECK(alive_peak(*dev) <= sluice::testing::allocator_bound(*dev, limit, o.working_memory_bytes));
    CHECK(s.device_memory.kind(MemoryKind::scratch).current > 0);
    CHECK(s.device_memory.kind(MemoryKind::params).current == 2 * 64 * 4);  // norm_weight + shift
    CHECK(static_cast<uint64_t>(s.device_memory.total.current) == engine.device_bytes());
    engine.detach();
    CHECK(dev->memory_stats().total.current == 0);
  }
  check_stored_dtypes(model, before);
}

TEST_CASE("engine: an impossible budget names the minimum and leaves the model untouched", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const Snapshot before = snapshot(model);
  std::string msg;
  try {
    StreamingEngine engine(options(slowed_cpu(), 1 * MiB + 1000));
    engine.attach(*model, "toy");
    FAIL("attach accepted a budget below the minimum");
  } catch (const sluice::ResourceError& e) {
    msg = e.what();
  }
  CHECK(msg.find("'toy'") != std::string::npos);
  const uint64_t minimum = minimum_from(msg);
  CHECK(msg.find(sluice::format_mib(minimum)) != std::string::npos);
  for (auto& [name, l] : managed_layers(*model)) {
    CHECK(l->provider() == nullptr);
    CHECK(l->stored_weight().data_ptr() == before.data.at(name));
  }
  CHECK(at::equal(model->forward(x), ref));
  {
    StreamingEngine engine(options(slowed_cpu(), minimum - 1));
    CHECK_THROWS_AS(engine.attach(*model, "toy"), sluice::ResourceError);
  }
  StreamingEngine engine(options(slowed_cpu(), minimum));
  engine.attach(*model, "toy");
  CHECK(engine.minimum_budget() == minimum);
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(at::equal(run(engine, model, x), ref));
}

TEST_CASE("engine: a layer that throws mid-forward leaves the engine consistent", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const Snapshot before = snapshot(model);
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.0;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(at::equal(run(engine, model, x), ref));
  model->block_list[4]->fail_in_mid = true;
  CHECK_THROWS_WITH(run(engine, model, x), Catch::Contains("blocks.4.mid"));
  model->block_list[4]->fail_in_mid = false;
  check_stored_dtypes(model, before);
  for (int f = 0; f < 3; ++f) {
    CHECK(at::equal(run(engine, model, x), ref));
    check_stored_dtypes(model, before);
  }
  const EngineStats s = engine.stats();
  REQUIRE(s.forward_records.size() == 6);
  CHECK(s.forward_records[2].aborted);
  for (size_t i : {3u, 4u, 5u}) CHECK(s.forward_records[i].bytes_streamed == streamed_bytes(engine));
  CHECK_FALSE(s.forward_records[4].diverged);
  CHECK(s.slot_violations == 0);
}

TEST_CASE("engine: the layer progress callback counts each forward's layers against the recorded order",
          "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.5;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  std::vector<std::pair<int64_t, int64_t>> calls;
  engine.set_layer_progress([&](int64_t done, int64_t expected) { calls.emplace_back(done, expected); });
  CHECK(at::equal(run(engine, model, x), ref));
  // The first forward of a kind has no recorded order: the count is unknown (0).
  REQUIRE(!calls.empty());
  const auto layers = static_cast<int64_t>(calls.size());
  for (int64_t i = 0; i < layers; ++i) CHECK(calls[static_cast<size_t>(i)] == std::make_pair(i + 1, int64_t{0}));
  calls.clear();
  CHECK(at::equal(run(engine, model, x), ref));
  REQUIRE(static_cast<int64_t>(calls.size()) == layers);
  for (int64_t i = 0; i < layers; ++i) CHECK(calls[static_cast<size_t>(i)] == std::make_pair(i + 1, layers));
  // A throwing callback is logged once and turned off: the forward is unharmed.
  const uint64_t warnings = sluice::log::message_count(sluice::log::Level::warn);
  engine.set_layer_progress([](int64_t, int64_t) { throw std::runtime_error("display gone"); });
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(sluice::log::message_count(sluice::log::Level::warn) - warnings == 1);
  // Turned off: not called.
  calls.clear();
  engine.set_layer_progress({});
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(calls.empty());
}

namespace {

// Delegates to the engine, but fails one layer's acquire after the engine served it.
class FaultyProvider final : public WeightProvider {
 public:
  FaultyProvider(StreamingEngine& e, std::string fail) : engine_(e), fail_(std::move(fail)) {}
  LayerWeights acquire(ManagedLayerImpl& layer) override {
    LayerWeights w = engine_.acquire(layer);
    if (armed && layer.qualified_name() == fail_) {
      engine_.release(layer);
      throw std::runtime_error("injected acquire failure in " + fail_);
    }
    return w;
  }
  void release(ManagedLayerImpl& layer) noexcept override { engine_.release(layer); }
  bool armed = true;

 private:
  StreamingEngine& engine_;
  std::string fail_;
};

}  // namespace

TEST_CASE("engine: a failing acquire through a provider wrapper is recovered", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const Snapshot before = snapshot(model);
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.5;
  o.prefetch_depth = 3;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  CHECK(at::equal(run(engine, model, x), ref));
  FaultyProvider faulty(engine, "blocks.6.up");
  for (auto& [name, l] : managed_layers(*model)) l->set_provider(&faulty);
  CHECK_THROWS_WITH(run(engine, model, x), Catch::Contains("injected acquire failure"));
  check_stored_dtypes(model, before);
  faulty.armed = false;
  for (int f = 0; f < 3; ++f) CHECK(at::equal(run(engine, model, x), ref));
  const EngineStats s = engine.stats();
  REQUIRE(s.forward_records.size() == 5);
  CHECK(s.forward_records[1].aborted);
  CHECK(s.forward_records[3].bytes_streamed == streamed_bytes(engine));
  CHECK(s.forward_records[4].bytes_streamed == streamed_bytes(engine));
  CHECK(s.forward_records[4].demand_copies == 0);
  engine.detach();
  for (auto& [name, l] : managed_layers(*model)) CHECK(l->provider() == nullptr);
}

TEST_CASE("engine: a forward that leaves the recorded order stays correct and is re-recorded", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  model->skip_block = 5;
  const at::Tensor ref_skip = model->forward(x);
  model->skip_block = -1;
  model->swap_blocks = true;
  const at::Tensor ref_swap = model->forward(x);
  model->swap_blocks = false;

  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.25;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(at::equal(run(engine, model, x), ref));
  model->swap_blocks = true;
  CHECK(at::equal(run(engine, model, x), ref_swap));  // diverges, re-recorded
  CHECK(at::equal(run(engine, model, x), ref_swap));  // follows the new order
  model->swap_blocks = false;
  model->skip_block = 5;
  CHECK(at::equal(run(engine, model, x), ref_skip));
  model->skip_block = -1;
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(at::equal(run(engine, model, x), ref));
  const EngineStats s = engine.stats();
  REQUIRE(s.forward_records.size() == 7);
  CHECK_FALSE(s.forward_records[1].diverged);
  CHECK(s.forward_records[2].diverged);
  CHECK_FALSE(s.forward_records[3].diverged);
  CHECK(s.forward_records[3].demand_copies == 0);
  CHECK(s.forward_records[3].bytes_streamed == streamed_bytes(engine));
  CHECK(s.forward_records[4].diverged);
  CHECK(s.forward_records[5].diverged);
  CHECK_FALSE(s.forward_records[6].diverged);
  CHECK(s.forward_records[6].demand_copies == 0);
  CHECK(s.forward_records[6].bytes_streamed == streamed_bytes(engine));
  CHECK(s.slot_violations == 0);
}

TEST_CASE("engine: forwards of different kinds keep their own order", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  model->skip_block = 2;
  const at::Tensor ref_short = model->forward(x);
  model->skip_block = -1;
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.5;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  for (int f = 0; f < 3; ++f) {
    CHECK(at::equal(run(engine, model, x, "full"), ref));
    model->skip_block = 2;
    CHECK(at::equal(run(engine, model, x, "short"), ref_short));
    model->skip_block = -1;
  }
  const EngineStats s = engine.stats();
  REQUIRE(s.forward_records.size() == 6);
  for (size_t i = 2; i < 6; ++i) {
    INFO(i);
    CHECK_FALSE(s.forward_records[i].diverged);
    CHECK(s.forward_records[i].demand_copies == 0);
  }
  // The short forward does not run block 2: its streamed bytes are missing from the total.
  CHECK(s.forward_records[4].bytes_streamed == streamed_bytes(engine));
  CHECK(s.forward_records[5].bytes_streamed < streamed_bytes(engine));
}

TEST_CASE("engine: residency changes move exact bytes and never copy device to host", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const Snapshot before = snapshot(model);
  EngineOptions o = options(slowed_cpu());
  o.pin = PinMode::off;  // the host tensors stay the model's own (the strict device pins by default)
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  CHECK(engine.plan().streamed_count() == 0);
  const int64_t h2d_at_attach = engine.stats().residency_h2d.allocated;
  CHECK(engine.budget().full_unload() < 0);
  CHECK(engine.plan().streamed_count() == 25);  // every block layer and x_embedder
  auto check_consistent = [&] {
    uint64_t resident = 0;
    for (auto& [name, l] : managed_layers(*model)) {
      INFO(name);
      const bool r = engine.is_resident(name);
      if (r) resident += static_cast<uint64_t>(l->stored_bytes());
      // A streamed layer's stored tensor is its original host tensor: nothing was copied
      // back from the device.
      if (!r) CHECK(l->stored_weight().data_ptr() == before.data.at(name));
      if (r) CHECK(l->stored_weight().data_ptr() != before.data.at(name));
    }
    CHECK(resident + 2 * 64 * 4 == engine.plan().resident_bytes);
    for (int f = 0; f < 2; ++f) {
      CHECK(at::equal(run(engine, model, x), ref));
      CHECK(engine.stats().forward_records.back().bytes_streamed == streamed_bytes(engine));
    }
    check_stored_dtypes(model, before);
    const auto mem = engine.stats().device_memory;
    CHECK(static_cast<uint64_t>(mem.total.current) == engine.device_bytes());
    CHECK(static_cast<uint64_t>(mem.total.current) ==
          engine.plan().resident_bytes + engine.plan().ring_bytes + engine.plan().scratch_bytes);
  };
  check_consistent();
  const uint64_t start_bytes = engine.device_bytes();
  const uint64_t start_resident = engine.plan().resident_bytes;
  const int64_t h2d_before = engine.stats().residency_h2d.allocated;

  const int64_t loaded = engine.budget().partial_load(40000);
  CHECK(loaded > 0);
  CHECK(loaded <= 40000);
  CHECK(engine.device_bytes() == start_bytes + static_cast<uint64_t>(loaded));
  check_consistent();
  // residency_h2d counts exactly the stored bytes copied in (and dropped): its balance is
  // the resident layers' bytes.
  const Stat h2d = engine.stats().residency_h2d;
  CHECK(h2d.allocated - h2d_before >= static_cast<int64_t>(engine.plan().resident_bytes - start_resident));
  CHECK(h2d.current == static_cast<int64_t>(engine.plan().resident_bytes) - 2 * 64 * 4);
  CHECK(h2d_at_attach > 0);

  const int64_t full = engine.budget().full_load();
  CHECK(engine.plan().streamed_count() == 0);
  CHECK(engine.plan().ring_slots == 0);
  CHECK(engine.device_bytes() == start_bytes + static_cast<uint64_t>(loaded) + static_cast<uint64_t>(full));
  check_consistent();

  const int64_t unloaded = engine.budget().partial_unload(30000);
  CHECK(unloaded <= -30000);
  check_consistent();

  const int64_t min_delta = engine.budget().full_unload();
  CHECK(min_delta <= 0);
  CHECK(engine.device_bytes() <= engine.minimum_budget() - o.working_memory_bytes);
  check_consistent();

  // Unloading below the minimum stops at the minimum.
  CHECK(engine.budget().partial_unload(1ull << 40) == 0);
  check_consistent();
}

TEST_CASE("engine: set_budget replans and a too-small budget changes nothing", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  StreamingEngine engine(options(slowed_cpu()));
  engine.attach(*model, "toy");
  CHECK(engine.plan().streamed_count() == 0);
  const uint64_t minimum = engine.minimum_budget();
  engine.budget().set_budget(minimum + 50000);
  CHECK(engine.plan().streamed_count() > 0);
  CHECK(engine.device_bytes() <= minimum + 50000 - MiB);
  CHECK(at::equal(run(engine, model, x), ref));
  const std::string map = engine.plan().residency_map();
  CHECK_THROWS_AS(engine.budget().set_budget(minimum - 1), sluice::ResourceError);
  CHECK(engine.plan().residency_map() == map);
  CHECK(at::equal(run(engine, model, x), ref));
  engine.budget().set_budget(64 * MiB);
  CHECK(engine.plan().streamed_count() == 0);
  CHECK(at::equal(run(engine, model, x), ref));
}

TEST_CASE("engine: residency changes are refused during a forward", "[strict][accel]") {
  ToyModel model;
  StreamingEngine engine(options(slowed_cpu()));
  engine.attach(*model, "toy");
  engine.begin_forward();
  CHECK_THROWS_AS(engine.budget().partial_unload(1000), sluice::InvalidArgument);
  CHECK_THROWS_AS(engine.detach(), sluice::InvalidArgument);
  {
    WeightLease lease(*model->block_list[0]->up);
    CHECK_THROWS_AS(engine.budget().full_unload(), sluice::InvalidArgument);
  }
  engine.end_forward();
  CHECK_NOTHROW(engine.budget().full_unload());
}

TEST_CASE("engine: detach gives the model back as it was", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  const Snapshot before = snapshot(model);
  const void* norm_ptr = model->norm_weight.data_ptr();
  auto dev = slowed_cpu();
  EngineOptions o = options(dev);
  o.max_resident = 0.5;
  o.pin = PinMode::off;  // the host tensors stay the model's own (the strict device pins by default)
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  CHECK(model->norm_weight.data_ptr() != norm_ptr);  // moved to the device
  CHECK(at::equal(run(engine, model, x), ref));
  // A second engine cannot take layers that are already served.
  StreamingEngine other(options(slowed_cpu()));
  CHECK_THROWS_AS(other.attach(*model, "toy"), sluice::InvalidArgument);
  engine.detach();
  CHECK_FALSE(engine.attached());
  CHECK(model->norm_weight.data_ptr() == norm_ptr);
  for (auto& [name, l] : managed_layers(*model)) {
    INFO(name);
    CHECK(l->provider() == nullptr);
    CHECK(l->stored_weight().data_ptr() == before.data.at(name));
    CHECK(at::equal(l->stored_weight().to(at::kFloat), before.value.at(name).to(at::kFloat)));
  }
  CHECK(dev->memory_stats().total.current == 0);
  CHECK(at::equal(model->forward(x), ref));
  // And it can be attached again.
  engine.attach(*model, "toy");
  CHECK(at::equal(run(engine, model, x), ref));
}

TEST_CASE("engine: pinned bytes stop at the arena's limit and are counted", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  {
    EngineOptions o = options(slowed_cpu());
    o.max_resident = 0.0;
    StreamingEngine engine(o);  // auto: pinning only where the device pins (the strict CPU device does)
    engine.attach(*model, "toy");
    CHECK((engine.stats().pinned.current > 0) == o.device->pins_memory());
  }
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.0;
  o.pin = PinMode::on;
  o.pin_memory_limit = 100000;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  const EngineStats s = engine.stats();
  CHECK(s.pinned.current > 0);
  CHECK(static_cast<uint64_t>(s.pinned.current) <= 100000);
  // Pinned in execution order until the next layer would pass the limit (the toy's tensors
  // are multiples of the arena's alignment: no padding).
  uint64_t expect = 0;
  bool full = false;
  for (auto& [name, l] : managed_layers(*model)) {
    if (engine.is_resident(name) || full) continue;
    if (expect + static_cast<uint64_t>(l->stored_bytes()) > 100000) {
      full = true;
      continue;
    }
    expect += static_cast<uint64_t>(l->stored_bytes());
  }
  CHECK(static_cast<uint64_t>(s.pinned.current) == expect);
  CHECK(s.pinned_bytes == expect);
  CHECK(s.pin_limit_bytes == 100000);
  CHECK(at::equal(run(engine, model, x), ref));
  engine.budget().full_load();
  CHECK(at::equal(run(engine, model, x), ref));
  engine.detach();
  CHECK(engine.stats().pinned.current == 0);
}

TEST_CASE("engine: stats JSON carries the documented fields", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const double rate = 200e6;
  EngineOptions o = options(slowed_cpu(0, rate));
  o.max_resident = 0.5;
  StreamingEngine engine(o);
  engine.attach(*model, "toy model");
  for (int f = 0; f < 2; ++f) run(engine, model, x);
  const EngineStats s = engine.stats();
  const auto j = nlohmann::json::parse(s.to_json());
  CHECK(j["model"]["name"] == "toy model");
  CHECK(j["model"]["total_bytes"].get<uint64_t>() == snapshot(model).stored_bytes + 2 * 64 * 4);
  CHECK(j["model"]["resident_bytes"].get<uint64_t>() == engine.plan().resident_bytes);
  CHECK(j["model"]["residency"] == engine.plan().residency_map());
  CHECK(j["budget"]["budget_bytes"].get<uint64_t>() == o.budget_bytes);
  CHECK(j["budget"]["working_memory_bytes"].get<uint64_t>() == o.working_memory_bytes);
  CHECK(j["device"]["peak_bytes"].get<int64_t>() == s.device_memory.total.peak);
  CHECK(j["device"]["ledger_peak_bytes"].get<int64_t>() == s.device_memory.total.peak);
  // The CPU device counts the bytes alive itself: at most what the ledger charged (the
  // ring is charged at its capacity, allocated as its slots are made).
  CHECK(j["device"]["allocator_stats"] == "available");
  CHECK(j["device"]["allocator_current_bytes"].get<int64_t>() > 0);
  // (A torch device's allocator rounds each block up, to 512 bytes on CUDA.)
  if (engine.device().device().is_cpu()) {
    // (A torch device's allocator rounds each block up, to 512 bytes on CUDA.)
  if (engine.device().device().is_cpu()) {
    CHECK(j["device"]["allocator_current_bytes"].get<int64_t>() <= s.device_memory.total.current);
  }
  }
  CHECK(j["device"]["weight_bytes"].get<int64_t>() ==
        s.device_memory.kind(MemoryKind::resident).current + s.device_memory.kind(MemoryKind::params).current);
  CHECK(j["device"]["scratch_bytes"].get<int64_t>() == s.device_memory.kind(MemoryKind::scratch).current);
  CHECK(j["device"]["ring_bytes"].get<uint64_t>() == engine.plan().ring_bytes);
  CHECK(j["device"]["lora_bytes"].get<int64_t>() == 0);
  REQUIRE(j["forwards"].size() == 2);
  for (const auto& f : j["forwards"]) {
    CHECK(f["bytes_streamed"].get<uint64_t>() == streamed_bytes(engine));
    const double gbps = f["h2d_gbps"].get<double>();
    CHECK(gbps > 0);
    CHECK(gbps <= rate / 1e9 * 1.05);  // the slowed copy's rate is the ceiling
    CHECK(f["stall_ms"].get<double>() >= 0);
    CHECK(f["upcast_ms"].get<double>() > 0);
    CHECK(f["wall_ms"].get<double>() > 0);
  }
  // The copy time alone is at least bytes / rate.
  CHECK(j["forwards"][1]["wall_ms"].get<double>() >= 0);
}

TEST_CASE("engine: trace JSON has copy and upcast and compute tracks", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.5;
  o.trace = true;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  for (int f = 0; f < 2; ++f) run(engine, model, x);
  const auto j = nlohmann::json::parse(engine.trace().to_json());
  std::map<int, std::string> tracks;
  std::map<int, int> spans;
  std::set<std::string> copied;
  std::map<int64_t, double> forward_begin, forward_end;  // the "forward" track's spans
  std::map<int64_t, int> computed;                         // forward -> compute spans (not waits)
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks[e["tid"].get<int>()] = e["args"]["name"];
    if (e["ph"] == "X") {
      spans[e["tid"].get<int>()] += 1;
      CHECK(e["dur"].get<double>() >= 0);
      CHECK(e["ts"].get<double>() >= 0);
      if (e["cat"] == "copy stream") copied.insert(e["name"].get<std::string>());
      // Every span says which forward it is for; layer spans name the layer and its residency.
      REQUIRE(e.contains("args"));
      const auto& args = e["args"];
      const int64_t f = args.at("forward").get<int64_t>();
      if (e["tid"] == 4) {
        forward_begin[f] = e["ts"].get<double>();
        forward_end[f] = e["ts"].get<double>() + e["dur"].get<double>();
        CHECK(args.at("complete") == true);
        CHECK(args.at("wall_ms").get<double>() * 1000.0 == Approx(e["dur"].get<double>()));
        CHECK(args.contains("bytes_streamed"));
      } else {
        const std::string layer = args.at("layer").get<std::string>();
        const std::string name = e["name"].get<std::string>();
        CHECK((name == layer || name == "wait " + layer));
        CHECK(args.at("resident").is_boolean());
        if (e["tid"] == 1) CHECK(args.at("resident") == false);  // only streamed layers are copied
        if (e["tid"] == 3 && name == layer) computed[f] += 1;
      }
    }
  }
  CHECK(tracks.size() == 4);
  CHECK(tracks[1] == "copy stream");
  CHECK(tracks[2] == "upcast");
  CHECK(tracks[3] == "compute");
  CHECK(tracks[4] == "forward");
  REQUIRE(forward_begin.size() == 2);
  CHECK(forward_begin[0] < forward_end[0]);
  CHECK(forward_end[0] <= forward_begin[1]);
  CHECK(computed[0] == 26);
  CHECK(computed[1] == 26);
  const EngineStats s = engine.stats();
  CHECK(spans[1] == static_cast<int>(s.forward_records[0].copies + s.forward_records[1].copies));
  CHECK(copied.size() == engine.plan().streamed_count());
  CHECK(spans[2] > 0);
  CHECK(spans[3] >= 2 * 26);  // one compute span per layer per forward
  const std::string path = std::string(SLUICE_BINARY_DIR) + "/engine_trace_test.json";
  engine.trace().write(path);
  CHECK_THROWS_AS(engine.trace().write("/nonexistent-dir/x.json"), sluice::FileError);
}

TEST_CASE("engine: nested leases get their own slot and scratch", "[strict][accel]") {
  ToyModel model;
  EngineOptions o = options(slowed_cpu());
  o.max_resident = 0.0;
  o.prefetch_depth = 0;  // a single-slot ring
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  auto& a = *model->block_list[0]->mid;
  auto& b = *model->block_list[1]->mid;
  engine.begin_forward();
  {
    WeightLease la(a);
    WeightLease lb(b);
    CHECK(at::equal(la.weight().cpu(), a.upcast_stored().weight));
    CHECK(at::equal(lb.weight().cpu(), b.upcast_stored().weight));
    CHECK(la.weight().data_ptr() != lb.weight().data_ptr());
  }
  engine.end_forward();
  CHECK(engine.stats().slot_violations == 0);
}

TEST_CASE("engine: a budget cut and detaching give freed device memory back to the allocator's driver",
          "[strict][accel]") {
  // The strict CPU device caches freed blocks like a GPU's caching allocator; its reserved
  // bytes fall only when the engine asks for the cache to be emptied, which it does where
  // memory must leave the process (Note [releasing cached memory] in offload/device/device_allocator.h).
  CpuDeviceOptions co;
  co.strict = true;
  auto dev = std::shared_ptr<DeviceBackend>(make_cpu_device(co));
  ToyModel model;
  const at::Tensor x = input();
  StreamingEngine engine(options(dev));
  engine.attach(*model, "toy");
  REQUIRE(engine.plan().streamed_count() == 0);
  run(engine, model, x);
  const auto reserved = [&] { return dev->allocator_stats().reserved_bytes; };
  const int64_t full = reserved();
  CHECK(full >= static_cast<int64_t>(engine.device_bytes()) - static_cast<int64_t>(engine.plan().ring_bytes));
  // Unloading keeps what it freed cached (for this process's next allocations).
  const int64_t unloaded = -engine.budget().full_unload();
  REQUIRE(unloaded > 0);
  CHECK(reserved() >= full);
  engine.budget().full_load();
  run(engine, model, x);
  const int64_t before_cut = reserved();
  // A budget cut gives it back: everything the cut freed left the cache (`freed` is the
  // demoted layers' bytes minus the ring's reservation, and the ring's slots are at most
  // that reservation).
  const uint64_t held = engine.device_bytes();
  engine.budget().set_budget(engine.minimum_budget());
  const int64_t freed = static_cast<int64_t>(held) - static_cast<int64_t>(engine.device_bytes());
  REQUIRE(freed > 0);
  CHECK(reserved() <= before_cut - freed);
  run(engine, model, x);
  engine.detach();
  CHECK(reserved() == 0);
  CHECK(dev->allocator_stats().current_bytes == 0);
}

TEST_CASE("engine: only a detach or a budget cut empties the allocator's cache and a shrinking replan does not",
          "[strict][accel]") {
  // Note [releasing cached memory] (offload/device/device_allocator.h): emptyCache synchronizes the device
  // and empties the cache other models allocate from; a plan that only shrinks keeps its
  // freed blocks cached for the next forward.
  auto counting = std::make_shared<sluice::testing::CountingDevice>(slowed_cpu(0, 0));
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  StreamingEngine engine(options(counting));
  engine.attach(*model, "toy");
  REQUIRE(engine.plan().streamed_count() == 0);
  CHECK(at::equal(run(engine, model, x), ref));
  const int before = counting->release_calls();
  engine.budget().set_max_resident(0.0);  // shrinks: streams every block layer
  CHECK(engine.plan().streamed_count() > 0);
  CHECK(engine.budget().partial_unload(MiB) <= 0);
  CHECK(engine.budget().full_unload() <= 0);
  CHECK(at::equal(run(engine, model, x), ref));
  CHECK(counting->release_calls() == before);  // no emptyCache for a plan that shrank
  engine.budget().set_max_resident(std::nullopt);
  engine.budget().full_load();
  const int64_t budget = static_cast<int64_t>(engine.minimum_budget()) + 50000;
  engine.budget().set_budget(static_cast<uint64_t>(budget));  // a budget cut: the freed memory goes back
  CHECK(counting->release_calls() == before + 1);
  engine.budget().set_budget(64 * MiB);  // a budget raise releases nothing
  CHECK(counting->release_calls() == before + 1);
  engine.detach();
  CHECK(counting->release_calls() == before + 2);
}

// [cpu-device]: the CPU device's allocator sees no activations but those CountingDevice plays, so the
// measurement is exact here; on a torch device the forward's real activations add to it.
TEST_CASE("engine: a first forward whose activations pass the working memory grows it to the measurement and replans",
          "[cpu-device][strict]") {
  // Note [measured working memory]: the activations are device memory the allocator hands
  // out and no ledger of sluice counts (CountingDevice plays them on the CPU device). The
  // first forward of a kind measures allocator peak minus ledger; more than the working
  // memory grows it (plus an eighth) and replans under what is left.
  auto counting = std::make_shared<sluice::testing::CountingDevice>(slowed_cpu(0, 0));
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  EngineOptions o = options(counting);
  o.working_memory_bytes = 64 * 1024;
  // Every layer resident with room to spare, but not with the activations below beside them.
  uint64_t full = 0, minimum = 0;
  {
    StreamingEngine probe(options(counting));
    probe.attach(*model, "probe");
    full = probe.device_bytes();
    minimum = probe.minimum_budget() - MiB;  // its working memory is 1 MiB
  }
  REQUIRE(full > minimum + 64 * 1024);
  o.budget_bytes = o.working_memory_bytes + full + 32 * 1024;
  const int64_t activations = static_cast<int64_t>((o.budget_bytes - (minimum + full) / 2) * 8 / 9);
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  REQUIRE(engine.plan().streamed_count() == 0);
  const uint64_t infos = sluice::log::message_count(sluice::log::Level::info);
  const auto forward = [&](std::string_view kind) {
    ForwardScope scope(engine, kind);
    counting->activations(activations);  // held across the forward, freed at its end
    at::Tensor y = model->forward(x);
    counting->activations(-activations);
    return y;
  };
  CHECK(at::equal(forward("dit"), ref));
  EngineStats s = engine.stats();
  CHECK(s.measured_working_memory);
  CHECK(s.measured_working_memory_bytes >= static_cast<uint64_t>(activations));
  CHECK(s.measured_working_memory_bytes <= static_cast<uint64_t>(activations) + 64 * 1024);
  CHECK(s.working_memory_grown == 1);
  CHECK(s.working_memory_bytes >= s.measured_working_memory_bytes);
  CHECK(engine.residency().limits().working_memory == s.working_memory_bytes);
  CHECK(sluice::log::message_count(sluice::log::Level::info) == infos + 1);  // the one line
  CHECK(engine.plan().streamed_count() > 0);  // replanned under budget minus the grown working memory
  CHECK(engine.device_bytes() + s.working_memory_bytes <= o.budget_bytes);
  const auto j = nlohmann::json::parse(s.to_json());
  CHECK(j["budget"]["measured_working_memory_bytes"].get<uint64_t>() == s.measured_working_memory_bytes);
  CHECK(j["budget"]["working_memory_bytes"].get<uint64_t>() == s.working_memory_bytes);
  // Measured once per kind: the next forward of the kind neither measures nor replans.
  const std::string map = engine.plan().residency_map();
  CHECK(at::equal(forward("dit"), ref));
  CHECK(engine.stats().working_memory_grown == 1);
  CHECK(engine.plan().residency_map() == map);
  // A kind whose forward fits the working memory now changes nothing.
  CHECK(at::equal(run(engine, model, x, "adapter"), ref));
  CHECK(engine.stats().working_memory_grown == 1);
  engine.detach();
}

TEST_CASE("engine: what nested leases held beyond the plan is reserved in later plans and the minimum",
          "[strict][accel]") {
  // Note [device extras]: a second scratch buffer and an overflow slot are charged when
  // made; after the forward every plan leaves room for them, so a budget cut to the new
  // minimum still runs the nested forward. Before, the minimum ignored them and that
  // forward failed for want of budget.
  ToyModel model;
  auto dev = slowed_cpu();
  EngineOptions o = options(dev);
  o.max_resident = 0.0;
  o.prefetch_depth = 0;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  auto& a = *model->block_list[0]->mid;
  auto& b = *model->block_list[1]->mid;
  const auto nested = [&] {
    ForwardScope scope(engine);
    WeightLease la(a);
    WeightLease lb(b);
    CHECK(at::equal(la.weight().cpu(), a.upcast_stored().weight));
    CHECK(at::equal(lb.weight().cpu(), b.upcast_stored().weight));
  };
  const uint64_t minimum_before = engine.minimum_budget();
  CHECK(engine.residency().limits().nested_reserve == 0);
  nested();
  const uint64_t reserve = engine.residency().limits().nested_reserve;
  CHECK(reserve >= a.upcast_stored().weight.nbytes());  // a second scratch buffer at least
  CHECK(engine.minimum_budget() == minimum_before + reserve);
  engine.budget().set_budget(engine.minimum_budget());
  dev->reset_allocator_peak();
  for (int f = 0; f < 3; ++f) REQUIRE_NOTHROW(nested());
  CHECK(alive_peak(*dev) <= sluice::testing::allocator_bound(*dev, engine.minimum_budget() - o.working_memory_bytes,
                                                             o.working_memory_bytes));
  CHECK(engine.residency().limits().nested_reserve == reserve);
  CHECK(engine.stats().slot_violations == 0);
}


TEST_CASE("engine: needs() before attach matches the attached engine", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  for (std::optional<double> cap : {std::optional<double>(), std::optional<double>(0.0), std::optional<double>(0.5)}) {
    INFO("max_resident " << (cap ? *cap : -1.0));
    EngineOptions o = options(slowed_cpu());
    o.max_resident = cap;
    const WeightNeeds n = StreamingEngine::needs(*model, o);
    CHECK(n.minimum <= n.wanted);
    CHECK(n.wanted <= n.full);
    if (!cap || *cap > 0) CHECK(n.minimum < n.wanted);
    if (!cap) CHECK(n.wanted == n.full);
    StreamingEngine engine(o);
    CHECK_THROWS_AS(engine.attach(*model, "toy", n.minimum - 1 + o.working_memory_bytes), sluice::ResourceError);
    engine.attach(*model, "toy", n.minimum + o.working_memory_bytes);  // overrides options.budget_bytes
    CHECK(engine.minimum_budget() == n.minimum + o.working_memory_bytes);
    CHECK(engine.device_bytes() <= n.minimum);
    CHECK(engine.stats().model_total_bytes == n.model_bytes);
    CHECK(at::equal(run(engine, model, x), ref));
    engine.detach();
    engine.attach(*model, "toy", n.wanted + o.working_memory_bytes);
    // Under a cap the plan at exactly `wanted` may pick a different (not larger) layer set.
    CHECK(engine.device_bytes() <= n.wanted);
    if (!cap) {
      CHECK(engine.device_bytes() == n.full);
      CHECK(engine.plan().streamed_count() == 0);
    }
    // Sizes only: needs() of an attached model is the same.
    const WeightNeeds again = StreamingEngine::needs(*model, o);
    CHECK(again.minimum == n.minimum);
    CHECK(again.full == n.full);
    CHECK(again.wanted == n.wanted);
    engine.detach();
  }
}

TEST_CASE("engine: set_max_resident replans under the current limit", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  StreamingEngine engine(options(slowed_cpu()));
  engine.attach(*model, "toy");
  CHECK(engine.plan().streamed_count() == 0);
  engine.budget().set_max_resident(0.0);
  CHECK(engine.plan().streamed_count() == 25);  // every block layer and x_embedder
  CHECK(at::equal(run(engine, model, x), ref));
  engine.budget().set_max_resident(std::nullopt);
  CHECK(engine.plan().streamed_count() == 0);
  CHECK_THROWS_AS(engine.budget().set_max_resident(1.5), sluice::InvalidArgument);
  engine.detach();
  engine.budget().set_max_resident(0.0);  // kept for the next attach
  engine.attach(*model, "toy");
  CHECK(engine.plan().streamed_count() == 25);
  CHECK(at::equal(run(engine, model, x), ref));
}

// --- On the device SLUICE_TEST_DEVICE names (tests/support/device_env.h) -------------

TEST_CASE("engine: env device: every residency gives the fully resident output bit for bit and frees all it held",
          "[env-device][strict][accel]") {
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  ToyModel m;
  const at::Tensor x = input().to(dev->device());
  at::Tensor ref;
  for (double f : {1.0, 0.5, 0.0}) {
    INFO("max_resident " << f);
    EngineOptions o = options(dev);
    o.max_resident = f;
    StreamingEngine e(o);
    e.attach(*m, "toy");
    for (int i = 0; i < 3; ++i) {
      const at::Tensor host = run(e, m, x);  // computed on dev, returned to the host
      if (!ref.defined()) ref = host;
      CHECK(at::equal(host, ref));
    }
    const EngineStats s = e.stats();
    CHECK(s.slot_violations == 0);
    CHECK((e.plan().streamed_count() > 0) == (f < 1.0));
    if (f < 1.0) CHECK(s.forward_records.back().bytes_streamed > 0);
    e.detach();
    dev->synchronize();
    CHECK(dev->memory_stats().total.current == 0);
  }
}

TEST_CASE("engine: env device: detach empties the allocator's cache, so reserved memory falls",
          "[env-device][strict][accel]") {
  // Note [device extras]: freed device memory goes back to the driver for other processes.
  // On a GPU the caching allocator would otherwise keep every block the model used.
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  ToyOptions big;
  big.dim = 512;
  big.hidden = 2048;  // ~6 MiB of fp8 per block: well above the allocator's block rounding
  ToyModel m(big);
  const at::Tensor x = input(big.dim).to(dev->device());
  StreamingEngine e(options(dev, 256 * MiB));
  e.attach(*m, "toy");
  run(e, m, x);
  dev->synchronize();
  const auto before = dev->allocator_stats();
  REQUIRE(before.available);
  const int64_t held = static_cast<int64_t>(e.residency().device_allocated_bytes());
  REQUIRE(before.reserved_bytes >= held);
  e.detach();
  const auto after = dev->allocator_stats();
  INFO("reserved " << before.reserved_bytes << " -> " << after.reserved_bytes << ", engine held " << held);
  CHECK(after.reserved_bytes <= before.reserved_bytes - held);
}

// [cpu-device]: its timing bounds model the CPU device's slowed copies.
TEST_CASE("engine: the balanced plan is made from measurements and reports its prediction", "[cpu-device][strict]") {
  ToyModel model;
  const at::Tensor x = input();
  const at::Tensor ref = model->forward(x);
  EngineOptions o = options(slowed_cpu(20, 100e6));
  o.plan_from_measurements = true;
  o.max_resident = 0.5;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  EngineStats s = engine.stats();
  CHECK(s.plan.policy == "balanced");
  CHECK_FALSE(s.plan.from_measurements);
  CHECK(s.plan.kinds.empty());
  auto j = nlohmann::json::parse(s.to_json());
  CHECK(j["plan"]["predicted_step_ms"].is_null());

  // Forward 0 warms up, forward 1 is measured, the plan is made after it.
  for (int f = 0; f < 2; ++f) CHECK(at::equal(run(engine, model, x, "dit"), ref));
  s = engine.stats();
  CHECK(s.plan.from_measurements);
  CHECK(s.plan.measured_plans == 1);
  CHECK(s.plan.copy_gbps > 0);
  REQUIRE(s.plan.step() != nullptr);
  // The copy model reproduces the slowed copy (20 us + bytes at 100 MB/s): its slope and
  // intercept are fitted to the timed copies. At least half of it; at most 4x, since the
  // strict device adds random latencies to every copy.
  const double modelled_ms = static_cast<double>(streamed_bytes(engine)) / 100e6 * 1e3 +
                             0.02 * static_cast<double>(engine.plan().streamed_count());
  CHECK(s.plan.step()->copy_ms > 0.5 * modelled_ms);
  CHECK(s.plan.step()->copy_ms < 4.0 * modelled_ms);
  CHECK(s.plan.step_kind == "dit");
  const PlanKindStats first = *s.plan.step();
  CHECK(first.predicted_step_ms > 0);
  CHECK(first.predicted_step_ms >= first.floor_ms * (1 - 1e-9));  // no plan beats the floor
  CHECK(first.floor_ms >= first.compute_ms * (1 - 1e-9));
  CHECK(first.copy_ms > 0);
  CHECK(s.plan.ring_bytes == engine.plan().ring_bytes);
  CHECK(engine.plan().ring_bytes >= engine.plan().ring_slots * engine.plan().slot_bytes);
  CHECK(alive_peak(engine.device()) <= o.budget_bytes - o.working_memory_bytes);

  // Under the plan: outputs unchanged, every forward streams its plan's bytes, at most one
  // more plan (the check forward), and the measured steps beside the prediction.
  for (int f = 0; f < 5; ++f) CHECK(at::equal(run(engine, model, x, "dit"), ref));
  s = engine.stats();
  CHECK(s.plan.measured_plans == (s.plan.recomputed ? 2u : 1u));
  for (const auto& r : s.forward_records) CHECK(r.bytes_streamed == r.planned_bytes);
  CHECK(s.mismatched_forwards == 0);
  CHECK(s.slot_violations == 0);
  REQUIRE(s.plan.step() != nullptr);
  CHECK(s.plan.step()->measured_forwards >= 1);
  CHECK(s.plan.step()->measured_step_ms > 0);
  j = nlohmann::json::parse(s.to_json());
  CHECK(j["plan"]["predicted_step_ms"].get<double>() == Approx(s.plan.step()->predicted_step_ms));
  CHECK(j["plan"]["floor_ms"].get<double>() > 0);
  CHECK(j["plan"]["measured_step_ms"].get<double>() > 0);
  CHECK(j["plan"]["recomputed"].get<bool>() == s.plan.recomputed);
  CHECK(j["prefetch"]["mismatched_forwards"] == 0);

  // A residency change replans with the measured costs: the prediction follows it.
  engine.budget().set_max_resident(0.0);
  s = engine.stats();
  REQUIRE(s.plan.step() != nullptr);
  CHECK(s.plan.step()->copy_ms > first.copy_ms);
  CHECK(at::equal(run(engine, model, x, "dit"), ref));
  engine.detach();
  CHECK(at::equal(model->forward(x), ref));
}

TEST_CASE("engine: without timing or with plan_from_measurements off the plan stays as attached", "[strict][accel]") {
  ToyModel model;
  const at::Tensor x = input();
  for (int variant = 0; variant < 2; ++variant) {
    EngineOptions o = options(slowed_cpu());
    o.plan_from_measurements = variant == 0;
    o.timing = false;  // variant 0: no events, nothing to measure by
    o.max_resident = 0.5;
    StreamingEngine engine(o);
    engine.attach(*model, "toy");
    const std::vector<bool> resident = engine.plan().resident;
    for (int f = 0; f < 4; ++f) run(engine, model, x, "dit");
    const EngineStats s = engine.stats();
    CHECK_FALSE(s.plan.from_measurements);
    CHECK(s.plan.measured_plans == 0);
    CHECK(engine.plan().resident == resident);
  }
}
