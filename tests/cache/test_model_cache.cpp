// The model cache (cache/model_cache.h) on generated anima-tiny/anima-small models with
// the CPU as the device: RAM tier (LRU eviction, locks, drop while locked, reload on a
// settings change), device tier (shares of one budget, partial unloads before whole drops,
// exact accounting against budget - working memory, the minimum-budget error), output
// identity across budgets/max_resident/prefetch, storage dtypes after every forward,
// concurrent users, queries and other models' locks during a forward that is held open,
// concurrent misses under a RAM limit, and two loads racing to add one model.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <regex>
#include <string>
#include <cstdio>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cache/model_cache.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "offload/layer/layer.h"
#include "runtime/error.h"
#include "runtime/size_parse.h"
#include "tests/support/counting_device.h"
#include "tests/support/device_env.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using namespace sluice::cache;

namespace {

constexpr uint64_t MiB = 1ull << 20;

LoadSpec spec(const std::string& preset = "anima-tiny", uint64_t seed = 1) {
  LoadSpec s;
  s.source = preset;
  s.seed = seed;
  s.storage.storage = at::kFloat8_e4m3fn;
  s.storage.compute = at::kBFloat16;
  return s;
}

CacheOptions options(uint64_t budget = 512 * MiB, uint64_t working = 1 * MiB) {
  CacheOptions o;
  o.device = sluice::testing::test_device_or_cpu();
  o.vram_budget = budget;
  o.working_memory = working;
  o.ram_limit = 0;  // unlimited unless a test sets one
  return o;
}

struct Inputs {
  at::Tensor x, t, ctx;
};

Inputs inputs(const anima::AnimaConfig& c, uint64_t seed = 7) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return {at::randn({1, c.in_channels, 1, 8, 8}, gen).to(at::kBFloat16), at::rand({1}, gen),
          at::randn({1, 5, c.crossattn_emb_channels}, gen).to(at::kBFloat16)};
}

at::Tensor forward(ModelCache& cache, const Lock& lock, const Inputs& in) {
  at::Tensor out;
  cache.run(lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode guard;
    offload::ForwardScope scope(engine, "dit");
    const c10::Device d = engine.device().device();  // any SLUICE_TEST_DEVICE: in there, result back
    out = m.forward(in.x.to(d), in.t.to(d), in.ctx.to(d)).cpu();
  });
  return out;
}

at::Tensor forward(ModelCache& cache, const std::shared_ptr<Entry>& e, const Inputs& in) {
  Lock l = cache.lock(e);
  return forward(cache, l, in);
}

// Stored dtype of every parameter of a locked model, keyed by module name for the managed
// layers' weights ("blocks.0.mlp.layer1") and by parameter name for everything else.
std::map<std::string, at::ScalarType> stored_dtypes(ModelCache& cache, const Lock& lock) {
  std::map<std::string, at::ScalarType> out;
  cache.run(lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine&) {
    for (const auto& [name, l] : offload::managed_layers(m)) out[name] = l->stored_weight().scalar_type();
    for (const auto& p : m.named_parameters(true)) out[p.key()] = p.value().scalar_type();
  });
  return out;
}

// The device bytes every attached model holds, summed, against the backend's own count
// (a staging ring is reserved at its capacity and allocated as its slots are made).
// The most device memory alive at once since the cache last set its budget, as the CPU
// device's allocator counts it: independent of the ledgers that enforce the budget.
uint64_t alive_peak(const offload::DeviceBackend& dev) {
  const auto a = dev.allocator_stats();
  REQUIRE(a.available);
  return static_cast<uint64_t>(a.peak_bytes);
}

void check_accounting(ModelCache& cache, const std::vector<std::shared_ptr<Entry>>& entries) {
  const CacheStats s = cache.stats();
  uint64_t sum = 0;
  for (const auto& e : entries) {
    const auto st = cache.entry_state(e);
    sum += st.device_allocated;
    CHECK(st.device_allocated <= st.device_bytes);
    CHECK(st.device_bytes <= st.share);
  }
  CHECK(sum == static_cast<uint64_t>(s.vram.current));
  CHECK(s.vram_reserved_bytes <= s.vram_limit_bytes);
  CHECK(alive_peak(cache.device()) <= sluice::testing::allocator_bound(cache.device(), s.vram_limit_bytes, s.working_memory_bytes));
}

uint64_t model_bytes(const std::string& preset = "anima-tiny") {
  return estimate_model_bytes(spec(preset), at::kCPU);
}

// A gate that opens once. Waits give up after `limit`, so that a cache that makes a call
// wait for what the test holds open fails its checks instead of hanging.
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  bool open = false;
  void release() {
    {
      std::lock_guard<std::mutex> g(m);
      open = true;
    }
    cv.notify_all();
  }
  bool wait(std::chrono::seconds limit) {
    std::unique_lock<std::mutex> g(m);
    return cv.wait_for(g, limit, [&] { return open; });
  }
};

// A fresh file name under $TMPDIR (or /tmp), removed with the object.
struct TempFile {
  std::string path;
  TempFile() {
    const char* t = std::getenv("TMPDIR");
    std::string tmpl = std::string(t && *t ? t : "/tmp") + "/sluice_cache_XXXXXX";
    const int fd = ::mkstemp(tmpl.data());
    REQUIRE(fd >= 0);
    ::close(fd);
    path = tmpl;
  }
  ~TempFile() { ::unlink(path.c_str()); }
};

