// LoRA sidecars: key mapping (pure), loading and validation, patching scopes on an fp8
// Anima model (storage untouched, effect present, removal exact, stacking).
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <map>
#include <string>
#include <unistd.h>

#include "models/anima/anima.h"
#include "models/anima/block_layout.h"
#include "models/anima/generator.h"
#include "models/lora.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "tests/support/device_env.h"
#include "tests/support/engine_options.h"
#include "tests/support/temp_dir.h"

using namespace sluice;
using namespace sluice::anima;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

namespace {

AnimaModel fp8_model(const AnimaConfig& c, uint64_t seed = 3) {
  AnimaModel model(c, BuildOptions{at::kBFloat16, at::kCPU});
  auto params = model->named_parameters();
  for (const auto& [name, t] : random_weights(c, seed, at::kBFloat16)) params[name].set_data(t);
  Fp8Options o;
  o.storage = at::kFloat8_e4m3fn;
  o.compute = at::kBFloat16;
  offload::apply_storage(*model, c.name, o, declared_fp8_skips());
  return model;
}

AnimaModel fp8_model(const std::string& name, uint64_t seed = 3) { return fp8_model(preset(name), seed); }

AnimaModel fp8_tiny(uint64_t seed = 3) { return fp8_model("anima-tiny", seed); }

offload::ManagedLayerImpl& layer(torch::nn::Module& m, const std::string& name) {
  for (const auto& [n, l] : offload::managed_layers(m)) {
    if (n == name) return *l;
  }
  FAIL("no layer " << name);
  throw;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

std::map<std::string, at::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> s;
  for (const auto& p : m.named_parameters()) s[p.key()] = p.value().clone();
  return s;
}

void require_unchanged(torch::nn::Module& m, const std::map<std::string, at::Tensor>& before) {
  for (const auto& p : m.named_parameters()) {
    INFO(p.key());
    REQUIRE(same_bits(p.value(), before.at(p.key())));
  }
}

struct Inputs {
  at::Tensor x, t, ctx, qwen, ids;
};
Inputs inputs() {
  at::manual_seed(9);
  return {at::randn({1, 16, 1, 8, 8}).to(at::kBFloat16), at::full({1}, 0.4), at::randn({1, 6, 32}).to(at::kBFloat16),
          at::randn({1, 7, 32}).to(at::kBFloat16), at::randint(0, 128, {1, 5}, at::kLong)};
}
// On `d` (an attached engine's device: SLUICE_TEST_DEVICE), the result back on the host.
at::Tensor step(AnimaModelImpl& m, const Inputs& in, c10::Device d = c10::kCPU) {
  return at::cat({m.forward(in.x.to(d), in.t.to(d), in.ctx.to(d)).flatten().cpu(),
                  m.encode_text(in.qwen.to(d), in.ids.to(d)).flatten().cpu()});
}

// A rank-r pair for `name` (shape from the model), keyed in the given layout.
void add_pair(Tensors& out, torch::nn::Module& m, const std::string& name, int64_t rank, uint64_t seed,
              const std::string& down_key, const std::string& up_key, double magnitude = 0.5) {
  const auto w = layer(m, name).stored_weight().sizes();
  at::manual_seed(seed);
  out.emplace_back(down_key, at::randn({rank, w[1]}) * magnitude);
  out.emplace_back(up_key, at::randn({w[0], rank}) * magnitude);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "<no CheckpointError>";
}

using sluice::testing::TempDir;  // tests/support/temp_dir.h

}  // namespace

