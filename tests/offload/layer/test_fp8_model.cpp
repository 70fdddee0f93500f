// fp8 storage of a whole model: offload::apply_storage on Anima (sizes pinned against
// anima-2b's known bf16 and fp8 sizes on a shape-only build), the load_anima wiring, exception safety of the
// weight leases, exact storage round trips and the fp8-off identity.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <unistd.h>

#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "tests/support/temp_dir.h"

using namespace sluice;
using namespace sluice::anima;

namespace {

AnimaModel random_model(const AnimaConfig& config, uint64_t seed, at::ScalarType dtype) {
  AnimaModel model(config, BuildOptions{dtype, at::kCPU});
  const auto weights = random_weights(config, seed, dtype);
  auto params = model->named_parameters();
  REQUIRE(weights.size() == params.size());
  for (const auto& [name, t] : weights) params[name].set_data(t);
  return model;
}

std::string one_decimal(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

Fp8Options fp8(at::ScalarType storage = at::kFloat8_e4m3fn) {
  Fp8Options o;
  o.storage = storage;
  o.compute = at::kBFloat16;
  return o;
}

// param_size of a shape-only anima-2b under `options`.
offload::StorageReport meta_2b(const Fp8Options& options) {
  AnimaModel model(preset("anima-2b"), BuildOptions{at::kBFloat16, at::kMeta});
  return offload::apply_storage(*model, "anima-2b", options, declared_fp8_skips());
}

// Bitwise equality that also works for fp8 tensors.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  return at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

// name -> (dtype, clone) of every parameter.
std::map<std::string, at::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> s;
  for (const auto& p : m.named_parameters()) s[p.key()] = p.value().clone();
  return s;
}

void require_unchanged(torch::nn::Module& m, const std::map<std::string, at::Tensor>& before) {
  const auto params = m.named_parameters();
  REQUIRE(params.size() == before.size());
  for (const auto& p : params) {
    INFO(p.key());
    REQUIRE(same_bits(p.value(), before.at(p.key())));
  }
}

using sluice::testing::TempDir;  // tests/support/temp_dir.h

struct Inputs {
  at::Tensor x, t, ctx, qwen, ids;
};
Inputs tiny_inputs(at::ScalarType dtype) {
  at::manual_seed(3);
  Inputs in;
  in.x = at::randn({1, 16, 1, 8, 8}).to(dtype);
  in.t = at::full({1}, 0.6);
  in.ctx = at::randn({1, 6, 32}).to(dtype);
  in.qwen = at::randn({1, 7, 32}).to(dtype);
  in.ids = at::randint(0, 128, {1, 5}, at::kLong);
  return in;
}

// One DiT forward and one adapter pass, concatenated.
at::Tensor step(AnimaModelImpl& m, const Inputs& in) {
  return at::cat({m.forward(in.x, in.t, in.ctx).flatten(), m.encode_text(in.qwen, in.ids).flatten()});
}

}  // namespace

TEST_CASE("fp8 model: anima-2b param_size per skip list matches its known sizes (shape-only build)", "[strict]") {
  AnimaModel bf16(preset("anima-2b"), BuildOptions{at::kBFloat16, at::kMeta});
  CHECK(one_decimal(offload::param_bytes(*bf16) / 1048576.0) == "3988.4");

  // Storage = compute: nothing changes.
  Fp8Options off = fp8(at::kBFloat16);
  CHECK(one_decimal(meta_2b(off).param_mib()) == "3988.4");

  Fp8Options none = fp8();
  none.use_default_skips = false;
  none.use_model_skips = false;
  const auto r_none = meta_2b(none);
  CHECK(one_decimal(r_none.param_mib()) == "1994.2");
  CHECK(r_none.skipped.empty());

  // "t_embedder only": the defaults match no Linear of Anima, so they may stay on.
  Fp8Options t_only = fp8();
  t_only.use_model_skips = false;
  t_only.extra_skip_patterns = {"t_embedder"};
  const auto r_t = meta_2b(t_only);
  CHECK(one_decimal(r_t.param_mib()) == "2010.2");
  CHECK(r_t.skipped.size() == 2);

  const auto r_declared = meta_2b(fp8());
  CHECK(one_decimal(r_declared.param_mib()) == "2012.0");

  // Whole-component matching: the in-block modules are adaln_modulation_{self_attn,...},
  // so the reference's substring pattern is spelled as a regex here.
  Fp8Options plus_adaln = fp8();
  plus_adaln.extra_skip_patterns = {"adaln_modulation\\w*"};
  CHECK(one_decimal(meta_2b(plus_adaln).param_mib()) == "2180.0");

  // A plain `adaln_modulation` only names final_layer's (already declared).
  Fp8Options plain_adaln = fp8();
  plain_adaln.extra_skip_patterns = {"adaln_modulation"};
  CHECK(one_decimal(meta_2b(plain_adaln).param_mib()) == "2012.0");
}

