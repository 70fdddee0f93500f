// The public C++ API (include/sluice/sluice.hpp) as an embedder uses it: presets on the CPU
// device, forwards and encode_text, residency and budget changes, stats JSON, trace, LoRA,
// errors, and the load log line.
#include <sluice/sluice.hpp>

#include <ATen/Parallel.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fcntl.h>
#include <fstream>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unistd.h>
#include <vector>

#include "runtime/error.h"        // exception types callers catch
#include "runtime/hardware.h"     // what compute "auto" picks here
#include "runtime/logging.h"      // raising the level for the log-line test
#include "runtime/safetensors.h"  // writing the LoRA fixture
#include "tests/support/device_env.h"     // SLUICE_TEST_DEVICE
#include "tests/support/single_thread.h"  // one intra-op thread
#include "tests/support/temp_dir.h"

namespace {

constexpr uint64_t MiB = 1ull << 20;

using sluice::testing::TempDir;  // tests/support/temp_dir.h

// How the device of cpu() below names itself ("cpu", "testaccel:0").
std::string device_name() {
  const std::string s = sluice::testing::test_device_spec();
  return s == "cpu" || s.find(':') != std::string::npos ? s : s + ":0";
}

sluice::RuntimeOptions cpu(const std::string& budget = "512MiB", const std::string& working = "1MiB") {
  sluice::RuntimeOptions o;
  o.device = sluice::testing::test_device_spec();  // "cpu" unless SLUICE_TEST_DEVICE names another
  o.vram_budget = budget;
  o.working_memory = working;
  o.ram_limit = "0";
  return o;
}

struct Inputs {
  at::Tensor x, t, ctx, qwen, ids;
};

Inputs inputs(const sluice::ModelInfo& info, uint64_t seed = 5) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  Inputs in;
  in.x = at::randn({2, info.in_channels, 1, 8, 8}, gen);  // fp32: the API converts
  in.t = at::rand({2}, gen);
  in.ctx = at::randn({2, 6, info.context_dim}, gen);
  in.qwen = at::randn({2, 7, info.adapter_source_dim}, gen);
  in.ids = at::randint(0, info.adapter_vocab_size, {2, 5}, gen);
  return in;
}

nlohmann::json parse(const std::string& text) { return nlohmann::json::parse(text); }

// Captures what is written to stderr (spdlog's sink) while alive.
class StderrCapture {
 public:
  explicit StderrCapture(std::string path) : path_(std::move(path)) {
    std::fflush(stderr);
    saved_ = ::dup(2);
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    ::dup2(fd, 2);
    ::close(fd);
  }
  std::string finish() {
    std::fflush(stderr);
    if (saved_ >= 0) {
      ::dup2(saved_, 2);
      ::close(saved_);
      saved_ = -1;
    }
    std::ifstream f(path_);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  ~StderrCapture() { finish(); }

 private:
  std::string path_;
  int saved_ = -1;
};

}  // namespace

TEST_CASE("api: a preset loads and runs and its stats JSON has the documented fields", "[strict][accel]") {
  sluice::ModelCache cache(cpu());
  sluice::Model model = cache.load("anima-tiny");
  CHECK(model.name() == "anima-tiny");
  const sluice::ModelInfo info = model.info();
  CHECK(info.storage_dtype == "float8_e4m3fn");
  // compute "auto": bf16 where the device computes it natively, else fp32 (Note [compute
  // dtype auto]); the test accelerator reports bf16 whatever the CPU does.
  const bool bf16 = sluice::native_matmul(at::Device(cache.stats().device), at::kBFloat16).native;
  CHECK(info.compute_dtype == (bf16 ? "bfloat16" : "float32"));
  CHECK(info.compute_reason.rfind("auto: " + info.compute_dtype + ", because ", 0) == 0);
  CHECK(info.in_channels == 16);
  REQUIRE(info.has_adapter);
  const Inputs in = inputs(info);
  at::Tensor v, ctx;
  {
    sluice::LockedModel m = model.lock();
    v = m(in.x, in.t, in.ctx);
    ctx = m.encode_text(in.qwen, in.ids);
    CHECK_NOTHROW(m.synchronize());  // the stream contract's host wait
  }
  CHECK_THROWS_AS(sluice::LockedModel().synchronize(), sluice::InvalidArgument);
  CHECK(v.sizes() == in.x.sizes());
  CHECK(v.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat));
  CHECK(ctx.sizes() == at::IntArrayRef({2, info.adapter_output_tokens, info.context_dim}));

  const nlohmann::json j = parse(model.stats_json());
  CHECK(j.at("model").at("name") == "anima-tiny");
  const uint64_t total = j.at("model").at("total_bytes");
  const uint64_t resident = j.at("model").at("resident_bytes");
  CHECK(total > 0);
  CHECK(resident == total);  // roomy budget: everything resident
  CHECK(j.at("model").at("residency").get<std::string>().find("blocks: RR") == 0);
  CHECK(j.at("budget").at("budget_bytes") == 512 * MiB);
  CHECK(j.at("budget").at("working_memory_bytes") == 1 * MiB);
  CHECK(j.at("device").at("peak_bytes").get<uint64_t>() > 0);
  const auto& fw = j.at("forwards");
  REQUIRE(fw.size() == 2);  // the DiT forward and the adapter
  for (const auto& f : fw) {
    for (const char* k : {"bytes_streamed", "h2d_gbps", "stall_ms", "upcast_ms", "wall_ms"}) CHECK(f.contains(k));
    CHECK(f.at("bytes_streamed") == 0);
  }
  CHECK(j.at("cache").at("misses") == 1);
  CHECK(j.at("cache").at("hits") == 1);  // the lock
  CHECK(j.at("cache").at("evictions") == 0);

  const sluice::CacheStats cs = cache.stats();
  CHECK(cs.models == 1);
  CHECK(cs.vram_budget_bytes == 512 * MiB);
  CHECK(cs.vram_limit_bytes == 511 * MiB);
  CHECK(static_cast<uint64_t>(cs.ram.current) == total);
  CHECK(parse(cache.stats_json()).at("loads") == 1);
  CHECK(!sluice::version().empty());
}

