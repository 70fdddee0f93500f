// ForeignModel (offload/layer/foreign_model.h, Note [foreign layers]): a torch model's Linear
// layers and other tensors, handed over by name, streamed by the engine. Runs on the plain
// and the strict CPU device.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "offload/engine/engine.h"
#include "offload/layer/foreign_model.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "tests/support/device_env.h"

using namespace sluice;
using namespace sluice::offload;

namespace {

// A caller's model: four Linear layers (two with a bias) and two other tensors.
struct CallerModel {
  std::vector<ForeignLayer> layers;
  std::vector<std::pair<std::string, at::Tensor>> extras;
};

CallerModel caller_model(at::ScalarType dtype) {
  at::manual_seed(7);
  CallerModel m;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{48, 32}, {64, 48}, {64, 64}, {32, 64}};
  const std::vector<std::string> names = {"patch_embed.proj", "blocks.0.attn.to_q", "blocks.0.ff.net.2", "proj_out"};
  for (size_t i = 0; i < shapes.size(); ++i) {
    ForeignLayer l;
    l.name = names[i];
    l.weight = at::randn({shapes[i].first, shapes[i].second}).to(dtype);
    if (i % 2 == 1) l.bias = at::randn({shapes[i].first}).to(dtype);
    m.layers.push_back(std::move(l));
  }
  m.extras.emplace_back("blocks.0.norm.weight", at::randn({64}));
  m.extras.emplace_back("rope.freqs", at::randn({16, 2}));
  return m;
}

// What the caller's model computes: its layers one after the other.
at::Tensor run_reference(const CallerModel& m, at::Tensor x, const std::vector<at::Tensor>& weights) {
  for (size_t i = 0; i < m.layers.size(); ++i) {
    x = at::linear(x, weights[i], m.layers[i].bias ? *m.layers[i].bias : at::Tensor());
  }
  return x;
}

at::Tensor run_foreign(ForeignModel& fm, StreamingEngine& engine, at::Tensor x) {
  ForwardScope scope(engine, "dit");
  for (size_t i = 0; i < fm.size(); ++i) x = fm.linear(i, x);
  return x;
}

// An engine that streams every layer, under the smallest budget that allows it.
EngineOptions streaming_options(ForeignModel& fm, const std::shared_ptr<DeviceBackend>& dev) {
  EngineOptions o;
  o.device = dev;
  o.working_memory_bytes = uint64_t{1} << 20;
  o.required_patterns = {};
  o.max_resident = 0.0;  // every streamable layer streams
  o.log_attach = false;
  o.budget_bytes = StreamingEngine::needs(fm.module(), o).minimum + o.working_memory_bytes;
  return o;
}

// fn(engine) with `fm` attached to an engine that streams every layer (max_resident 0), then to
// one that keeps every layer resident (max_resident 1).
template <typename Fn>
void streamed_then_resident(ForeignModel& fm, const std::shared_ptr<DeviceBackend>& dev, Fn fn) {
  for (double resident : {0.0, 1.0}) {
    EngineOptions o = streaming_options(fm, dev);
    o.max_resident = resident;
    o.budget_bytes += static_cast<uint64_t>(fm.stored_bytes());
    StreamingEngine engine(o);
    engine.attach(fm.module(), "caller");
    fn(engine);
    engine.detach();
  }
}

}  // namespace

TEST_CASE("foreign model: bf16 storage streams the caller's layers bit for bit and gives its tensors back",
          "[strict]") {
  CallerModel m = caller_model(at::kBFloat16);
  std::vector<at::Tensor> originals;
  for (const auto& l : m.layers) originals.push_back(l.weight.clone());
  const at::Tensor norm = m.extras[0].second;
  const void* norm_ptr = norm.data_ptr();
  const at::Tensor norm_values = norm.clone();
  ForeignModel fm(m.layers, m.extras, {at::kBFloat16, at::kBFloat16, {}});
  REQUIRE(fm.size() == 4);
  CHECK(fm.name(1) == "blocks.0.attn.to_q");
  auto dev = sluice::testing::test_device_or_cpu();
  StreamingEngine engine(streaming_options(fm, dev));
  engine.attach(fm.module(), "caller");
  const EngineStats attached = engine.stats();
  CHECK(attached.streamed_layers > 0);
  CHECK(attached.layers == 4);
  CHECK(norm.data_ptr() != norm_ptr);  // the caller's own tensor now points at the device copy
  const at::Tensor x = at::randn({3, 32}).to(at::kBFloat16);
  const at::Tensor want = run_reference(m, x, originals);
  for (int f = 0; f < 2; ++f) CHECK(at::equal(run_foreign(fm, engine, x).cpu(), want));
  CHECK(engine.stats().forwards == 2);
  engine.detach();
  CHECK(norm.data_ptr() == norm_ptr);
  CHECK(at::equal(norm, norm_values));
  for (size_t i = 0; i < m.layers.size(); ++i) CHECK(at::equal(m.layers[i].weight, originals[i]));  // untouched
}