TEST_CASE("lora: map_lora_key: the usual layouts and prefixes map onto module names", "[strict][accel]") {
  const std::vector<std::string> names = {"t_embedder.1.linear_1", "blocks.0.self_attn.q_proj", "blocks.0.mlp.layer1",
                                          "final_layer.linear", "llm_adapter.blocks.0.mlp.0"};
  struct Case {
    std::string key;
    LoraPart part;
    std::string module;
  };
  const std::vector<Case> cases = {
      {"blocks.0.self_attn.q_proj.lora_A.weight", LoraPart::down, "blocks.0.self_attn.q_proj"},
      {"blocks.0.self_attn.q_proj.lora_B.weight", LoraPart::up, "blocks.0.self_attn.q_proj"},
      {"diffusion_model.blocks.0.mlp.layer1.lora_down.weight", LoraPart::down, "blocks.0.mlp.layer1"},
      {"model.diffusion_model.blocks.0.mlp.layer1.lora_up.weight", LoraPart::up, "blocks.0.mlp.layer1"},
      {"transformer.final_layer.linear.alpha", LoraPart::alpha, "final_layer.linear"},
      {"base_model.model.blocks.0.mlp.layer1.lora_A.default.weight", LoraPart::down, "blocks.0.mlp.layer1"},
      {"net.t_embedder.1.linear_1.lora_B.weight", LoraPart::up, "t_embedder.1.linear_1"},
      {"lora_unet_blocks_0_self_attn_q_proj.lora_down.weight", LoraPart::down, "blocks.0.self_attn.q_proj"},
      {"lora_unet_t_embedder_1_linear_1.alpha", LoraPart::alpha, "t_embedder.1.linear_1"},
      {"lora_transformer_llm_adapter_blocks_0_mlp_0.lora_up.weight", LoraPart::up, "llm_adapter.blocks.0.mlp.0"},
  };
  for (const auto& c : cases) {
    INFO(c.key);
    const auto m = map_lora_key(c.key, names);
    REQUIRE(m.has_value());
    CHECK(m->known);
    CHECK(m->part == c.part);
    CHECK(m->module == c.module);
  }
  // Recognised suffix, unknown module: the stem without prefixes is reported.
  auto u = map_lora_key("diffusion_model.blocks.7.mlp.layer1.lora_A.weight", names);
  REQUIRE(u.has_value());
  CHECK_FALSE(u->known);
  CHECK(u->module == "blocks.7.mlp.layer1");
  u = map_lora_key("lora_unet_blocks_7_mlp_layer1.lora_up.weight", names);
  REQUIRE(u.has_value());
  CHECK_FALSE(u->known);
  CHECK(u->module == "blocks_7_mlp_layer1");
  // No LoRA suffix.
  for (const std::string k : {"blocks.0.mlp.layer1.weight", "blocks.0.mlp.layer1.lora_C.weight", "alpha",
                              "lora_A.weight", "", ".", "blocks.0.mlp.layer1.lora_A.bias"}) {
    INFO(k);
    CHECK_FALSE(map_lora_key(k, names).has_value());
  }
  // Degenerate inputs never crash.
  for (const std::string k : {".alpha", ".lora_A.weight", "lora_unet_.alpha", "lora_unet_..lora_A.weight",
                              "diffusion_model..alpha", "transformer.transformer..lora_B.x.weight"}) {
    INFO(k);
    const auto m = map_lora_key(k, names);
    if (m) CHECK_FALSE(m->known);
  }
  // A flattened name two modules share is ambiguous.
  const auto amb = map_lora_key("lora_unet_a_b_c.alpha", {"a.b_c", "a_b.c"});
  REQUIRE(amb.has_value());
  CHECK_FALSE(amb->known);
}

TEST_CASE("lora: a LoRA sidecar adds scale*(x A^T) B^T with scale = alpha/rank * strength, fp8 weight untouched",
          "[strict][accel]") {
  AnimaModel m = fp8_tiny();
  auto& l = layer(*m, "blocks.0.mlp.layer1");
  REQUIRE(l.stored_weight().scalar_type() == at::kFloat8_e4m3fn);
  Tensors t;
  add_pair(t, *m, "blocks.0.mlp.layer1", 4, 1, "blocks.0.mlp.layer1.lora_down.weight", "blocks.0.mlp.layer1.lora_up.weight");
  t.emplace_back("blocks.0.mlp.layer1.alpha", at::scalar_tensor(2.0));
  const LoraAdapter a = lora_from_tensors(t, *m, "test");
  REQUIRE(a.targets.size() == 1);
  CHECK(a.targets[0].alpha_scale == 0.5);
  CHECK(a.rank() == 4);

  auto* linear = dynamic_cast<offload::LinearImpl*>(&l);
  REQUIRE(linear != nullptr);
  at::manual_seed(2);
  const at::Tensor x = at::randn({3, l.stored_weight().size(1)}).to(at::kBFloat16);
  const at::Tensor base = linear->forward(x);
  const auto before = snapshot(*m);
  {
    LoraScope scope(*m, a, 0.8);
    CHECK(scope.patched_layers() == 1);
    REQUIRE(l.loras().size() == 1);
    CHECK(l.loras()[0].down.scalar_type() == at::kBFloat16);
    const at::Tensor y = linear->forward(x);
    // Independent reference in fp32 from the file's tensors.
    const at::Tensor A = t[0].second.to(at::kBFloat16).to(at::kFloat), B = t[1].second.to(at::kBFloat16).to(at::kFloat);
    const at::Tensor delta = at::matmul(at::matmul(x.to(at::kFloat), A.t()), B.t()) * (2.0 / 4.0 * 0.8);
    const at::Tensor want = base.to(at::kFloat) + delta;
    CHECK((y.to(at::kFloat) - want).abs().max().item<double>() < 0.02 * want.abs().max().item<double>());
    CHECK(delta.abs().max().item<double>() > 0.5);  // the effect is far above that tolerance
    require_unchanged(*m, before);
  }
  CHECK(l.loras().empty());
  CHECK(at::equal(linear->forward(x), base));
}