TEST_CASE("fp8 model: Anima's declared skip list matches exactly its 6 modules on anima-2b", "[strict]") {
  CHECK(declared_fp8_skips() == std::vector<std::string>{"t_embedder", "x_embedder", "final_layer"});
  const auto r = meta_2b(fp8());
  std::set<std::string> modules;
  for (const auto& [module, pattern] : r.skipped) modules.insert(module);
  CHECK(modules == std::set<std::string>{"t_embedder.1.linear_1", "t_embedder.1.linear_2", "x_embedder.proj.1",
                                         "final_layer.linear", "final_layer.adaln_modulation.1",
                                         "final_layer.adaln_modulation.2"});
  for (const auto& [module, pattern] : r.skipped) {
    INFO(module);
    CHECK(module.rfind(pattern, 0) == 0);  // the pattern that matched is the module's group
  }
  // Every other Linear/Embedding is cast; norms are never counted as layers.
  AnimaModel m(preset("anima-2b"), BuildOptions{at::kBFloat16, at::kMeta});
  const int64_t layers = static_cast<int64_t>(offload::managed_layers(*m).size());
  CHECK(r.cast_layers == layers - 6);
  CHECK(r.cast_params + r.skipped_params + 37376 == 2091068928);  // 37,376 norm elements
}

TEST_CASE("fp8 model: apply_storage casts weight and bias of unskipped layers only, norms and buffers untouched",
          "[strict]") {
  AnimaModel m = random_model(preset("anima-tiny"), 2, at::kBFloat16);
  std::map<std::string, at::ScalarType> buffer_dtypes;
  for (const auto& b : m->named_buffers()) buffer_dtypes[b.key()] = b.value().scalar_type();
  const auto r = offload::apply_storage(*m, "anima-tiny", fp8(), declared_fp8_skips());
  std::set<std::string> managed_params;
  for (const auto& [name, layer] : offload::managed_layers(*m)) {
    INFO(name);
    const bool skipped = name.rfind("t_embedder", 0) == 0 || name.rfind("x_embedder", 0) == 0 ||
                         name.rfind("final_layer", 0) == 0;
    const at::ScalarType want = skipped ? at::kBFloat16 : at::kFloat8_e4m3fn;
    CHECK(layer->stored_weight().scalar_type() == want);
    if (layer->has_bias()) CHECK(layer->stored_bias().scalar_type() == want);
    CHECK(layer->compute_dtype() == at::kBFloat16);
    managed_params.insert(name + ".weight");
    if (layer->has_bias()) managed_params.insert(name + ".bias");
  }
  int64_t expected_bytes = 0, biases = 0;
  for (const auto& p : m->named_parameters()) {
    if (!managed_params.count(p.key())) {
      INFO(p.key());
      CHECK(p.value().scalar_type() == at::kBFloat16);  // norm scales
    }
    if (p.key().find(".bias") != std::string::npos) biases += 1;
    expected_bytes += p.value().numel() * (p.value().scalar_type() == at::kFloat8_e4m3fn ? 1 : 2);
  }
  CHECK(biases > 0);  // the adapter's MLP biases were among the cast tensors
  CHECK(r.param_bytes == expected_bytes);
  for (const auto& b : m->named_buffers()) CHECK(b.value().scalar_type() == buffer_dtypes.at(b.key()));
}