// Needs of a preset under default engine options, learned from a roomy cache.
ModelCache::EntryState needs_of(const std::string& preset, std::optional<double> max_resident = std::nullopt) {
  auto cache = ModelCache::create(options());
  LoadSpec s = spec(preset);
  s.max_resident = max_resident;
  return cache->entry_state(cache->load(s));
}

}  // namespace

TEST_CASE("model_cache: the RAM estimate equals the loaded model's bytes", "[strict][accel]") {
  auto cache = ModelCache::create(options());
  for (const char* preset : {"anima-tiny", "anima-small"}) {
    for (auto storage : {at::kFloat8_e4m3fn, at::kBFloat16}) {
      INFO(preset << " " << storage);
      LoadSpec s = spec(preset);
      s.storage.storage = storage;
      auto e = cache->load(s);
      CHECK(cache->entry_state(e).ram_bytes == estimate_model_bytes(s, at::kCPU));
      CHECK(e->estimate == cache->entry_state(e).ram_bytes);
    }
  }
}

TEST_CASE("model_cache: the RAM limit evicts unlocked models least recently used first", "[strict][accel]") {
  const uint64_t size = model_bytes();
  CacheOptions o = options();
  o.ram_limit = size * 5 / 2;  // two models fit, three do not
  auto cache = ModelCache::create(o);
  const Inputs in = inputs(anima::preset("anima-tiny"));
  auto a = cache->load(spec("anima-tiny", 1));
  auto b = cache->load(spec("anima-tiny", 2));
  const at::Tensor ref_b = forward(*cache, b, in);
  forward(*cache, a, in);  // a is now the most recently used
  CHECK(cache->stats().evictions == 0);
  auto c = cache->load(spec("anima-tiny", 3));
  CHECK(cache->entry_state(a).in_ram);
  CHECK_FALSE(cache->entry_state(b).in_ram);  // least recently used
  CHECK(cache->entry_state(c).in_ram);
  CHECK_FALSE(cache->entry_state(b).attached);
  CacheStats s = cache->stats();
  CHECK(s.evictions == 1);
  CHECK(s.loads == 3);
  CHECK(static_cast<uint64_t>(s.ram.current) == 2 * size);
  CHECK(s.vram.current == static_cast<int64_t>(cache->entry_state(a).device_bytes + cache->entry_state(c).device_bytes));

  // Locking the evicted model reloads it (a miss) and evicts the next LRU (a, used before c).
  const uint64_t misses = s.misses;
  const at::Tensor again = forward(*cache, b, in);
  CHECK(at::equal(again, ref_b));  // the reload is the same model
  s = cache->stats();
  CHECK(s.misses == misses + 1);
  CHECK(s.loads == 4);
  CHECK(s.evictions == 2);
  CHECK_FALSE(cache->entry_state(a).in_ram);
  CHECK(cache->entry_state(c).in_ram);
  CHECK(static_cast<uint64_t>(s.ram.peak) <= o.ram_limit.value() + size);  // one model over while loading at most
  CHECK(static_cast<uint64_t>(s.ram.current) <= *o.ram_limit);
}

TEST_CASE("model_cache: a locked model is never evicted and goes first once unlocked", "[strict][accel]") {
  const uint64_t size = model_bytes();
  CacheOptions o = options();
  o.ram_limit = size * 3 / 2;  // one model fits
  auto cache = ModelCache::create(o);
  const Inputs in = inputs(anima::preset("anima-tiny"));
  auto a = cache->load(spec("anima-tiny", 1));
  {
    Lock la = cache->lock(a);
    auto b = cache->load(spec("anima-tiny", 2));  // over the limit: a is locked, so both stay
    CHECK(cache->entry_state(a).in_ram);
    CHECK(cache->entry_state(b).in_ram);
    CHECK(cache->stats().evictions == 0);
    CHECK(cache->stats().locked == 1);
    forward(*cache, la, in);
    // b is unlocked and now least recently used: loading c evicts b, not the locked a.
    auto c = cache->load(spec("anima-tiny", 3));
    CHECK(cache->entry_state(a).in_ram);
    CHECK_FALSE(cache->entry_state(b).in_ram);
    CHECK(cache->entry_state(c).in_ram);
  }
  // Unlocked, a is the least recently used and the cache is over its limit: a goes.
  CHECK_FALSE(cache->entry_state(a).in_ram);
  CHECK(static_cast<uint64_t>(cache->stats().ram.current) <= *o.ram_limit);
}

TEST_CASE("model_cache: dropping a locked model marks it stale and evicts it at unlock", "[strict][accel]") {
  auto cache = ModelCache::create(options());
  const Inputs in = inputs(anima::preset("anima-tiny"));
  auto a = cache->load(spec());
  const at::Tensor ref = forward(*cache, a, in);
  {
    Lock l = cache->lock(a);
    cache->drop(a);
    const auto st = cache->entry_state(a);
    CHECK(st.dropped);
    CHECK(st.in_ram);
    CHECK(st.attached);
    CHECK(at::equal(forward(*cache, l, in), ref));  // still usable while locked
    CHECK_THROWS_AS(cache->lock(a), InvalidArgument);
    CHECK(cache->stats().evictions == 0);
  }
  CHECK_FALSE(cache->entry_state(a).in_ram);
  CHECK(cache->stats().evictions == 1);
  CHECK(cache->stats().ram.current == 0);
  CHECK(cache->stats().vram.current == 0);
  CHECK_THROWS_AS(cache->lock(a), InvalidArgument);
  // Loading the source again makes a new model.
  auto again = cache->load(spec());
  CHECK(again != a);
  CHECK(at::equal(forward(*cache, again, in), ref));
  CHECK(cache->stats().loads == 2);
}