TEST_CASE("lora: patching a whole fp8 model from a file: storage unchanged, effect present, removal exact",
          "[strict][accel]") {
  TempDir tmp;
  AnimaModel m = fp8_tiny();
  const Inputs in = inputs();
  const at::Tensor base = step(*m, in);
  const auto before = snapshot(*m);
  int64_t stored = 0;
  for (const auto& [n, l] : offload::managed_layers(*m)) stored += l->stored_bytes();

  // kohya layout with alpha over every Linear of the DiT and the adapter, incl. the bf16
  // (skipped) final_layer.linear and t_embedder.
  Tensors t;
  uint64_t seed = 10;
  int64_t linears = 0;
  for (const auto& [n, l] : offload::managed_layers(*m)) {
    if (l->kind() != offload::LayerKind::linear) continue;
    std::string flat = n;
    std::replace(flat.begin(), flat.end(), '.', '_');
    add_pair(t, *m, n, 2, seed++, "lora_unet_" + flat + ".lora_down.weight", "lora_unet_" + flat + ".lora_up.weight",
             0.2);
    t.emplace_back("lora_unet_" + flat + ".alpha", at::scalar_tensor(1.0).to(at::kBFloat16));
    ++linears;
  }
  safetensors::save(tmp / "l.safetensors", t);
  const LoraAdapter a = load_lora(tmp / "l.safetensors", *m);
  CHECK(static_cast<int64_t>(a.targets.size()) == linears);
  {
    LoraScope scope(*m, a);
    CHECK(scope.patched_layers() == linears);
    CHECK(layer(*m, "final_layer.linear").stored_weight().scalar_type() == at::kBFloat16);
    CHECK(layer(*m, "final_layer.linear").loras().size() == 1);
    const at::Tensor y = step(*m, in);
    CHECK(at::isfinite(y).all().item<bool>());
    CHECK_FALSE(at::allclose(y, base, 1e-2, 1e-2));
    require_unchanged(*m, before);
    int64_t now = 0;
    for (const auto& [n, l] : offload::managed_layers(*m)) now += l->stored_bytes();
    CHECK(now == stored);
  }
  for (const auto& [n, l] : offload::managed_layers(*m)) CHECK(l->loras().empty());
  CHECK(at::equal(step(*m, in), base));
}

TEST_CASE("lora: a bf16 (skipped) layer alone can be patched", "[strict][accel]") {
  AnimaModel m = fp8_tiny();
  const Inputs in = inputs();
  const at::Tensor base = m->forward(in.x, in.t, in.ctx);
  Tensors t;
  add_pair(t, *m, "final_layer.linear", 4, 3, "diffusion_model.final_layer.linear.lora_A.weight",
           "diffusion_model.final_layer.linear.lora_B.weight");
  LoraScope scope(*m, lora_from_tensors(t, *m, "t"));
  CHECK_FALSE(at::equal(m->forward(in.x, in.t, in.ctx), base));
}

TEST_CASE("lora: stacked scopes: removing the first leaves exactly the second's effect", "[strict][accel]") {
  AnimaModel m = fp8_tiny();
  const Inputs in = inputs();
  const at::Tensor base = step(*m, in);
  Tensors ta, tb;
  for (const char* n : {"blocks.0.self_attn.q_proj", "blocks.1.mlp.layer2"}) {
    add_pair(ta, *m, n, 4, 20, std::string(n) + ".lora_A.weight", std::string(n) + ".lora_B.weight", 0.3);
  }
  for (const char* n : {"blocks.0.self_attn.q_proj", "llm_adapter.blocks.1.mlp.0"}) {
    add_pair(tb, *m, n, 3, 30, std::string("transformer.") + n + ".lora_A.weight",
             std::string("transformer.") + n + ".lora_B.weight", 0.3);
  }
  const LoraAdapter a = lora_from_tensors(ta, *m, "a"), b = lora_from_tensors(tb, *m, "b");

  at::Tensor only_b;
  {
    LoraScope sb(*m, b);
    only_b = step(*m, in);
  }
  CHECK_FALSE(at::allclose(only_b, base, 1e-2, 1e-2));

  auto sa = std::make_unique<LoraScope>(*m, a);
  const at::Tensor only_a = step(*m, in);
  {
    LoraScope sb(*m, b);
    const at::Tensor both = step(*m, in);
    CHECK_FALSE(at::allclose(both, only_a, 1e-2, 1e-2));
    CHECK_FALSE(at::allclose(both, only_b, 1e-2, 1e-2));
    CHECK(layer(*m, "blocks.0.self_attn.q_proj").loras().size() == 2);
    sa.reset();  // remove the first while the second stays
    CHECK(layer(*m, "blocks.0.self_attn.q_proj").loras().size() == 1);
    CHECK(layer(*m, "blocks.0.self_attn.q_proj").loras()[0].id == sb.id());
    CHECK(at::equal(step(*m, in), only_b));
  }
  CHECK(at::equal(step(*m, in), base));
}

