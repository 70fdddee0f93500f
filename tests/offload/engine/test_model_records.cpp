// ModelRecords (offload/engine/model_records.h) on its own, without the streaming engine: what it
// collects from a model (records in execution order, which layers are required, the extras
// and their bytes), the checks attach relies on, and the extras' trip to the device and
// back (Note [attached model on the host]).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <memory>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "offload/device/device.h"
#include "offload/engine/engine_options.h"
#include "offload/layer/layer.h"
#include "offload/engine/model_records.h"
#include "offload/layer/repoint.h"
#include "runtime/error.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice;
using namespace sluice::offload;
using sluice::testing::ToyModel;
using sluice::testing::ToyOptions;

namespace {

ToyModel small_toy(int blocks = 2) {
  ToyOptions o;
  o.blocks = blocks;
  return ToyModel(o);
}

// A provider that is only ever installed, never asked.
class IdleProvider : public WeightProvider {
 public:
  LayerWeights acquire(ManagedLayerImpl& layer) override {
    throw std::logic_error("IdleProvider asked for " + layer.qualified_name());
  }
  void release(ManagedLayerImpl&) noexcept override {}
};

// A model with an embedding (stored in its compute dtype), a linear layer, and one
// parameter and one buffer outside them.
class EmbedModelImpl : public torch::nn::Module {
 public:
  EmbedModelImpl() {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    tok = register_module("tok", Embedding(16, 8, f32));
    tok->set_stored(at::randn({16, 8}));
    proj = register_module("proj", Linear(8, 8, true, f32));
    testing::store(*proj, at::randn({8, 8}), at::randn({8}), at::kFloat8_e4m3fn, at::kFloat, false);
    gain = register_parameter("gain", at::ones({8}), false);
    table = register_buffer("table", at::arange(32, at::kFloat));
  }
  Embedding tok{nullptr};
  Linear proj{nullptr};
  at::Tensor gain, table;
};
TORCH_MODULE(EmbedModel);

std::vector<std::string> names_of(const ModelRecords& records) {
  std::vector<std::string> names;
  for (const auto& r : records.layers()) names.push_back(r.name);
  return names;
}

std::string required_names(const ModelRecords& records) {
  std::string out;
  for (const auto& r : records.layers()) {
    if (r.required) out += (out.empty() ? "" : " ") + r.name;
  }
  return out;
}

bool one_line(const std::string& s) { return s.find('\n') == std::string::npos; }

}  // namespace

TEST_CASE("model records: layers are collected in execution order with their index", "[strict][accel]") {
  ToyModel model = small_toy(2);
  ModelRecords records;
  records.collect(*model, "toy", {}, false, true);
  const std::vector<std::string> expected = {"x_embedder",  "blocks.0.up", "blocks.0.mid", "blocks.0.down",
                                             "blocks.1.up", "blocks.1.mid", "blocks.1.down", "final_layer"};
  CHECK(names_of(records) == expected);
  REQUIRE(records.size() == expected.size());
  const auto managed = managed_layers(*model);
  REQUIRE(managed.size() == expected.size());
  for (size_t i = 0; i < managed.size(); ++i) {
    INFO(managed[i].first);
    CHECK(records.at(static_cast<int64_t>(i)).layer == managed[i].second);
    CHECK(records.find(managed[i].second) == static_cast<int64_t>(i));
    // Host copies alias the module's tensors: nothing was copied.
    CHECK(records.at(static_cast<int64_t>(i)).host_w.data_ptr() == managed[i].second->stored_weight().data_ptr());
    CHECK_FALSE(records.at(static_cast<int64_t>(i)).resident);
  }
  // Blocks are parsed from the names; the others belong to none.
  CHECK(records.at(1).group == "blocks");
  CHECK(records.at(1).block == 0);
  CHECK(records.at(6).block == 1);
  CHECK(records.at(0).group.empty());
  CHECK(records.at(0).block == -1);
}

TEST_CASE("model records: find returns -1 for a layer of another model", "[strict][accel]") {
  ToyModel model = small_toy(1);
  ToyModel other = small_toy(1);
  ModelRecords records;
  records.collect(*model, "toy", {}, false, true);
  CHECK(records.find(other->final_layer.get()) == -1);
  CHECK(records.find(other->block_list[0]->mid.get()) == -1);
  CHECK(records.find(nullptr) == -1);
  CHECK(records.find(model->final_layer.get()) == static_cast<int64_t>(records.size()) - 1);
  records.clear();
  CHECK(records.size() == 0);
  CHECK(records.find(model->final_layer.get()) == -1);  // clear() forgets the index too
  CHECK(records.extras().empty());
  CHECK(records.extra_bytes() == 0);
  CHECK(records.scratch_bytes() == 0);
}

