// sluice::OffloadedModel (include/sluice/offload.hpp) as a frontend embeds it: torch
// models of its own, handed over layer by layer, inside a sluice::ModelCache beside each
// other and beside an Anima model, under one device budget (Note [adopted models] in
// cache/model_cache.h). On the plain and the strict CPU device.
#include <sluice/offload.hpp>
#include <sluice/sluice.hpp>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "runtime/error.h"

using namespace sluice;
using nlohmann::json;

namespace {

constexpr int64_t kWidth = 256;  // 8 fp32 layers of 256x256: 2 MiB a model
constexpr int kLayers = 8;

// A frontend's model: its layers' weights (kept for the reference) and its own tensors.
struct HostModel {
  std::vector<at::Tensor> weights;
  std::vector<at::Tensor> biases;
  at::Tensor norm;  // an extra: moved to the device and back in place
};

HostModel host_model(uint64_t seed) {
  at::manual_seed(seed);
  HostModel m;
  for (int i = 0; i < kLayers; ++i) {
    m.weights.push_back(at::randn({kWidth, kWidth}) / 16.0);
    m.biases.push_back(at::randn({kWidth}));
  }
  m.norm = at::randn({kWidth});
  return m;
}

std::vector<OffloadLayer> layers_of(const HostModel& m) {
  std::vector<OffloadLayer> out;
  for (int i = 0; i < kLayers; ++i) out.push_back({"blocks." + std::to_string(i) + ".proj", m.weights[i], m.biases[i]});
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> extras_of(const HostModel& m) { return {{"norm.weight", m.norm}}; }

OffloadOptions fp32(const std::string& name) {
  OffloadOptions o;
  o.name = name;
  o.storage = "float32";
  o.compute = "float32";
  return o;
}

// What the frontend's forward computes, through sluice and by itself.
at::Tensor run(OffloadedModel& m, at::Tensor x) {
  m.begin_forward("dit");
  for (int i = 0; i < kLayers; ++i) x = m.linear(i, x);
  m.end_forward(false);
  return x;
}

at::Tensor reference(const HostModel& m, at::Tensor x) {
  for (int i = 0; i < kLayers; ++i) x = at::linear(x, m.weights[i], m.biases[i]);
  return x;
}

RuntimeOptions small_cache(const std::string& budget) {
  RuntimeOptions r;
  r.device = "cpu";
  r.vram_budget = budget;
  r.working_memory = "1MiB";
  return r;
}

json held(const ModelCache& cache, const std::string& name) {
  const json stats = json::parse(cache.stats_json());
  for (const auto& m : stats["models_held"]) {
    if (m["name"] == name) return m;
  }
  return json();
}

}  // namespace

TEST_CASE("offload api: two offloaded models share one cache budget and each forward gets its share", "[strict]") {
  // 3 MiB with 1 MiB of working memory: room for one 2 MiB model (plus a little), not two.
  ModelCache cache(small_cache("3MiB"));
  const HostModel ha = host_model(1), hb = host_model(2);
  OffloadedModel a(layers_of(ha), extras_of(ha), cache, fp32("text encoder"));
  OffloadedModel b(layers_of(hb), extras_of(hb), cache, fp32("transformer"));
  const at::Tensor x = at::randn({3, kWidth});
  for (int round = 0; round < 2; ++round) {
    CHECK(at::allclose(run(a, x), reference(ha, x), 1e-5, 1e-5));
    CHECK(held(cache, "text encoder")["share_bytes"].get<uint64_t>() >= 2u << 20);  // all of it, as it ran last
    CHECK(at::allclose(run(b, x), reference(hb, x), 1e-5, 1e-5));
    CHECK(held(cache, "transformer")["share_bytes"].get<uint64_t>() >= 2u << 20);
    // The one that ran first gave way: the shares never pass the budget beside the working memory.
    const uint64_t shares = held(cache, "text encoder")["share_bytes"].get<uint64_t>() +
                            held(cache, "transformer")["share_bytes"].get<uint64_t>();
    CHECK(shares <= (2u << 20));
  }
  const json sa = json::parse(a.stats_json()), sb = json::parse(b.stats_json());
  CHECK(sa["forward_count"] == 2);
  CHECK(sb["forward_count"] == 2);
  CHECK(sa["model"]["name"] == "text encoder");
  CHECK(sa["model"]["source"] == "offload:text encoder");
  CHECK(sa["budget"]["budget_bytes"] == 3u << 20);
  CHECK(json::parse(cache.stats_json())["models_held"].size() == 2);
  CHECK(cache.models().empty());  // the OffloadedModels are their handles
}

TEST_CASE("offload api: an offloaded model and an Anima model run side by side in one cache", "[strict]") {
  RuntimeOptions r;
  r.device = "cpu";
  ModelCache cache(r);
  Model anima = cache.load("anima-tiny");
  const HostModel h = host_model(3);
  OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("frontend module"));
  const at::Tensor x = at::randn({2, kWidth});
  CHECK(at::allclose(run(m, x), reference(h, x), 1e-5, 1e-5));
  {
    LockedModel locked = anima.lock();
    const ModelInfo& info = locked.info();
    const at::Tensor y = locked(at::randn({1, info.in_channels, 1, 16, 16}), at::full({1}, 0.5),
                                at::randn({1, 8, info.context_dim}));
    CHECK(y.size(1) == info.out_channels);
  }
  CHECK(at::allclose(run(m, x), reference(h, x), 1e-5, 1e-5));
  REQUIRE(cache.models().size() == 1);
  CHECK(cache.models()[0].name() == anima.name());
  CHECK(json::parse(cache.stats_json())["models_held"].size() == 2);
}