TEST_CASE("model_cache: changing the storage dtype or the skip list forces a reload", "[strict][accel]") {
  auto cache = ModelCache::create(options());
  auto fp8 = cache->load(spec());
  CHECK(cache->stats().loads == 1);
  auto same = cache->load(spec());
  CHECK(same == fp8);
  CHECK(cache->stats().loads == 1);
  CHECK(cache->stats().hits == 1);

  Lock old_lock = cache->lock(fp8);
  LoadSpec bf16 = spec();
  bf16.storage.storage = at::kBFloat16;
  auto b = cache->load(bf16);
  CHECK(b != fp8);
  CHECK(cache->stats().loads == 2);
  CHECK(cache->entry_state(fp8).dropped);
  CHECK(cache->entry_state(fp8).in_ram);  // locked: stale until unlocked
  {
    Lock l = cache->lock(b);
    CHECK(stored_dtypes(*cache, l).at("blocks.0.mlp.layer1") == at::kBFloat16);
  }
  CHECK(stored_dtypes(*cache, old_lock).at("blocks.0.mlp.layer1") == at::kFloat8_e4m3fn);
  old_lock.unlock();
  CHECK_FALSE(cache->entry_state(fp8).in_ram);

  LoadSpec skip = spec();
  skip.storage.extra_skip_patterns = {"mlp"};
  auto s = cache->load(skip);
  CHECK(cache->stats().loads == 3);
  CHECK_FALSE(cache->entry_state(b).in_ram);  // the bf16 copy was replaced
  {
    Lock l = cache->lock(s);
    const auto dt = stored_dtypes(*cache, l);
    CHECK(dt.at("blocks.0.mlp.layer1") == at::kBFloat16);
    CHECK(dt.at("blocks.0.self_attn.q_proj") == at::kFloat8_e4m3fn);
  }
  // max_resident is not a loading setting: no reload.
  LoadSpec capped = skip;
  capped.max_resident = 0.5;
  CHECK(cache->load(capped) == s);
  CHECK(cache->stats().loads == 3);
}

TEST_CASE("model_cache: other models are partially unloaded before any is dropped from the device", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  REQUIRE(n.minimum < n.full);
  const uint64_t W = 1 * MiB;
  // Room for one model fully resident plus the other at its minimum and a bit.
  const uint64_t slack = n.minimum / 2;
  REQUIRE(slack < n.full - n.minimum);
  auto cache = ModelCache::create(options(n.full + n.minimum + slack + W, W));
  const Inputs in = inputs(anima::preset("anima-small"));
  auto a = cache->load(spec("anima-small", 1));
  CHECK(cache->entry_state(a).share == n.full);
  auto b = cache->load(spec("anima-small", 2));
  auto sa = cache->entry_state(a);
  auto sb = cache->entry_state(b);
  CHECK(sb.share == n.full);
  CHECK(sa.attached);
  CHECK(sa.share == n.minimum + slack);  // only as much as b needed
  CHECK(cache->stats().device_unloads == 1);
  CHECK(cache->stats().device_drops == 0);
  check_accounting(*cache, {a, b});

  // Locking a takes the room back from b, again partially.
  const at::Tensor out_a = forward(*cache, a, in);
  CHECK(cache->entry_state(a).share == n.full);
  CHECK(cache->entry_state(b).share == n.minimum + slack);
  CHECK(cache->stats().device_unloads == 2);
  CHECK(cache->stats().device_drops == 0);
  check_accounting(*cache, {a, b});

  // A third model: partial unloads cannot free enough, so a whole model (the LRU, b) goes.
  auto c = cache->load(spec("anima-small", 3));
  CHECK(cache->entry_state(c).share == n.full);
  CHECK_FALSE(cache->entry_state(b).attached);
  CHECK(cache->entry_state(b).in_ram);  // off the device only
  CHECK(cache->entry_state(a).attached);
  CHECK(cache->stats().device_drops == 1);
  check_accounting(*cache, {a, b, c});
  CHECK(at::equal(forward(*cache, a, in), out_a));
  check_accounting(*cache, {a, b, c});
}

TEST_CASE("model_cache: a model in use keeps its residency and the budget is never exceeded", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  const uint64_t W = 2 * MiB;
  auto cache = ModelCache::create(options(n.full + n.minimum + W, W));
  const Inputs in = inputs(anima::preset("anima-small"));
  auto a = cache->load(spec("anima-small", 1));
  auto b = cache->load(spec("anima-small", 2));
  auto c = cache->load(spec("anima-small", 3));
  std::vector<std::shared_ptr<Entry>> all = {a, b, c};
  {
    Lock la = cache->lock(a);
    const uint64_t share_a = cache->entry_state(a).share;
    Lock lb = cache->lock(b);
    CHECK(cache->entry_state(a).share == share_a);  // not unloaded while locked
    CHECK(cache->entry_state(b).share >= n.minimum);
    // No room for c beside two locked models.
    CHECK_THROWS_AS(cache->lock(c), ResourceError);
    check_accounting(*cache, all);
    forward(*cache, la, in);
    forward(*cache, lb, in);
    check_accounting(*cache, all);
  }
  for (int round = 0; round < 2; ++round) {
    for (const auto& e : all) {
      forward(*cache, e, in);
      check_accounting(*cache, all);
    }
  }
  // Every allocation went through the backend: its hard limit is the budget minus working
  // memory, and nothing is held outside the models.
  const CacheStats s = cache->stats();
  CHECK(s.vram_limit_bytes == n.full + n.minimum);
  CHECK(alive_peak(cache->device()) <= sluice::testing::allocator_bound(cache->device(), s.vram_limit_bytes, s.working_memory_bytes));
  CHECK_THROWS_AS(cache->device().allocate({static_cast<int64_t>(s.vram_limit_bytes - s.vram.current + 1)}, at::kByte,
                                           offload::MemoryKind::scratch, "probe"),
                  ResourceError);
}

