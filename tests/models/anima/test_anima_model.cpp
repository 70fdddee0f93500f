// The Anima module tree (pinned against the published anima-2b checkpoint's names and shapes, on a shape-only build) and
// the forward passes on the tiny preset.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <tuple>
#include <set>
#include <string>

#include "models/anima/anima.h"
#include "models/anima/embedders.h"
#include "models/anima/generator.h"
#include "models/anima/inspect.h"
#include "offload/layer/layer.h"
#include "runtime/error.h"

using namespace sluice::anima;

namespace {

// A tiny model with the generator's random weights (seeded) in `dtype`.
AnimaModel random_model(AnimaConfig config, uint64_t seed = 1, at::ScalarType dtype = at::kFloat) {
  AnimaModel model(config, BuildOptions{dtype, at::kCPU});
  const auto weights = random_weights(config, seed, dtype);
  auto params = model->named_parameters();
  REQUIRE(weights.size() == params.size());
  for (const auto& [name, t] : weights) params[name].set_data(t);
  return model;
}

std::vector<int64_t> shape(const at::Tensor& t) { return t.sizes().vec(); }

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const sluice::InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument thrown>";
}

double rel_l2(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).norm().item<double>() / b.to(at::kDouble).norm().item<double>();
}

// Every parameter name of anima-2b, written out from the published checkpoint's module table.
std::set<std::string> design_names() {
  std::set<std::string> n = {"x_embedder.proj.1.weight",        "t_embedder.1.linear_1.weight",
                             "t_embedder.1.linear_2.weight",    "t_embedding_norm.weight",
                             "final_layer.linear.weight",       "final_layer.adaln_modulation.1.weight",
                             "final_layer.adaln_modulation.2.weight", "llm_adapter.embed.weight",
                             "llm_adapter.out_proj.weight",     "llm_adapter.out_proj.bias",
                             "llm_adapter.norm.weight"};
  for (int b = 0; b < 28; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const char* a : {"self_attn.", "cross_attn."}) {
      for (const char* l : {"q_proj", "k_proj", "v_proj", "output_proj", "q_norm", "k_norm"}) {
        n.insert(p + a + l + ".weight");
      }
    }
    n.insert(p + "mlp.layer1.weight");
    n.insert(p + "mlp.layer2.weight");
    for (const char* m : {"self_attn", "cross_attn", "mlp"}) {
      n.insert(p + "adaln_modulation_" + m + ".1.weight");
      n.insert(p + "adaln_modulation_" + m + ".2.weight");
    }
  }
  for (int b = 0; b < 6; ++b) {
    const std::string p = "llm_adapter.blocks." + std::to_string(b) + ".";
    for (const char* m : {"norm_self_attn", "norm_cross_attn", "norm_mlp"}) n.insert(p + m + ".weight");
    for (const char* a : {"self_attn.", "cross_attn."}) {
      for (const char* l : {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}) n.insert(p + a + l + ".weight");
    }
    for (const char* l : {"mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"}) n.insert(p + l);
  }
  return n;
}

}  // namespace