TEST_CASE("offload api: the cache's own options are refused when a model goes into a cache", "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  const HostModel h = host_model(4);
  for (const char* field : {"device", "vram_budget", "working_memory", "pin_memory", "prefetch"}) {
    OffloadOptions o = fp32("m");
    const std::string f = field;
    if (f == "device") o.device = "cuda";
    if (f == "vram_budget") o.vram_budget = "1GiB";
    if (f == "working_memory") o.working_memory = "1MiB";
    if (f == "pin_memory") o.pin_memory = "on";
    if (f == "prefetch") o.prefetch = "2";
    CHECK_THROWS_WITH(OffloadedModel(layers_of(h), extras_of(h), cache, o),
                      Catch::Contains("'" + f + "' is the ModelCache's"));
  }
  OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("m"));
  CHECK_THROWS_WITH(m.set_vram_budget("32MiB"), Catch::Contains("set the budget with the cache's set_vram_budget"));
  CHECK(json::parse(cache.stats_json())["models_held"].size() == 1);  // the refused ones left nothing
}

TEST_CASE("offload api: a budget too small for the model is refused and leaves nothing in the cache", "[strict]") {
  ModelCache cache(small_cache("1100KiB"));  // 76 KiB beside the working memory: not one 256 KiB layer
  const HostModel h = host_model(5);
  CHECK_THROWS_AS(OffloadedModel(layers_of(h), extras_of(h), cache, fp32("too big")), ResourceError);
  CHECK(json::parse(cache.stats_json())["models_held"].empty());
  // Its own cache: the same error, naming the minimum.
  OffloadOptions o = fp32("alone");
  o.vram_budget = "1100KiB";
  o.working_memory = "1MiB";
  CHECK_THROWS_WITH(OffloadedModel(layers_of(h), extras_of(h), o), Catch::Contains("the minimum that would work is"));
}

