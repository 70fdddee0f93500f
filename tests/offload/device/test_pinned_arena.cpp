// The pinned arena (offload/device/pinned_arena.h, Note [pinned arena]): packing, alignment,
// exact chunk sizes, the limit, lifetime (a chunk is freed with its last view) and the
// pinned / placed ratio on model-shaped layers; then through the engine and the model
// cache: pinned / streamed <= 1.01 in the stats, one limit shared by the models of a cache,
// the layers past it streamed from pageable memory (one warning, same output), re-attach
// without a second copy, and no host copy (peak RSS within 5%) when a model leaves the
// device.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <cstdio>

#include <fstream>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cache/model_cache.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "offload/device/pinned_arena.h"
#include "runtime/fault_injection.h"
#include "runtime/host_memory.h"
#include "runtime/logging.h"
#include "tests/support/fake_cgroup.h"
#include "tests/support/single_thread.h"
#include "tests/support/toy_model.h"

using namespace sluice;
using namespace sluice::offload;
using sluice::testing::ToyModel;
using sluice::testing::ToyOptions;

namespace {

constexpr uint64_t MiB = 1ull << 20;

std::shared_ptr<DeviceBackend> cpu(bool strict) {
  CpuDeviceOptions o;
  o.strict = strict;
  return std::shared_ptr<DeviceBackend>(make_cpu_device(o));
}

// Bytes of tensor `t` as uint8 (for bitwise comparisons of any dtype).
at::Tensor bytes_of(const at::Tensor& t) { return t.contiguous().view({-1}).view(at::kByte).clone(); }

// Filled so that every byte differs between tensors (a misplaced copy shows).
at::Tensor filled(int64_t nbytes, int seed) {
  at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
  return at::randint(0, 256, {nbytes}, gen, at::TensorOptions().dtype(at::kByte));
}

uint64_t footprints(const PinnedArena::Group& g) {
  uint64_t n = 0;
  for (const auto& t : g) n += PinnedArena::footprint(t);
  return n;
}

// /proc/self/status field in bytes (VmRSS, VmHWM); 0 when unreadable.
uint64_t proc_status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

// Resets the peak RSS (VmHWM) to the current RSS. False where the kernel refuses.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.close();
  return f.good();
}

// Peak RSS while `op` runs, beyond the RSS before it (VmHWM after resetting it).
struct RssGrowth {
  uint64_t before = 0, bytes = 0;
  double fraction() const { return static_cast<double>(bytes) / static_cast<double>(before); }
};
template <class Op>
RssGrowth peak_rss_growth(Op op) {
  REQUIRE(reset_peak_rss());
  RssGrowth g;
  g.before = proc_status_bytes("VmRSS");
  REQUIRE(g.before > 0);
  op();
  const uint64_t peak = proc_status_bytes("VmHWM");
  g.bytes = peak > g.before ? peak - g.before : 0;
  return g;
}

at::Tensor run(StreamingEngine& e, ToyModel& m, const at::Tensor& x) {
  ForwardScope scope(e);
  return m->forward(x);
}

EngineOptions streaming(std::shared_ptr<DeviceBackend> dev) {
  EngineOptions o;
  o.device = std::move(dev);
  o.budget_bytes = 4096 * MiB;
  o.working_memory_bytes = 1 * MiB;
  o.max_resident = 0.0;  // everything that can stream streams
  o.pin = PinMode::on;
  o.plan_from_measurements = false;
  return o;
}

}  // namespace