TEST_CASE("api: forward with a progress callback reports each layer and returns the same output", "[strict][accel]") {
  sluice::ModelCache cache(cpu());
  sluice::LoadOptions lo;
  lo.max_resident = 0.5;
  sluice::Model model = cache.load("anima-tiny", lo);
  const Inputs in = inputs(model.info());
  sluice::LockedModel m = model.lock();
  const at::Tensor ref = m(in.x, in.t, in.ctx);  // no callback: the first forward records the order
  std::vector<std::pair<int64_t, int64_t>> calls;
  const at::Tensor v = m.forward(in.x, in.t, in.ctx, [&](int64_t done, int64_t expected) {
    calls.emplace_back(done, expected);
  });
  CHECK(at::equal(v, ref));
  REQUIRE(!calls.empty());
  const auto n = static_cast<int64_t>(calls.size());
  CHECK(calls.front() == std::make_pair(int64_t{1}, n));
  CHECK(calls.back() == std::make_pair(n, n));
  // The callback belongs to that forward only.
  calls.clear();
  CHECK(at::equal(m(in.x, in.t, in.ctx), ref));
  CHECK(calls.empty());
  // A throwing callback does not fail the forward.
  CHECK(at::equal(m.forward(in.x, in.t, in.ctx, [](int64_t, int64_t) { throw std::runtime_error("closed"); }), ref));
  // The residency grid is in the stats: a row per layer of a block, R and S at 0.5.
  const std::string grid = model.stats().residency_grid;
  CHECK(grid.rfind("blocks ", 0) == 0);
  CHECK(grid.find('R') != std::string::npos);
  CHECK(grid.find('S') != std::string::npos);
}

TEST_CASE("api: a progress callback that throws Interrupted stops the forward before its next layer",
          "[strict][accel]") {
  // Issue 29, item 10 (Python's Ctrl-C is built on it): a request to stop ends the forward at
  // the next layer boundary, as an exception does; the next forward is unchanged.
  sluice::ModelCache cache(cpu());
  sluice::LoadOptions lo;
  lo.max_resident = 0.5;
  sluice::Model model = cache.load("anima-small", lo);
  const Inputs in = inputs(model.info());
  sluice::LockedModel m = model.lock();
  int64_t n = 0;
  const at::Tensor ref = m.forward(in.x, in.t, in.ctx, [&](int64_t done, int64_t) { n = done; });
  REQUIRE(n > 4);
  for (const int64_t stop_at : {int64_t{1}, n / 2, n}) {  // n: after the last layer
    INFO("stop at layer " << stop_at);
    int64_t calls = 0;
    try {
      m.forward(in.x, in.t, in.ctx, [&](int64_t done, int64_t) {
        calls = done;
        if (done == stop_at) throw sluice::Interrupted("stop at " + std::to_string(done));
      });
      FAIL("no Interrupted");
    } catch (const sluice::Interrupted& e) {
      CHECK(std::string(e.what()) == "stop at " + std::to_string(stop_at));
    }
    CHECK(calls == stop_at);  // no layer after the one whose callback asked
    CHECK(at::equal(m(in.x, in.t, in.ctx), ref));
  }
  // Storage dtypes and residency are as before.
  CHECK(model.stats().residency_grid.find('S') != std::string::npos);
  CHECK(model.info().storage_dtype == "float8_e4m3fn");
}