TEST_CASE("offload api: remove takes the model out of its cache and gives its tensors back", "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  const HostModel h = host_model(6);
  const at::Tensor norm_before = h.norm.clone();
  const void* norm_ptr = h.norm.data_ptr();
  OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("m"));
  run(m, at::randn({1, kWidth}));
  m.remove();
  CHECK(m.removed());
  CHECK(h.norm.data_ptr() == norm_ptr);  // re-pointed back at the very same memory
  CHECK(at::equal(h.norm, norm_before));
  CHECK(json::parse(cache.stats_json())["models_held"].empty());
  const auto [w, b] = m.stored_layer(3);
  CHECK(at::equal(w, h.weights[3]));
  REQUIRE(b.has_value());
  CHECK(at::equal(*b, h.biases[3]));
  CHECK_THROWS_WITH(m.remove(), Catch::Contains("already removed"));
  CHECK_THROWS_WITH(m.linear(0, at::randn({1, kWidth})), Catch::Contains("was removed"));
  CHECK_THROWS_WITH(m.begin_forward(), Catch::Contains("was removed"));
}

TEST_CASE("offload api: stored layers are read only after remove and remove waits for no forward of its own",
          "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  const HostModel h = host_model(7);
  OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("m"));
  CHECK_THROWS_WITH(m.stored_layer(0), Catch::Contains("after remove()"));
  m.begin_forward("dit");
  CHECK_THROWS_WITH(m.remove(), Catch::Contains("during the model's forward"));
  m.end_forward(false);
  CHECK_THROWS_WITH(m.end_forward(false), Catch::Contains("without a begin_forward"));
  m.remove();
}

TEST_CASE("offload api: nested forwards count once and a layer called outside a forward is a forward of its own",
          "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  const HostModel h = host_model(8);
  OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("m"));
  const at::Tensor x = at::randn({2, kWidth});
  m.begin_forward("dit");
  const at::Tensor inner = run(m, x);  // nests
  m.end_forward(false);
  CHECK(at::allclose(inner, reference(h, x), 1e-5, 1e-5));
  CHECK(at::allclose(m.linear(0, x), at::linear(x, h.weights[0], h.biases[0]), 1e-5, 1e-5));
  const json s = json::parse(m.stats_json());
  REQUIRE(s["forward_count"] == 2);
  CHECK(s["forwards"][0]["kind"] == "dit");
  CHECK(s["forwards"][1]["kind"] == "layer");
}

TEST_CASE("offload api: a forward from another thread waits for the running one to end", "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  const HostModel h = host_model(9);
  OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("m"));
  const at::Tensor x = at::randn({2, kWidth});
  m.begin_forward("dit");
  std::atomic<bool> started{false}, finished{false};
  at::Tensor other;
  std::thread t([&] {
    started = true;
    other = run(m, x);
    finished = true;
  });
  while (!started) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK_FALSE(finished.load());  // waiting in begin_forward, not nested into ours
  for (int i = 0; i < kLayers; ++i) (void)m.linear(i, x);
  m.end_forward(false);
  t.join();
  CHECK(finished.load());
  CHECK(at::allclose(other, reference(h, x), 1e-5, 1e-5));
  CHECK(json::parse(m.stats_json())["forward_count"] == 2);
}

TEST_CASE("offload api: an offloaded model is never evicted from RAM and other models make room for it", "[strict]") {
  RuntimeOptions r = small_cache("64MiB");
  r.ram_limit = "3MiB";
  ModelCache cache(r);
  const HostModel ha = host_model(10), hb = host_model(11);
  OffloadedModel a(layers_of(ha), extras_of(ha), cache, fp32("a"));
  OffloadedModel b(layers_of(hb), extras_of(hb), cache, fp32("b"));  // 4 MiB in all: over the limit
  const at::Tensor x = at::randn({1, kWidth});
  CHECK(at::allclose(run(a, x), reference(ha, x), 1e-5, 1e-5));
  CHECK(at::allclose(run(b, x), reference(hb, x), 1e-5, 1e-5));
  const json stats = json::parse(cache.stats_json());
  CHECK(stats["evictions"] == 0);
  CHECK(held(cache, "a")["in_ram"] == true);
  CHECK(held(cache, "b")["in_ram"] == true);
}