TEST_CASE("lora: bad LoRA files are CheckpointErrors naming what is wrong", "[strict][accel]") {
  AnimaModel m = fp8_tiny();
  Tensors ok;
  add_pair(ok, *m, "blocks.0.mlp.layer1", 4, 1, "blocks.0.mlp.layer1.lora_A.weight", "blocks.0.mlp.layer1.lora_B.weight");

  // Unknown target modules are listed (a block the model lacks is refused apart, below).
  Tensors unknown = ok;
  add_pair(unknown, *m, "blocks.0.mlp.layer1", 4, 1, "blocks.1.mlp.layer9.lora_A.weight",
           "blocks.1.mlp.layer9.lora_B.weight");
  unknown.emplace_back("lora_te1_text_model_encoder_layers_0_mlp_fc1.alpha", at::scalar_tensor(1.0));
  std::string e = error_of([&] { lora_from_tensors(unknown, *m, "u.safetensors"); });
  CHECK(e.find("u.safetensors") != std::string::npos);
  CHECK(e.find("2 unknown target modules") != std::string::npos);
  CHECK(e.find("blocks.1.mlp.layer9") != std::string::npos);
  CHECK(e.find("lora_te1_text_model_encoder_layers_0_mlp_fc1") != std::string::npos);

  // Shape mismatch names the module and both shapes.
  Tensors bad_shape;
  bad_shape.emplace_back("blocks.0.mlp.layer1.lora_A.weight", at::randn({4, 63}));
  bad_shape.emplace_back("blocks.0.mlp.layer1.lora_B.weight", at::randn({256, 4}));
  e = error_of([&] { lora_from_tensors(bad_shape, *m, "s"); });
  CHECK(e.find("blocks.0.mlp.layer1") != std::string::npos);
  CHECK(e.find("[4, 63]") != std::string::npos);
  CHECK(e.find("[256, 64]") != std::string::npos);

  // Rank disagreement between A and B.
  Tensors bad_rank;
  bad_rank.emplace_back("blocks.0.mlp.layer1.lora_A.weight", at::randn({4, 64}));
  bad_rank.emplace_back("blocks.0.mlp.layer1.lora_B.weight", at::randn({256, 3}));
  CHECK(error_of([&] { lora_from_tensors(bad_rank, *m, "r"); }).find("[256, 3]") != std::string::npos);

  // Non-LoRA keys, incomplete pairs, embeddings, NaN.
  Tensors junk = ok;
  junk.emplace_back("blocks.0.mlp.layer1.weight", at::randn({2}));
  CHECK(error_of([&] { lora_from_tensors(junk, *m, "j"); }).find("no LoRA key: blocks.0.mlp.layer1.weight") !=
        std::string::npos);
  Tensors half = {ok[0]};
  CHECK(error_of([&] { lora_from_tensors(half, *m, "h"); }).find("blocks.0.mlp.layer1 (no up/lora_B)") !=
        std::string::npos);
  Tensors emb;
  emb.emplace_back("llm_adapter.embed.lora_A.weight", at::randn({2, 32}));
  emb.emplace_back("llm_adapter.embed.lora_B.weight", at::randn({128, 2}));
  CHECK(error_of([&] { lora_from_tensors(emb, *m, "e"); }).find("llm_adapter.embed is not a Linear layer") !=
        std::string::npos);
  Tensors nan = ok;
  nan[0].second = nan[0].second.clone();
  nan[0].second.view(-1)[3] = std::nanf("");
  CHECK(error_of([&] { lora_from_tensors(nan, *m, "n"); }).find("blocks.0.mlp.layer1.lora_A.weight") !=
        std::string::npos);

  // An adapter mapped onto one model cannot patch a model without its modules, and a
  // failed scope patches nothing.
  const LoraAdapter a = lora_from_tensors(ok, *m, "ok");
  LoraAdapter wrong = a;
  wrong.targets.push_back(a.targets[0]);
  wrong.targets.back().module = "blocks.5.mlp.layer1";
  CHECK(error_of([&] { LoraScope s(*m, wrong); }).find("blocks.5.mlp.layer1") != std::string::npos);
  CHECK(layer(*m, "blocks.0.mlp.layer1").loras().empty());

  // A missing file is a FileError.
  CHECK_THROWS_AS(load_lora("/nonexistent/x.safetensors", *m), FileError);
}

