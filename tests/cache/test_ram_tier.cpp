// The RAM tier of the model cache (cache/ram_tier.h) on its own, with generated anima-tiny
// models that never go on the device: where a source comes from, an entry's identity (the
// same source and settings find it, other settings replace it, and of two askers racing to
// add it only the one that added it made it), eviction under the RAM limit (least recently
// used first, never a locked, excluded or reading model, one warning when only those are
// left), and a read outside the cache mutex with its bytes reserved while a second asker
// waits for it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <cstdint>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include "cache/ram_tier.h"
#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "runtime/skip_patterns.h"
#include "runtime/error.h"
#include "tests/support/cache_parts.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using namespace sluice::cache;
using sluice::testing::cache_spec;
using sluice::testing::CacheParts;
using sluice::testing::roomy_cache_options;

namespace {

uint64_t tiny_bytes() { return estimate_model_bytes(cache_spec(), at::kCPU); }

}  // namespace

TEST_CASE("ram_tier: a source is a preset or a json config or a checkpoint") {
  CHECK(source_kind("anima-tiny") == SourceKind::preset);
  CHECK(source_kind("configs/custom.json") == SourceKind::json_config);
  CHECK(source_kind("/models/anima.safetensors") == SourceKind::checkpoint);
  CHECK(source_kind("anima-unknown") == SourceKind::checkpoint);  // not a preset: a path
}

TEST_CASE("ram_tier: a load request is resolved once: its key, settings, dtypes, skip list and config") {
  LoadSpec spec = cache_spec("anima-tiny", 7);
  spec.storage.extra_skip_patterns = {"blocks.0"};
  LoadRequest r = LoadRequest::resolve(spec, at::kCPU);
  CHECK(r.kind == SourceKind::preset);
  CHECK(r.key == "preset:anima-tiny#seed=7");
  CHECK(r.dtypes.storage == at::kFloat8_e4m3fn);
  CHECK(r.skips.patterns() == SkipList::from_options(spec.storage, anima::declared_fp8_skips()).patterns());
  CHECK(r.settings.find("skips=[") != std::string::npos);
  CHECK(r.settings.find("blocks.0;") != std::string::npos);
  CHECK_FALSE(r.config);  // a config may read a file: resolved only for a new entry
  CHECK(r.resolve_config().name == "anima-tiny");
  CHECK(r.model_name() == "anima-tiny");

  LoadSpec bad = cache_spec();
  bad.max_resident = 1.5;
  CHECK_THROWS_AS(LoadRequest::resolve(bad, at::kCPU), InvalidArgument);

  // A .json config is read once, when its entry is made: the read that follows (and any
  // read after an eviction) generates the model the entry was made for, whatever the file
  // says by then.
  const std::string path = (std::filesystem::temp_directory_path() / "sluice_ram_tier_request.json").string();
  anima::AnimaConfig small = anima::config_from_name_or_file("anima-tiny");
  small.name = "from-json";
  std::ofstream(path) << anima::config_to_json(small).dump();
  CacheParts p(roomy_cache_options());
  bool created = false;
  LoadSpec from_file = cache_spec(path, 1);
  auto e = p.ram.entry_for(from_file, created);
  REQUIRE(created);
  CHECK(e->name == "from-json");
  REQUIRE(e->request.config);
  CHECK(e->request.config->num_blocks == small.num_blocks);
  anima::AnimaConfig changed = small;
  changed.name = "changed";
  changed.num_blocks = small.num_blocks + 1;
  std::ofstream(path, std::ios::trunc) << anima::config_to_json(changed).dump();
  Guard g(p.locking.mutex());
  p.ram.ensure_loaded(e, g, /*count_hit=*/true);
  REQUIRE(e->model);
  CHECK(e->model->config().num_blocks == small.num_blocks);
  CHECK(e->model->config().name == "from-json");
  std::filesystem::remove(path);
}

TEST_CASE("ram_tier: the same source and settings find one entry and other settings replace it") {
  CacheParts p(roomy_cache_options());
  bool created = false;
  auto a = p.ram.entry_for(cache_spec("anima-tiny", 1), created);
  CHECK(created);
  CHECK(a->id == 1);
  CHECK(a->name == "anima-tiny");
  CHECK_FALSE(a->model);  // not read yet
  CHECK(a->estimate == tiny_bytes());
  CHECK(p.ram.entry_for(cache_spec("anima-tiny", 1), created) == a);
  CHECK_FALSE(created);

  LoadSpec other_seed = cache_spec("anima-tiny", 2);  // another generated model
  other_seed.name = "second";
  auto b = p.ram.entry_for(other_seed, created);
  CHECK(created);
  CHECK(b != a);
  CHECK(b->id == 2);
  CHECK(b->name == "second");
  CHECK_FALSE(a->dropped);

  LoadSpec bf16 = cache_spec("anima-tiny", 1);  // a's source with other settings
  bf16.storage.storage = at::kBFloat16;
  auto c = p.ram.entry_for(bf16, created);
  CHECK(created);
  CHECK(c != a);
  CHECK(c->request.key == a->request.key);
  CHECK(c->request.settings != a->request.settings);
  CHECK(a->dropped);
  {
    Guard g(p.locking.mutex());
    CHECK(p.state.entries.size() == 2);  // a was unlocked and not in RAM: gone at once
  }

  LoadSpec capped = cache_spec();
  capped.max_resident = 1.5;
  CHECK_THROWS_AS(p.ram.entry_for(capped, created), InvalidArgument);
}