TEST_CASE("anima model: anima-2b shape-only build has exactly the checkpoint's names and shapes", "[strict]") {
  AnimaModel model(preset("anima-2b"), BuildOptions{at::kBFloat16, at::kMeta});
  const auto params = model->named_parameters();
  CHECK(params.size() == 685);
  for (const auto& p : params) REQUIRE(p.value().is_meta());  // nothing allocated

  std::set<std::string> names;
  for (const auto& p : params) names.insert(p.key());
  const std::set<std::string> expected = design_names();
  CHECK(expected.size() == 685);
  for (const auto& n : expected) CHECK(names.count(n) == 1);
  for (const auto& n : names) CHECK(expected.count(n) == 1);
  CHECK(model->named_buffers().size() == 0);  // RoPE tables are computed, never registered

  const std::vector<std::pair<std::string, std::vector<int64_t>>> table = {
      {"x_embedder.proj.1.weight", {2048, 68}},
      {"t_embedder.1.linear_1.weight", {2048, 2048}},
      {"t_embedder.1.linear_2.weight", {6144, 2048}},
      {"t_embedding_norm.weight", {2048}},
      {"blocks.0.self_attn.q_proj.weight", {2048, 2048}},
      {"blocks.27.self_attn.output_proj.weight", {2048, 2048}},
      {"blocks.5.self_attn.q_norm.weight", {128}},
      {"blocks.5.cross_attn.k_norm.weight", {128}},
      {"blocks.3.cross_attn.q_proj.weight", {2048, 2048}},
      {"blocks.3.cross_attn.k_proj.weight", {2048, 1024}},
      {"blocks.3.cross_attn.v_proj.weight", {2048, 1024}},
      {"blocks.12.mlp.layer1.weight", {8192, 2048}},
      {"blocks.12.mlp.layer2.weight", {2048, 8192}},
      {"blocks.7.adaln_modulation_self_attn.1.weight", {256, 2048}},
      {"blocks.7.adaln_modulation_mlp.2.weight", {6144, 256}},
      {"final_layer.linear.weight", {64, 2048}},
      {"final_layer.adaln_modulation.1.weight", {256, 2048}},
      {"final_layer.adaln_modulation.2.weight", {4096, 256}},
      {"llm_adapter.embed.weight", {32128, 1024}},
      {"llm_adapter.blocks.5.norm_cross_attn.weight", {1024}},
      {"llm_adapter.blocks.0.cross_attn.k_proj.weight", {1024, 1024}},
      {"llm_adapter.blocks.2.self_attn.q_norm.weight", {64}},
      {"llm_adapter.blocks.1.mlp.0.weight", {4096, 1024}},
      {"llm_adapter.blocks.1.mlp.0.bias", {4096}},
      {"llm_adapter.blocks.4.mlp.2.weight", {1024, 4096}},
      {"llm_adapter.blocks.4.mlp.2.bias", {1024}},
      {"llm_adapter.out_proj.bias", {1024}},
      {"llm_adapter.norm.weight", {1024}},
  };
  for (const auto& [name, s] : table) {
    INFO(name);
    REQUIRE(params.contains(name));
    CHECK(shape(params[name]) == s);
    CHECK(params[name].scalar_type() == at::kBFloat16);
  }
}

TEST_CASE("anima model: anima-2b parameter totals match the published checkpoint", "[strict]") {
  AnimaModel model(preset("anima-2b"), BuildOptions{at::kBFloat16, at::kMeta});
  const ModelSummary s = summarize(*model);
  CHECK(s.tensors == 685);
  CHECK(s.parameters == 2091068928LL);
  CHECK(s.total_bytes == 2 * 2091068928LL);
  REQUIRE(s.bytes_by_dtype.size() == 1);
  CHECK(s.bytes_by_dtype.at("BFloat16") == s.total_bytes);
  char mib[32];
  std::snprintf(mib, sizeof mib, "%.2f", double(s.total_bytes) / (1024.0 * 1024.0));
  CHECK(std::string(mib) == "3988.40");

  const std::vector<std::pair<std::string, int64_t>> groups = {
      {"x_embedder", 139264},         {"t_embedder", 16777216}, {"t_embedding_norm", 2048},
      {"blocks", 28LL * 69206528LL}, {"final_layer", 1703936}, {"llm_adapter", 134663680}};
  CHECK(s.params_by_group == groups);
  int64_t dit = 0;
  for (const auto& [g, n] : s.params_by_group) dit += g == "llm_adapter" ? 0 : n;
  CHECK(dit == 1956405248LL);

  int64_t adaln = 0, block0 = 0;
  for (const auto& p : model->named_parameters()) {
    if (p.key().rfind("blocks.", 0) == 0 && p.key().find(".adaln_modulation_") != std::string::npos) adaln += p.value().numel();
    if (p.key().rfind("blocks.0.", 0) == 0) block0 += p.value().numel();
  }
  CHECK(adaln == 176160768LL);
  CHECK(block0 == 69206528LL);
}

