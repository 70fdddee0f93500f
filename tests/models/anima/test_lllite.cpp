// ControlNet-LLLite for Anima (models/anima/lllite.h): file validation, the input-adapter hook's
// order against a LoRA, passthrough and removal bit for bit, fp8 storage untouched, resident
// and streamed alike.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "models/anima/anima.h"
#include "models/anima/block_layout.h"
#include "models/anima/generator.h"
#include "models/anima/lllite.h"
#include "models/lora.h"
#include "offload/engine/engine.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "tests/support/device_env.h"
#include "tests/support/engine_options.h"
#include "tests/support/lllite_file.h"

using namespace sluice;
using namespace sluice::anima;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;
using Meta = std::map<std::string, std::string>;
using sluice::testing::LLLiteFileSpec;
using sluice::testing::lllite_file;

namespace {

AnimaModel model(bool fp8, uint64_t seed = 3, const std::string& name = "anima-tiny") {
  const AnimaConfig c = preset(name);
  AnimaModel m(c, BuildOptions{fp8 ? at::kBFloat16 : at::kFloat, at::kCPU});
  auto params = m->named_parameters();
  for (const auto& [n, t] : random_weights(c, seed, fp8 ? at::kBFloat16 : at::kFloat)) params[n].set_data(t);
  if (fp8) {
    Fp8Options o;
    o.storage = at::kFloat8_e4m3fn;
    o.compute = at::kBFloat16;
    offload::apply_storage(*m, c.name, o, declared_fp8_skips());
  }
  return m;
}

struct Inputs {
  at::Tensor x, t, ctx, image, mask;
};
Inputs inputs(at::ScalarType dt) {
  at::manual_seed(9);
  return {at::randn({1, 16, 1, 8, 8}).to(dt), at::full({1}, 0.4), at::randn({1, 6, 32}).to(dt),
          at::rand({3, 40, 56}), (at::rand({50, 30}) > 0.5).to(at::kFloat)};
}

at::Tensor dit(AnimaModelImpl& m, const Inputs& in, c10::Device d = c10::kCPU) {
  return m.forward(in.x.to(d), in.t.to(d), in.ctx.to(d)).cpu();
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

std::string checkpoint_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "<no CheckpointError>";
}

std::string invalid_argument(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

Tensors without(Tensors t, const std::string& key) {
  t.erase(std::remove_if(t.begin(), t.end(), [&](const auto& p) { return p.first == key; }), t.end());
  return t;
}

Tensors replaced(Tensors t, const std::string& key, at::Tensor v) {
  for (auto& p : t)
    if (p.first == key) p.second = v;
  return t;
}

using sluice::testing::engine_options;  // tests/support/engine_options.h

double rel_l2(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / b.to(at::kDouble).norm().item<double>();
}

}  // namespace

TEST_CASE("lllite: a valid file reads its hyperparameters from metadata, else from shapes", "[strict][accel]") {
  LLLiteFileSpec s;
  s.aspp = true;
  s.resblocks = 2;
  const LLLiteAdapter a = lllite_from_tensors(lllite_file(s), {}, "ok.safetensors");
  CHECK(a.config.cond_dim == 16);
  CHECK(a.config.cond_emb_dim == 24);
  CHECK(a.config.mlp_dim == 8);
  CHECK(a.config.cond_resblocks == 2);
  CHECK(a.config.use_aspp);
  CHECK(a.config.cond_in_channels == 3);
  CHECK_FALSE(a.config.inpaint_masked_input);
  REQUIRE(a.modules.size() == 10);
  CHECK(a.modules[0].name == "lllite_dit_blocks_0_self_attn_q_proj");
  CHECK(a.modules[3].target == "cross_attn.q_proj");
  CHECK(a.modules[9].name == "lllite_dit_blocks_1_mlp_layer1");
  CHECK(a.max_block() == 1);
  const LLLiteAdapter m = lllite_from_tensors(lllite_file(LLLiteFileSpec{}),
                                              {{"lllite.inpaint_masked_input", "True"}, {"lllite.mlp_dim", "8"}}, "m");
  CHECK(m.config.inpaint_masked_input);
}

TEST_CASE("lllite: bad files are one CheckpointError line naming the file and the fault", "[strict][accel]") {
  const Tensors good = lllite_file(LLLiteFileSpec{});
  const std::string f = "LLLite 'f.safetensors'";
  auto err = [&](const Tensors& t, const Meta& meta = {}) {
    return checkpoint_error([&] { lllite_from_tensors(t, meta, "f.safetensors"); });
  };
  Tensors legacy = good;
  legacy.emplace_back("lllite_modules.0.down.weight", at::zeros({8, 64}));
  CHECK(err(legacy) == f + " is in the legacy LLLite format (key 'lllite_modules.0.down.weight'); only the v2 "
                           "named-key format (lllite_conditioning1.*, lllite_dit_blocks_*) is supported");
  Tensors unknown = good;
  unknown.emplace_back("lllite_dit_blocks_0_cross_attn_k_proj.down.weight", at::zeros({8, 64}));
  CHECK(err(unknown) == f + ": unknown LLLite module name lllite_dit_blocks_0_cross_attn_k_proj (known: "
                            "lllite_dit_blocks_<i>_{self_attn_q_proj, self_attn_k_proj, self_attn_v_proj, "
                            "cross_attn_q_proj, mlp_layer1})");
  Tensors stray = good;
  stray.emplace_back("model.something", at::zeros({2}));
  CHECK(err(stray) == f + ": 1 keys that are no LLLite key: model.something");
  const std::string missing = err(without(good, "lllite_dit_blocks_1_mlp_layer1.up.bias"));
  CHECK(missing.find(f + " does not fit its hyperparameters") == 0);
  CHECK(missing.find("1 missing keys: lllite_dit_blocks_1_mlp_layer1.up.bias") != std::string::npos);
  const std::string trunk = err(without(good, "lllite_conditioning1.norm2.weight"));
  CHECK(trunk.find("1 missing keys: lllite_conditioning1.norm2.weight") != std::string::npos);
  CHECK(err(without(good, "lllite_conditioning1.conv3.weight")) ==
        f + " is missing key 'lllite_conditioning1.conv3.weight'");
  const std::string shape = err(replaced(good, "lllite_dit_blocks_0_self_attn_v_proj.mid.weight", at::zeros({8, 31})));
  CHECK(shape.find("1 shape mismatches: lllite_dit_blocks_0_self_attn_v_proj.mid.weight is [8, 31], want [8, 32]") !=
        std::string::npos);
  CHECK(err(good, {{"lllite.cond_emb_dim", "abc"}}) ==
        f + ": metadata lllite.cond_emb_dim is 'abc' (want a positive integer)");
  CHECK(err(replaced(good, "lllite_dit_blocks_0_mlp_layer1.up.bias", at::full({64}, NAN))) ==
        f + ": tensor 'lllite_dit_blocks_0_mlp_layer1.up.bias' holds NaN or inf values");
  CHECK(err({{"lllite_conditioning1.conv1.weight", at::zeros({8, 3, 4, 4})}}) ==
        f + " holds no LLLite module (no 'lllite_dit_blocks_*' keys)");
  // A file every line of which is one line.
  for (const std::string& e : {missing, trunk, shape}) CHECK(e.find('\n') == std::string::npos);
}

TEST_CASE("lllite: a target the model lacks or of another width is refused before anything binds", "[strict][accel]") {
  AnimaModel m = model(false);
  const Inputs in = inputs(at::kFloat);
  const at::Tensor plain = dit(*m, in);
  LLLiteFileSpec wide;
  wide.dim = 96;
  const LLLiteAdapter a = lllite_from_tensors(lllite_file(wide), {}, "wide.safetensors");
  const std::string e = checkpoint_error([&] { LLLiteScope s(*m, a, in.image); });
  CHECK(e.find("LLLite 'wide.safetensors' does not fit this model: 10 shape mismatches: "
               "lllite_dit_blocks_0_self_attn_q_proj has in_features 96, blocks.0.self_attn.q_proj has 64") == 0);
  LLLiteFileSpec deep;
  deep.blocks = 3;  // anima-tiny has 2 blocks
  const LLLiteAdapter d = lllite_from_tensors(lllite_file(deep), {}, "deep.safetensors");
  const std::string de = checkpoint_error([&] { LLLiteScope s(*m, d, in.image, 1.0, std::nullopt, false); });
  CHECK(de.find("deep.safetensors") != std::string::npos);
  for (const auto& [n, l] : offload::managed_layers(*m)) CHECK(l->input_adapters().empty());
  CHECK(same_bits(dit(*m, in), plain));
}

TEST_CASE("lllite: image and mask are checked against the adapter's input channels", "[strict][accel]") {
  AnimaModel m = model(false);
  const Inputs in = inputs(at::kFloat);
  const LLLiteAdapter rgb = lllite_from_tensors(lllite_file(LLLiteFileSpec{}), {}, "rgb.safetensors");
  LLLiteFileSpec ip;
  ip.in_channels = 4;
  const LLLiteAdapter inpaint = lllite_from_tensors(lllite_file(ip), {}, "inpaint.safetensors");
  CHECK(invalid_argument([&] { LLLiteScope s(*m, rgb, in.image, 1.0, in.mask); }) ==
        "LLLite 'rgb.safetensors' takes an RGB image only (3 input channels): it takes no mask");
  CHECK(invalid_argument([&] { LLLiteScope s(*m, inpaint, in.image); }) ==
        "LLLite 'inpaint.safetensors' is an inpaint adapter (4 input channels): it needs a mask (1 = inpaint, 0 = keep)");
  CHECK(invalid_argument([&] { LLLiteScope s(*m, rgb, at::rand({4, 8, 8})); }) ==
        "LLLite 'rgb.safetensors': the conditioning image has shape [4, 8, 8] (want [3, H, W] or [1, 3, H, W], RGB in "
        "[0, 1])");
  CHECK(invalid_argument([&] { LLLiteScope s(*m, rgb, in.image, NAN); }) == "LLLite 'rgb.safetensors': weight nan is not finite");
  for (const auto& [n, l] : offload::managed_layers(*m)) CHECK(l->input_adapters().empty());
}

TEST_CASE("lllite: it moves the output, weight 0 and no image pass through and removal restores it bit for bit",
          "[strict][accel]") {
  for (const bool fp8 : {false, true}) {
    INFO("fp8 " << fp8);
    AnimaModel m = model(fp8);
    const Inputs in = inputs(fp8 ? at::kBFloat16 : at::kFloat);
    std::map<std::string, at::Tensor> stored;
    for (const auto& p : m->named_parameters()) stored[p.key()] = p.value().clone();
    const at::Tensor plain = dit(*m, in);
    const LLLiteAdapter a = lllite_from_tensors(lllite_file(LLLiteFileSpec{}), {}, "a.safetensors");
    {
      LLLiteScope s(*m, a, in.image, 1.0);
      CHECK(s.modules() == 10);
      CHECK(s.bound_layers() == 10);
      CHECK(s.device_bytes() == a.host_bytes() / (fp8 ? 2 : 1));  // compute dtype
      const at::Tensor on = dit(*m, in);
      const double moved = rel_l2(on, plain);
      INFO("moved " << moved);
      CHECK(moved > 1e-3);
      CHECK(same_bits(dit(*m, in), on));  // the cached embedding gives the same result
      s.set_weight(0.0);
      CHECK(same_bits(dit(*m, in), plain));
      s.set_weight(0.5);
      const at::Tensor half = dit(*m, in);
      CHECK_FALSE(same_bits(half, plain));
      CHECK_FALSE(same_bits(half, on));
      // A video latent (T > 1 tokens per image token) passes through, as in InvokeAI.
      const at::Tensor x2 = at::cat({in.x, in.x}, 2);
      s.set_weight(0.0);
      const at::Tensor plain2 = m->forward(x2, in.t, in.ctx);
      s.set_weight(1.0);
      CHECK(same_bits(m->forward(x2, in.t, in.ctx), plain2));
    }
    {
      LLLiteScope none(*m, a, at::Tensor());  // no image
      CHECK(same_bits(dit(*m, in), plain));
    }
    CHECK(same_bits(dit(*m, in), plain));
    for (const auto& [n, l] : offload::managed_layers(*m)) CHECK(l->input_adapters().empty());
    for (const auto& p : m->named_parameters()) {
      INFO(p.key());
      CHECK(same_bits(p.value(), stored.at(p.key())));  // fp8 stays fp8, bit for bit
    }
  }
}

TEST_CASE("lllite: an input adapter runs before the matmul and before the LoRA sidecars, the last added first",
          "[strict][accel]") {
  struct Add : offload::InputPerturbation {
    at::Tensor d;
    double scale;
    at::Tensor operator()(const at::Tensor& x) override { return x * scale + d; }
  };
  at::manual_seed(1);
  offload::Linear lin(4, 3, true, at::TensorOptions().dtype(at::kFloat));
  lin->set_stored(at::randn({3, 4}), at::randn({3}));
  offload::LoraSidecar lora;
  lora.down = at::randn({2, 4});
  lora.up = at::randn({3, 2});
  lora.scale = 0.5;
  lin->loras().push_back(lora);
  auto first = std::make_shared<Add>();
  first->d = at::randn({4});
  first->scale = 2.0;
  auto second = std::make_shared<Add>();
  second->d = at::randn({4});
  second->scale = -1.0;
  lin->input_adapters().push_back({first, 1});
  lin->input_adapters().push_back({second, 2});
  const at::Tensor x = at::randn({5, 4});
  const at::Tensor xp = (x * -1.0 + second->d) * 2.0 + first->d;  // the second (outermost) first
  const at::Tensor want = at::linear(xp, lin->stored_weight(), lin->stored_bias()) +
                          at::linear(at::linear(xp, lora.down), lora.up) * 0.5;
  CHECK(at::allclose(lin->forward(x), want, 1e-5, 1e-5));
}

TEST_CASE("lllite: with a LoRA on the same layers, either removed first leaves exactly the other", "[strict][accel]") {
  AnimaModel m = model(true);
  const Inputs in = inputs(at::kBFloat16);
  const at::Tensor plain = dit(*m, in);
  const LLLiteAdapter a = lllite_from_tensors(lllite_file(LLLiteFileSpec{}), {}, "a.safetensors");
  Tensors lt;
  at::manual_seed(5);
  for (const char* n : {"blocks.0.self_attn.q_proj", "blocks.1.mlp.layer1"}) {
    const auto w = offload::managed_layers(*m);
    int64_t out = 0, inf = 0;
    for (const auto& [name, l] : w)
      if (name == n) out = l->stored_weight().size(0), inf = l->stored_weight().size(1);
    lt.emplace_back(std::string(n) + ".lora_A.weight", at::randn({4, inf}) * 0.3);
    lt.emplace_back(std::string(n) + ".lora_B.weight", at::randn({out, 4}) * 0.3);
  }
  const LoraAdapter lora = lora_from_tensors(lt, *m, "l.safetensors");
  at::Tensor only_lora, only_lllite, both;
  {
    LoraScope l(*m, lora);
    only_lora = dit(*m, in);
  }
  {
    LLLiteScope s(*m, a, in.image);
    only_lllite = dit(*m, in);
  }
  {
    auto l = std::make_unique<LoraScope>(*m, lora);
    LLLiteScope s(*m, a, in.image);
    both = dit(*m, in);
    l.reset();
    CHECK(same_bits(dit(*m, in), only_lllite));
  }
  {
    auto s = std::make_unique<LLLiteScope>(*m, a, in.image);
    LoraScope l(*m, lora);
    CHECK(same_bits(dit(*m, in), both));
    s.reset();
    CHECK(same_bits(dit(*m, in), only_lora));
  }
  CHECK_FALSE(same_bits(both, only_lora));
  CHECK_FALSE(same_bits(both, only_lllite));
  CHECK(same_bits(dit(*m, in), plain));
}

TEST_CASE("lllite: an inpaint adapter uses its mask, masked input zeroes the RGB under it", "[strict][accel]") {
  AnimaModel m = model(false);
  const Inputs in = inputs(at::kFloat);
  LLLiteFileSpec ip;
  ip.in_channels = 4;
  ip.aspp = true;
  const Tensors file = lllite_file(ip);
  const LLLiteAdapter a = lllite_from_tensors(file, {}, "ip.safetensors");
  const LLLiteAdapter masked = lllite_from_tensors(file, {{"lllite.inpaint_masked_input", "true"}}, "ip.safetensors");
  const at::Tensor plain = dit(*m, in);
  at::Tensor with_mask, other_mask, masked_out;
  {
    LLLiteScope s(*m, a, in.image, 1.0, in.mask);
    with_mask = dit(*m, in);
  }
  {
    LLLiteScope s(*m, a, in.image, 1.0, 1 - in.mask);
    other_mask = dit(*m, in);
  }
  {
    LLLiteScope s(*m, masked, in.image, 1.0, in.mask);
    masked_out = dit(*m, in);
  }
  CHECK_FALSE(same_bits(with_mask, plain));
  CHECK_FALSE(same_bits(with_mask, other_mask));
  CHECK_FALSE(same_bits(with_mask, masked_out));
  // The trunk's input: 4 channels at the padded latent x 8, in [-1, 1], the mask binary.
  const at::Tensor c = lllite_cond_input(masked.config, in.image, in.mask, 8, 8);
  REQUIRE(c.sizes() == at::IntArrayRef({1, 4, 64, 64}));
  const at::Tensor mk = c.select(1, 3);
  CHECK(at::logical_or(mk == 1, mk == -1).all().item<bool>());
  CHECK((c.narrow(1, 0, 3) * (mk.unsqueeze(1) > 0)).abs().max().item<double>() == 0.0);
  CHECK(c.max().item<double>() <= 1.0);
  CHECK(c.min().item<double>() >= -1.0);
}

TEST_CASE("lllite: resident and streamed under a budget give the same output, the weights are charged",
          "[strict][accel]") {
  AnimaModel m = model(true);
  const Inputs in = inputs(at::kBFloat16);
  const LLLiteAdapter a = lllite_from_tensors(lllite_file(LLLiteFileSpec{}), {}, "a.safetensors");
  at::Tensor reference;
  {
    LLLiteScope s(*m, a, in.image, 0.8);
    reference = dit(*m, in);
  }
  auto dev = sluice::testing::test_device_or_cpu();
  const offload::EngineOptions o = engine_options(dev);
  const offload::WeightNeeds n = offload::StreamingEngine::needs(*m, o);
  offload::StreamingEngine engine(o);
  engine.attach(*m, "tiny", n.full + o.working_memory_bytes);  // exactly the model: the adapter streams layers
  const auto forward = [&] {
    offload::ForwardScope scope(engine);
    return dit(*m, in, dev->device());
  };
  const at::Tensor plain = forward();
  {
    LLLiteScope s(*m, a, in.image, 0.8);  // the engine the layers are attached to places it
    CHECK(engine.residency().limits().sidecar_bytes == s.device_bytes());
    CHECK(engine.plan().streamed_count() > 0);
    for (int f = 0; f < 2; ++f) {
      const at::Tensor out = forward();
      if (dev->device().is_cpu()) {
        CHECK(same_bits(out, reference));
      } else {
        CHECK(rel_l2(out, reference) < 1e-2);
      }
    }
  }
  CHECK(engine.residency().limits().sidecar_bytes == 0);
  CHECK(engine.plan().streamed_count() == 0);
  CHECK(same_bits(forward(), plain));
  engine.detach();
}

TEST_CASE("lllite: a base (28-block) adapter on a 40-block model binds the blocks it was trained on, as-is by index",
          "[strict]") {
  AnimaConfig c = preset("anima-tiny");
  c.num_blocks = 40;
  c.name = "anima-tiny-40";
  AnimaModel m(c, BuildOptions{at::kFloat, at::kCPU});
  auto params = m->named_parameters();
  for (const auto& [n, t] : random_weights(c, 3, at::kFloat)) params[n].set_data(t);
  LLLiteFileSpec s;
  s.blocks = 28;
  const LLLiteAdapter a = lllite_from_tensors(lllite_file(s), {}, "base.safetensors");
  const std::vector<int64_t> pos = block_positions(28, 40);
  REQUIRE(pos.size() == 28);
  auto bound_blocks = [&] {
    std::vector<int64_t> blocks;
    for (int64_t b = 0; b < 40; ++b) {
      for (const auto& [n, l] : offload::managed_layers(*m)) {
        if (n == "blocks." + std::to_string(b) + ".self_attn.q_proj" && !l->input_adapters().empty()) blocks.push_back(b);
      }
    }
    return blocks;
  };
  {
    LLLiteScope measured(*m, a, at::rand({3, 16, 16}));
    CHECK(bound_blocks() == pos);
    CHECK(measured.remap_line().find("LLLite 'base.safetensors'") != std::string::npos);
    CHECK(measured.bound_layers() == 28 * 5);
  }
  {
    LLLiteScope as_is(*m, a, at::rand({3, 16, 16}), 1.0, std::nullopt, /*measured_blocks=*/false);
    std::vector<int64_t> first(28);
    for (int64_t i = 0; i < 28; ++i) first[static_cast<size_t>(i)] = i;
    CHECK(bound_blocks() == first);
    CHECK(as_is.remap_line().empty());
  }
  for (const auto& [n, l] : offload::managed_layers(*m)) CHECK(l->input_adapters().empty());
}