TEST_CASE("api: bytes streamed equal the non-resident bytes and outputs match across budgets", "[strict][accel]") {
  sluice::ModelCache roomy(cpu());
  sluice::Model ref_model = roomy.load("anima-small");
  const Inputs in = inputs(ref_model.info());
  const at::Tensor ref = ref_model.lock()(in.x, in.t, in.ctx);
  const uint64_t minimum = ref_model.stats().minimum_bytes;
  for (const std::string& budget : {std::to_string(minimum + MiB), std::to_string(minimum * 2 + MiB)}) {
    for (const std::string prefetch : {"0", "2", "auto"}) {
      INFO("budget " << budget << " prefetch " << prefetch);
      sluice::RuntimeOptions o = cpu(budget);
      o.prefetch = prefetch;
      sluice::ModelCache cache(o);
      sluice::Model model = cache.load("anima-small");
      sluice::LockedModel m = model.lock();
      for (int f = 0; f < 2; ++f) CHECK(at::equal(m(in.x, in.t, in.ctx), ref));
      const sluice::ModelStats s = model.stats();
      CHECK(s.streamed_dit_bytes > 0);
      CHECK(s.streamed_bytes == s.total_bytes - s.resident_bytes);
      CHECK(s.streamed_bytes == s.streamed_dit_bytes + s.streamed_adapter_bytes);
      const at::Tensor ctx = m.encode_text(in.qwen, in.ids);
      REQUIRE(s.forward_records.size() == 2);
      // Each forward streams the non-resident bytes of the plan it ran under (the plan is
      // made again from the second forward's measurements, after it).
      for (const auto& r : s.forward_records) CHECK(r.bytes_streamed == r.planned_bytes);
      const nlohmann::json j = parse(model.stats_json());
      REQUIRE(j.at("forwards").size() == 3);
      for (const auto& f : j.at("forwards")) CHECK(f.at("bytes_streamed") == f.at("planned_bytes"));
      CHECK(j.at("prefetch").at("mismatched_forwards") == 0);
      CHECK(j.at("forwards").at(2).at("kind") == "adapter");
    }
  }
  // max_resident through LoadOptions and set_max_resident.
  sluice::ModelCache cache(cpu());
  sluice::LoadOptions lo;
  lo.max_resident = 0.0;
  sluice::Model model = cache.load("anima-small", lo);
  CHECK(at::equal(model.lock()(in.x, in.t, in.ctx), ref));
  const uint64_t streamed0 = model.stats().streamed_bytes;
  model.set_max_resident(0.5);
  CHECK(model.stats().streamed_bytes < streamed0);
  CHECK(at::equal(model.lock()(in.x, in.t, in.ctx), ref));
}

TEST_CASE("api: residency and budget changes at runtime", "[strict][accel]") {
  sluice::ModelCache cache(cpu("256MiB"));
  sluice::Model model = cache.load("anima-small");
  const Inputs in = inputs(model.info());
  const at::Tensor ref = model.lock()(in.x, in.t, in.ctx);
  const sluice::ModelStats full = model.stats();
  CHECK(full.streamed_bytes == 0);
  CHECK(model.full_unload() < 0);
  const sluice::ModelStats low = model.stats();
  CHECK(low.share_bytes == low.minimum_bytes);
  CHECK(low.streamed_bytes > 0);
  CHECK(model.residency_map().find('S') != std::string::npos);
  CHECK(at::equal(model.lock()(in.x, in.t, in.ctx), ref));
  CHECK(model.partial_load(full.device_bytes / 2) > 0);
  CHECK(model.stats().resident_bytes > low.resident_bytes);
  CHECK(model.partial_unload(1ull << 40) < 0);
  // Back at the minimum share. Its resident set need not be `low`'s: the forwards in between
  // gave the plan measured costs (Note [balanced plan]), and on the strict device their
  // random latencies made it keep other layers (one CI run saw 203520 resident bytes against
  // 596736 at `low`).
  const sluice::ModelStats back = model.stats();
  CHECK(back.share_bytes == back.minimum_bytes);
  CHECK(back.streamed_bytes > 0);
  CHECK(back.resident_bytes < full.resident_bytes);
  CHECK(model.full_load() > 0);
  CHECK(model.stats().streamed_bytes == 0);
  // A smaller budget shrinks the model; a larger one lets it grow back.
  cache.set_vram_budget(std::to_string(low.minimum_bytes + MiB + 4096));
  CHECK(model.stats().share_bytes <= low.minimum_bytes + 4096);
  CHECK(at::equal(model.lock()(in.x, in.t, in.ctx), ref));
  cache.set_vram_budget("256MiB");
  CHECK(model.stats().streamed_bytes == 0);
  CHECK_THROWS_AS(cache.set_vram_budget("lots"), sluice::InvalidArgument);
  CHECK_THROWS_AS(cache.set_vram_budget("1MiB"), sluice::ResourceError);
}

TEST_CASE("api: vram_budget auto is the free device memory minus vram_headroom, at creation and when set again",
          "[strict][accel]") {
  sluice::RuntimeOptions o = cpu("auto");
  o.device_memory = 1024 * MiB;  // the CPU device's total; free is the total minus what it holds
  o.vram_headroom = "256MiB";
  sluice::ModelCache cache(o);
  sluice::CacheStats cs = cache.stats();
  CHECK(cs.vram_budget_bytes == 768 * MiB);
  CHECK(cs.vram_budget_source == "auto: free 1.0GiB - headroom 256.0MiB = 768.0MiB on " + device_name());
  sluice::Model model = cache.load("anima-tiny");
  (void)model.lock();
  // Again with a model on the device: what sluice holds counts as free for its budget.
  cache.set_vram_budget("auto");
  cs = cache.stats();
  CHECK(cs.vram_budget_bytes == 768 * MiB);
  CHECK(cs.vram_budget_source.find("sluice holds") != std::string::npos);
  cache.set_vram_budget("50%");
  CHECK(cache.stats().vram_budget_bytes == 512 * MiB);
  CHECK(cache.stats().vram_budget_source == "50% of total 1.0GiB = 512.0MiB on " + device_name());
  cache.set_vram_budget("300MiB");  // the headroom applies to auto only: no error here
  CHECK(cache.stats().vram_budget_source.empty());
  // A headroom that leaves nothing, or one given with another budget, is refused.
  o.vram_headroom = "100%";
  CHECK_THROWS_WITH(sluice::ModelCache(o), Catch::Contains("vram_headroom '100%'"));
  o.vram_budget = "50%";
  o.vram_headroom = "1MiB";
  CHECK_THROWS_WITH(sluice::ModelCache(o), Catch::Contains("vram_headroom: only applies to vram_budget auto"));
}