namespace {

// A rank-`rank` pair for every Linear of `m` (embeddings cannot be targeted).
Tensors every_linear(torch::nn::Module& m, int64_t rank) {
  Tensors t;
  uint64_t seed = 100;
  for (const auto& [name, l] : offload::managed_layers(m)) {
    if (l->kind() != offload::LayerKind::linear) continue;
    add_pair(t, m, name, rank, seed++, name + ".lora_A.weight", name + ".lora_B.weight", 0.05);
  }
  return t;
}

using sluice::testing::engine_options;  // tests/support/engine_options.h

uint64_t alive_peak(const offload::DeviceBackend& dev) {
  const auto a = dev.allocator_stats();
  REQUIRE(a.available);
  return static_cast<uint64_t>(a.peak_bytes);
}

uint64_t lora_bytes_in_stats(offload::StreamingEngine& e) {
  return nlohmann::json::parse(e.stats().to_json())["device"]["lora_bytes"].get<uint64_t>();
}

}  // namespace

TEST_CASE("lora: a rank-64 LoRA on every Linear under a budget that fits the model exactly streams more layers",
          "[strict][accel]") {
  // Note [device extras] (offload/engine/model_budget.h): the engine places the sidecars under the
  // model's budget; the plan streams layers to make room, and the allocator's own count of
  // device bytes alive never passes the budget.
  AnimaModel m = fp8_model("anima-medium");  // 512 wide: a rank-64 bf16 pair is a quarter to a half of an fp8 weight
  auto dev = sluice::testing::test_device_or_cpu();
  const offload::EngineOptions o = engine_options(dev);
  const offload::WeightNeeds n = offload::StreamingEngine::needs(*m, o);
  offload::StreamingEngine engine(o);
  engine.attach(*m, "medium", n.full + o.working_memory_bytes);  // exactly the model, beside working memory
  REQUIRE(engine.plan().streamed_count() == 0);
  const uint64_t resident = engine.plan().resident_bytes;
  const LoraAdapter adapter = lora_from_tensors(every_linear(*m, 64), *m, "every-linear-r64");
  {
    LoraScope scope(*m, adapter, 1.0, std::nullopt, &engine);
    CHECK(scope.patched_layers() == static_cast<int64_t>(adapter.targets.size()));
    CHECK(scope.device_bytes() > 0);
    CHECK(engine.residency().limits().sidecar_bytes == scope.device_bytes());
    CHECK(lora_bytes_in_stats(engine) == scope.device_bytes());
    CHECK(engine.plan().resident_bytes < resident);  // replanned: fewer resident bytes
    CHECK(engine.plan().streamed_count() > 0);
    CHECK(engine.device_bytes() <= n.full);
    CHECK(alive_peak(*dev) <= sluice::testing::allocator_bound(*dev, n.full, o.working_memory_bytes));
    CHECK(engine.minimum_budget() > n.minimum);  // the minimum includes the sidecars
    std::printf("anima-medium, rank-64 LoRA on %zu Linears at a budget of %llu bytes (fully resident): sidecars %llu "
                "bytes; resident %llu -> %llu bytes, %zu layers streamed; device bytes alive peaked at %llu\n",
                adapter.targets.size(), static_cast<unsigned long long>(n.full),
                static_cast<unsigned long long>(scope.device_bytes()), static_cast<unsigned long long>(resident),
                static_cast<unsigned long long>(engine.plan().resident_bytes), engine.plan().streamed_count(),
                static_cast<unsigned long long>(alive_peak(*dev)));
  }
  // Dropped: the room goes back to resident layers.
  CHECK(engine.residency().limits().sidecar_bytes == 0);
  CHECK(lora_bytes_in_stats(engine) == 0);
  CHECK(engine.plan().streamed_count() == 0);
  CHECK(engine.plan().resident_bytes == resident);
  CHECK(alive_peak(*dev) <= sluice::testing::allocator_bound(*dev, n.full, o.working_memory_bytes));
  engine.detach();
}