TEST_CASE("model_cache: an impossible budget names the minimum that would work", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  const uint64_t W = 3 * MiB;
  std::string msg;
  try {
    auto cache = ModelCache::create(options(W + n.minimum / 2, W));
    cache->load(spec("anima-small"));
    FAIL("load accepted a budget below the minimum");
  } catch (const ResourceError& e) {
    msg = e.what();
  }
  CHECK(msg.find("'anima-small'") != std::string::npos);
  std::smatch m;
  REQUIRE(std::regex_search(msg, m, std::regex(R"(minimum that would work is \S+ \((\d+) bytes)")));
  const uint64_t minimum = std::stoull(m[1].str());
  CHECK(minimum == n.minimum + W);
  {
    auto cache = ModelCache::create(options(minimum, W));
    auto e = cache->load(spec("anima-small"));
    CHECK(cache->entry_state(e).attached);
    CHECK(cache->stats().models == 1);
    forward(*cache, e, inputs(anima::preset("anima-small")));
  }
  {
    auto cache = ModelCache::create(options(minimum - 1, W));
    CHECK_THROWS_AS(cache->load(spec("anima-small")), ResourceError);
    CHECK(cache->stats().models == 0);  // not kept
    CHECK(cache->stats().ram.current == 0);
  }
  // With the default working memory (a quarter of a small budget) the minimum is exact too.
  CacheOptions o = options(n.minimum, 0);
  o.working_memory.reset();
  try {
    ModelCache::create(o)->load(spec("anima-small"));
    FAIL("load accepted a budget below the minimum");
  } catch (const ResourceError& e) {
    msg = e.what();
  }
  REQUIRE(std::regex_search(msg, m, std::regex(R"(minimum that would work is \S+ \((\d+) bytes)")));
  const uint64_t with_default = std::stoull(m[1].str());
  o.vram_budget = with_default;
  CHECK_NOTHROW(ModelCache::create(o)->load(spec("anima-small")));
  o.vram_budget = with_default - 1;
  CHECK_THROWS_AS(ModelCache::create(o)->load(spec("anima-small")), ResourceError);
}

TEST_CASE("model_cache: outputs are bit-identical across budgets and max_resident and prefetch", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  const Inputs in = inputs(anima::preset("anima-small"));
  const uint64_t W = 1 * MiB;
  at::Tensor ref;
  {
    auto cache = ModelCache::create(options());
    ref = forward(*cache, cache->load(spec("anima-small")), in);
  }
  struct Case {
    uint64_t weights;
    std::optional<double> cap;
    uint32_t prefetch;
    offload::ResidencyPolicy policy;
  };
  const uint64_t mid = (n.minimum + n.full) / 2;
  const std::vector<Case> cases = {
      {n.minimum, std::nullopt, 2, offload::ResidencyPolicy::spread},
      {n.minimum, std::nullopt, 0, offload::ResidencyPolicy::spread},
      {mid, std::nullopt, 1, offload::ResidencyPolicy::spread},
      {mid, std::nullopt, 3, offload::ResidencyPolicy::front_first},
      {n.full, 0.0, 2, offload::ResidencyPolicy::spread},
      {n.full, 0.5, 1, offload::ResidencyPolicy::spread},
      {n.full, std::nullopt, 2, offload::ResidencyPolicy::spread},
  };
  for (const auto& c : cases) {
    INFO("weights " << c.weights << " cap " << (c.cap ? *c.cap : -1.0) << " prefetch " << c.prefetch);
    CacheOptions o = options(c.weights + W, W);
    o.prefetch = c.prefetch;
    o.policy = c.policy;
    auto cache = ModelCache::create(o);
    LoadSpec s = spec("anima-small");
    s.max_resident = c.cap;
    auto e = cache->load(s);
    Lock l = cache->lock(e);
    const auto before = stored_dtypes(*cache, l);
    for (int f = 0; f < 3; ++f) {
      CHECK(at::equal(forward(*cache, l, in), ref));
      CHECK(stored_dtypes(*cache, l) == before);
    }
    l.unlock();
    const offload::EngineStats st = cache->engine_stats(e);
    REQUIRE(st.forward_records.size() == 3);
    const uint64_t streamed = cache->entry_state(e).streamed_dit;  // what a DiT forward uses
    CHECK(streamed + cache->entry_state(e).streamed_adapter == st.model_total_bytes - st.model_resident_bytes);
    if (c.weights == n.minimum || (c.cap && *c.cap == 0.0)) CHECK(streamed > 0);
    if (c.weights == n.full && !c.cap) CHECK(streamed == 0);
    for (const auto& r : st.forward_records) CHECK(r.bytes_streamed == streamed);
    CHECK(alive_peak(cache->device()) <=
          sluice::testing::allocator_bound(cache->device(), c.weights, cache->stats().working_memory_bytes));
  }
}