TEST_CASE("foreign model: fp8 storage computes what the weights' fp8 round trip computes", "[strict]") {
  CallerModel m = caller_model(at::kBFloat16);
  ForeignModel fm(m.layers, m.extras, {at::kFloat8_e4m3fn, at::kBFloat16, {"patch_embed"}});
  CHECK(fm.stored_dtype(0) == at::kBFloat16);  // skipped: its own dtype
  CHECK(fm.stored_dtype(1) == at::kFloat8_e4m3fn);
  std::vector<at::Tensor> rounded;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    rounded.push_back(i == 0 ? m.layers[i].weight : m.layers[i].weight.to(at::kFloat8_e4m3fn).to(at::kBFloat16));
    if (i > 0 && m.layers[i].bias) m.layers[i].bias = m.layers[i].bias->to(at::kFloat8_e4m3fn).to(at::kBFloat16);
  }
  auto dev = sluice::testing::test_device_or_cpu();
  StreamingEngine engine(streaming_options(fm, dev));
  engine.attach(fm.module(), "caller");
  const at::Tensor x = at::randn({2, 32}).to(at::kBFloat16);
  CHECK(at::equal(run_foreign(fm, engine, x).cpu(), run_reference(m, x, rounded)));
  // Stored bytes: fp8 weights and biases, the skipped layer in bf16, the extras as they are.
  int64_t want = m.layers[0].weight.nbytes() + 4 * 64 + 4 * 32;
  for (size_t i = 1; i < m.layers.size(); ++i) {
    want += m.layers[i].weight.numel() + (m.layers[i].bias ? m.layers[i].bias->numel() : 0);
  }
  CHECK(fm.stored_bytes() == want);
  engine.detach();
}

TEST_CASE("foreign model: bad layers and names are refused naming them", "[strict]") {
  CallerModel m = caller_model(at::kFloat);
  auto refused = [&](std::vector<ForeignLayer> layers, std::vector<std::pair<std::string, at::Tensor>> extras,
                     const std::string& needle) {
    try {
      ForeignModel fm(std::move(layers), std::move(extras), {});
      FAIL("no error");
    } catch (const InvalidArgument& e) {
      CHECK_THAT(e.what(), Catch::Contains(needle));
    }
  };
  {
    auto layers = m.layers;
    layers[2].weight = at::randn({4, 4, 4});
    refused(layers, m.extras, "'blocks.0.ff.net.2' has a weight of 3 dims");
  }
  {
    auto layers = m.layers;
    layers[1].bias = at::randn({7});
    refused(layers, m.extras, "the bias of layer 'blocks.0.attn.to_q'");
  }
  {
    auto layers = m.layers;
    layers[3].name = layers[0].name;
    refused(layers, m.extras, "'patch_embed.proj' is given twice");
  }
  {
    auto extras = m.extras;
    extras[0].first = "blocks..norm";
    refused(m.layers, extras, "'blocks..norm' is not a dotted module path");
  }
  {
    auto layers = m.layers;
    layers[0].weight = at::randint(0, 3, {48, 32}, at::kInt);
    refused(layers, m.extras, "not floating");
  }
  {
    auto layers = m.layers;
    layers[1].weight = layers[1].weight.clone();
    layers[1].weight[0][0] = std::numeric_limits<float>::quiet_NaN();
    CHECK_THROWS_WITH(ForeignModel(layers, m.extras, {}), Catch::Contains("blocks.0.attn.to_q"));
  }
  ForeignModel fm(m.layers, m.extras, {});
  CHECK_THROWS_WITH(fm.linear(4, at::zeros({1, 32})), Catch::Contains("no layer 4"));
}