TEST_CASE("lora: sidecars placed by the engine give the outputs of the patched model, and removal restores them",
          "[strict][accel]") {
  AnimaModel m = fp8_tiny();
  const Inputs in = inputs();
  const at::Tensor plain = step(*m, in);
  const LoraAdapter adapter = lora_from_tensors(every_linear(*m, 4), *m, "every-linear-r4");
  at::Tensor patched;
  {
    LoraScope reference(*m, adapter, 0.7);  // no engine: plain .to()
    patched = step(*m, in);
  }
  CHECK_FALSE(at::equal(patched, plain));
  auto dev = sluice::testing::test_device_or_cpu();
  const offload::EngineOptions o = engine_options(dev);
  const offload::WeightNeeds n = offload::StreamingEngine::needs(*m, o);
  offload::StreamingEngine engine(o);
  engine.attach(*m, "tiny", n.full + o.working_memory_bytes);  // exactly the model, beside working memory
  const auto forward = [&] {
    offload::ForwardScope scope(engine);
    return step(*m, in, dev->device());
  };
  {
    LoraScope scope(*m, adapter, 0.7, std::nullopt, &engine);
    CHECK(engine.plan().streamed_count() > 0);
    for (int f = 0; f < 2; ++f) CHECK(at::equal(forward(), patched));
    CHECK(alive_peak(*dev) <= sluice::testing::allocator_bound(*dev, n.full, o.working_memory_bytes));
  }
  {
    // Without the engine named: the layers' engine places the sidecars all the same.
    LoraScope scope(*m, adapter, 0.7);
    CHECK(engine.residency().limits().sidecar_bytes == scope.device_bytes());
    CHECK(at::equal(forward(), patched));
  }
  CHECK(engine.residency().limits().sidecar_bytes == 0);
  CHECK(at::equal(forward(), plain));
  CHECK(engine.plan().streamed_count() == 0);
}

TEST_CASE("lora: sidecars that cannot fit even with every layer streamed give one error naming the LoRA",
          "[strict][accel]") {
  AnimaModel m = fp8_tiny();
  const Inputs in = inputs();
  const at::Tensor plain = step(*m, in);
  auto dev = sluice::testing::test_device_or_cpu();
  const offload::EngineOptions o = engine_options(dev);
  const offload::WeightNeeds n = offload::StreamingEngine::needs(*m, o);
  offload::StreamingEngine engine(o);
  engine.attach(*m, "tiny", n.full + o.working_memory_bytes);  // exactly the model, beside working memory
  const std::string map = engine.plan().residency_map();
  // anima-tiny's layers are 64 wide: a rank-64 bf16 pair is four times an fp8 weight.
  const LoraAdapter adapter = lora_from_tensors(every_linear(*m, 64), *m, "big.safetensors");
  std::string error;
  try {
    LoraScope scope(*m, adapter, 1.0, std::nullopt, &engine);
  } catch (const ResourceError& e) {
    error = e.what();
  }
  INFO(error);
  CHECK(error.find("LoRA 'big.safetensors'") != std::string::npos);
  CHECK(error.find("missing") != std::string::npos);
  CHECK(error.find('\n') == std::string::npos);
  for (const auto& [name, l] : offload::managed_layers(*m)) CHECK(l->loras().empty());  // nothing patched
  CHECK(engine.residency().limits().sidecar_bytes == 0);
  CHECK(engine.plan().residency_map() == map);
  CHECK(alive_peak(*dev) <= sluice::testing::allocator_bound(*dev, n.full, o.working_memory_bytes));
  offload::ForwardScope scope(engine);
  CHECK(at::equal(step(*m, in, dev->device()), plain));
}

