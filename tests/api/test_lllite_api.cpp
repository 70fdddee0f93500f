// ControlNet-LLLite through the public C++ API (LockedModel::apply_lllite, LLLiteHandle):
// effect, weight, removal bit for bit, the lock's end, the charged share, stats JSON, errors;
// and the C functions (sluice_lllite_*, include/sluice/sluice.h) called as a C host calls them.
#include <sluice/sluice.h>
#include <sluice/sluice.hpp>

#include <ATen/DLConvertor.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <string>
#include <unistd.h>

#include "runtime/error.h"        // exception types callers catch
#include "runtime/safetensors.h"  // writing the fixture
#include "tests/support/temp_dir.h"
#include "tests/support/device_env.h"
#include "tests/support/lllite_file.h"

namespace {

using sluice::testing::TempDir;  // tests/support/temp_dir.h

sluice::RuntimeOptions cpu(const std::string& budget = "512MiB") {
  sluice::RuntimeOptions o;
  o.device = sluice::testing::test_device_spec();
  o.vram_budget = budget;
  o.working_memory = "1MiB";
  o.ram_limit = "0";
  return o;
}

struct Inputs {
  at::Tensor x, t, ctx, image, mask;
};
Inputs inputs(const sluice::ModelInfo& info) {
  at::Generator gen = at::detail::createCPUGenerator(5);
  return {at::randn({2, info.in_channels, 1, 8, 8}, gen), at::rand({2}, gen), at::randn({2, 6, info.context_dim}, gen),
          at::rand({3, 37, 45}, gen), (at::rand({20, 20}, gen) > 0.5).to(at::kFloat)};
}

nlohmann::json parse(const std::string& s) { return nlohmann::json::parse(s); }

template <class E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "<no error of the expected type>";
}

}  // namespace

TEST_CASE("api: an LLLite moves the output, its weight steps, and removal restores it bit for bit", "[strict][accel]") {
  TempDir dir;
  sluice::safetensors::save(dir / "ll.safetensors", sluice::testing::lllite_file({}), {});
  sluice::ModelCache cache(cpu());
  sluice::Model model = cache.load("anima-tiny");
  const Inputs in = inputs(model.info());
  sluice::LockedModel m = model.lock();
  const at::Tensor base = m(in.x, in.t, in.ctx);
  const uint64_t share = parse(model.stats_json()).at("budget").at("share_bytes");
  {
    sluice::LLLiteHandle ll = m.apply_lllite(dir / "ll.safetensors", in.image, 1.0);
    CHECK(ll.active());
    CHECK(ll.modules() == 10);
    CHECK(ll.bound_layers() == 10);
    CHECK(ll.device_bytes() > 0);
    const nlohmann::json s = parse(model.stats_json());
    REQUIRE(s.at("lllite").size() == 1);
    CHECK(s.at("lllite")[0].at("source") == dir / "ll.safetensors");
    CHECK(s.at("lllite")[0].at("device_bytes") == ll.device_bytes());
    CHECK(s.at("lllite")[0].at("modules") == 10);
    CHECK(s.at("lllite")[0].at("layers_bound") == 10);
    // Charged like LoRA sidecars: the share grew by its bytes, counted as the model's sidecar bytes.
    CHECK(s.at("budget").at("share_bytes").get<uint64_t>() == share + ll.device_bytes());
    CHECK(s.at("device").at("lora_bytes").get<uint64_t>() == ll.device_bytes());
    const at::Tensor on = m(in.x, in.t, in.ctx);
    CHECK_FALSE(at::equal(on, base));
    ll.set_weight(0.0);
    CHECK(ll.weight() == 0.0);
    CHECK(at::equal(m(in.x, in.t, in.ctx), base));
    ll.set_weight(1.0);
    CHECK(at::equal(m(in.x, in.t, in.ctx), on));
    // Residency changes keep it.
    model.full_unload();
    CHECK(at::equal(m(in.x, in.t, in.ctx), on));
    CHECK(error_of<sluice::InvalidArgument>([&] { ll.set_weight(NAN); }) ==
          "LLLite '" + dir / "ll.safetensors" + "': weight nan is not finite");
    ll.remove();
    CHECK_FALSE(ll.active());
  }
  CHECK(at::equal(m(in.x, in.t, in.ctx), base));
  CHECK(parse(model.stats_json()).at("lllite").empty());
  CHECK(parse(model.stats_json()).at("device").at("lora_bytes").get<uint64_t>() == 0);
  // A handle outliving its lock is inactive; the next lock finds the model as loaded.
  sluice::LLLiteHandle kept = m.apply_lllite(dir / "ll.safetensors", in.image);
  m.unlock();
  CHECK_FALSE(kept.active());
  CHECK(error_of<sluice::InvalidArgument>([&] { kept.set_weight(0.5); }).find("is no longer bound") !=
        std::string::npos);
  sluice::LockedModel again = model.lock();
  CHECK(at::equal(again(in.x, in.t, in.ctx), base));
}