TEST_CASE("model records: required comes from the patterns and unconverted storage", "[strict][accel]") {
  ToyModel model = small_toy(2);
  EngineOptions defaults;
  SECTION("the default pattern keeps final_layer only") {
    ModelRecords records;
    records.collect(*model, "toy", required_regexes(defaults), false, true);
    CHECK(required_names(records) == "final_layer");
  }
  SECTION("no pattern and converted storage: nothing is required") {
    ModelRecords records;
    records.collect(*model, "toy", {}, false, true);
    CHECK(required_names(records).empty());
  }
  SECTION("require_unconverted adds the layer stored in its compute dtype") {
    ModelRecords records;
    records.collect(*model, "toy", required_regexes(defaults), true, true);
    CHECK(required_names(records) == "x_embedder final_layer");
  }
  SECTION("patterns are searched, not matched whole") {
    EngineOptions o;
    o.required_patterns = {"\\.mid$", "^blocks\\.1\\.up"};
    ModelRecords records;
    records.collect(*model, "toy", required_regexes(o), false, true);
    CHECK(required_names(records) == "blocks.0.mid blocks.1.up blocks.1.mid");
    // The planner sees the same.
    const std::vector<PlanLayer> plan = records.plan_layers();
    REQUIRE(plan.size() == records.size());
    for (size_t i = 0; i < plan.size(); ++i) {
      const LayerRecord& r = records.at(static_cast<int64_t>(i));
      INFO(r.name);
      CHECK(plan[i].name == r.name);
      CHECK(plan[i].required == r.required);
      CHECK(plan[i].stored_bytes == r.stored_bytes);
      CHECK(plan[i].slot_bytes == r.slot_bytes);
      CHECK(plan[i].group == r.group);
      CHECK(plan[i].block == r.block);
    }
  }
  SECTION("a bad pattern is refused naming it") {
    EngineOptions o;
    o.required_patterns = {"blocks.(1"};
    try {
      (void)required_regexes(o);
      FAIL("no error");
    } catch (const InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains("'blocks.(1'"));
    }
  }
}

TEST_CASE("model records: an embedding is always required", "[strict][accel]") {
  EmbedModel model;
  ModelRecords records;
  records.collect(*model, "embed", {}, false, true);
  REQUIRE(records.size() == 2);
  CHECK(records.at(0).name == "tok");
  CHECK(records.at(0).required);
  CHECK_FALSE(records.at(1).required);  // a converted linear layer, no pattern
  // An embedding stored in its compute dtype needs no upcast, so no scratch.
  CHECK(records.at(0).scratch_bytes == 0);
  CHECK(records.scratch_bytes() == records.at(1).scratch_bytes);
}

TEST_CASE("model records: extras are the other parameters and buffers with their bytes", "[strict][accel]") {
  ToyModel model = small_toy(2);
  ModelRecords records;
  records.collect(*model, "toy", {}, false, true);
  REQUIRE(records.extras().size() == 2);
  // The same tensor objects as the module's: re-pointing them moves the module's.
  std::set<const c10::TensorImpl*> handles;
  for (const auto& e : records.extras()) {
    handles.insert(e.handle.unsafeGetTensorImpl());
    CHECK(e.host.data_ptr() == e.handle.data_ptr());
    CHECK_FALSE(e.dev.defined());
  }
  CHECK(handles.count(model->norm_weight.unsafeGetTensorImpl()) == 1);
  CHECK(handles.count(model->shift.unsafeGetTensorImpl()) == 1);
  CHECK(records.extra_bytes() == model->norm_weight.nbytes() + model->shift.nbytes());

  // Stored bytes: every parameter and buffer of the model, plus the layers' weight scales.
  uint64_t total = 0;
  for (const auto& p : model->named_parameters(true)) total += p.value().nbytes();
  for (const auto& b : model->named_buffers(true)) total += b.value().nbytes();
  uint64_t scales = 0;
  uint64_t layer_bytes = 0;
  uint64_t largest_scratch = 0;
  for (const auto& r : records.layers()) {
    if (r.host_s.defined()) scales += r.host_s.nbytes();
    layer_bytes += r.stored_bytes;
    largest_scratch = std::max(largest_scratch, r.scratch_bytes);
  }
  CHECK(scales > 0);  // the mid layers are scaled
  CHECK(records.stored_bytes() == total + scales);
  CHECK(records.stored_bytes() == layer_bytes + records.extra_bytes());
  CHECK(records.scratch_bytes() == largest_scratch);
  CHECK(records.scratch_bytes() > 0);
}

