// ModelResidency (offload/engine/model_residency.h) on its own, without the streaming engine: a
// toy model attached with a recording PlanObserver in the engine's place. Checks what the
// observer is told and in which order (Note [residency changes]), that refused changes
// change nothing, what detach gives back, and that needs() agrees with an attach.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <regex>
#include <string>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/engine_options.h"
#include "offload/layer/layer.h"
#include "offload/engine/model_residency.h"
#include "runtime/error.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice;
using namespace sluice::offload;
using sluice::testing::ToyModel;
using sluice::testing::ToyOptions;

namespace {

constexpr uint64_t MiB = 1ull << 20;
constexpr uint64_t kWorkingMemory = 1 * MiB;
constexpr uint64_t kRoomy = 64 * MiB;  // a weight budget the toy model fits whole

// Records what it is told, in order; before_change can be made to refuse.
class RecordingObserver : public PlanObserver {
 public:
  void before_change(const char* what) override {
    calls.push_back(std::string("before_change: ") + what);
    if (refuse) throw InvalidArgument("a lease is open");
  }
  void plan_changing() noexcept override { calls.push_back("plan_changing"); }
  void ring_dropped() noexcept override { calls.push_back("ring_dropped"); }
  void streamed_changed() override { calls.push_back("streamed_changed"); }

  std::vector<std::string> calls;
  bool refuse = false;
};

class IdleProvider : public WeightProvider {
 public:
  LayerWeights acquire(ManagedLayerImpl& layer) override {
    throw std::logic_error("IdleProvider asked for " + layer.qualified_name());
  }
  void release(ManagedLayerImpl&) noexcept override {}
};

EngineOptions residency_options(std::shared_ptr<DeviceBackend> dev, PinMode pin) {
  EngineOptions o;
  o.device = std::move(dev);
  o.pin = pin;
  o.working_memory_bytes = kWorkingMemory;
  o.plan_from_measurements = false;  // plans from the budget alone
  o.log_attach = false;
  return resolve_engine_options(o);  // as the engine hands them over: ring_slots resolved
}

ToyModel toy() {
  ToyOptions o;
  o.blocks = 4;
  return ToyModel(o);
}

// Per layer: where its stored weight lives and its bytes, to compare after a detach.
struct HostState {
  std::map<std::string, const void*> data;
  std::map<std::string, at::Tensor> value;
  const void* norm = nullptr;
  const void* shift = nullptr;
};

HostState host_state(ToyModel& m) {
  HostState s;
  for (auto& [name, l] : managed_layers(*m)) {
    s.data[name] = l->stored_weight().data_ptr();
    s.value[name] = l->stored_weight().clone();
  }
  s.norm = m->norm_weight.data_ptr();
  s.shift = m->shift.data_ptr();
  return s;
}

// Members in this order: the model outlives the residency, which is detached first.
struct Rig {
  std::shared_ptr<DeviceBackend> dev = sluice::testing::test_device_or_cpu();
  EngineOptions options;  // the residency keeps a reference
  ToyModel model = toy();
  WeightNeeds needs;
  RecordingObserver observer;
  IdleProvider provider;
  ModelResidency residency;

  // Pinning off by default: the host tensors stay the model's own (pinning moves streamed
  // layers to page-locked copies, and the strict device and the test accelerator pin).
  explicit Rig(PinMode pin = PinMode::off)
      : options(residency_options(dev, pin)), needs(ModelResidency::needs(*model, options)), residency(dev, options) {
    residency.set_observer(&observer);
  }
  ~Rig() { residency.detach(); }

  // The smallest budget the model attaches under: some layers stream.
  void attach_tight() { residency.attach(*model, "toy", needs.minimum + kWorkingMemory, &provider); }
  // A budget raised to kRoomy, as ModelBudget::set_budget raises it before replanning:
  // replan's weight budget stays within the budget minus working memory.
  void raise_budget() { residency.limits().budget_bytes = kRoomy + kWorkingMemory; }
};

// The "(N bytes" of a budget error.
uint64_t bytes_in(const std::string& msg) {
  std::smatch m;
  REQUIRE(std::regex_search(msg, m, std::regex(R"(\((\d+) bytes)")));
  return std::stoull(m[1].str());
}

using Calls = std::vector<std::string>;

}  // namespace