TEST_CASE("pinned arena: groups are packed in order at 64-byte offsets into exact-size chunks", "[strict]") {
  for (const bool strict : {false, true}) {
    INFO("strict " << strict);
    auto dev = cpu(strict);
    PinnedArena arena(std::numeric_limits<uint64_t>::max());
    // Three 24 MiB groups with odd tails: two fit a 64 MiB chunk, the third starts another.
    std::vector<PinnedArena::Group> groups;
    std::vector<std::vector<at::Tensor>> originals;
    for (int i = 0; i < 3; ++i) {
      PinnedArena::Group g{filled(24 * MiB - 1000, 3 * i), filled(77, 3 * i + 1), at::Tensor(), filled(3, 3 * i + 2)};
      originals.push_back({bytes_of(g[0]), bytes_of(g[1]), at::Tensor(), bytes_of(g[3])});
      groups.push_back(g);
    }
    const auto placed = arena.place(*dev, groups);
    CHECK(placed.groups == 3);
    CHECK_FALSE(placed.limited);
    CHECK_FALSE(placed.failed);
    CHECK(arena.chunks() == 2);
    const uint64_t per_group = footprints(groups[0]);
    CHECK(per_group == (24 * MiB - 1000 + 40) + 128 + 64);  // each tensor rounded up to 64 bytes, no more
    CHECK(static_cast<uint64_t>(arena.pinned().current) == 3 * per_group);  // exact: nothing rounded to a power of two
    uint64_t used = 0;
    for (size_t i = 0; i < groups.size(); ++i) {
      for (size_t k = 0; k < groups[i].size(); ++k) {
        const at::Tensor& t = groups[i][k];
        if (!originals[i][k].defined()) {
          CHECK_FALSE(t.defined());
          continue;
        }
        INFO("group " << i << " tensor " << k);
        CHECK(arena.holds(t));
        CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % PinnedArena::kAlignment == 0);
        CHECK(at::equal(bytes_of(t), originals[i][k]));
        CHECK(dev->is_pinned(t));
        used += t.nbytes();
      }
    }
    CHECK(arena.used_bytes() == used);
    // Packed: within a chunk each tensor starts where the previous one's footprint ends.
    const auto* w0 = static_cast<const uint8_t*>(groups[0][0].data_ptr());
    CHECK(static_cast<const uint8_t*>(groups[0][1].data_ptr()) == w0 + PinnedArena::footprint(groups[0][0]));
    CHECK(static_cast<const uint8_t*>(groups[1][0].data_ptr()) == w0 + per_group);
    CHECK(arena.chunk_of(groups[0][0]).id == arena.chunk_of(groups[1][3]).id);
    CHECK(arena.chunk_of(groups[0][0]).bytes == 2 * per_group);
    CHECK(arena.chunk_of(groups[2][0]).id != arena.chunk_of(groups[0][0]).id);
    CHECK(arena.chunk_of(groups[2][0]).bytes == per_group);  // the last chunk: exactly what is left
    CHECK_FALSE(arena.holds(originals[0][0]));
    PinnedArena other(std::numeric_limits<uint64_t>::max());
    CHECK_FALSE(other.holds(groups[0][0]));

    // Placing views already here copies nothing.
    auto again = groups;
    CHECK(arena.place(*dev, again).groups == 3);
    CHECK(arena.chunks() == 2);
    CHECK(again[0][0].data_ptr() == groups[0][0].data_ptr());

    // Lifetime: a chunk goes with the last view of it, and only then.
    again.clear();
    groups[2].clear();
    CHECK(arena.chunks() == 1);
    CHECK(static_cast<uint64_t>(arena.pinned().current) == 2 * per_group);
    groups[0].clear();
    CHECK(arena.chunks() == 1);  // group 1 still holds the first chunk
    at::Tensor survivor = groups[1][0];
    groups[1].clear();
    CHECK(arena.chunks() == 1);
    CHECK(at::equal(bytes_of(survivor), originals[1][0]));
    survivor = at::Tensor();
    CHECK(arena.chunks() == 0);
    CHECK(arena.pinned().current == 0);
    CHECK(arena.used_bytes() == 0);
    CHECK(arena.pinned().freed == 3 * static_cast<int64_t>(per_group));
  }
}

TEST_CASE("pinned arena: place stops at the first group past the limit and leaves the rest alone", "[strict]") {
  auto dev = cpu(strict_device_requested());
  std::vector<PinnedArena::Group> groups;
  for (int i = 0; i < 5; ++i) groups.push_back({filled(4096, i), filled(64, 10 + i)});
  const uint64_t per_group = footprints(groups[0]);
  PinnedArena arena(2 * per_group + per_group / 2);
  std::vector<const void*> before;
  for (const auto& g : groups) before.push_back(g[0].data_ptr());
  const auto placed = arena.place(*dev, groups);
  CHECK(placed.groups == 2);
  CHECK(placed.limited);
  CHECK_FALSE(placed.failed);
  CHECK(static_cast<uint64_t>(arena.pinned().current) == 2 * per_group);
  CHECK(static_cast<uint64_t>(arena.pinned().current) <= arena.limit());
  for (size_t i = 0; i < groups.size(); ++i) {
    CHECK(arena.holds(groups[i][0]) == (i < 2));
    if (i >= 2) CHECK(groups[i][0].data_ptr() == before[i]);
  }
  // A raised limit lets the rest in (an arena's limit is shared: room can appear).
  arena.set_limit(std::numeric_limits<uint64_t>::max());
  CHECK(arena.place(*dev, groups).groups == 5);
  CHECK(static_cast<uint64_t>(arena.pinned().current) == 5 * per_group);
}