TEST_CASE("model_cache: stored dtypes hold after a forward that throws on a bad input shape", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  auto cache = ModelCache::create(options((n.minimum + n.full) / 2 + MiB, MiB));
  const Inputs in = inputs(anima::preset("anima-small"));
  auto e = cache->load(spec("anima-small"));
  Lock l = cache->lock(e);
  const at::Tensor ref = forward(*cache, l, in);
  const auto before = stored_dtypes(*cache, l);
  CHECK(before.at("blocks.0.mlp.layer1") == at::kFloat8_e4m3fn);
  Inputs bad_ctx = in;
  bad_ctx.ctx = at::zeros({1, 5, 7}, at::kBFloat16);  // wrong context width
  Inputs bad_x = in;
  bad_x.x = at::zeros({1, 3, 1, 8, 8}, at::kBFloat16);  // wrong channel count
  Inputs bad_batch = in;
  bad_batch.ctx = at::zeros({2, 5, in.ctx.size(2)}, at::kBFloat16);  // batch mismatch
  for (const Inputs* bad : {&bad_ctx, &bad_x, &bad_batch}) {
    CHECK_THROWS(forward(*cache, l, *bad));
    CHECK(stored_dtypes(*cache, l) == before);
    CHECK(at::equal(forward(*cache, l, in), ref));
  }
  l.unlock();
  const offload::EngineStats st = cache->engine_stats(e);
  CHECK(st.slot_violations == 0);
}

TEST_CASE("model_cache: concurrent users of two models and of the same model match the reference", "[strict][accel]") {
  const auto n = needs_of("anima-tiny");
  const uint64_t W = 1 * MiB;
  // Both can be locked at once, but not both fully resident: locks move residency around.
  auto cache = ModelCache::create(options(n.full + n.minimum + (n.full - n.minimum) / 2 + W, W));
  const anima::AnimaConfig cfg = anima::preset("anima-tiny");
  auto a = cache->load(spec("anima-tiny", 1));
  auto b = cache->load(spec("anima-tiny", 2));
  constexpr int kThreads = 4, kIters = 6;
  std::map<std::pair<int, int>, at::Tensor> ref;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kIters; ++i) ref[{t, i}] = forward(*cache, t < 2 ? a : b, inputs(cfg, 100 * t + i));
  }
  std::atomic<int> mismatches{0}, errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      try {
        const auto& e = t < 2 ? a : b;  // threads 0,1 share a; 2,3 share b
        for (int i = 0; i < kIters; ++i) {
          const at::Tensor out = forward(*cache, e, inputs(cfg, 100 * t + i));
          if (!at::equal(out, ref.at({t, i}))) ++mismatches;
          if (i % 3 == 1) cache->partial_unload(e, 1ull << 16);
          if (i % 3 == 2) cache->partial_load(e, 1ull << 20);
          (void)cache->model_stats_json(e);
        }
      } catch (const std::exception& ex) {
        UNSCOPED_INFO("thread " << t << ": " << ex.what());
        ++errors;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(errors == 0);
  CHECK(mismatches == 0);
  check_accounting(*cache, {a, b});
  for (const auto& e : {a, b}) {
    const offload::EngineStats st = cache->engine_stats(e);
    CHECK(st.slot_violations == 0);
    for (const auto& r : st.forward_records) CHECK_FALSE(r.aborted);
  }
}

TEST_CASE("model_cache: residency changes of one model move only its share", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  const uint64_t W = 1 * MiB;
  auto cache = ModelCache::create(options(2 * n.full + W, W));
  auto a = cache->load(spec("anima-small", 1));
  CHECK(cache->entry_state(a).share == n.full);
  const int64_t down = cache->full_unload(a);
  CHECK(down < 0);
  CHECK(cache->entry_state(a).share == n.minimum);
  CHECK(cache->entry_state(a).device_bytes <= n.minimum);
  // A later lock keeps the target the user set.
  forward(*cache, a, inputs(anima::preset("anima-small")));
  CHECK(cache->entry_state(a).share == n.minimum);
  const int64_t up = cache->partial_load(a, (n.full - n.minimum) / 2);
  CHECK(up > 0);
  CHECK(cache->entry_state(a).share == n.minimum + (n.full - n.minimum) / 2);
  CHECK(cache->partial_unload(a, 1ull << 40) < 0);
  CHECK(cache->entry_state(a).share == n.minimum);
  CHECK(cache->full_load(a) > 0);
  CHECK(cache->entry_state(a).share == n.full);
  cache->set_max_resident(a, 0.0);
  const auto capped = cache->entry_state(a);
  CHECK(capped.share == capped.wanted);
  CHECK(capped.share < n.full);
  cache->set_max_resident(a, std::nullopt);
  CHECK(cache->entry_state(a).share == n.full);
  {
    // The budget shrinks below what the locked a holds: a is partially unloaded, never
    // below its minimum.
    Lock l = cache->lock(a);
    cache->set_vram_budget(n.minimum + W + 1000);
    CHECK(cache->entry_state(a).share <= n.minimum + 1000);
    CHECK(cache->entry_state(a).attached);
    CHECK(cache->stats().vram_limit_bytes == n.minimum + 1000);
    check_accounting(*cache, {a});
    CHECK_THROWS_AS(cache->set_vram_budget(W + 1000), ResourceError);
    CHECK(cache->stats().vram_limit_bytes == n.minimum + 1000);  // unchanged
  }
  // Unlocked, it is taken off the device instead.
  cache->set_vram_budget(W + 1000);
  CHECK_FALSE(cache->entry_state(a).attached);
  CHECK(cache->entry_state(a).in_ram);
  CHECK(cache->stats().vram.current == 0);
  CHECK_THROWS_AS(cache->lock(a), ResourceError);
}