TEST_CASE("offload api: destroying a model in the middle of its forward ends the forward and the model", "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  const HostModel h = host_model(12);
  const at::Tensor norm_before = h.norm.clone();
  {
    OffloadedModel m(layers_of(h), extras_of(h), cache, fp32("m"));
    m.begin_forward("dit");
    m.begin_forward("dit");  // nested: both levels end with it
    (void)m.linear(0, at::randn({1, kWidth}));
  }
  CHECK(json::parse(cache.stats_json())["models_held"].empty());
  CHECK(at::equal(h.norm, norm_before));
  CHECK(h.norm.device().is_cpu());
}

TEST_CASE("offload api: embeddings and host-computed layers stream beside Linear layers", "[strict]") {
  ModelCache cache(small_cache("64MiB"));
  at::manual_seed(13);
  const at::Tensor table = at::randn({50, 16});
  const at::Tensor conv_w = at::randn({16, 4, 3, 3}) / 8.0, conv_b = at::randn({16});
  const at::Tensor lin_w = at::randn({8, 16}) / 4.0;
  std::vector<OffloadLayer> layers = {{"embed_tokens", table, std::nullopt, OffloadLayerKind::embedding},
                                      {"patch_embed.conv", conv_w, conv_b, OffloadLayerKind::other},
                                      {"proj", lin_w, std::nullopt, OffloadLayerKind::linear}};
  OffloadOptions o = fp32("mixed");
  o.max_resident = 0.0;  // the convolution and the Linear stream (an embedding is always resident)
  OffloadedModel m(layers, {}, cache, o);
  const at::Tensor ids = at::randint(0, 50, {2, 5});
  const at::Tensor img = at::randn({2, 4, 6, 6});
  for (int round = 0; round < 2; ++round) {
    m.begin_forward("dit");
    const at::Tensor e = m.embedding(0, ids);
    const at::Tensor c = m.call(1, [&](const at::Tensor& w, const at::Tensor& b) { return at::conv2d(img, w, b, 1, 1); });
    const at::Tensor y = m.linear(2, e);
    m.end_forward(false);
    CHECK(at::equal(e, at::embedding(table, ids)));
    CHECK(at::allclose(c, at::conv2d(img, conv_w, conv_b, 1, 1), 1e-5, 1e-5));
    CHECK(at::allclose(y, at::linear(at::embedding(table, ids), lin_w), 1e-5, 1e-5));
  }
  const json s = json::parse(m.stats_json());
  CHECK(s["model"]["streamed_layers"] == 2);
  CHECK(s["forwards"][1]["bytes_streamed"].get<uint64_t>() == conv_w.nbytes() + conv_b.nbytes() + lin_w.nbytes());
  // The wrong entry point for a layer's kind, and bad ids, are named.
  CHECK_THROWS_WITH(m.linear(0, at::randn({1, 50})), Catch::Contains("'embed_tokens' is not a Linear layer"));
  CHECK_THROWS_WITH(m.embedding(2, ids), Catch::Contains("'proj' is not an embedding"));
  CHECK_THROWS_WITH(m.embedding(0, ids.to(at::kFloat)), Catch::Contains("takes int32/int64 ids"));
  // A failing host computation ends its forward aborted and leaves the model usable.
  CHECK_THROWS_WITH(m.call(1, [](const at::Tensor&, const at::Tensor&) -> at::Tensor { throw std::runtime_error("host failed"); }),
                    Catch::Contains("host failed"));
  CHECK(at::equal(m.embedding(0, ids), at::embedding(table, ids)));
  std::vector<OffloadLayer> bad = {{"embed", table, at::zeros({50}), OffloadLayerKind::embedding}};
  CHECK_THROWS_WITH(OffloadedModel(bad, {}, cache, fp32("bad")), Catch::Contains("embedding 'embed' has a bias"));
}