TEST_CASE("fp8 model: load_anima with fp8 storage yields the fp8 resident size (dead-toggle guard)", "[strict]") {
  TempDir tmp;
  const AnimaConfig c = preset("anima-tiny");
  const std::string path = tmp / "tiny.safetensors";
  write_random_checkpoint(c, 5, at::kBFloat16, path);

  LoadOptions plain;
  plain.dtype = at::kBFloat16;
  AnimaModel ref = load_anima(path, plain);

  // Expected bytes, derived from the bf16 load: a managed layer outside the declared groups
  // is 1 byte per element, everything else 2.
  std::set<std::string> fp8_params;
  for (const auto& [name, layer] : offload::managed_layers(*ref)) {
    if (name.rfind("t_embedder", 0) == 0 || name.rfind("x_embedder", 0) == 0 || name.rfind("final_layer", 0) == 0) {
      continue;
    }
    fp8_params.insert(name + ".weight");
    if (layer->has_bias()) fp8_params.insert(name + ".bias");
  }
  int64_t expected = 0;
  for (const auto& p : ref->named_parameters()) expected += p.value().numel() * (fp8_params.count(p.key()) ? 1 : 2);
  REQUIRE(expected < offload::param_bytes(*ref));

  LoadOptions o;
  o.storage = fp8();
  AnimaModel model = load_anima(path, o);
  CHECK(offload::param_bytes(*model) == expected);
  for (const auto& p : model->named_parameters()) {
    INFO(p.key());
    CHECK(p.value().scalar_type() == (fp8_params.count(p.key()) ? at::kFloat8_e4m3fn : at::kBFloat16));
    // The stored bytes are the checked cast of the checkpoint's values.
    const at::Tensor want = fp8_params.count(p.key())
                                ? cast_to_storage(ref->named_parameters()[p.key()], at::kFloat8_e4m3fn, p.key()).stored
                                : ref->named_parameters()[p.key()];
    CHECK(same_bits(p.value(), want));
  }
  // And it runs, close to the bf16 model.
  const Inputs in = tiny_inputs(at::kBFloat16);
  const at::Tensor y = model->forward(in.x, in.t, in.ctx).to(at::kFloat);
  const at::Tensor y_ref = ref->forward(in.x, in.t, in.ctx).to(at::kFloat);
  CHECK(at::isfinite(y).all().item<bool>());
  CHECK((y - y_ref).norm().item<double>() / y_ref.norm().item<double>() < 0.25);
  CHECK_FALSE(at::equal(y, y_ref));
}

TEST_CASE("fp8 model: apply_storage refuses NaN weights and leaves that layer untouched", "[strict]") {
  AnimaModel m = random_model(preset("anima-tiny"), 2, at::kBFloat16);
  auto layers = offload::managed_layers(*m);
  offload::ManagedLayerImpl* victim = nullptr;
  for (auto& [name, layer] : layers) {
    if (name == "blocks.1.mlp.layer2") victim = layer;
  }
  REQUIRE(victim != nullptr);
  at::Tensor w = victim->stored_weight().clone();
  w.view(-1)[7] = std::nanf("");
  victim->set_stored(w);
  try {
    offload::apply_storage(*m, "anima-tiny", fp8(), declared_fp8_skips());
    FAIL("no throw");
  } catch (const InvalidArgument& e) {
    CHECK(std::string(e.what()).find("blocks.1.mlp.layer2.weight") != std::string::npos);
    CHECK(std::string(e.what()).find("NaN") != std::string::npos);
  }
  CHECK(victim->stored_weight().scalar_type() == at::kBFloat16);
  CHECK(at::isnan(victim->stored_weight()).sum().item<int64_t>() == 1);
}