TEST_CASE("ram_tier: the RAM limit evicts the least recently used unlocked model and never a locked or excluded one") {
  const uint64_t size = tiny_bytes();
  CacheParts p(roomy_cache_options(size * 5 / 2));  // two models fit, three do not
  auto a = p.loaded(cache_spec("anima-tiny", 1));
  auto b = p.loaded(cache_spec("anima-tiny", 2));
  Guard g(p.locking.mutex());
  CHECK(static_cast<uint64_t>(p.state.ram.current) == 2 * size);
  p.ram.touch(*b);
  p.ram.touch(*a);  // b is the least recently used
  CHECK(p.state.misses == 2);
  p.ram.ensure_loaded(a, g, /*count_hit=*/true);
  CHECK(p.state.hits == 1);

  // A third model: b goes.
  bool created = false;
  g.unlock();
  auto c = p.ram.entry_for(cache_spec("anima-tiny", 3), created);
  g.lock();
  p.ram.ensure_loaded(c, g, /*count_hit=*/true);
  CHECK(a->model);
  CHECK_FALSE(b->model);
  CHECK(c->model);
  CHECK(p.state.evictions == 1);
  CHECK(static_cast<uint64_t>(p.state.ram.current) == 2 * size);

  // Locked (a) and excluded (c): nothing can go, so the limit is passed with one warning.
  p.ram.touch(*c);
  a->locks = 1;
  CHECK_FALSE(p.state.ram_warned);
  p.ram.make_room(size, c.get());
  CHECK(a->model);
  CHECK(c->model);
  CHECK(p.state.evictions == 1);
  CHECK(p.state.ram_warned);

  // Unlocked, a is the least recently used: room for one more model evicts it, not c.
  a->locks = 0;
  p.ram.make_room(size, nullptr);
  CHECK_FALSE(a->model);
  CHECK(c->model);
  CHECK(p.state.evictions == 2);
  CHECK(static_cast<uint64_t>(p.state.ram.current) == size);

  // Dropped while unlocked: evicted and gone from the cache at once.
  p.ram.mark_dropped(c);
  CHECK_FALSE(c->model);
  CHECK(p.state.ram.current == 0);
  for (const auto& e : p.state.entries) CHECK(e != c);
}

TEST_CASE("ram_tier: a read runs outside the cache mutex with its bytes reserved and a second asker waits for it") {
  std::mutex m;
  std::condition_variable cv;
  bool reading = false, go = false;
  CacheOptions o = roomy_cache_options();
  o.before_read = [&](const std::string&) {
    std::unique_lock<std::mutex> g(m);
    reading = true;
    cv.notify_all();
    cv.wait_for(g, std::chrono::seconds(60), [&] { return go; });
  };
  CacheParts p(o);
  bool created = false;
  auto e = p.ram.entry_for(cache_spec(), created);
  std::thread first([&] {
    Guard g(p.locking.mutex());
    p.ram.ensure_loaded(e, g, /*count_hit=*/true);
  });
  {
    std::unique_lock<std::mutex> g(m);
    REQUIRE(cv.wait_for(g, std::chrono::seconds(120), [&] { return reading; }));
  }
  bool second_done = false;
  std::thread second([&] {
    Guard g(p.locking.mutex());
    p.ram.ensure_loaded(e, g, /*count_hit=*/true);
    second_done = true;
  });
  {
    // The cache mutex is free while the model is read; its estimate is reserved.
    Guard g(p.locking.mutex());
    CHECK(e->loading);
    CHECK(p.state.ram_reserved == e->estimate);
    CHECK(p.state.ram.current == 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  {
    Guard g(p.locking.mutex());
    CHECK_FALSE(second_done);  // waiting for the read, not reading again
  }
  {
    std::lock_guard<std::mutex> g(m);
    go = true;
  }
  cv.notify_all();
  first.join();
  second.join();
  Guard g(p.locking.mutex());
  CHECK(second_done);
  CHECK(e->model);
  CHECK(p.state.ram_reserved == 0);
  CHECK(static_cast<uint64_t>(p.state.ram.current) == e->ram_bytes);
  CHECK(p.state.misses == 1);
  CHECK(p.state.loads == 1);
  CHECK(p.state.hits == 1);  // the second asker found it read
}

TEST_CASE("ram_tier: of two askers racing to add one entry, only the one that added it has created it") {
  // Both find no entry and estimate the model outside the cache mutex, where before_insert
  // holds each until both have looked: the second to take the mutex back finds the entry
  // the first added, and must not count it as its own (ModelCache::load drops an entry it
  // created when the budget cannot hold the model).
  std::mutex m;
  std::condition_variable cv;
  int looked = 0;
  CacheOptions o = roomy_cache_options();
  o.before_insert = [&](const std::string&) {
    std::unique_lock<std::mutex> g(m);
    ++looked;
    cv.notify_all();
    cv.wait_for(g, std::chrono::seconds(60), [&] { return looked == 2; });
  };
  CacheParts p(o);
  std::shared_ptr<Entry> a, b;
  bool a_created = false, b_created = false;
  std::thread ta([&] { a = p.ram.entry_for(cache_spec(), a_created); });
  std::thread tb([&] { b = p.ram.entry_for(cache_spec(), b_created); });
  ta.join();
  tb.join();
  CHECK(looked == 2);
  REQUIRE(a);
  CHECK(a == b);
  CHECK(a_created != b_created);  // one made it, the other found it
  CHECK(a->id == 1);
  Guard g(p.locking.mutex());
  CHECK(p.state.entries.size() == 1);
  CHECK(p.state.next_id == 1);
}