TEST_CASE("anima model: managed layers carry their dotted names in execution order", "[strict]") {
  AnimaModel model(preset("anima-tiny"), BuildOptions{at::kFloat, at::kMeta});
  const auto layers = sluice::offload::managed_layers(*model);
  // 1 x_embedder + 2 t_embedder + 2 blocks * (6 adaln + 8 attention + 2 mlp) + 3 final_layer
  // + 1 embed + 2 adapter blocks * (8 attention + 2 mlp) + 1 out_proj
  CHECK(layers.size() == 1 + 2 + 2 * 16 + 3 + 1 + 2 * 10 + 1);
  CHECK(layers.front().first == "x_embedder.proj.1");
  CHECK(layers[1].first == "t_embedder.1.linear_1");
  CHECK(layers[3].first == "blocks.0.adaln_modulation_self_attn.1");
  CHECK(layers[9].first == "blocks.0.self_attn.q_proj");
  for (size_t i = 0; i < layers.size(); ++i) {
    CHECK(layers[i].second->qualified_name() == layers[i].first);
    CHECK(layers[i].second->layer_index() == static_cast<int64_t>(i));
  }
  // Module registration order: the DiT first, in forward order, the adapter last.
  CHECK(layers.back().first == "llm_adapter.out_proj");
}

TEST_CASE("anima model: a model without adapter has no llm_adapter tensors and refuses encode_text", "[strict]") {
  AnimaConfig c = preset("anima-tiny");
  c.adapter.enabled = false;
  AnimaModel model(c, BuildOptions{});
  for (const auto& p : model->named_parameters()) CHECK(p.key().rfind("llm_adapter.", 0) == std::string::npos);
  CHECK_FALSE(model->has_adapter());
  const std::string msg =
      message_of([&] { model->encode_text(at::zeros({1, 3, 32}), at::zeros({1, 3}, at::kLong)); });
  CHECK(msg.find("no LLM adapter") != std::string::npos);
}

TEST_CASE("anima model: tiny forward: output shaped like x, finite, deterministic, seed-dependent", "[strict]") {
  const AnimaConfig c = preset("anima-tiny");
  AnimaModel model = random_model(c, 11);
  at::manual_seed(0);
  const at::Tensor x = at::randn({1, 16, 1, 8, 6});
  const at::Tensor t = at::full({1}, 0.7);
  const at::Tensor ctx = at::randn({1, 5, 32});
  const at::Tensor y = model->forward(x, t, ctx);
  CHECK(shape(y) == shape(x));
  CHECK(y.scalar_type() == at::kFloat);
  CHECK(at::isfinite(y).all().item<bool>());
  CHECK(y.abs().max().item<float>() > 1e-3);
  CHECK(at::equal(y, model->forward(x, t, ctx)));
  // Every input matters.
  CHECK_FALSE(at::allclose(y, model->forward(x, at::full({1}, 0.2), ctx)));
  CHECK_FALSE(at::allclose(y, model->forward(x, t, at::randn({1, 5, 32}))));
  CHECK_FALSE(at::allclose(y, random_model(c, 12)->forward(x, t, ctx)));
}

TEST_CASE("anima model: odd sizes are zero-padded to the patch grid and cropped back", "[strict]") {
  AnimaModel model = random_model(preset("anima-tiny"), 3);
  at::manual_seed(1);
  const at::Tensor x = at::randn({1, 16, 1, 5, 7});
  const at::Tensor t = at::full({1}, 0.4);
  const at::Tensor ctx = at::randn({1, 4, 32});
  const at::Tensor y = model->forward(x, t, ctx);
  CHECK(shape(y) == shape(x));
  // Padding by hand and cropping the result must give the same numbers.
  const at::Tensor padded = at::constant_pad_nd(x, {0, 1, 0, 1}, 0);
  const at::Tensor y_padded = model->forward(padded, t, ctx);
  CHECK(shape(y_padded) == std::vector<int64_t>{1, 16, 1, 6, 8});
  CHECK(at::allclose(y, y_padded.narrow(3, 0, 5).narrow(4, 0, 7), 1e-5, 1e-6));
}