TEST_CASE("api: LoRA changes the output and its removal restores it bit-exactly", "[strict][accel]") {
  TempDir dir;
  sluice::ModelCache cache(cpu());
  sluice::Model model = cache.load("anima-tiny");
  const Inputs in = inputs(model.info());
  // A rank-2 adapter on two DiT layers (PEFT keys), made from the model's shapes.
  at::Generator gen = at::detail::createCPUGenerator(11);
  const int64_t d = 64;  // anima-tiny model_channels
  std::vector<std::pair<std::string, at::Tensor>> t = {
      {"blocks.0.self_attn.q_proj.lora_A.weight", at::randn({2, d}, gen)},
      {"blocks.0.self_attn.q_proj.lora_B.weight", at::randn({d, 2}, gen)},
      {"blocks.1.mlp.layer2.lora_A.weight", at::randn({2, 4 * d}, gen)},
      {"blocks.1.mlp.layer2.lora_B.weight", at::randn({d, 2}, gen)},
  };
  sluice::safetensors::save(dir / "lora.safetensors", t, {});
  sluice::LockedModel m = model.lock();
  const at::Tensor base = m(in.x, in.t, in.ctx);
  {
    sluice::LoraHandle lora = m.apply_lora(dir / "lora.safetensors", 0.8);
    CHECK(lora.patched_layers() == 2);
    const at::Tensor patched = m(in.x, in.t, in.ctx);
    CHECK_FALSE(at::equal(patched, base));
    // Residency changes keep the LoRA (sidecars live beside the stored weights).
    model.full_unload();
    CHECK(at::equal(m(in.x, in.t, in.ctx), patched));
    m.remove_lora(lora);
    CHECK_FALSE(lora);
  }
  CHECK(at::equal(m(in.x, in.t, in.ctx), base));
  {
    sluice::LoraHandle lora = m.apply_lora(dir / "lora.safetensors", 0.8);
    CHECK_FALSE(at::equal(m(in.x, in.t, in.ctx), base));
  }  // removed on destruction
  CHECK(at::equal(m(in.x, in.t, in.ctx), base));
  CHECK_THROWS_AS(m.apply_lora(dir / "missing.safetensors"), sluice::FileError);
}

namespace {

// A rank-`rank` LoRA on every Linear of every DiT block (attention and MLP) of `info`'s
// model, saved at `path`.
void save_block_lora(const std::string& path, const sluice::ModelInfo& info, int64_t rank, uint64_t seed = 3) {
  const nlohmann::json cfg = parse(info.config_json);
  const int64_t d = cfg.at("model_channels"), h = d * cfg.at("mlp_ratio").get<int64_t>();
  at::Generator gen = at::detail::createCPUGenerator(seed);
  std::vector<std::pair<std::string, at::Tensor>> t;
  for (int64_t b = 0; b < info.num_blocks; ++b) {
    for (const auto& [name, in, out] : std::vector<std::tuple<std::string, int64_t, int64_t>>{
             {"self_attn.q_proj", d, d}, {"self_attn.k_proj", d, d}, {"self_attn.v_proj", d, d},
             {"self_attn.output_proj", d, d}, {"mlp.layer1", d, h}, {"mlp.layer2", h, d}}) {
      const std::string key = "blocks." + std::to_string(b) + "." + name;
      t.emplace_back(key + ".lora_A.weight", at::randn({rank, in}, gen) * 0.02);
      t.emplace_back(key + ".lora_B.weight", at::randn({out, rank}, gen) * 0.02);
    }
  }
  sluice::safetensors::save(path, t, {});
}

uint64_t share_of(const sluice::Model& m) { return parse(m.stats_json()).at("budget").at("share_bytes"); }
uint64_t lora_bytes_of(const sluice::Model& m) { return parse(m.stats_json()).at("device").at("lora_bytes"); }

}  // namespace

TEST_CASE("api: a LoRA's sidecars grow the model's share into the free budget and the share shrinks back",
          "[strict][accel]") {
  // Issue 29, item 1 (Note [sidecar share] in cache/sidecar_share.h).
  TempDir dir;
  sluice::ModelCache cache(cpu("4GiB", "64MiB"));
  sluice::Model model = cache.load("anima-small");
  const Inputs in = inputs(model.info());
  const uint64_t share = share_of(model);
  const std::string map = model.residency_map();
  REQUIRE(map.rfind("blocks: RRRRRRRR;", 0) == 0);  // fully resident: its share has no room to spare
  save_block_lora(dir / "r64.safetensors", model.info(), 64);
  sluice::LockedModel m = model.lock();
  const at::Tensor base = m(in.x, in.t, in.ctx);
  {
    sluice::LoraHandle lora = m.apply_lora(dir / "r64.safetensors");
    const uint64_t sidecars = lora_bytes_of(model);
    CHECK(sidecars > 0);
    CHECK(share_of(model) == share + sidecars);
    CHECK(cache.stats().vram_reserved_bytes == share + sidecars);
    CHECK(model.residency_map() == map);  // nothing more streams
    CHECK_FALSE(at::equal(m(in.x, in.t, in.ctx), base));
    // Residency changes size the share with the sidecars.
    model.full_unload();
    CHECK(model.stats().minimum_bytes == share_of(model));
    model.full_load();
    CHECK(share_of(model) == share + sidecars);
    CHECK(model.residency_map() == map);
  }
  CHECK(lora_bytes_of(model) == 0);
  CHECK(share_of(model) == share);
  CHECK(model.residency_map() == map);
  CHECK(at::equal(m(in.x, in.t, in.ctx), base));
}