TEST_CASE("pinned arena: a chunk that cannot be had stops placement and gives its reservation back", "[strict]") {
  fault::ScopedFault f("host.pin", fault::Trigger{2, 1});  // the second chunk
  auto dev = cpu(strict_device_requested());
  PinnedArena arena(std::numeric_limits<uint64_t>::max());
  std::vector<PinnedArena::Group> groups;
  for (int i = 0; i < 3; ++i) groups.push_back({filled(40 * MiB, i)});  // one chunk each
  const auto placed = arena.place(*dev, groups);
  CHECK(f.fired() == 1);
  CHECK(placed.failed);
  CHECK(placed.groups == 1);
  CHECK(arena.chunks() == 1);
  CHECK(static_cast<uint64_t>(arena.pinned().current) == 40 * MiB);
  CHECK_FALSE(arena.holds(groups[1][0]));
}

TEST_CASE("pinned arena: pinned / placed <= 1.01 on model-shaped layers", "[strict]") {
  // The linear layers of a DiT block at a width of 1536 (anima-2b's shape class), fp8
  // weights, bf16 biases, f32 per-row scales, plus the odd-sized ones (adaLN, embedders).
  auto dev = cpu(strict_device_requested());
  PinnedArena arena(std::numeric_limits<uint64_t>::max());
  const int64_t d = 1536;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{3 * d, d}, {d, d}, {d, d}, {2 * d, 1024}, {d, d},
                                                           {4 * d, d}, {d, 4 * d}, {9 * d, 256}, {d, 68}, {17, d}};
  std::vector<PinnedArena::Group> groups;
  uint64_t stored = 0;
  for (int block = 0; block < 2; ++block) {
    for (const auto& [out, in] : shapes) {
      PinnedArena::Group g{at::empty({out, in}, at::kFloat8_e4m3fn), at::empty({out}, at::kBFloat16),
                           at::empty({out}, at::kFloat)};
      for (const auto& t : g) stored += t.nbytes();
      groups.push_back(std::move(g));
    }
  }
  REQUIRE(arena.place(*dev, groups).groups == groups.size());
  CHECK(arena.used_bytes() == stored);
  const double ratio = static_cast<double>(arena.pinned().current) / static_cast<double>(stored);
  INFO("pinned " << arena.pinned().current << " / placed " << stored << " = " << ratio);
  CHECK(ratio >= 1.0);
  CHECK(ratio <= 1.01);
  CHECK(arena.chunks() < 6);  // large chunks, not one per tensor
}

TEST_CASE("pinned arena: the default limit leaves the OS half of the host memory limit and at least 4 GiB",
          "[strict]") {
  constexpr uint64_t GiB = uint64_t{1} << 30;
  for (const uint64_t l : {uint64_t{0}, 2 * GiB, 4 * GiB, 6 * GiB, 8 * GiB, 16 * GiB, 64 * GiB, 1024 * GiB}) {
    INFO("host memory limit " << l);
    const uint64_t limit = default_pin_memory_limit(l);
    CHECK(limit <= l / 2);
    CHECK(l - limit >= std::min<uint64_t>(l, 4 * GiB));
  }
  // Of the host memory limit (Note [host memory limit]): here physical RAM, 16 GiB, all of it available.
  sluice::testing::FakeCgroupRoot root;
  root.meminfo(16 * GiB, 16 * GiB);
  const PinLimit pin = default_pin_memory_limit();
  CHECK(pin.bytes == 8 * GiB);
  CHECK(pin.source == "default min(L / 2, L - 4GiB) of the host memory limit L = 16.0GiB from physical RAM");
  CHECK(PinnedArena(pin).limit_source() == pin.source);
}