TEST_CASE("fp8 model: apply_storage refuses NaN and Inf weights for every storage dtype, a weight kept as it is too",
          "[strict]") {
  // Issue 29, item 3: bf16 storage kept a NaN weight of a bf16 model as it was.
  for (const at::ScalarType storage : {at::kFloat8_e4m3fn, at::kBFloat16, at::kHalf, at::kFloat}) {
    for (const at::ScalarType compute : {at::kBFloat16, at::kFloat}) {
      for (const float bad : {std::nanf(""), -INFINITY}) {
        CAPTURE(storage, compute, bad);
        AnimaModel m = random_model(preset("anima-tiny"), 2, compute);
        offload::ManagedLayerImpl* victim = nullptr;
        for (auto& [name, layer] : offload::managed_layers(*m)) {
          if (name == "blocks.1.mlp.layer2") victim = layer;
        }
        REQUIRE(victim != nullptr);
        at::Tensor w = victim->stored_weight().clone();
        w.view(-1)[7] = bad;
        victim->set_stored(w);
        Fp8Options o = fp8();
        o.storage = storage;
        o.compute = compute;
        const std::string what = std::isnan(bad) ? "1 NaN and 0 inf" : "0 NaN and 1 inf";
        CHECK_THROWS_WITH(offload::apply_storage(*m, "anima-tiny", o, declared_fp8_skips()),
                          Catch::Contains("'blocks.1.mlp.layer2.weight'") && Catch::Contains(what));
      }
    }
  }
  // Beyond float16's range: saturated with the one warning, never inf.
  AnimaModel m = random_model(preset("anima-tiny"), 2, at::kFloat);
  offload::ManagedLayerImpl* victim = offload::managed_layers(*m).front().second;
  for (auto& [name, layer] : offload::managed_layers(*m)) {
    if (name == "blocks.1.mlp.layer2") victim = layer;
  }
  at::Tensor w = victim->stored_weight().clone();
  w.view(-1)[3] = 1e6f;
  victim->set_stored(w);
  Fp8Options o = fp8();
  o.storage = at::kHalf;
  o.compute = at::kFloat;
  const offload::StorageReport r = offload::apply_storage(*m, "anima-tiny", o, declared_fp8_skips());
  CHECK(r.clipped == 1);
  CHECK(victim->stored_weight().scalar_type() == at::kHalf);
  CHECK(victim->stored_weight().view(-1)[3].item<float>() == 65504.0f);
  o.out_of_range = OutOfRangePolicy::refuse;
  AnimaModel m2 = random_model(preset("anima-tiny"), 2, at::kFloat);
  for (auto& [name, layer] : offload::managed_layers(*m2)) {
    if (name == "blocks.1.mlp.layer2") layer->set_stored(w);
  }
  CHECK_THROWS_WITH(offload::apply_storage(*m2, "anima-tiny", o, declared_fp8_skips()),
                    Catch::Contains("blocks.1.mlp.layer2.weight") && Catch::Contains("65504"));
}

TEST_CASE("fp8 model: apply_storage on a meta model also builds meta scales for scaled storage", "[strict]") {
  AnimaModel m(preset("anima-tiny"), BuildOptions{at::kBFloat16, at::kMeta});
  Fp8Options o = fp8();
  o.scale_mode = ScaleMode::per_channel;
  offload::apply_storage(*m, "anima-tiny", o, declared_fp8_skips());
  for (const auto& [name, layer] : offload::managed_layers(*m)) {
    INFO(name);
    const bool cast = layer->stored_weight().scalar_type() == at::kFloat8_e4m3fn;
    CHECK(layer->weight_scale().defined() == cast);
    if (cast) CHECK(layer->weight_scale().sizes() == at::IntArrayRef{layer->stored_weight().size(0)});
    CHECK(layer->stored_weight().is_meta());
  }
}

namespace {

// Delegates to the layer's own upcast, except on the `fault_at`-th acquire (counted from 0
// over the whole model), where it throws (`in_acquire`) or hands out a weight of the wrong
// shape so that the op inside the layer's forward throws while the lease is held.
class FaultyProvider : public offload::WeightProvider {
 public:
  int64_t fault_at = -1;
  bool in_acquire = true;
  int64_t acquires = 0, releases = 0, fired = 0;

  offload::LayerWeights acquire(offload::ManagedLayerImpl& layer) override {
    const int64_t k = acquires++;
    offload::LayerWeights w = layer.upcast_stored();
    if (k == fault_at) {
      fired += 1;
      if (in_acquire) {
        acquires -= 1;  // no lease was made, so no release will come
        throw std::runtime_error("injected fault in " + layer.qualified_name());
      }
      w.weight = w.weight.narrow(-1, 0, w.weight.size(-1) - 1);
    }
    return w;
  }
  void release(offload::ManagedLayerImpl&) noexcept override { releases += 1; }
};

}  // namespace