TEST_CASE("model_cache: queries and other models' locks never wait for a running forward", "[strict][accel]") {
  const auto n = needs_of("anima-tiny");
  const uint64_t W = 1 * MiB;
  CacheOptions o = options(2 * n.full + W, W);
  o.trace = true;
  auto cache = ModelCache::create(o);
  const Inputs in = inputs(anima::preset("anima-tiny"));
  auto a = cache->load(spec("anima-tiny", 1));
  auto b = cache->load(spec("anima-tiny", 2));
  forward(*cache, a, in);
  const uint64_t forwards = cache->engine_stats(a).forwards;
  REQUIRE(forwards == 1);

  // A forward of a that lasts at least 2 s and until the test releases it (at most 5 s):
  // a real forward, then a hold inside the same run().
  using Clock = std::chrono::steady_clock;
  Lock la = cache->lock(a);
  Gate started, release;
  std::atomic<bool> ended{false};
  Clock::time_point run_start, run_end;
  std::thread runner([&] {
    cache->run(la, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
      run_start = Clock::now();
      {
        c10::InferenceMode guard;
        offload::ForwardScope scope(engine, "dit");
        const c10::Device d = engine.device().device();
        m.forward(in.x.to(d), in.t.to(d), in.ctx.to(d));
      }
      started.release();
      release.wait(std::chrono::seconds(5));
      std::this_thread::sleep_until(run_start + std::chrono::seconds(2));
      run_end = Clock::now();
      ended = true;
    });
  });
  REQUIRE(started.wait(std::chrono::seconds(120)));
  // The longest of the calls below; the done-when bound is a tenth of the forward's time.
  double longest_ms = 0;
  const auto timed = [&](const auto& call) {
    const auto t0 = Clock::now();
    call();
    longest_ms = std::max(longest_ms, std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  };

  // A residency change of a waits for a's forward, without holding up anyone else.
  std::atomic<bool> unload_after_end{false};
  std::thread unloader([&] {
    cache->full_unload(a);
    unload_after_end = ended.load();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // lets it reach its wait; not a bound

  // Each call returns while a's forward is still running; the snapshot predates it.
  offload::EngineStats st;
  timed([&] { st = cache->engine_stats(a); });
  CHECK_FALSE(ended);
  CHECK(st.forwards == forwards);
  std::string model_json;
  timed([&] { model_json = cache->model_stats_json(a); });
  CHECK(model_json.find("\"forwards\"") != std::string::npos);
  CHECK_FALSE(ended);
  ModelCache::EntryState es;
  timed([&] { es = cache->entry_state(a); });
  CHECK_FALSE(ended);
  CHECK(es.locks >= 1);
  CHECK(es.device_bytes > 0);
  TempFile trace;
  timed([&] { cache->write_trace(a, trace.path); });
  CHECK_FALSE(ended);
  std::ifstream written(trace.path);
  const std::string json((std::istreambuf_iterator<char>(written)), std::istreambuf_iterator<char>());
  CHECK(json.find("traceEvents") != std::string::npos);
  std::string cache_json;
  timed([&] { cache_json = cache->stats_json(); });
  CHECK(cache_json.find("\"hits\"") != std::string::npos);
  CHECK_FALSE(ended);
  {
    Lock lb;
    timed([&] { lb = cache->lock(b); });
    CHECK_FALSE(ended);
    forward(*cache, lb, in);
    CHECK_FALSE(ended);
  }
  CHECK(cache->engine_stats(b).forwards == 1);
  CHECK_FALSE(ended);

  release.release();
  runner.join();
  unloader.join();
  CHECK(unload_after_end);
  const double forward_ms = std::chrono::duration<double, std::milli>(run_end - run_start).count();
  std::printf("a forward of %.0f ms: stats, model stats, entry state, trace, cache stats and another model's lock() "
              "took at most %.2f ms each\n", forward_ms, longest_ms);
  CHECK(forward_ms >= 2000);
  CHECK(longest_ms < forward_ms / 10);
  la.unlock();
  // The forward published its stats as it ended.
  CHECK(cache->engine_stats(a).forwards == forwards + 1);
  CHECK(cache->entry_state(a).share == n.minimum);  // the unload ran after it
  check_accounting(*cache, {a, b});
}

TEST_CASE("model_cache: the published state follows forwards and residency changes", "[strict][accel]") {
  const auto n = needs_of("anima-small");
  REQUIRE(n.minimum < n.full);
  const uint64_t W = 1 * MiB;
  auto cache = ModelCache::create(options(n.full + W, W));
  const Inputs in = inputs(anima::preset("anima-small"));
  auto a = cache->load(spec("anima-small", 1));
  CHECK(cache->engine_stats(a).forwards == 0);
  const ModelCache::EntryState full = cache->entry_state(a);
  CHECK(full.streamed_dit == 0);
  for (uint64_t i = 1; i <= 2; ++i) {
    forward(*cache, a, in);
    CHECK(cache->engine_stats(a).forwards == i);
  }
  cache->full_unload(a);
  const ModelCache::EntryState low = cache->entry_state(a);
  CHECK(low.device_bytes <= n.minimum);
  CHECK(low.device_bytes < full.device_bytes);
  CHECK(low.streamed_dit > 0);
  CHECK(low.residency != full.residency);
  const offload::EngineStats st = cache->engine_stats(a);
  CHECK(st.residency == low.residency);
  CHECK(st.model_resident_bytes < st.model_total_bytes);
  // Taken off the device (a budget that holds nothing), the state says so.
  cache->set_vram_budget(W + 1000);
  CHECK(cache->entry_state(a).device_bytes == 0);
  CHECK(cache->entry_state(a).residency.empty());
}

TEST_CASE("model_cache: a forward that uses more than the working memory grows the cache's working memory",
          "[strict][accel]") {
  // Note [measured working memory] (offload/engine/model_budget.h): the engines measure, the cache keeps
  // the working memory out of every share and grows it to a measurement plus an eighth.
  auto counting = std::make_shared<sluice::testing::CountingDevice>(
      std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device()));
  CacheOptions o = options(512 * MiB, 1 * MiB);
  o.device = counting;
  auto cache = ModelCache::create(o);
  auto e = cache->load(spec());
  Lock l = cache->lock(e);
  const Inputs in = inputs(cache->entry_config(e));
  const at::Tensor ref = forward(*cache, l, in);
  CHECK(cache->stats().working_memory_bytes == 1 * MiB);  // anima-tiny's activations are host memory here
  const int64_t activations = 8 * MiB;
  at::Tensor out;
  cache->run(l, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode guard;
    offload::ForwardScope scope(engine, "adapter-like");  // a kind not measured yet
    counting->activations(activations);
    out = m.forward(in.x, in.t, in.ctx);
    counting->activations(-activations);
  });
  CHECK(at::equal(out, ref));
  const CacheStats s = cache->stats();
  CHECK(s.measured_working_memory_bytes >= static_cast<uint64_t>(activations));
  CHECK(s.working_memory_bytes >= s.measured_working_memory_bytes);
  CHECK(s.working_memory_bytes < 2 * static_cast<uint64_t>(activations));
  CHECK(s.vram_limit_bytes == s.vram_budget_bytes - s.working_memory_bytes);
  CHECK(s.vram_reserved_bytes <= s.vram_limit_bytes);
  CHECK(nlohmann::json::parse(cache->stats_json())["measured_working_memory_bytes"].get<uint64_t>() ==
        s.measured_working_memory_bytes);
  CHECK(at::equal(forward(*cache, l, in), ref));
}