TEST_CASE("model residency: attach tells plan_changing then streamed_changed and never before_change",
          "[strict][accel]") {
  Rig rig;
  rig.attach_tight();
  CHECK(rig.observer.calls == Calls{"plan_changing", "streamed_changed"});
  REQUIRE(rig.residency.attached());
  CHECK(rig.residency.model_name() == "toy");
  // Tight: something streams, through a ring; every layer is the provider's.
  CHECK(rig.residency.plan().streamed_count() > 0);
  CHECK(rig.residency.buffers().ring() != nullptr);
  for (const auto& r : rig.residency.records().layers()) {
    INFO(r.name);
    CHECK(r.layer->provider() == &rig.provider);
    CHECK(r.resident == rig.residency.is_resident(r.name));
    CHECK(r.layer->stored_weight().device() == (r.resident ? rig.dev->device() : c10::Device(c10::kCPU)));
  }
  CHECK(rig.residency.limits().budget_bytes == rig.needs.minimum + kWorkingMemory);
  CHECK(rig.residency.limits().weight_budget == rig.needs.minimum);
  CHECK(rig.residency.ledger()->limit() == rig.needs.minimum);
  CHECK(rig.residency.device_bytes() == rig.residency.ledger()->current());
  CHECK(rig.residency.device_bytes() <= rig.needs.minimum);
  CHECK(rig.residency.device_allocated_bytes() ==
        rig.residency.device_bytes() - rig.residency.buffers().unmade_ring_bytes());
  CHECK_NOTHROW(rig.residency.check_invariants("test"));
  CHECK_THROWS_AS(rig.residency.is_resident("blocks.9.up"), InvalidArgument);
  // A second attach is refused.
  ToyModel other = toy();
  CHECK_THROWS_AS(rig.residency.attach(*other, "other", kRoomy, nullptr), InvalidArgument);
  CHECK(rig.observer.calls.size() == 2);
}

TEST_CASE("model residency: replan tells before_change first and ring_dropped only when a ring existed",
          "[strict][accel]") {
  Rig rig;
  rig.attach_tight();
  REQUIRE(rig.residency.buffers().ring() != nullptr);

  // Everything resident: the ring goes.
  rig.raise_budget();
  rig.observer.calls.clear();
  int64_t before = static_cast<int64_t>(rig.residency.device_bytes());
  int64_t change = rig.residency.replan(kRoomy, 1.0);
  CHECK(rig.observer.calls == Calls{"before_change: residency change", "ring_dropped", "plan_changing", "streamed_changed"});
  CHECK(change == static_cast<int64_t>(rig.residency.device_bytes()) - before);
  CHECK(rig.residency.plan().streamed_count() == 0);
  CHECK(rig.residency.buffers().ring() == nullptr);
  CHECK(rig.residency.limits().weight_budget == kRoomy);
  CHECK(rig.residency.limits().max_resident == 1.0);
  CHECK(rig.residency.ledger()->limit() == kRoomy);

  // No ring to drop this time.
  rig.observer.calls.clear();
  CHECK(rig.residency.replan(kRoomy, 1.0) == 0);
  CHECK(rig.observer.calls == Calls{"before_change: residency change", "plan_changing", "streamed_changed"});

  // Back to streaming: a ring is made, none was dropped.
  rig.observer.calls.clear();
  before = static_cast<int64_t>(rig.residency.device_bytes());
  change = rig.residency.replan(kRoomy, 0.0);
  CHECK(rig.observer.calls == Calls{"before_change: residency change", "plan_changing", "streamed_changed"});
  CHECK(change == static_cast<int64_t>(rig.residency.device_bytes()) - before);
  CHECK(change < 0);
  CHECK(rig.residency.buffers().ring() != nullptr);
  CHECK(rig.residency.plan().streamed_count() > 0);
  for (const auto& r : rig.residency.records().layers()) {
    INFO(r.name);
    CHECK(r.resident == r.required);  // max_resident 0: only what must stay
  }
  CHECK_NOTHROW(rig.residency.check_invariants("test"));
}