TEST_CASE("foreign model: a layer already in its storage dtype is sluice's own copy, never the caller's memory",
          "[strict]") {
  // Issue 37: a write through a reference the caller kept must not reach the streamed
  // layers and miss the resident ones (an output that would depend on the budget).
  CallerModel m = caller_model(at::kBFloat16);
  std::vector<at::Tensor> originals;
  for (const auto& l : m.layers) originals.push_back(l.weight.clone());
  const at::Tensor x = at::randn({3, 32}).to(at::kBFloat16);
  const at::Tensor want = run_reference(m, x, originals);
  ForeignModel fm(m.layers, m.extras, {at::kBFloat16, at::kBFloat16, {}});
  for (size_t i = 0; i < m.layers.size(); ++i) {
    m.layers[i].weight.mul_(2);  // the caller writes to its own tensors in place
    CHECK_FALSE(fm.host_copy(i).weight.data_ptr() == m.layers[i].weight.data_ptr());
  }
  streamed_then_resident(fm, sluice::testing::test_device_or_cpu(),
                         [&](StreamingEngine& engine) { CHECK(at::equal(run_foreign(fm, engine, x).cpu(), want)); });
}

TEST_CASE("foreign model: each layer computes in its own dtype, a skipped layer in its weight's", "[strict]") {
  at::manual_seed(3);
  ForeignOptions o{at::kBFloat16, at::kBFloat16, {"time_embedder"}};
  ForeignModel fm(o);
  const at::Tensor w32 = at::randn({16, 8});
  const at::Tensor b32 = at::randn({16});
  const at::Tensor w16 = at::randn({8, 16}).to(at::kBFloat16);
  fm.add_layer({"time_embedder.linear_1", w32, b32, LayerKind::linear, at::kBFloat16});  // kept: fp32 whatever is named
  fm.add_layer({"blocks.0.proj", w16, std::nullopt, LayerKind::linear, std::nullopt});   // the options': bf16
  fm.add_extras({});
  CHECK(fm.stored_dtype(0) == at::kFloat);
  CHECK(fm.stored_dtype(1) == at::kBFloat16);
  const at::Tensor t = at::randn({2, 8});
  const at::Tensor y = fm.linear(0, t);  // no engine: the layers' own leases
  CHECK(y.scalar_type() == at::kFloat);
  CHECK(at::equal(y, at::linear(t, w32, b32)));
  const at::Tensor z = fm.linear(1, y.to(at::kBFloat16));
  CHECK(at::equal(z, at::linear(y.to(at::kBFloat16), w16)));
}

TEST_CASE("foreign model: layers one at a time, a refused one leaves nothing behind, release_host frees a layer",
          "[strict]") {
  CallerModel m = caller_model(at::kBFloat16);
  ForeignModel fm(ForeignOptions{at::kBFloat16, at::kBFloat16, {}});
  fm.add_layer(m.layers[0]);
  ForeignLayer bad = m.layers[1];
  bad.bias = at::randn({5});
  CHECK_THROWS_WITH(fm.add_layer(bad), Catch::Contains("the bias of layer 'blocks.0.attn.to_q'"));
  CHECK(fm.size() == 1);
  fm.add_layer(m.layers[1]);  // the name is free again
  CHECK(fm.size() == 2);
  fm.add_extras(m.extras);
  const int64_t before = fm.stored_bytes();
  fm.release_host(0);
  CHECK(fm.stored_bytes() == before - static_cast<int64_t>(m.layers[0].weight.nbytes()));
  CHECK(fm.host_copy(0).weight.numel() == 0);
}

