// The queries of the model cache (cache/cache_queries.h) on their own, with generated
// anima-tiny models on the test device: the device totals are the sums of their parts
// (Note [stats parts]) in CacheStats and in its JSON, the models held are those read at
// least once, and an entry's engine-side state is its published snapshot, not the engine.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>

#include <cstdint>
#include <mutex>

#include <nlohmann/json.hpp>

#include "cache/cache_queries.h"
#include "runtime/record_json.h"
#include "tests/support/cache_parts.h"
#include "tests/support/single_thread.h"

using namespace sluice;
using namespace sluice::cache;
using sluice::testing::cache_spec;
using sluice::testing::CacheParts;
using sluice::testing::roomy_cache_options;

namespace {

}  // namespace

TEST_CASE("cache_queries: every device total is the sum of its parts over the models held", "[strict][accel]") {
  CacheParts p(roomy_cache_options());
  CacheQueries q(p.state, p.locking, p.shares);
  auto a = p.attached(cache_spec("anima-tiny", 1));
  auto b = p.attached(cache_spec("anima-tiny", 2));
  {
    Guard g(p.locking.mutex());
    p.shares.resize(*b, b->needs.minimum);  // b streams: its ring is reserved, not all allocated
  }
  bool created = false;
  auto unread = p.ram.entry_for(cache_spec("anima-tiny", 3), created);  // never read: not held
  REQUIRE_FALSE(unread->loaded_once);

  const CacheStats s = q.stats();
  REQUIRE(s.models_held.size() == 2);
  CHECK(s.models_held[0].id == a->id);
  CHECK(s.models_held[1].id == b->id);
  CHECK(s.models == 2);
  CHECK(s.vram_reserved_bytes == a->share + b->share);
  CHECK(s.vram_limit_bytes == p.shares.limit());
  uint64_t device = 0, allocated = 0;
  for (const auto& m : s.models_held) {
    CHECK(m.on_device);
    CHECK(m.allocated_bytes <= m.device_bytes);
    CHECK(m.device_bytes <= m.share_bytes);
    device += m.device_bytes;
    allocated += m.allocated_bytes;
  }
  CHECK(s.models_device_bytes == device);
  CHECK(s.models_allocated_bytes == allocated);
  CHECK(s.vram_unattributed_bytes == s.vram.current - static_cast<int64_t>(allocated));
  CHECK(s.vram_unattributed_bytes == 0);  // no forward in flight
  CHECK(q.entries() == std::vector<std::shared_ptr<Entry>>{a, b});

  const nlohmann::json j = nlohmann::json::parse(q.stats_json(-1));
  CHECK(j["models_held"].size() == 2);
  CHECK(j["vram"]["current"].get<int64_t>() ==
        j["models_allocated_bytes"].get<int64_t>() + j["vram_unattributed_bytes"].get<int64_t>());
  CHECK(j["vram_reserved_bytes"].get<uint64_t>() ==
        j["models_held"][0]["share_bytes"].get<uint64_t>() + j["models_held"][1]["share_bytes"].get<uint64_t>());

  const nlohmann::json m = nlohmann::json::parse(q.model_stats_json(b, -1));
  CHECK(m["model"]["id"].get<uint64_t>() == b->id);
  CHECK(m["budget"]["share_bytes"].get<uint64_t>() == b->share);
  CHECK(m["device"]["allocated_bytes"].get<uint64_t>() == s.models_held[1].allocated_bytes);
  CHECK(m["device"]["other_models_bytes"].get<uint64_t>() == s.models_held[0].allocated_bytes);
}

TEST_CASE("cache_queries: an entry's engine-side state is its published snapshot", "[strict][accel]") {
  CacheParts p(roomy_cache_options());
  CacheQueries q(p.state, p.locking, p.shares);
  auto e = p.attached(cache_spec());
  EntryState st = q.entry_state(e);
  CHECK(st.in_ram);
  CHECK(st.attached);
  CHECK(st.share == e->share);
  CHECK(st.minimum == e->needs.minimum);
  CHECK(st.wanted == e->needs.wanted);
  CHECK(st.device_bytes == e->engine->device_bytes());
  CHECK(st.residency == e->engine->plan().residency_map());
  {
    std::lock_guard<std::mutex> g(e->published_mutex);
    e->published.device_bytes = 12345;  // what a forward would have published
    e->published.residency = "published";
  }
  st = q.entry_state(e);
  CHECK(st.device_bytes == 12345);
  CHECK(st.residency == "published");
  CHECK(q.stats().models_held.at(0).device_bytes == 12345);
  {
    Guard g(p.locking.mutex());
    p.shares.detach(*e);  // publishes
  }
  st = q.entry_state(e);
  CHECK_FALSE(st.attached);
  CHECK(st.device_bytes == 0);
  CHECK(st.residency.empty());
  CHECK(st.in_ram);
}

TEST_CASE("cache_queries: the cache stats JSON has one key per CacheStats field and the older keys",
          "[strict][accel]") {
  // Note [field lists] (sluice/stats.hpp): the JSON is written from the record's one field
  // list, so every field is there under its own name with the struct's value; beside them
  // only the keys the JSON had before the record named them (host_memory_limit in detail,
  // pinned_bytes, "given" for a given limit).
  CacheParts p(roomy_cache_options());
  CacheQueries q(p.state, p.locking, p.shares);
  auto a = p.attached(cache_spec("anima-tiny", 1));
  const CacheStats s = q.stats();
  const nlohmann::json j = nlohmann::json::parse(q.stats_json(-1));
  size_t fields = 0;
#define CHECK_FIELD(type, name)                                    \
  ++fields;                                                        \
  {                                                                \
    INFO(#name);                                                   \
    REQUIRE(j.contains(#name));                                    \
    if (std::string(#name) != "ram_limit_source" && std::string(#name) != "pin_limit_source") \
      CHECK(j[#name] == nlohmann::json(s.name));                   \
  }
  SLUICE_CACHE_STATS_FIELDS(CHECK_FIELD)
#undef CHECK_FIELD
  CHECK(fields == 30);
  CHECK(j.size() == fields + 2);  // and host_memory_limit, pinned_bytes
  CHECK(j["models_held"][0]["id"].get<uint64_t>() == a->id);
  CHECK(j["models_held"][0].size() == 10);  // HeldModel's fields
  CHECK(j["pinned_bytes"].get<int64_t>() == s.pinned.current);
  CHECK(j["host_memory_limit"]["bytes"].get<uint64_t>() == s.host_memory_limit_bytes);
  CHECK(j["host_memory_limit"]["source"].get<std::string>() == s.host_memory_limit_source);
  CHECK(j["ram_limit_source"].get<std::string>() == (s.ram_limit_source.empty() ? "given" : s.ram_limit_source));
  CHECK(j["vram"]["current"].get<int64_t>() == s.vram.current);
}