TEST_CASE("model_cache: only a lower vram budget and taking models off the device empty the allocator's cache",
          "[strict][accel]") {
  // Note [releasing cached memory] (offload/device/device_allocator.h): making room for another model, a
  // partial unload or a budget raise keep the freed blocks cached for this process.
  auto counting = std::make_shared<sluice::testing::CountingDevice>(
      std::shared_ptr<offload::DeviceBackend>(offload::make_cpu_device()));
  CacheOptions o = options(512 * MiB, 1 * MiB);
  o.device = counting;
  auto cache = ModelCache::create(o);
  auto a = cache->load(spec("anima-tiny", 1));
  auto b = cache->load(spec("anima-tiny", 2));
  const int start = counting->release_calls();
  CHECK(cache->partial_unload(a, 64 * 1024) < 0);
  CHECK(cache->full_unload(b) < 0);
  CHECK(counting->release_calls() == start);
  cache->set_vram_budget(1024 * MiB);  // a raise
  CHECK(counting->release_calls() == start);
  const CacheStats s = cache->stats();
  cache->set_vram_budget(s.vram_reserved_bytes + s.working_memory_bytes - 64 * 1024);  // a cut that unloads
  // Once for the cut, and once per model it took off the device (a detach), if any.
  CHECK(counting->release_calls() == start + 1 + static_cast<int>(cache->stats().device_drops - s.device_drops));
}

TEST_CASE("model_cache: concurrent misses reserve their RAM before reading", "[strict][accel]") {
  const uint64_t size = model_bytes();
  CacheOptions o = options();
  o.ram_limit = size * 5 / 2;  // two models fit, three do not
  // Holds the reads of a and b until both have started, so that the two misses overlap.
  std::mutex m;
  std::condition_variable cv;
  int reading = 0;
  bool go = false;
  o.before_read = [&](const std::string& name) {
    if (name == "f") throw FileError("cannot read model 'f' (test)");
    if (name != "a" && name != "b") return;
    std::unique_lock<std::mutex> g(m);
    ++reading;
    cv.notify_all();
    cv.wait_for(g, std::chrono::seconds(10), [&] { return go; });
  };
  auto cache = ModelCache::create(o);
  auto c = cache->load(spec("anima-tiny", 3));
  auto named = [](uint64_t seed, const std::string& name) {
    LoadSpec s = spec("anima-tiny", seed);
    s.name = name;
    return s;
  };
  std::shared_ptr<Entry> a, b;
  std::thread ta([&] { a = cache->load(named(1, "a")); });
  std::thread tb([&] { b = cache->load(named(2, "b")); });
  {
    std::unique_lock<std::mutex> g(m);
    REQUIRE(cv.wait_for(g, std::chrono::seconds(120), [&] { return reading == 2; }));
  }
  // Both are being read: their bytes are reserved, and the second miss made room for both
  // by evicting c before it started.
  CacheStats s = cache->stats();
  CHECK(s.ram_reserved_bytes == 2 * size);
  CHECK(s.evictions == 1);
  CHECK(static_cast<uint64_t>(s.ram.current) + s.ram_reserved_bytes <= *o.ram_limit);
  {
    std::lock_guard<std::mutex> g(m);
    go = true;
  }
  cv.notify_all();
  ta.join();
  tb.join();
  REQUIRE(a);
  REQUIRE(b);
  s = cache->stats();
  CHECK(s.ram_reserved_bytes == 0);
  CHECK(static_cast<uint64_t>(s.ram.peak) <= *o.ram_limit);
  CHECK(static_cast<uint64_t>(s.ram.current) == 2 * size);
  CHECK(cache->entry_state(a).in_ram);
  CHECK(cache->entry_state(b).in_ram);
  CHECK_FALSE(cache->entry_state(c).in_ram);

  // A read that fails gives its reservation back.
  CHECK_THROWS_WITH(cache->load(named(4, "f")), Catch::Contains("cannot read model 'f'"));
  s = cache->stats();
  CHECK(s.ram_reserved_bytes == 0);
  CHECK(static_cast<uint64_t>(s.ram.current) <= *o.ram_limit);
}