namespace {

// A provider whose upcast lease must not be asked for: an embedding's lookup leases the
// table as stored (Note [embedding rows]).
struct StoredOnly : WeightProvider {
  int stored = 0;
  LayerWeights acquire(ManagedLayerImpl& layer) override {
    throw std::runtime_error("the whole table was upcast for '" + layer.qualified_name() + "'");
  }
  LayerWeights acquire_stored(ManagedLayerImpl& layer) override {
    ++stored;
    LayerWeights w;
    w.weight = layer.stored_weight();
    w.scale = layer.weight_scale();
    w.stored = true;
    return w;
  }
  void release(ManagedLayerImpl&) noexcept override {}
};

}  // namespace

TEST_CASE("foreign model: an fp8 embedding looks up its rows and upcasts only those, resident or streamed",
          "[strict]") {
  at::manual_seed(5);
  const at::Tensor table = at::randn({1000, 24}).to(at::kBFloat16);
  const at::Tensor ids = at::tensor(std::vector<int64_t>{3, 999, 0, 3, 512, 7}).view({2, 3});
  const at::Tensor want = at::embedding(table.to(at::kFloat8_e4m3fn).to(at::kBFloat16), ids);
  ForeignModel fm({{"embed_tokens", table, std::nullopt, LayerKind::embedding}, {"proj", at::randn({8, 24}).to(at::kBFloat16), std::nullopt, LayerKind::linear}},
                  {}, {at::kFloat8_e4m3fn, at::kBFloat16, {}});
  REQUIRE(fm.stored_dtype(0) == at::kFloat8_e4m3fn);
  {
    StoredOnly provider;
    auto& layer = *dynamic_cast<ManagedLayerImpl*>(fm.module().named_modules()["embed_tokens"].get());
    layer.set_provider(&provider);
    const at::Tensor y = fm.embedding(0, ids);
    layer.set_provider(nullptr);
    CHECK(provider.stored == 1);
    CHECK(y.sizes() == at::IntArrayRef({2, 3, 24}));
    CHECK(at::equal(y, want));
  }
  CHECK(at::equal(fm.embedding(0, ids.to(at::kInt)), want));  // no provider: the stored table itself
  auto dev = sluice::testing::test_device_or_cpu();
  streamed_then_resident(fm, dev, [&](StreamingEngine& engine) {
    ForwardScope scope(engine, "dit");
    CHECK(at::equal(fm.embedding(0, ids.to(dev->device())).cpu(), want));
  });
}

TEST_CASE("foreign model: a layer called twice per forward is two calls, each prefetched (Note [repeated calls])",
          "[strict]") {
  CallerModel m = caller_model(at::kBFloat16);
  ForeignModel fm(m.layers, m.extras, {at::kBFloat16, at::kBFloat16, {}});
  auto dev = sluice::testing::test_device_or_cpu();
  EngineOptions o = streaming_options(fm, dev);
  o.budget_bytes += uint64_t{4} << 20;  // room in the ring for every call's copy
  StreamingEngine engine(o);
  engine.attach(fm.module(), "caller");
  const at::Tensor x = at::randn({3, 32}).to(at::kBFloat16);
  auto forward = [&] {
    ForwardScope scope(engine, "dit");
    at::Tensor y = fm.linear(0, x);
    y = fm.linear(1, y);
    y = fm.linear(2, y);
    y = fm.linear(2, y);  // the same layer again
    return fm.linear(3, y);
  };
  const at::Tensor want = forward().cpu();
  for (int f = 0; f < 4; ++f) CHECK(at::equal(forward().cpu(), want));
  const EngineStats s = engine.stats(/*wait=*/true);
  REQUIRE(s.forward_records.size() >= 3);
  const ForwardRecord& last = s.forward_records.back();
  uint64_t calls_bytes = 0;
  for (size_t i : {0, 1, 2, 2, 3}) calls_bytes += static_cast<uint64_t>(fm.module().named_parameters()[fm.name(i) + ".weight"].nbytes());
  for (size_t i : {1, 3}) calls_bytes += static_cast<uint64_t>(fm.module().named_parameters()[fm.name(i) + ".bias"].nbytes());
  CHECK(last.copies == 5);        // one copy per call
  CHECK(last.demand_copies == 0);  // each prefetched
  CHECK_FALSE(last.diverged);
  CHECK(last.bytes_streamed == last.planned_bytes);
  CHECK(s.mismatched_forwards == 0);
  engine.detach();
}