TEST_CASE("api: an unlocked model gives up residency for another model's LoRA and a budget that cannot hold it refuses in one line",
          "[strict][accel]") {
  TempDir dir;
  uint64_t small_share = 0, tiny_share = 0;
  {
    sluice::ModelCache roomy(cpu("4GiB", "1MiB"));
    small_share = share_of(roomy.load("anima-small"));
    tiny_share = share_of(roomy.load("anima-tiny"));
  }
  // Exactly both models fully resident beside 1 MiB of working memory: no free budget.
  sluice::ModelCache cache(cpu(std::to_string(small_share + tiny_share + MiB), "1MiB"));
  sluice::Model tiny = cache.load("anima-tiny");
  sluice::Model small = cache.load("anima-small");
  REQUIRE(share_of(tiny) == tiny_share);
  REQUIRE(share_of(small) == small_share);
  const std::string map = tiny.residency_map();
  save_block_lora(dir / "r16.safetensors", tiny.info(), 16);
  {
    sluice::LockedModel m = tiny.lock();
    sluice::LoraHandle lora = m.apply_lora(dir / "r16.safetensors");
    const uint64_t sidecars = lora_bytes_of(tiny);
    REQUIRE(sidecars < small_share - small.stats().minimum_bytes);  // the unlocked small can make the room
    CHECK(share_of(tiny) == tiny_share + sidecars);
    CHECK(tiny.residency_map() == map);
    CHECK(share_of(small) == small_share - sidecars);  // partially unloaded, only as much as needed
    CHECK(cache.stats().device_unloads == 1);
  }
  CHECK(share_of(tiny) == tiny_share);

  // The tiny model alone under exactly its own share: a rank-64 LoRA on every block cannot
  // fit even with every layer streamed.
  sluice::ModelCache tight(cpu(std::to_string(tiny_share + MiB), "1MiB"));
  sluice::Model alone = tight.load("anima-tiny");
  const std::string tiny_map = alone.residency_map();
  save_block_lora(dir / "big.safetensors", alone.info(), 64);
  sluice::LockedModel m = alone.lock();
  std::string error;
  try {
    m.apply_lora(dir / "big.safetensors");
  } catch (const sluice::ResourceError& e) {
    error = e.what();
  }
  INFO(error);
  CHECK(error.find("LoRA '" + dir / "big.safetensors" + "' needs ") == 0);
  CHECK(error.find("model 'anima-tiny'") != std::string::npos);
  CHECK(error.find(" missing") != std::string::npos);
  CHECK(error.find('\n') == std::string::npos);
  CHECK(lora_bytes_of(alone) == 0);
  CHECK(share_of(alone) == tiny_share);
  CHECK(alone.residency_map() == tiny_map);
}

TEST_CASE("api: a LoRA does not outlive the lock it was applied through", "[strict][accel]") {
  // Issue 29, item 2 (Note [LoRA lifetime] in include/sluice/sluice.hpp).
  TempDir dir;
  sluice::ModelCache cache(cpu());
  sluice::Model model = cache.load("anima-tiny");
  const Inputs in = inputs(model.info());
  save_block_lora(dir / "lora.safetensors", model.info(), 4);
  const std::string path = dir / "lora.safetensors";
  sluice::LockedModel m = model.lock();
  const at::Tensor base = m(in.x, in.t, in.ctx);
  sluice::LoraHandle lora = m.apply_lora(path);
  CHECK(lora);
  CHECK_FALSE(at::equal(m(in.x, in.t, in.ctx), base));
  CHECK(model.stats().locks == 2);  // the lock and its LoRA
  m.unlock();  // the LoRA goes with it
  CHECK_FALSE(lora);
  CHECK(lora_bytes_of(model) == 0);
  CHECK(model.stats().locks == 0);
  {
    sluice::LockedModel again = model.lock();
    CHECK(at::equal(again(in.x, in.t, in.ctx), base));  // bit for bit
  }
  CHECK_NOTHROW(lora.remove());  // nothing left to remove
  CHECK_THROWS_AS(m.apply_lora(path), sluice::InvalidArgument);
  // The lock's destruction, and a lock moved over it, end its LoRAs too.
  sluice::LoraHandle outer;
  {
    sluice::LockedModel scoped = model.lock();
    outer = scoped.apply_lora(path);
    CHECK(outer);
  }
  CHECK_FALSE(outer);
  sluice::LockedModel moved = model.lock();
  sluice::LoraHandle inner = moved.apply_lora(path);
  moved = model.lock();
  CHECK_FALSE(inner);
  CHECK(at::equal(moved(in.x, in.t, in.ctx), base));
  CHECK(lora_bytes_of(model) == 0);
  CHECK(model.stats().locks == 1);
}