TEST_CASE("pinned arena: engine stats report pinned / streamed <= 1.01, plain and strict, same output", "[strict]") {
  for (const bool strict : {false, true}) {
    INFO("strict " << strict);
    ToyOptions to;
    to.dim = 256;
    to.hidden = 512;
    ToyModel model(to);
    const at::Tensor x = at::randn({4, to.dim}, at::detail::createCPUGenerator(5));
    const at::Tensor ref = model->forward(x);
    StreamingEngine engine(streaming(cpu(strict)));
    engine.attach(*model, "toy");
    REQUIRE(engine.plan().streamed_bytes > 0);
    const EngineStats s = engine.stats();
    // Every streamed layer is pinned; the model's only pinned layers are its streamed ones.
    CHECK(static_cast<uint64_t>(s.pinned.current) == engine.plan().streamed_bytes);
    const double ratio = static_cast<double>(s.pinned_bytes) / static_cast<double>(engine.plan().streamed_bytes);
    INFO("pinned " << s.pinned_bytes << " / streamed " << engine.plan().streamed_bytes << " = " << ratio);
    CHECK(ratio >= 1.0);
    CHECK(ratio <= 1.01);
    const std::string json = s.to_json();
    CHECK(json.find("\"pinned_bytes\": " + std::to_string(s.pinned_bytes)) != std::string::npos);
    CHECK(json.find("\"pinned_used_bytes\": " + std::to_string(s.pinned.current)) != std::string::npos);
    for (int i = 0; i < 2; ++i) CHECK(at::equal(run(engine, model, x), ref));
    engine.detach();
    CHECK(at::equal(model->forward(x), ref));
  }
}

TEST_CASE("pinned arena: detach makes no host copy and re-attach pins nothing again", "[strict]") {
  ToyOptions to;
  to.dim = 1024;
  to.hidden = 4096;
  to.blocks = 4;  // about 100 MiB of streamed fp8 layers
  ToyModel model(to);
  const at::Tensor x = at::randn({2, to.dim}, at::detail::createCPUGenerator(5));
  const at::Tensor ref = model->forward(x);
  auto arena = std::make_shared<PinnedArena>(std::numeric_limits<uint64_t>::max());
  EngineOptions o = streaming(cpu(strict_device_requested()));
  o.pin_arena = arena;
  StreamingEngine engine(o);
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> originals;
  for (const auto& [name, l] : managed_layers(*model)) originals.push_back(l->stored_weight().storage().getWeakStorageImpl());
  engine.attach(*model, "toy");
  // The pinned copies replaced the pageable weights: those are freed, not kept beside them.
  size_t freed = 0;
  for (const auto& w : originals) freed += w.expired() ? 1 : 0;
  CHECK(freed + 1 == originals.size());  // all but final_layer (required resident: never pinned)
  const Stat pinned = arena->pinned();
  const uint64_t chunks = arena->chunks();
  REQUIRE(pinned.current > 0);
  std::map<std::string, const void*> where;
  for (const auto& [name, l] : managed_layers(*model)) {
    if (arena->holds(l->stored_weight())) where[name] = l->stored_weight().data_ptr();
  }
  REQUIRE(!where.empty());
  CHECK(at::equal(run(engine, model, x), ref));

  // The pinned copies could be noticed in the peak RSS if detach copied them.
  REQUIRE(static_cast<double>(pinned.current) > 0.1 * static_cast<double>(proc_status_bytes("VmRSS")));
  const RssGrowth growth = peak_rss_growth([&] { engine.detach(); });
  INFO("peak RSS growth during detach: " << growth.bytes << " bytes, " << growth.fraction() * 100 << "%");
  std::printf("detach with %llu pinned bytes: peak RSS grew %llu bytes (%.3f%%)\n",
              static_cast<unsigned long long>(pinned.current), static_cast<unsigned long long>(growth.bytes),
              growth.fraction() * 100);
  CHECK(growth.fraction() <= 0.05);
  CHECK(growth.bytes < static_cast<uint64_t>(pinned.current) / 4);  // a host copy would be all of it
  // The model keeps its pinned host weights.
  for (const auto& [name, l] : managed_layers(*model)) {
    if (where.count(name)) CHECK(l->stored_weight().data_ptr() == where.at(name));
  }
  CHECK(arena->pinned().current == pinned.current);
  CHECK(at::equal(model->forward(x), ref));

  // Re-attach: recognised, counted, not copied.
  engine.attach(*model, "toy");
  CHECK(arena->chunks() == chunks);
  CHECK(arena->pinned().allocated == pinned.allocated);
  CHECK(engine.stats().pinned_bytes == static_cast<uint64_t>(pinned.current));
  for (const auto& [name, l] : managed_layers(*model)) {
    if (where.count(name) && !engine.is_resident(name)) CHECK(l->stored_weight().data_ptr() == where.at(name));
  }
  CHECK(at::equal(run(engine, model, x), ref));
  // Promotion and demotion keep the host copies where they are.
  engine.budget().full_load();
  CHECK(at::equal(run(engine, model, x), ref));
  engine.budget().full_unload();
  CHECK(arena->pinned().allocated == pinned.allocated);
  CHECK(at::equal(run(engine, model, x), ref));
  engine.detach();
  // The pinned memory goes with the model.
  model = ToyModel(nullptr);
  CHECK(arena->pinned().current == 0);
  CHECK(arena->chunks() == 0);
}