namespace {

// anima-tiny at another depth (anima-tiny's width: the depth-expanded presets' block tables
// apply to any model of 40 or 52 blocks), with fp8 storage as fp8_model's.
AnimaModel fp8_tiny_depth(int64_t blocks, uint64_t seed = 3) {
  AnimaConfig c = preset("anima-tiny");
  c.num_blocks = blocks;
  c.name = "anima-tiny-" + std::to_string(blocks);
  return fp8_model(c, seed);
}

// A LoRA over blocks 0..source_blocks-1 (two Linears each, kohya-flattened and dotted keys) and
// two non-block targets, each block's pair written at block `at(i)`: the same tensors whatever
// `at` is, so a remapped adapter and one written at the expected positions hold the same values.
Tensors block_lora(torch::nn::Module& m, int64_t source_blocks, const std::function<int64_t(int64_t)>& at) {
  Tensors t;
  for (int64_t i = 0; i < source_blocks; ++i) {
    const std::string b = "blocks." + std::to_string(at(i));
    const std::string flat = "blocks_" + std::to_string(at(i));
    add_pair(t, m, "blocks.0.self_attn.q_proj", 2, 1000 + static_cast<uint64_t>(i),
             "diffusion_model." + b + ".self_attn.q_proj.lora_A.weight",
             "diffusion_model." + b + ".self_attn.q_proj.lora_B.weight", 0.3);
    add_pair(t, m, "blocks.0.mlp.layer2", 2, 2000 + static_cast<uint64_t>(i),
             "lora_unet_" + flat + "_mlp_layer2.lora_down.weight", "lora_unet_" + flat + "_mlp_layer2.lora_up.weight",
             0.3);
    t.emplace_back("lora_unet_" + flat + "_mlp_layer2.alpha", at::scalar_tensor(1.0));
  }
  add_pair(t, m, "llm_adapter.blocks.1.mlp.0", 2, 3000, "llm_adapter.blocks.1.mlp.0.lora_A.weight",
           "llm_adapter.blocks.1.mlp.0.lora_B.weight", 0.3);
  add_pair(t, m, "final_layer.linear", 2, 3001, "final_layer.linear.lora_A.weight",
           "final_layer.linear.lora_B.weight", 0.3);
  return t;
}

std::vector<std::string> target_modules(const LoraAdapter& a) {
  std::vector<std::string> v;
  for (const auto& t : a.targets) v.push_back(t.module);
  std::sort(v.begin(), v.end());
  return v;
}

// The INFO lines logged while `f` runs (the level raised to info for it: ctest runs at warn).
std::vector<std::string> info_lines(const std::function<void()>& f) {
  std::vector<std::string> lines;
  const log::Level before = log::level();
  log::set_level(log::Level::info);
  log::set_sink([&](log::Level l, const std::string& line) {
    if (l == log::Level::info) lines.push_back(line);
  });
  try {
    f();
  } catch (...) {
    log::set_sink({});
    log::set_level(before);
    throw;
  }
  log::set_sink({});
  log::set_level(before);
  return lines;
}

}  // namespace

TEST_CASE("lora: a base (28-block) LoRA on 40- and 52-block models patches the blocks it was trained on",
          "[strict][accel]") {
  const Inputs in = inputs();
  for (const int64_t depth : {int64_t{40}, int64_t{52}}) {
    INFO("depth " << depth);
    AnimaModel m = fp8_tiny_depth(depth);
    const std::vector<int64_t> pos = block_positions(28, depth);
    REQUIRE(pos.size() == 28);
    const Tensors base_keys = block_lora(*m, 28, [](int64_t i) { return i; });
    const Tensors placed_keys = block_lora(*m, 28, [&](int64_t i) { return pos[static_cast<size_t>(i)]; });

    std::optional<LoraAdapter> remapped;
    const auto lines = info_lines([&] { remapped = lora_from_tensors(base_keys, *m, "base.safetensors"); });
    const std::string expected_line = "LoRA 'base.safetensors' was trained on a 28-block Anima: its blocks go to "
                                      "their measured positions in this " + std::to_string(depth) +
                                      "-block model (block 2 -> " + std::to_string(pos[2]) + ", ..., 27 -> " +
                                      std::to_string(pos[27]) +
                                      "); block_layout \"as-is\" (--adapter-blocks as-is) turns this off";
    CHECK(std::count(lines.begin(), lines.end(), expected_line) == 1);
    CHECK(lines.size() == 1);
    // Written at the expected positions: a 40- or 52-block adapter on its own depth, as is.
    std::vector<std::string> placed_lines;
    std::optional<LoraAdapter> placed;
    placed_lines = info_lines([&] { placed = lora_from_tensors(placed_keys, *m, "placed.safetensors"); });
    CHECK(placed_lines.empty());
    REQUIRE(target_modules(*remapped) == target_modules(*placed));
    CHECK(std::find(target_modules(*remapped).begin(), target_modules(*remapped).end(), "final_layer.linear") !=
          target_modules(*remapped).end());

    // As is: index by index.
    const LoraAdapter as_is = lora_from_tensors(base_keys, *m, "base.safetensors", /*measured_blocks=*/false);
    std::vector<std::string> by_index;
    for (int64_t i = 0; i < 28; ++i) {
      by_index.push_back("blocks." + std::to_string(i) + ".self_attn.q_proj");
      by_index.push_back("blocks." + std::to_string(i) + ".mlp.layer2");
    }
    by_index.push_back("llm_adapter.blocks.1.mlp.0");
    by_index.push_back("final_layer.linear");
    std::sort(by_index.begin(), by_index.end());
    CHECK(target_modules(as_is) == by_index);

    // Outputs: remapped == placed, bit for bit, both directly and through an engine that
    // streams part of the model on the test device; as-is differs.
    at::Tensor out_remapped, out_placed, out_as_is;
    {
      LoraScope s(*m, *remapped);
      out_remapped = step(*m, in);
    }
    {
      LoraScope s(*m, *placed);
      out_placed = step(*m, in);
    }
    {
      LoraScope s(*m, as_is);
      out_as_is = step(*m, in);
    }
    CHECK(same_bits(out_remapped, out_placed));
    CHECK_FALSE(at::equal(out_remapped, out_as_is));

    auto dev = sluice::testing::test_device_or_cpu();
    const offload::EngineOptions o = engine_options(dev);
    const offload::WeightNeeds n = offload::StreamingEngine::needs(*m, o);
    offload::StreamingEngine engine(o);
    engine.attach(*m, "deep", n.full / 2 + o.working_memory_bytes);
    REQUIRE(engine.plan().streamed_count() > 0);
    const auto forward = [&](const LoraAdapter& a) {
      LoraScope s(*m, a, 1.0, std::nullopt, &engine);
      offload::ForwardScope scope(engine);
      return step(*m, in, dev->device());
    };
    const at::Tensor e_remapped = forward(*remapped), e_placed = forward(*placed);
    CHECK(same_bits(e_remapped, e_placed));
    CHECK(at::isfinite(e_remapped).all().item<bool>());
  }
}