TEST_CASE("api: an LLLite at half residency gives the fully resident output, bad inputs are one line", "[strict][accel]") {
  TempDir dir;
  sluice::testing::LLLiteFileSpec ip;
  ip.in_channels = 4;
  sluice::safetensors::save(dir / "ip.safetensors", sluice::testing::lllite_file(ip), {});
  sluice::safetensors::save(dir / "rgb.safetensors", sluice::testing::lllite_file({}), {});
  sluice::ModelCache cache(cpu());
  sluice::Model model = cache.load("anima-tiny");
  const Inputs in = inputs(model.info());
  at::Tensor full;
  {
    sluice::LockedModel m = model.lock();
    sluice::LLLiteHandle ll = m.apply_lllite(dir / "ip.safetensors", in.image, 0.7, in.mask);
    full = m(in.x, in.t, in.ctx);
  }
  model.set_max_resident(0.5);
  {
    sluice::LockedModel m = model.lock();
    sluice::LLLiteHandle ll = m.apply_lllite(dir / "ip.safetensors", in.image, 0.7, in.mask);
    CHECK(model.stats().streamed_layers > 0);
    CHECK(at::equal(m(in.x, in.t, in.ctx), full));
    const std::string ip_name = "LLLite '" + dir / "ip.safetensors" + "'";
    CHECK(error_of<sluice::InvalidArgument>([&] { m.apply_lllite(dir / "ip.safetensors", in.image); }) ==
          ip_name + " is an inpaint adapter (4 input channels): it needs a mask (1 = inpaint, 0 = keep)");
    CHECK(error_of<sluice::InvalidArgument>([&] { m.apply_lllite(dir / "rgb.safetensors", in.image, 1.0, in.mask); }) ==
          "LLLite '" + dir / "rgb.safetensors" + "' takes an RGB image only (3 input channels): it takes no mask");
    at::Tensor nan_image = in.image.clone();
    nan_image[0][1][2] = NAN;
    const std::string nan_error =
        error_of<sluice::InvalidArgument>([&] { m.apply_lllite(dir / "rgb.safetensors", nan_image); });
    INFO(nan_error);
    CHECK(nan_error == "apply_lllite: input 'cond_image' has 1 non-finite value (first at [0, 1, 2]: nan)");
    CHECK(nan_error.find('\n') == std::string::npos);
    CHECK_THROWS_AS(m.apply_lllite(dir / "missing.safetensors", in.image), sluice::FileError);
    CHECK(parse(model.stats_json()).at("lllite").size() == 1);  // the failed ones bound nothing
  }
}

TEST_CASE("api: the C functions bind, weigh and unbind an LLLite, errors are statuses with one line", "[strict][accel]") {
  TempDir dir;
  sluice::safetensors::save(dir / "ll.safetensors", sluice::testing::lllite_file({}), {});
  sluice_cache_options o;
  sluice_cache_options_init(&o);
  o.device = "cpu";
  sluice_cache* cache = nullptr;
  REQUIRE(sluice_cache_create(&o, &cache) == SLUICE_OK);
  sluice_model* model = nullptr;
  REQUIRE(sluice_load(cache, "anima-tiny", nullptr, &model) == SLUICE_OK);
  sluice_locked* lock = nullptr;
  REQUIRE(sluice_lock(model, &lock) == SLUICE_OK);
  at::Generator gen = at::detail::createCPUGenerator(7);
  const at::Tensor x = at::randn({1, 16, 1, 8, 8}, gen), t = at::full({1}, 0.5), ctx = at::randn({1, 4, 32}, gen);
  const at::Tensor image = at::rand({3, 30, 30}, gen);
  auto forward = [&] {
    DLManagedTensor* out = nullptr;
    DLManagedTensor *dx = at::toDLPack(x), *dt = at::toDLPack(t), *dc = at::toDLPack(ctx);
    REQUIRE(sluice_forward(lock, dx, dt, dc, &out) == SLUICE_OK);
    for (DLManagedTensor* d : {dx, dt, dc}) d->deleter(d);
    at::Tensor v = at::fromDLPack(out).clone();
    return v;
  };
  const at::Tensor base = forward();
  DLManagedTensor* img = at::toDLPack(image);
  sluice_lllite* ll = nullptr;
  REQUIRE(sluice_lllite_apply(lock, (dir / "ll.safetensors").c_str(), img, 1.0, nullptr, nullptr, &ll) == SLUICE_OK);
  CHECK(sluice_lllite_active(ll) == 1);
  const at::Tensor on = forward();
  CHECK_FALSE(at::equal(on, base));
  REQUIRE(sluice_lllite_set_weight(ll, 0.0) == SLUICE_OK);
  CHECK(at::equal(forward(), base));
  CHECK(sluice_lllite_set_weight(ll, NAN) == SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(sluice_last_error()).find("weight nan is not finite") != std::string::npos);
  // A mask for an RGB adapter: refused, nothing bound, one line.
  sluice_lllite* bad = nullptr;
  DLManagedTensor* mask = at::toDLPack(at::ones({30, 30}));
  CHECK(sluice_lllite_apply(lock, (dir / "ll.safetensors").c_str(), img, 1.0, mask, nullptr, &bad) ==
        SLUICE_ERROR_INVALID_ARGUMENT);
  CHECK(bad == nullptr);
  CHECK(std::string(sluice_last_error()).find("takes no mask") != std::string::npos);
  CHECK(sluice_lllite_apply(lock, (dir / "nope.safetensors").c_str(), img, 1.0, nullptr, nullptr, &bad) ==
        SLUICE_ERROR_FILE);
  mask->deleter(mask);
  img->deleter(img);
  sluice_unlock(lock);  // unbinds it: the handle stays valid, inactive
  CHECK(sluice_lllite_active(ll) == 0);
  sluice_lllite_remove(ll);
  CHECK(sluice_lllite_active(nullptr) == 0);
  REQUIRE(sluice_lock(model, &lock) == SLUICE_OK);
  CHECK(at::equal(forward(), base));
  sluice_unlock(lock);
  sluice_model_release(model);
  sluice_cache_destroy(cache);
}