namespace {

cache::LoadSpec spec(const std::string& preset, uint64_t seed) {
  cache::LoadSpec s;
  s.source = preset;
  s.seed = seed;
  s.storage.storage = at::kFloat8_e4m3fn;
  s.storage.compute = at::kBFloat16;
  s.max_resident = 0.0;  // every layer that can stream streams
  return s;
}

cache::CacheOptions cache_options(offload::PinMode pin, std::optional<uint64_t> limit, uint64_t budget = 512 * MiB) {
  cache::CacheOptions o;
  o.device = cpu(strict_device_requested());
  o.vram_budget = budget;
  o.working_memory = 1 * MiB;
  o.ram_limit = 0;
  o.pin = pin;
  o.pin_memory_limit = limit;
  return o;
}

struct Inputs {
  at::Tensor x, t, ctx;
};

Inputs inputs(const anima::AnimaConfig& c) {
  at::Generator gen = at::detail::createCPUGenerator(7);
  return {at::randn({1, c.in_channels, 1, 8, 8}, gen).to(at::kBFloat16), at::rand({1}, gen),
          at::randn({1, 5, c.crossattn_emb_channels}, gen).to(at::kBFloat16)};
}

at::Tensor forward(cache::ModelCache& cache, const std::shared_ptr<cache::Entry>& e, const Inputs& in) {
  cache::Lock lock = cache.lock(e);
  at::Tensor out;
  cache.run(lock, [&](anima::AnimaModelImpl& m, offload::StreamingEngine& engine) {
    c10::InferenceMode guard;
    offload::ForwardScope scope(engine, "dit");
    out = m.forward(in.x, in.t, in.ctx);
  });
  return out;
}

}  // namespace

TEST_CASE("pinned arena: one limit for the models of a cache, the rest streams pageable with one warning", "[strict]") {
  const Inputs in = inputs(anima::preset("anima-small"));
  // References with pinning off, and each model's streamed bytes.
  auto plain = cache::ModelCache::create(cache_options(PinMode::off, std::nullopt));
  auto pa = plain->load(spec("anima-small", 1));
  auto pb = plain->load(spec("anima-small", 2));
  const at::Tensor ref_a = forward(*plain, pa, in), ref_b = forward(*plain, pb, in);
  REQUIRE(plain->entry_state(pa).streamed_dit > 0);
  CHECK(plain->stats().pinned.current == 0);

  // A limit that holds a: a pins, b pins what is left and streams the rest from pageable memory.
  uint64_t pinned_a = 0;
  {
    auto probe = cache::ModelCache::create(cache_options(PinMode::on, std::nullopt));
    auto e = probe->load(spec("anima-small", 1));
    pinned_a = probe->engine_stats(e).pinned_bytes;
    const auto s = probe->stats();
    const double ratio = static_cast<double>(s.pinned.current) / static_cast<double>(s.pinned_used_bytes);
    INFO("cache pinned " << s.pinned.current << " / used " << s.pinned_used_bytes << " = " << ratio);
    CHECK(ratio <= 1.01);
    CHECK(s.pinned.current == static_cast<int64_t>(pinned_a));
  }
  REQUIRE(pinned_a > 0);
  const uint64_t limit = pinned_a + pinned_a / 2;
  auto cache = cache::ModelCache::create(cache_options(PinMode::on, limit));
  auto a = cache->load(spec("anima-small", 1));
  const uint64_t warnings = log::message_count(log::Level::warn);
  auto b = cache->load(spec("anima-small", 2));
  CHECK(log::message_count(log::Level::warn) == warnings + 1);  // b's layers past the limit, said once
  const auto s = cache->stats();
  CHECK(s.pin_limit_bytes == limit);
  CHECK(static_cast<uint64_t>(s.pinned.current) <= limit);
  CHECK(static_cast<uint64_t>(s.pinned.current) > pinned_a);  // b got some
  const auto sb = cache->engine_stats(b);
  CHECK(sb.pinned_bytes > 0);
  CHECK(sb.pinned_bytes < pinned_a);
  CHECK(static_cast<uint64_t>(s.pinned.current) == cache->engine_stats(a).pinned_bytes + sb.pinned_bytes);
  // Pinned bytes are in the RAM accounting: each model's bytes plus its padding.
  const auto ea = cache->entry_state(a), eb = cache->entry_state(b);
  CHECK(static_cast<uint64_t>(s.ram.current) == ea.ram_bytes + eb.ram_bytes);
  CHECK(ea.ram_bytes == a->needs.model_bytes + (cache->engine_stats(a).pinned_bytes -
                                                 static_cast<uint64_t>(cache->engine_stats(a).pinned.current)));
  CHECK(eb.ram_bytes >= b->needs.model_bytes);
  // Same outputs, pinned or not, several times (no second warning).
  for (int i = 0; i < 2; ++i) {
    CHECK(at::equal(forward(*cache, a, in), ref_a));
    CHECK(at::equal(forward(*cache, b, in), ref_b));
  }
  CHECK(log::message_count(log::Level::warn) == warnings + 1);
  if (strict_device_requested()) {
    CHECK(cache->engine_stats(b).bounce_copies > 0);  // b's pageable layers went through the bounce ring
    CHECK(cache->engine_stats(a).bounce_copies == 0);
  }
  // The pinned memory goes with the models.
  cache->drop(a);
  cache->drop(b);
  CHECK(cache->stats().pinned.current == 0);
}