TEST_CASE("lora: a 2.9B (40-block) LoRA on a 52-block model goes to the 3.8B's positions of the 2.9B blocks",
          "[strict][accel]") {
  const Inputs in = inputs();
  AnimaModel m = fp8_tiny_depth(52);
  const std::vector<int64_t> pos = block_positions(40, 52);
  const Tensors keys40 = block_lora(*m, 40, [](int64_t i) { return i; });
  const Tensors placed_keys = block_lora(*m, 40, [&](int64_t i) { return pos[static_cast<size_t>(i)]; });
  std::optional<LoraAdapter> remapped;
  const auto lines = info_lines([&] { remapped = lora_from_tensors(keys40, *m, "v29.safetensors"); });
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("LoRA 'v29.safetensors' was trained on a 40-block Anima") == 0);
  CHECK(lines[0].find("(block 3 -> 4, ..., 39 -> 51)") != std::string::npos);
  const LoraAdapter placed = lora_from_tensors(placed_keys, *m, "placed.safetensors");
  REQUIRE(target_modules(*remapped) == target_modules(placed));
  at::Tensor a, b;
  {
    LoraScope s(*m, *remapped);
    a = step(*m, in);
  }
  {
    LoraScope s(*m, placed);
    b = step(*m, in);
  }
  CHECK(same_bits(a, b));
}

TEST_CASE("lora: a LoRA for a deeper model is refused with one line naming it, its block and the model's depth",
          "[strict][accel]") {
  AnimaModel m = fp8_tiny_depth(28);
  AnimaModel deep = fp8_tiny_depth(40);
  const Tensors keys40 = block_lora(*deep, 40, [](int64_t i) { return i; });
  for (const bool measured : {true, false}) {
    const std::string e = error_of([&] { lora_from_tensors(keys40, *m, "deep.safetensors", measured); });
    CHECK(e ==
          "LoRA 'deep.safetensors' addresses block 39 (trained on a 40-block Anima), but this model has 28 blocks: "
          "an adapter for a deeper model cannot be applied");
  }
  // The same on anima-tiny's two blocks, from a file.
  TempDir tmp;
  AnimaModel tiny = fp8_tiny();
  Tensors t;
  add_pair(t, *tiny, "blocks.0.mlp.layer1", 2, 1, "lora_unet_blocks_5_mlp_layer1.lora_down.weight",
           "lora_unet_blocks_5_mlp_layer1.lora_up.weight");
  safetensors::save(tmp / "five.safetensors", t);
  const std::string e = error_of([&] { load_lora(tmp / "five.safetensors", *tiny); });
  CHECK(e.find("LoRA '" + tmp / "five.safetensors" + "' addresses block 5 (trained on a 28-block Anima), but "
               "this model has 2 blocks") == 0);
  // A model of a depth no Anima was released at keeps the indices.
  AnimaModel odd = fp8_tiny_depth(30);
  const LoraAdapter a = lora_from_tensors(block_lora(*odd, 28, [](int64_t i) { return i; }), *odd, "base");
  CHECK(std::find(target_modules(a).begin(), target_modules(a).end(), "blocks.2.mlp.layer2") !=
        target_modules(a).end());
}