TEST_CASE("model_cache: of two loads racing to add one model, only the one that added it may drop it",
          "[strict][accel]") {
  // Both loads find no entry and estimate the model outside the cache mutex; the second to
  // take it back finds the entry the first added (RamTier::entry_for) and only found it.
  // before_insert holds them between the two: "winner" goes on once "loser" has looked too,
  // and "loser" once the winner's load has returned and the budget has been cut below the
  // model's minimum, so that the loser's load fails with ResourceError. The two names are
  // the same model (a name is not a loading setting).
  const auto n = needs_of("anima-tiny");
  const uint64_t W = 1 * MiB;
  CacheOptions o = options(512 * MiB, W);
  std::mutex m;
  std::condition_variable cv;
  int looked = 0;
  bool loser_go = false;
  o.before_insert = [&](const std::string& name) {
    std::unique_lock<std::mutex> g(m);
    ++looked;
    cv.notify_all();
    if (name == "winner") cv.wait_for(g, std::chrono::seconds(60), [&] { return looked == 2; });
    if (name == "loser") cv.wait_for(g, std::chrono::seconds(120), [&] { return loser_go; });
  };
  auto cache = ModelCache::create(o);
  auto named = [](const std::string& name) {
    LoadSpec s = spec();
    s.name = name;
    return s;
  };
  std::shared_ptr<Entry> won, lost;
  std::string winner_error, loser_error;
  std::thread winner([&] {
    try {
      won = cache->load(named("winner"));
    } catch (const std::exception& e) {
      winner_error = e.what();
    }
  });
  std::thread loser([&] {
    try {
      lost = cache->load(named("loser"));
    } catch (const ResourceError& e) {
      loser_error = e.what();
    } catch (const std::exception& e) {
      loser_error = std::string("not a ResourceError: ") + e.what();
    }
  });
  auto release_loser = [&] {
    {
      std::lock_guard<std::mutex> g(m);
      loser_go = true;
    }
    cv.notify_all();
    loser.join();
  };
  try {
    winner.join();
    CHECK(winner_error.empty());
    REQUIRE(won);
    {
      std::lock_guard<std::mutex> g(m);
      CHECK(looked == 2);  // both looked before the winner added the entry
    }
    CHECK(cache->entry_state(won).attached);
    cache->set_vram_budget(W + n.minimum / 2);  // the unlocked model leaves the device
    CHECK_FALSE(cache->entry_state(won).attached);
  } catch (...) {
    release_loser();
    throw;
  }
  release_loser();
  CHECK_FALSE(lost);
  CHECK(loser_error.find("is too small for model 'winner'") != std::string::npos);

  // The loser only found the entry: the winner's model stays, in RAM, made and read once.
  const auto st = cache->entry_state(won);
  CHECK_FALSE(st.dropped);
  CHECK(st.in_ram);
  CacheStats s = cache->stats();
  REQUIRE(s.models_held.size() == 1);
  CHECK(s.models_held[0].id == 1);
  CHECK(s.models == 1);
  CHECK(s.misses == 1);
  CHECK(s.loads == 1);
  CHECK(s.hits == 1);  // the loser's
  CHECK(s.evictions == 0);

  // Under a budget that holds it again, the next load finds it and runs it without a read.
  cache->set_vram_budget(512 * MiB);
  CHECK(cache->load(named("again")) == won);
  CHECK(cache->entry_state(won).attached);
  const at::Tensor out = forward(*cache, won, inputs(anima::preset("anima-tiny")));
  CHECK(at::isfinite(out).all().item<bool>());
  s = cache->stats();
  CHECK(s.loads == 1);
  CHECK(s.hits == 3);  // the loser's, the load's, the lock's
}

// --- On the device SLUICE_TEST_DEVICE names (tests/support/device_env.h) -------------

TEST_CASE("model_cache: env device: two models sharing a budget too small for both give their fully resident outputs",
          "[env-device][strict][accel]") {
  SLUICE_TEST_DEVICE_OR_SKIP(dev);
  const auto n = needs_of("anima-tiny");
  REQUIRE(n.minimum < n.full);
  const uint64_t W = 1 * MiB;
  CacheOptions roomy = options(2 * n.full + W, W);
  roomy.device = dev;
  const anima::AnimaConfig c = anima::preset("anima-tiny");
  Inputs in = inputs(c);
  in.x = in.x.to(dev->device());
  in.t = in.t.to(dev->device());
  in.ctx = in.ctx.to(dev->device());
  auto cache = ModelCache::create(roomy);
  auto a = cache->load(spec("anima-tiny", 1));
  auto b = cache->load(spec("anima-tiny", 2));
  const at::Tensor ref_a = forward(*cache, a, in).cpu();
  const at::Tensor ref_b = forward(*cache, b, in).cpu();
  CHECK_FALSE(at::equal(ref_a, ref_b));
  check_accounting(*cache, {a, b});

  // One fully resident, the other near its minimum: the cache moves room between them.
  cache->set_vram_budget(n.full + n.minimum + (n.full - n.minimum) / 4 + W);
  for (int i = 0; i < 3; ++i) {
    CHECK(at::equal(forward(*cache, a, in).cpu(), ref_a));
    CHECK(at::equal(forward(*cache, b, in).cpu(), ref_b));
    check_accounting(*cache, {a, b});
  }
  CHECK(cache->stats().device_unloads > 0);
}