TEST_CASE("anima model: a batch of two equals two single runs", "[strict]") {
  AnimaModel model = random_model(preset("anima-tiny"), 4);
  at::manual_seed(2);
  const at::Tensor x = at::randn({2, 16, 1, 6, 4});
  const at::Tensor t = at::tensor({0.9, 0.1}, at::kFloat);
  const at::Tensor ctx = at::randn({2, 7, 32});
  const at::Tensor y = model->forward(x, t, ctx);
  for (int64_t b = 0; b < 2; ++b) {
    const at::Tensor yb = model->forward(x.narrow(0, b, 1), t.narrow(0, b, 1), ctx.narrow(0, b, 1));
    CHECK(at::allclose(y.narrow(0, b, 1), yb, 1e-5, 1e-6));
  }
  CHECK_FALSE(at::allclose(y[0], y[1]));
}

TEST_CASE("anima model: several frames attend to each other", "[strict]") {
  AnimaModel model = random_model(preset("anima-tiny"), 5);
  at::manual_seed(3);
  const at::Tensor x = at::randn({1, 16, 3, 4, 4});
  const at::Tensor t = at::full({1}, 0.5);
  const at::Tensor ctx = at::randn({1, 6, 32});
  const at::Tensor y = model->forward(x, t, ctx);
  CHECK(shape(y) == shape(x));
  CHECK(at::isfinite(y).all().item<bool>());
  const at::Tensor single = model->forward(x.narrow(2, 1, 1), t, ctx);
  CHECK(rel_l2(y.narrow(2, 1, 1), single) > 1e-3);
}

TEST_CASE("anima model: fp16 and bf16 compute stay finite and close to fp32", "[strict]") {
  const AnimaConfig c = preset("anima-tiny");
  AnimaModel model = random_model(c, 6);
  at::manual_seed(4);
  const at::Tensor x = at::randn({1, 16, 1, 6, 6});
  const at::Tensor t = at::full({1}, 0.3);
  const at::Tensor ctx = at::randn({1, 5, 32});
  const at::Tensor ref = model->forward(x, t, ctx);

  model->set_compute_dtype(at::kHalf);
  CHECK(model->compute_dtype() == at::kHalf);
  for (const auto& [name, layer] : sluice::offload::managed_layers(*model)) CHECK(layer->compute_dtype() == at::kHalf);
  const at::Tensor y16 = model->forward(x.to(at::kHalf), t, ctx);
  CHECK(y16.scalar_type() == at::kHalf);
  CHECK(at::isfinite(y16).all().item<bool>());
  CHECK(rel_l2(y16, ref) < 5e-3);

  // The same weights stored in bf16, computing in bf16.
  AnimaModel bf = random_model(c, 6, at::kBFloat16);
  const at::Tensor ybf = bf->forward(x.to(at::kBFloat16), t, ctx);
  CHECK(ybf.scalar_type() == at::kBFloat16);
  CHECK(rel_l2(ybf, ref) < 3e-2);

  CHECK_THROWS_AS(model->set_compute_dtype(at::kDouble), sluice::InvalidArgument);
}