TEST_CASE("pinned arena: a model taken off the device keeps its pinned weights, with no host copy", "[strict]") {
  const Inputs in = inputs(anima::preset("anima-medium"));
  uint64_t share = 0;
  {
    auto probe = cache::ModelCache::create(cache_options(PinMode::on, std::nullopt));
    share = probe->entry_state(probe->load(spec("anima-medium", 1))).share;
  }
  REQUIRE(share > 0);
  // Room on the device for one model at a time: loading b takes a off it, locking a takes b off.
  auto cache = cache::ModelCache::create(cache_options(PinMode::on, std::nullopt, share + share / 2 + 1 * MiB));
  auto a = cache->load(spec("anima-medium", 1));
  const at::Tensor ref_a = forward(*cache, a, in);
  const uint64_t pinned_a = cache->engine_stats(a).pinned_bytes;
  auto b = cache->load(spec("anima-medium", 2));
  REQUIRE(cache->stats().device_drops == 1);
  REQUIRE_FALSE(cache->entry_state(a).attached);
  REQUIRE(cache->entry_state(b).attached);
  const uint64_t pinned_b = cache->engine_stats(b).pinned_bytes;
  REQUIRE(pinned_a > 0);
  REQUIRE(pinned_b > 0);
  const uint64_t ram_a = cache->entry_state(a).ram_bytes, ram_b = cache->entry_state(b).ram_bytes;
  const Counter arena = cache->stats().pinned;
  // A host copy of b's pinned weights would show in the peak RSS.
  REQUIRE(static_cast<double>(pinned_b) > 0.06 * static_cast<double>(proc_status_bytes("VmRSS")));

  // Locking a takes b off the device and puts a back on it: no host copy of either.
  cache::Lock hold_a;
  const RssGrowth growth = peak_rss_growth([&] { hold_a = cache->lock(a); });
  INFO("peak RSS growth while b leaves the device and a comes back: " << growth.bytes << " bytes, "
       << growth.fraction() * 100 << "%");
  std::printf("device drop of b (%llu pinned bytes) and a back on the device: peak RSS grew %llu bytes (%.3f%%)\n",
              static_cast<unsigned long long>(pinned_b), static_cast<unsigned long long>(growth.bytes),
              growth.fraction() * 100);
  REQUIRE(cache->stats().device_drops == 2);
  REQUIRE_FALSE(cache->entry_state(b).attached);
  CHECK(growth.fraction() <= 0.05);
  CHECK(growth.bytes < pinned_b / 4);  // a host copy of b's weights would be all of them
  const Counter after = cache->stats().pinned;
  CHECK(after.current == arena.current);      // both models' weights stay pinned
  CHECK(after.allocated == arena.allocated);  // and nothing was pinned again
  CHECK(cache->entry_state(a).ram_bytes == ram_a);
  CHECK(cache->entry_state(b).ram_bytes == ram_b);
  CHECK(cache->engine_stats(a).pinned_bytes == pinned_a);
  hold_a = cache::Lock();
  CHECK(at::equal(forward(*cache, a, in), ref_a));
}