TEST_CASE("api: the cache's stats list every model it holds and each device total is the sum of its parts",
          "[strict][accel]") {
  // Issue 29, item 6 (Note [stats parts] in cache/cache_queries.h).
  sluice::ModelCache cache(cpu("4GiB", "64MiB"));
  const auto run = [](sluice::Model& model) {
    const Inputs in = inputs(model.info());
    sluice::LockedModel m = model.lock();
    m(in.x, in.t, in.ctx);
    m(in.x, in.t, in.ctx);
  };
  sluice::LoadOptions lo;
  lo.name = "same";
  lo.max_resident = 0.5;  // a staging ring
  uint64_t first_id = 0;
  {
    sluice::Model first = cache.load("anima-tiny", lo);
    run(first);
    first_id = parse(first.stats_json()).at("model").at("id");
  }  // its handle goes: the cache still holds it
  lo.max_resident.reset();
  lo.seed = 4;
  sluice::Model second = cache.load("anima-small", lo);
  run(second);
  const nlohmann::json c = parse(cache.stats_json());
  const auto& held = c.at("models_held");
  REQUIRE(held.size() == 2);
  CHECK(held[0].at("id") == first_id);
  CHECK(held[1].at("id") != first_id);
  CHECK(held[0].at("name") == "same");
  CHECK(held[1].at("name") == "same");
  CHECK(held[0].at("source") == "anima-tiny");
  CHECK(held[1].at("source") == "anima-small");
  uint64_t allocated = 0, device = 0, shares = 0;
  for (const auto& h : held) {
    allocated += h.at("allocated_bytes").get<uint64_t>();
    device += h.at("device_bytes").get<uint64_t>();
    shares += h.at("share_bytes").get<uint64_t>();
  }
  CHECK(c.at("vram").at("current").get<int64_t>() ==
        static_cast<int64_t>(allocated) + c.at("vram_unattributed_bytes").get<int64_t>());
  CHECK(c.at("vram_unattributed_bytes") == 0);  // between forwards
  CHECK(c.at("models_allocated_bytes") == allocated);
  CHECK(c.at("models_device_bytes") == device);
  CHECK(c.at("vram_reserved_bytes") == shares);
  const sluice::CacheStats cs = cache.stats();
  CHECK(cs.models_allocated_bytes == allocated);
  CHECK(cs.vram_unattributed_bytes == 0);
  // Each model's document splits the allocator's whole-device count the same way.
  const std::vector<sluice::Model> models = cache.models();
  REQUIRE(models.size() == 2);
  CHECK(models[0].stats().id == first_id);
  CHECK(models[1].stats().source == "anima-small");
  for (size_t i = 0; i < models.size(); ++i) {
    const nlohmann::json j = parse(models[i].stats_json());
    const auto& d = j.at("device");
    CHECK(j.at("model").at("id") == held[i].at("id"));
    CHECK(d.at("current_bytes") == held[i].at("device_bytes"));
    CHECK(d.at("allocated_bytes") == held[i].at("allocated_bytes"));
    CHECK(d.at("other_models_bytes") == allocated - held[i].at("allocated_bytes").get<uint64_t>());
    CHECK(models[i].stats().allocated_bytes == held[i].at("allocated_bytes"));
    REQUIRE(d.at("allocator_stats") == "available");
    CHECK(d.at("allocator_current_bytes").get<int64_t>() ==
          d.at("allocated_bytes").get<int64_t>() + d.at("other_models_bytes").get<int64_t>() +
              d.at("unattributed_bytes").get<int64_t>());
  }
}

TEST_CASE("api: errors name what is at fault", "[strict][accel]") {
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const sluice::Error& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message([] { sluice::RuntimeOptions o = cpu("a lot"); sluice::ModelCache c(o); }).find("vram_budget") !=
        std::string::npos);
  CHECK(message([] { sluice::RuntimeOptions o = cpu(); o.device = "tpu:0"; sluice::ModelCache c(o); }).find("device") !=
        std::string::npos);
  CHECK(message([] { sluice::RuntimeOptions o = cpu(); o.pin_memory = "maybe"; sluice::ModelCache c(o); })
            .find("pin_memory") != std::string::npos);
  CHECK(message([] { sluice::RuntimeOptions o = cpu(); o.pin_memory_limit = "plenty"; sluice::ModelCache c(o); })
            .find("pin_memory_limit") != std::string::npos);
  CHECK(message([] { sluice::RuntimeOptions o = cpu(); o.policy = "random"; sluice::ModelCache c(o); })
            .find("policy") != std::string::npos);
  sluice::ModelCache cache(cpu());
  CHECK(message([&] { cache.load("/nonexistent/model.safetensors"); }).find("/nonexistent/model.safetensors") !=
        std::string::npos);
  CHECK_THROWS_AS(cache.load("/nonexistent/model.safetensors"), sluice::FileError);
  sluice::LoadOptions bad;
  bad.storage = "int4";
  CHECK(message([&] { cache.load("anima-tiny", bad); }).find("int4") != std::string::npos);
  sluice::Model model = cache.load("anima-tiny");
  const Inputs in = inputs(model.info());
  sluice::LockedModel m = model.lock();
  CHECK_THROWS_AS(m(in.x.narrow(1, 0, 3), in.t, in.ctx), sluice::InvalidArgument);
  CHECK_THROWS_AS(m(in.x, in.t, in.ctx.to(at::kInt)), sluice::InvalidArgument);
  CHECK_THROWS_AS(m.encode_text(in.qwen, in.ids.to(at::kFloat)), sluice::InvalidArgument);
  CHECK(at::equal(m(in.x, in.t, in.ctx), m(in.x, in.t, in.ctx)));  // still fine afterwards
  m.unlock();
  CHECK_THROWS_AS(m(in.x, in.t, in.ctx), sluice::InvalidArgument);  // unlocked
  cache.drop(model);
  CHECK(message([&] { model.lock(); }).find("'anima-tiny'") != std::string::npos);
  CHECK_THROWS_AS(sluice::Model().lock(), sluice::InvalidArgument);
  // An impossible budget: one error with the minimum that would work.
  const std::string msg = message([] {
    sluice::ModelCache small(cpu("2MiB", "1MiB"));
    small.load("anima-small");
  });
  std::smatch sm;
  REQUIRE(std::regex_search(msg, sm, std::regex(R"(minimum that would work is \S+ \((\d+) bytes)")));
  sluice::ModelCache exact(cpu(sm[1].str(), "1MiB"));
  CHECK_NOTHROW(exact.load("anima-small").lock());
}