TEST_CASE("model records: the embedding model's extras include its buffer", "[strict][accel]") {
  EmbedModel model;
  ModelRecords records;
  records.collect(*model, "embed", {}, false, true);
  REQUIRE(records.extras().size() == 2);
  CHECK(records.extra_bytes() == model->gain.nbytes() + model->table.nbytes());
  CHECK(records.stored_bytes() == records.at(0).stored_bytes + records.at(1).stored_bytes + records.extra_bytes());
}

TEST_CASE("model records: a layer that already has a provider is refused naming it on one line", "[strict][accel]") {
  ToyModel model = small_toy(2);
  IdleProvider provider;
  CHECK_NOTHROW(ModelRecords::check_attachable(*model, "toy"));
  model->block_list[1]->up->set_provider(&provider);
  try {
    ModelRecords::check_attachable(*model, "toy");
    FAIL("no error");
  } catch (const InvalidArgument& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Catch::Contains("'blocks.1.up'"));
    CHECK_THAT(msg, Catch::Contains("'toy'"));
    CHECK_THAT(msg, Catch::Contains("provider"));
    CHECK(one_line(msg));
  }
  // It only reads: the provider is still there.
  CHECK(model->block_list[1]->up->provider() == &provider);
  model->block_list[1]->up->set_provider(nullptr);
  CHECK_NOTHROW(ModelRecords::check_attachable(*model, "toy"));
}

TEST_CASE("model records: a layer off the host is refused naming it on one line", "[strict][accel]") {
  ToyModel model = small_toy(2);
  const auto meta = at::TensorOptions().device(at::kMeta);
  SECTION("its weight") {
    auto& mid = *model->block_list[0]->mid;
    mid.set_stored(at::empty(mid.stored_weight().sizes(), meta.dtype(mid.stored_weight().scalar_type())));
    try {
      ModelRecords::check_attachable(*model, "toy");
      FAIL("no error");
    } catch (const InvalidArgument& e) {
      const std::string msg = e.what();
      CHECK_THAT(msg, Catch::Contains("'blocks.0.mid'"));
      CHECK_THAT(msg, Catch::Contains("'toy'"));
      CHECK_THAT(msg, Catch::Contains("not on the host"));
      CHECK(one_line(msg));
    }
  }
  SECTION("its bias") {
    auto& down = *model->block_list[1]->down;
    down.set_stored(down.stored_weight(), at::empty(down.stored_bias().sizes(), meta.dtype(down.stored_bias().scalar_type())));
    try {
      ModelRecords::check_attachable(*model, "toy");
      FAIL("no error");
    } catch (const InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains("'blocks.1.down'"));
      CHECK(one_line(e.what()));
    }
  }
  SECTION("its weight scale: collect refuses it when checking the host, sizing reads it") {
    auto& mid = *model->block_list[1]->mid;
    mid.set_weight_scale(at::empty(mid.weight_scale().sizes(), meta.dtype(at::kFloat)));
    ModelRecords sizing;
    CHECK_NOTHROW(sizing.collect(*model, "toy", {}, false, /*check_host=*/false));
    CHECK(sizing.size() == 8);
    ModelRecords attaching;
    try {
      attaching.collect(*model, "toy", {}, false, /*check_host=*/true);
      FAIL("no error");
    } catch (const InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains("'blocks.1.mid'"));
      CHECK(one_line(e.what()));
    }
  }
  SECTION("a parameter outside the layers: collect refuses it naming the parameter and the model") {
    repoint(model->norm_weight, at::empty(model->norm_weight.sizes(), meta.dtype(at::kFloat)));
    ModelRecords sizing;
    CHECK_NOTHROW(sizing.collect(*model, "toy", {}, false, /*check_host=*/false));
    ModelRecords attaching;
    try {
      attaching.collect(*model, "toy", {}, false, /*check_host=*/true);
      FAIL("no error");
    } catch (const InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains("'toy'"));
      CHECK_THAT(e.what(), Catch::Contains("'norm_weight'"));
      CHECK(one_line(e.what()));
    }
  }
}