TEST_CASE("fp8 model: a throw inside any layer's forward leaves every parameter stored and the next forward unchanged",
          "[strict]") {
  AnimaModel m = random_model(preset("anima-tiny"), 4, at::kBFloat16);
  offload::apply_storage(*m, "anima-tiny", fp8(), declared_fp8_skips());
  const Inputs in = tiny_inputs(at::kBFloat16);
  const at::Tensor before = step(*m, in);
  const auto stored = snapshot(*m);

  FaultyProvider counter;
  for (auto& [name, layer] : offload::managed_layers(*m)) layer->set_provider(&counter);
  REQUIRE(at::equal(step(*m, in), before));
  const int64_t per_step = counter.acquires;
  REQUIRE(per_step > 10);
  CHECK(counter.releases == per_step);

  for (const bool in_acquire : {true, false}) {
    for (int64_t k = 0; k < per_step; ++k) {
      INFO("fault at acquire " << k << (in_acquire ? " (in acquire)" : " (in the op)"));
      FaultyProvider p;
      p.fault_at = k;
      p.in_acquire = in_acquire;
      for (auto& [name, layer] : offload::managed_layers(*m)) layer->set_provider(&p);
      CHECK_THROWS(step(*m, in));
      CHECK(p.fired == 1);
      CHECK(p.releases == p.acquires);  // every lease that was made was given back
      require_unchanged(*m, stored);
      p.fault_at = -1;
      CHECK(at::equal(step(*m, in), before));
    }
  }
  for (auto& [name, layer] : offload::managed_layers(*m)) layer->set_provider(nullptr);
}

TEST_CASE("fp8 model: fp8 storage round trip is bit-exact for every fp8 dtype", "[strict]") {
  const Inputs in = tiny_inputs(at::kBFloat16);
  for (const at::ScalarType dt :
       {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kFloat8_e4m3fnuz, at::kFloat8_e5m2fnuz}) {
    INFO(dtype_name(dt));
    AnimaModel m = random_model(preset("anima-tiny"), 6, at::kBFloat16);
    offload::apply_storage(*m, "anima-tiny", fp8(dt), declared_fp8_skips());
    const auto stored = snapshot(*m);
    int64_t checked = 0;
    for (const auto& [name, layer] : offload::managed_layers(*m)) {
      if (layer->stored_weight().scalar_type() != dt) continue;
      INFO(name);
      for (const at::Tensor& s : {layer->stored_weight(), layer->stored_bias()}) {
        if (!s.defined()) continue;
        CHECK(s.scalar_type() == dt);
        const at::Tensor up = upcast(s, at::kBFloat16, at::Tensor());
        CHECK(up.scalar_type() == at::kBFloat16);
        CHECK(same_bits(cast_to_storage(up, dt, name).stored, s));
        checked += 1;
      }
    }
    CHECK(checked > 20);
    const at::Tensor y = step(*m, in);
    CHECK(at::isfinite(y).all().item<bool>());
    require_unchanged(*m, stored);  // forwards never rewrite storage
    CHECK(at::equal(step(*m, in), y));
  }
}

TEST_CASE("fp8 model: fp8 off (storage = compute) is bit-identical to the plain model", "[strict]") {
  for (const at::ScalarType dt : {at::kBFloat16, at::kFloat}) {
    INFO(dtype_name(dt));
    const Inputs in = tiny_inputs(dt);
    AnimaModel plain = random_model(preset("anima-tiny"), 8, dt);
    AnimaModel stored = random_model(preset("anima-tiny"), 8, dt);
    Fp8Options off;
    off.storage = dt;
    off.compute = dt;
    const auto r = offload::apply_storage(*stored, "anima-tiny", off, declared_fp8_skips());
    CHECK(r.param_bytes == offload::param_bytes(*plain));
    require_unchanged(*stored, snapshot(*plain));
    CHECK(at::equal(step(*stored, in), step(*plain, in)));
  }
}