TEST_CASE("api: a NaN or Inf input is an InvalidArgument naming the input and its first position", "[strict][accel]") {
  auto message = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const sluice::InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  sluice::ModelCache cache(cpu());
  sluice::Model model = cache.load("anima-tiny");
  const Inputs in = inputs(model.info());
  sluice::LockedModel m = model.lock();
  const at::Tensor ref = m(in.x, in.t, in.ctx);
  at::Tensor x = in.x.clone();
  x.index_put_({0, 2, 0, 5, 7}, std::nan(""));
  x.index_put_({1, 0, 0, 0, 0}, INFINITY);
  x.index_put_({1, 3, 0, 1, 1}, -INFINITY);
  CHECK(message([&] { m(x, in.t, in.ctx); }) ==
        "forward: input 'x' has 3 non-finite values (first at [0, 2, 0, 5, 7]: nan)");
  at::Tensor t = in.t.clone();
  t.index_put_({1}, INFINITY);
  CHECK(message([&] { m(in.x, t, in.ctx); }) == "forward: input 'timesteps' has 1 non-finite value (first at [1]: inf)");
  at::Tensor ctx = in.ctx.to(at::kBFloat16);  // any floating dtype, checked as given
  ctx.index_put_({1, 4, 3}, -INFINITY);
  CHECK(message([&] { m(in.x, in.t, ctx); }) == "forward: input 'context' has 1 non-finite value (first at [1, 4, 3]: -inf)");
  at::Tensor qwen = in.qwen.clone();
  qwen.index_put_({0, 6, 31}, std::nan(""));
  CHECK(message([&] { m.encode_text(qwen, in.ids); }) ==
        "encode_text: input 'qwen_hidden' has 1 non-finite value (first at [0, 6, 31]: nan)");
  at::Tensor w = at::ones({2, 5});
  w.index_put_({1, 2}, INFINITY);
  CHECK(message([&] { m.encode_text(in.qwen, in.ids, w); }).find("input 't5_weights' has 1 non-finite value") !=
        std::string::npos);
  CHECK(message([&] { m.locate_nonfinite(x, in.t, in.ctx); }).find("input 'x' has 3 non-finite values") !=
        std::string::npos);
  // Nothing ran: the refused calls are not forwards, and the model is unharmed.
  CHECK(model.stats().forwards == 1);
  CHECK(at::equal(m(in.x, in.t, in.ctx), ref));
}

TEST_CASE("api: locate_nonfinite re-runs a forward with a per-layer check and names the first overflowing layer",
          "[strict][accel]") {
  TempDir dir;
  sluice::ModelCache cache(cpu());
  sluice::LoadOptions lo;
  lo.max_resident = 0.5;  // streamed layers too
  sluice::Model model = cache.load("anima-tiny", lo);
  const Inputs in = inputs(model.info());
  sluice::LockedModel m = model.lock();
  // A healthy forward: nothing to find, and the re-run still counts.
  CHECK(at::isfinite(m(in.x, in.t, in.ctx)).all().item<bool>());
  CHECK_FALSE(m.locate_nonfinite(in.x, in.t, in.ctx).has_value());
  CHECK_FALSE(m.locate_nonfinite_text(in.qwen, in.ids).has_value());
  CHECK(model.stats().nonfinite_reruns == 2);
  CHECK(model.stats().forwards == 3);
  // A LoRA whose residual overflows the compute dtype in one DiT layer and one adapter layer:
  // their outputs are the first non-finite ones (every layer before them is untouched).
  const int64_t d = 64, da = 32;  // anima-tiny model_channels, adapter model_dim
  std::vector<std::pair<std::string, at::Tensor>> t = {
      {"blocks.1.mlp.layer2.lora_A.weight", at::full({1, 4 * d}, 1e20)},
      {"blocks.1.mlp.layer2.lora_B.weight", at::full({d, 1}, 1e20)},
      {"llm_adapter.blocks.1.mlp.2.lora_A.weight", at::full({1, 4 * da}, 1e20)},
      {"llm_adapter.blocks.1.mlp.2.lora_B.weight", at::full({da, 1}, 1e20)},
  };
  sluice::safetensors::save(dir / "overflow.safetensors", t, {});
  sluice::LoraHandle lora = m.apply_lora(dir / "overflow.safetensors");
  const at::Tensor v = m(in.x, in.t, in.ctx);
  REQUIRE_FALSE(at::isfinite(v).all().item<bool>());
  const std::optional<sluice::NonFiniteReport> r = m.locate_nonfinite(in.x, in.t, in.ctx);
  REQUIRE(r.has_value());
  CHECK(r->kind == "dit");
  CHECK(r->module == "blocks.1.mlp.layer2");
  CHECK(r->nonfinite_values > 0);
  CHECK(r->nonfinite_values <= r->values);
  CHECK(r->output_nonfinite_values == at::logical_not(at::isfinite(v)).sum().item<int64_t>());
  CHECK(r->output_values == v.numel());
  const sluice::ModelStats st = model.stats();
  CHECK(r->forward_index == st.forwards - 1);
  CHECK(st.nonfinite_reruns == 3);
  REQUIRE(st.nonfinite.has_value());
  CHECK(st.nonfinite->module == "blocks.1.mlp.layer2");
  const nlohmann::json j = parse(model.stats_json());
  CHECK(j.at("nonfinite").at("reruns") == 3);
  CHECK(j.at("nonfinite").at("last").at("module") == "blocks.1.mlp.layer2");
  CHECK(j.at("nonfinite").at("last").at("kind") == "dit");
  CHECK(j.at("nonfinite").at("last").at("forward") == r->forward_index);

  const std::optional<sluice::NonFiniteReport> a = m.locate_nonfinite_text(in.qwen, in.ids);
  REQUIRE(a.has_value());
  CHECK(a->kind == "adapter");
  CHECK(a->module == "llm_adapter.blocks.1.mlp.2");
  CHECK(parse(model.stats_json()).at("nonfinite").at("last").at("module") == "llm_adapter.blocks.1.mlp.2");
  // Without the LoRA the same inputs are finite again: the re-runs changed nothing.
  lora.remove();
  CHECK(at::isfinite(m(in.x, in.t, in.ctx)).all().item<bool>());
}