TEST_CASE("model records: extras go to the device and back to the very same host memory bit for bit",
          "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  ToyModel model = small_toy(2);
  IdleProvider provider;
  const void* norm_ptr = model->norm_weight.data_ptr();
  const void* shift_ptr = model->shift.data_ptr();
  const at::Tensor norm_before = model->norm_weight.clone();
  const at::Tensor shift_before = model->shift.clone();
  const c10::TensorImpl* norm_impl = model->norm_weight.unsafeGetTensorImpl();
  std::vector<const void*> layer_ptrs;
  for (auto& [name, l] : managed_layers(*model)) layer_ptrs.push_back(l->stored_weight().data_ptr());

  auto ledger = std::make_shared<MemoryLedger>("test budget");
  {
    ModelRecords records;
    records.collect(*model, "toy", {}, false, true);
    for (auto& r : records.layers()) r.layer->set_provider(&provider);  // as attach does
    records.place_extras(*dev, ledger);

    // Every extra is charged, as parameters, at its exact size.
    CHECK(ledger->current() == records.extra_bytes());
    CHECK(ledger->stats().kind(MemoryKind::params).current == static_cast<int64_t>(records.extra_bytes()));
    // The module's own tensors (same objects) now point at the device copies.
    CHECK(model->norm_weight.unsafeGetTensorImpl() == norm_impl);
    CHECK(model->norm_weight.device() == dev->device());
    CHECK(model->shift.device() == dev->device());
    for (const auto& e : records.extras()) {
      REQUIRE(e.dev.defined());
      CHECK(e.handle.data_ptr() == e.dev.data_ptr());
      CHECK(e.dev.data_ptr() != e.host.data_ptr());
      CHECK(at::equal(e.dev.cpu(), e.host));
    }
    CHECK(model->norm_weight.data_ptr() != norm_ptr);
    CHECK(at::equal(model->norm_weight.cpu(), norm_before));
    CHECK(at::equal(model->shift.cpu(), shift_before));

    records.restore_to_host();
    CHECK(model->norm_weight.unsafeGetTensorImpl() == norm_impl);
    CHECK(model->norm_weight.data_ptr() == norm_ptr);
    CHECK(model->shift.data_ptr() == shift_ptr);
    CHECK(model->norm_weight.device().is_cpu());
    CHECK(model->shift.device().is_cpu());
    CHECK(at::equal(model->norm_weight, norm_before));
    CHECK(at::equal(model->shift, shift_before));
    for (const auto& e : records.extras()) CHECK_FALSE(e.dev.defined());
    // The layers: back on their host copies, the provider gone.
    size_t i = 0;
    for (auto& [name, l] : managed_layers(*model)) {
      INFO(name);
      CHECK(l->provider() == nullptr);
      CHECK(l->stored_weight().data_ptr() == layer_ptrs[i++]);
    }
    dev->synchronize();
  }
  // The device copies were the only users of the budget.
  CHECK(ledger->current() == 0);
  CHECK(dev->memory_stats().total.current == 0);
}

TEST_CASE("model records: extras that do not fit the budget throw ResourceError and leave the model on the host",
          "[strict][accel]") {
  auto dev = sluice::testing::test_device_or_cpu();
  ToyModel model = small_toy(1);
  const void* norm_ptr = model->norm_weight.data_ptr();
  ModelRecords records;
  records.collect(*model, "toy", {}, false, true);
  REQUIRE(!records.extras().empty());
  // Too small for the first extra: nothing is allocated or copied before the throw.
  auto ledger = std::make_shared<MemoryLedger>("tight budget", records.extras()[0].host.nbytes() - 1);
  try {
    records.place_extras(*dev, ledger);
    FAIL("no error");
  } catch (const ResourceError& e) {
    CHECK_THAT(e.what(), Catch::Contains("parameter"));
  }
  CHECK(ledger->current() == 0);
  // The model was never re-pointed.
  CHECK(model->norm_weight.device().is_cpu());
  CHECK(model->norm_weight.data_ptr() == norm_ptr);
  CHECK(model->shift.device().is_cpu());
  records.restore_to_host();
  CHECK(model->norm_weight.data_ptr() == norm_ptr);
  CHECK(dev->memory_stats().total.current == 0);
}

TEST_CASE("model records: an allocation failing after the first extra gives the placed ones back after their copies",
          "[strict][accel]") {
  // The strict device runs copies on its copy stream: restore_to_host() frees the extras
  // placed so far, and each free must wait for its queued copy (record_use in place_extras;
  // without it the strict device reports a free while the copy stream may still write).
  auto dev = sluice::testing::test_device_or_cpu();
  ToyModel model = small_toy(1);
  ModelRecords records;
  records.collect(*model, "toy", {}, false, true);
  REQUIRE(records.extras().size() >= 2);
  const at::Tensor norm_before = records.extras()[0].host.clone();
  auto ledger = std::make_shared<MemoryLedger>("budget one byte short", records.extra_bytes() - 1);
  CHECK_THROWS_AS(records.place_extras(*dev, ledger), ResourceError);
  CHECK(ledger->current() > 0);  // the first extras were placed
  records.restore_to_host();
  dev->synchronize();
  CHECK(ledger->current() == 0);
  CHECK(records.extras()[0].handle.device().is_cpu());
  CHECK(at::equal(records.extras()[0].handle, norm_before));
}