TEST_CASE("model residency: a before_change that throws leaves the plan and ledger unchanged", "[strict][accel]") {
  Rig rig;
  rig.attach_tight();
  const std::vector<bool> resident = rig.residency.plan().resident;
  const uint64_t bytes = rig.residency.device_bytes();
  const uint64_t weight_budget = rig.residency.limits().weight_budget;
  const auto limit = rig.residency.ledger()->limit();
  const StagingRing* ring = rig.residency.buffers().ring();
  rig.raise_budget();
  rig.observer.calls.clear();
  rig.observer.refuse = true;

  CHECK_THROWS_AS(rig.residency.replan(kRoomy, 1.0), InvalidArgument);
  CHECK(rig.observer.calls == Calls{"before_change: residency change"});
  CHECK(rig.residency.plan().resident == resident);
  CHECK(rig.residency.device_bytes() == bytes);
  CHECK(rig.residency.limits().weight_budget == weight_budget);
  CHECK_FALSE(rig.residency.limits().max_resident.has_value());
  CHECK(rig.residency.ledger()->limit() == limit);
  CHECK(rig.residency.buffers().ring() == ring);
  for (size_t i = 0; i < rig.residency.records().size(); ++i) {
    CHECK(rig.residency.records().at(static_cast<int64_t>(i)).resident == resident[i]);
  }
  CHECK_NOTHROW(rig.residency.check_invariants("test"));

  // Allowed again, the same change goes through.
  rig.observer.refuse = false;
  rig.residency.replan(kRoomy, 1.0);
  CHECK(rig.residency.plan().streamed_count() == 0);
}

TEST_CASE("model residency: a replan below minimum_weights throws ResourceError naming the model and changes nothing",
          "[strict][accel]") {
  Rig rig;
  rig.residency.attach(*rig.model, "toy", kRoomy + kWorkingMemory, &rig.provider);
  const uint64_t min_weights = rig.residency.minimum_weights();
  CHECK(rig.residency.minimum_budget() == min_weights + kWorkingMemory);
  const std::vector<bool> resident = rig.residency.plan().resident;
  const uint64_t bytes = rig.residency.device_bytes();
  rig.observer.calls.clear();

  try {
    rig.residency.replan(min_weights - 1, std::nullopt);
    FAIL("no error");
  } catch (const ResourceError& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("'toy'"));
    CHECK(bytes_in(msg) == min_weights + kWorkingMemory);
  }
  // Asked first (a forward may have had to end), but no plan was applied.
  CHECK(rig.observer.calls == Calls{"before_change: residency change"});
  CHECK(rig.residency.plan().resident == resident);
  CHECK(rig.residency.device_bytes() == bytes);
  CHECK(rig.residency.limits().weight_budget == kRoomy);
  CHECK(rig.residency.ledger()->limit() == kRoomy);

  // At the minimum itself it applies, and stays within it.
  rig.residency.replan(min_weights, std::nullopt);
  CHECK(rig.residency.plan().streamed_count() > 0);
  CHECK(rig.residency.device_bytes() <= min_weights);
  CHECK_NOTHROW(rig.residency.check_invariants("test"));
}

TEST_CASE("model residency: an attach below the minimum names it and leaves the model as it was", "[strict][accel]") {
  Rig rig;
  const HostState before = host_state(rig.model);
  try {
    rig.residency.attach(*rig.model, "toy", rig.needs.minimum + kWorkingMemory - 1, &rig.provider);
    FAIL("no error");
  } catch (const ResourceError& e) {
    CHECK_THAT(e.what(), Catch::Contains("'toy'"));
    CHECK(bytes_in(e.what()) == rig.needs.minimum + kWorkingMemory);
  }
  CHECK_FALSE(rig.residency.attached());
  CHECK(rig.observer.calls.empty());
  CHECK(rig.residency.device_bytes() == 0);
  CHECK(rig.dev->memory_stats().total.current == 0);
  for (auto& [name, l] : managed_layers(*rig.model)) {
    INFO(name);
    CHECK(l->provider() == nullptr);
    CHECK(l->stored_weight().data_ptr() == before.data.at(name));
  }
  // And it attaches at the minimum.
  rig.attach_tight();
  CHECK(rig.residency.attached());
}