TEST_CASE("anima model: encode_text: zero padding to output_tokens and per-token weights", "[strict]") {
  const AnimaConfig c = preset("anima-tiny");  // output_tokens 24, model_dim 32
  AnimaModel model = random_model(c, 7);
  at::manual_seed(5);
  const at::Tensor qwen = at::randn({2, 9, 32});
  const at::Tensor ids = at::randint(0, c.adapter.vocab_size, {2, 5}, at::kLong);
  const at::Tensor out = model->encode_text(qwen, ids);
  CHECK(shape(out) == std::vector<int64_t>{2, 24, 32});
  CHECK(at::isfinite(out).all().item<bool>());
  CHECK(out.narrow(1, 5, 19).abs().max().item<float>() == 0.0f);
  CHECK(out.narrow(1, 0, 5).abs().amax(-1).min().item<float>() > 1e-3);

  const at::Tensor w = at::tensor({1.0, 0.5, 2.0, 0.0, -1.0, 1.5, 1.0, 0.25, 3.0, 1.0}, at::kFloat).reshape({2, 5});
  const at::Tensor weighted = model->encode_text(qwen, ids, w);
  CHECK(at::allclose(weighted.narrow(1, 0, 5), out.narrow(1, 0, 5) * w.unsqueeze(-1), 1e-6, 1e-7));
  CHECK(weighted.narrow(1, 5, 19).abs().max().item<float>() == 0.0f);
  CHECK(at::equal(model->encode_text(qwen, ids, w.unsqueeze(-1)), weighted));
  // int32 ids give the same result.
  CHECK(at::equal(model->encode_text(qwen, ids.to(at::kInt)), out));
  // The context feeds the DiT.
  const at::Tensor y = model->forward(at::randn({2, 16, 1, 4, 4}), at::full({2}, 0.5), out);
  CHECK(at::isfinite(y).all().item<bool>());
}

TEST_CASE("anima model: input validation names the input and both shapes", "[strict]") {
  AnimaModel model = random_model(preset("anima-tiny"), 8);
  const at::Tensor x = at::randn({1, 16, 1, 4, 4});
  const at::Tensor t = at::full({1}, 0.5);
  const at::Tensor ctx = at::randn({1, 3, 32});

  std::string m = message_of([&] { model->forward(at::randn({1, 17, 1, 4, 4}), t, ctx); });
  CHECK(m.find("x has 17 channels, model expects 16") != std::string::npos);
  m = message_of([&] { model->forward(at::randn({1, 16, 4, 4}), t, ctx); });
  CHECK(m.find("x must be [B,C,T,H,W]") != std::string::npos);
  CHECK(m.find("[1, 16, 4, 4]") != std::string::npos);
  m = message_of([&] { model->forward(x, at::full({2}, 0.5), ctx); });
  CHECK(m.find("timesteps has shape [2], expected [1]") != std::string::npos);
  m = message_of([&] { model->forward(x, t, at::randn({1, 3, 24})); });
  CHECK(m.find("context has shape [1, 3, 24], model expects [1, S, 32]") != std::string::npos);
  m = message_of([&] { model->forward(x.to(at::kBFloat16), t, ctx); });
  CHECK(m.find("x has dtype BFloat16, the model computes in Float") != std::string::npos);
  m = message_of([&] { model->forward(x.to(at::kLong), t, ctx); });
  CHECK(m.find("x must be a floating-point tensor") != std::string::npos);

  const at::Tensor qwen = at::randn({1, 4, 32});
  m = message_of([&] { model->encode_text(at::randn({1, 4, 31}), at::zeros({1, 3}, at::kLong)); });
  CHECK(m.find("qwen_hidden has shape [1, 4, 31], adapter expects [B, S, 32]") != std::string::npos);
  m = message_of([&] { model->encode_text(qwen, at::zeros({2, 3}, at::kLong)); });
  CHECK(m.find("t5_ids has shape [2, 3], expected [1, S_t]") != std::string::npos);
  m = message_of([&] { model->encode_text(qwen, at::zeros({1, 3}, at::kFloat)); });
  CHECK(m.find("t5_ids must be int32 or int64") != std::string::npos);
  m = message_of([&] { model->encode_text(qwen, at::full({1, 3}, 128, at::kLong)); });
  CHECK(m.find("t5_ids contains id 128, outside the vocabulary [0, 128)") != std::string::npos);
  m = message_of([&] { model->encode_text(qwen, at::zeros({1, 25}, at::kLong)); });
  CHECK(m.find("t5_ids has 25 tokens, more than the adapter's 24") != std::string::npos);
  m = message_of([&] { model->encode_text(qwen, at::zeros({1, 3}, at::kLong), at::ones({1, 4})); });
  CHECK(m.find("t5_weights has shape [1, 4], expected [1, 3]") != std::string::npos);
}