TEST_CASE("api: the load log line and the residency map are printed at INFO", "[strict][accel]") {
  TempDir dir;
  const auto level = sluice::log::level();
  sluice::log::set_level(sluice::log::Level::info);
  std::string text;
  {
    StderrCapture capture(dir / "log.txt");
    sluice::ModelCache cache(cpu("512MiB"));
    cache.load("anima-tiny");
    text = capture.finish();
  }
  sluice::log::set_level(level);
  INFO(text);
  CHECK(std::regex_search(text, std::regex(R"(Loaded model 'anima-tiny' onto )" + device_name() + R"( in \d+\.\d\ds\. Total model size: )"
                                           R"(\d+\.\dMiB, VRAM: \d+\.\dMiB \(100\.0%\))")));
  CHECK(std::regex_search(text, std::regex(R"(Residency of 'anima-tiny' \(balanced\): blocks: RR)")));
}

TEST_CASE("api: handles outlive the cache and the trace is written", "[strict][accel]") {
  TempDir dir;
  sluice::Model model;
  {
    sluice::RuntimeOptions o = cpu("8MiB");
    o.trace = true;
    sluice::ModelCache cache(o);
    model = cache.load("anima-tiny", [] {
      sluice::LoadOptions lo;
      lo.max_resident = 0.0;
      return lo;
    }());
  }
  const Inputs in = inputs(model.info());
  {
    sluice::LockedModel m = model.lock();
    m(in.x, in.t, in.ctx);
    CHECK(m.model().name() == "anima-tiny");
  }
  model.write_trace(dir / "trace.json");
  std::ifstream f(dir / "trace.json");
  const nlohmann::json t = nlohmann::json::parse(f);
  bool copy = false, compute = false;
  for (const auto& ev : t.at("traceEvents")) {
    if (ev.value("ph", "") != "X") continue;
    copy = copy || ev.at("tid") == 1;
    compute = compute || ev.at("tid") == 3;
  }
  CHECK(copy);
  CHECK(compute);
}

TEST_CASE("api: log lines go to an embedder's sink at the level it sets, and to stderr again without one",
          "[strict][accel]") {
  const sluice::LogLevel before = sluice::log_level();
  std::vector<std::pair<sluice::LogLevel, std::string>> got;
  sluice::set_log_level(sluice::LogLevel::info);
  sluice::set_log_sink([&](sluice::LogLevel level, const std::string& line) { got.emplace_back(level, line); });
  {
    sluice::ModelCache cache(cpu());
    sluice::Model model = cache.load("anima-tiny");
  }
  const size_t at_info = got.size();
  CHECK(at_info > 0);
  bool loaded = false;
  for (const auto& [level, line] : got) loaded = loaded || (level == sluice::LogLevel::info && line.find("'anima-tiny'") != std::string::npos);
  CHECK(loaded);
  sluice::set_log_level(sluice::LogLevel::warn);  // the level still filters what reaches the sink
  {
    sluice::ModelCache cache(cpu());
    sluice::Model model = cache.load("anima-tiny");
  }
  CHECK(got.size() == at_info);
  sluice::set_log_sink(nullptr);
  sluice::set_log_level(sluice::LogLevel::info);
  {
    TempDir dir;
    StderrCapture err(dir / "log.txt");
    sluice::ModelCache cache(cpu());
    sluice::Model model = cache.load("anima-tiny");
    CHECK(err.finish().find("'anima-tiny'") != std::string::npos);  // stderr again
  }
  CHECK(got.size() == at_info);
  sluice::set_log_level(before);
}