TEST_CASE("model residency: detach gives the ledger back and the layers back on the host", "[strict][accel]") {
  const PinMode pin = GENERATE(PinMode::off, PinMode::on);
  INFO("pin " << (pin == PinMode::on ? "on" : "off"));
  Rig rig(pin);
  const HostState before = host_state(rig.model);
  for (double cap : {0.0, 0.5, 1.0}) {
    INFO("max_resident " << cap);
    rig.residency.attach(*rig.model, "toy", kRoomy + kWorkingMemory, &rig.provider);
    rig.residency.replan(kRoomy, cap);
    const bool had_ring = rig.residency.buffers().ring() != nullptr;
    CHECK(had_ring == (cap < 1.0));
    const std::shared_ptr<MemoryLedger> ledger = rig.residency.ledger();
    REQUIRE(ledger);
    CHECK(ledger->current() > 0);
    rig.observer.calls.clear();

    rig.residency.detach();
    CHECK_FALSE(rig.residency.attached());
    CHECK(rig.residency.device_bytes() == 0);
    CHECK(rig.residency.ledger() == nullptr);
    CHECK(ledger->current() == 0);
    CHECK(rig.dev->memory_stats().total.current == 0);
    CHECK(rig.observer.calls == (had_ring ? Calls{"ring_dropped"} : Calls{}));
    CHECK(rig.residency.records().size() == 0);
    CHECK(rig.residency.buffers().ring() == nullptr);
    // Bit for bit on the host, no provider; without pinning the very same host memory
    // (with it, a layer that streamed stays on its page-locked copy).
    for (auto& [name, l] : managed_layers(*rig.model)) {
      INFO(name);
      CHECK(l->provider() == nullptr);
      CHECK(l->stored_weight().device().is_cpu());
      if (pin == PinMode::off) CHECK(l->stored_weight().data_ptr() == before.data.at(name));
      CHECK(at::equal(l->stored_weight().to(at::kFloat), before.value.at(name).to(at::kFloat)));
    }
    CHECK(rig.model->norm_weight.data_ptr() == before.norm);
    CHECK(rig.model->shift.data_ptr() == before.shift);
    // Detaching twice is harmless.
    rig.residency.detach();
    CHECK(rig.observer.calls.size() == (had_ring ? 1u : 0u));
  }
}

TEST_CASE("model residency: needs() before attach is what the attach reports", "[strict][accel]") {
  Rig rig;
  // Its bytes: every parameter, buffer and weight scale of the model.
  uint64_t stored = 0;
  for (auto& [name, l] : managed_layers(*rig.model)) stored += static_cast<uint64_t>(l->stored_bytes());
  stored += rig.model->norm_weight.nbytes() + rig.model->shift.nbytes();
  CHECK(rig.needs.model_bytes == stored);
  CHECK(rig.needs.minimum < rig.needs.full);
  CHECK(rig.needs.wanted <= rig.needs.full);

  SECTION("at the minimum") {
    rig.attach_tight();
    CHECK(rig.residency.minimum_weights() == rig.needs.minimum);
    CHECK(rig.residency.minimum_budget() == rig.needs.minimum + kWorkingMemory);
    CHECK(rig.residency.records().stored_bytes() == rig.needs.model_bytes);
    CHECK(rig.needs.full == rig.needs.model_bytes + rig.residency.records().scratch_bytes());
  }
  SECTION("with room for everything") {
    rig.residency.attach(*rig.model, "toy", kRoomy + kWorkingMemory, &rig.provider);
    CHECK(rig.residency.minimum_weights() == rig.needs.minimum);
    CHECK(rig.residency.records().stored_bytes() == rig.needs.model_bytes);
    // The plan with no limit takes what needs() said it wants; all resident is `full`.
    CHECK(rig.residency.device_bytes() == rig.needs.wanted);
    rig.residency.replan(kRoomy, 1.0);
    CHECK(rig.residency.device_bytes() == rig.needs.full);
  }
  SECTION("under max_resident") {
    EngineOptions capped = rig.options;
    capped.max_resident = 0.0;
    const WeightNeeds n = ModelResidency::needs(*rig.model, capped);
    CHECK(n.model_bytes == rig.needs.model_bytes);
    CHECK(n.full == rig.needs.full);
    CHECK(n.wanted < rig.needs.wanted);
    CHECK(n.minimum == rig.needs.minimum);
    ModelResidency capped_residency(rig.dev, capped);
    capped_residency.attach(*rig.model, "capped", kRoomy + kWorkingMemory, nullptr);
    CHECK(capped_residency.minimum_weights() == n.minimum);
    CHECK(capped_residency.device_bytes() == n.wanted);
    capped_residency.detach();
  }
}

TEST_CASE("model residency: check_invariants notices a stored weight that is not where the plan puts it",
          "[strict][accel]") {
  Rig rig;
  rig.attach_tight();
  CHECK_NOTHROW(rig.residency.check_invariants("test"));
  const LayerRecord* streamed = nullptr;
  for (const auto& r : rig.residency.records().layers()) {
    if (!r.resident) streamed = &r;
  }
  REQUIRE(streamed);
  // Same bytes, other memory: the plan says it lives in its host copy.
  streamed->layer->set_stored(streamed->host_w.clone());
  CHECK_THROWS_WITH(rig.residency.check_invariants("test"), Catch::Contains(streamed->name));
  streamed->layer->set_stored(streamed->host_w);
  CHECK_NOTHROW(rig.residency.check_invariants("test"));
}