TEST_CASE("anima model: invalid configs are rejected at build time", "[strict]") {
  AnimaConfig c = preset("anima-tiny");
  c.num_heads = 8;  // head_dim 8: too small for 3D RoPE
  CHECK_THROWS_AS(AnimaModel(c, BuildOptions{at::kFloat, at::kMeta}), sluice::InvalidArgument);
  // Norm scales are never fp8: fp8 storage is the engine's job, after building.
  CHECK_THROWS_AS(AnimaModel(preset("anima-tiny"), BuildOptions{at::kFloat8_e4m3fn, at::kMeta}),
                  sluice::InvalidArgument);
}

TEST_CASE("anima model: timestep sinusoid is [cos, sin] with freq_k = exp(-ln(1e4) k / half)", "[strict]") {
  const at::Tensor s = timestep_sinusoid(at::tensor({0.5, 3.0}, at::kFloat), 8);
  REQUIRE(shape(s) == std::vector<int64_t>{2, 1, 8});
  CHECK(s.scalar_type() == at::kFloat);
  const double ts[] = {0.5, 3.0};
  for (int b = 0; b < 2; ++b)
    for (int k = 0; k < 4; ++k) {
      const double a = ts[b] * std::exp(-std::log(10000.0) * k / 4.0);
      CHECK(s[b][0][k].item<float>() == Approx(std::cos(a)).margin(1e-6));
      CHECK(s[b][0][k + 4].item<float>() == Approx(std::sin(a)).margin(1e-6));
    }
}

TEST_CASE("anima model: patchify and unpatchify put every value back where it came from", "[strict]") {
  // Blocks made inert (all adaLN weights zero => gates zero), the patch embedder copying
  // the 68 patch features (c r m n) into the first 68 channels, and the final linear
  // picking them back out in the output order (p1 p2 t C), both orders written from the
  // einops patterns of the reference model (tests/python/reference_anima.py). Then each output patch is LN(its input patch) routed
  // back, and a single non-zero input value must come out at its own position.
  AnimaConfig c = preset("anima-tiny");
  c.model_channels = 128;
  c.num_heads = 8;
  AnimaModel model(c, BuildOptions{});
  auto params = model->named_parameters();
  for (auto& p : params) p.value().set_data(at::zeros_like(p.value()));
  params["t_embedding_norm.weight"].set_data(at::ones({128}));
  at::Tensor we = at::zeros({128, 68});
  for (int i = 0; i < 68; ++i) we[i][i] = 1.0;
  params["x_embedder.proj.1.weight"].set_data(we);
  at::Tensor wf = at::zeros({64, 128});
  for (int ch = 0; ch < 16; ++ch)
    for (int m = 0; m < 2; ++m)
      for (int n = 0; n < 2; ++n) {
        const int in = (ch * 2 + m) * 2 + n;   // (c r m n) with r = 0
        const int out = (m * 2 + n) * 16 + ch;  // (p1 p2 t C) with t = 0
        wf[out][in] = 1.0;
      }
  params["final_layer.linear.weight"].set_data(wf);

  for (const auto& [ch, h, w] : std::vector<std::tuple<int, int, int>>{{5, 2, 3}, {0, 0, 0}, {15, 3, 4}, {9, 1, 2}}) {
    INFO("c=" << ch << " h=" << h << " w=" << w);
    at::Tensor x = at::zeros({1, 16, 1, 4, 5});  // W=5: also padded and cropped
    x[0][ch][0][h][w] = 7.0;
    const at::Tensor y = model->forward(x, at::full({1}, 0.5), at::randn({1, 3, 32}));
    CHECK(y.argmax().item<int64_t>() == x.argmax().item<int64_t>());
    // Outside the 2x2 patch holding the value, every token was zero and stays zero.
    at::Tensor outside = y.clone();
    outside.narrow(3, (h / 2) * 2, 2).narrow(4, (w / 2) * 2, std::min<int64_t>(2, 5 - (w / 2) * 2)).zero_();
    CHECK(outside.abs().max().item<float>() == 0.0f);
  }
}
