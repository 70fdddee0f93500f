// Checkpoint probe, strict loader and random-checkpoint generator, on small generated files.
#include <ATen/ATen.h>
#include <dirent.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/anima/convert.h"
#include "models/anima/generator.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/host_memory.h"
#include "runtime/safetensors.h"

using namespace sluice::anima;
namespace st = sluice::safetensors;
using Tensors = std::vector<std::pair<std::string, at::Tensor>>;

namespace {

// A scratch directory per test case, removed afterwards. POSIX calls, not
// std::filesystem: libtorch.so exports its own std::filesystem symbols, and the dynamic
// linker binds remove_all to that copy, which crashes.
struct Scratch {
  std::string dir;
  Scratch() {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/sluice_ckpt_test_XXXXXX";
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    dir = templ;
  }
  ~Scratch() {
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") ::unlink((dir + "/" + name).c_str());
      }
      ::closedir(d);
    }
    ::rmdir(dir.c_str());
  }
  std::string path(const std::string& name) const { return dir + "/" + name; }
};

Tensors read_all(const std::string& path) {
  const auto f = st::File::open(path);
  Tensors out;
  for (const auto& ti : f->tensors()) out.emplace_back(ti.name, f->tensor(ti.name).clone());
  return out;
}

Tensors renamed(const Tensors& in, const std::string& from, const std::string& to) {
  Tensors out;
  for (const auto& [k, v] : in) out.emplace_back(to + k.substr(from.size()), v);
  return out;
}

Tensors without(const Tensors& in, const std::string& prefix) {
  Tensors out;
  for (const auto& kv : in)
    if (kv.first.rfind(prefix, 0) != 0) out.push_back(kv);
  return out;
}

at::Tensor& find(Tensors& ts, const std::string& key) {
  for (auto& kv : ts)
    if (kv.first == key) return kv.second;
  FAIL("no tensor " << key);
  throw;
}

std::string load_error(const std::string& path, const LoadOptions& o = {}) {
  try {
    load_anima(path, o);
  } catch (const sluice::CheckpointError& e) {
    return e.what();
  }
  return "<no CheckpointError thrown>";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Every model parameter equals the file's tensor `prefix + name` converted to its dtype.
void check_equal_to_file(AnimaModel& model, const Tensors& file, const std::string& prefix) {
  std::map<std::string, at::Tensor> by_key(file.begin(), file.end());
  const auto params = model->named_parameters();
  for (const auto& p : params) {
    INFO(p.key());
    REQUIRE(by_key.count(prefix + p.key()) == 1);
    const at::Tensor& src = by_key.at(prefix + p.key());
    CHECK(at::equal(p.value(), src.to(p.value().scalar_type())));
  }
}

}  // namespace

TEST_CASE("checkpoint loader: generator -> loader round trip is bitwise") {
  Scratch s;
  const AnimaConfig c = preset("anima-tiny");
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const std::string path = s.path("tiny.safetensors");
    write_random_checkpoint(c, 123, dtype, path);
    const Tensors file = read_all(path);
    AnimaModel shapes(c, BuildOptions{at::kFloat, at::kMeta});
    CHECK(file.size() == shapes->named_parameters().size());
    for (const auto& [k, v] : file) {
      CHECK(k.rfind("net.", 0) == 0);
      CHECK(v.scalar_type() == dtype);
    }
    LoadOptions o;
    o.dtype = dtype;
    AnimaModel model = load_anima(path, o);
    check_equal_to_file(model, file, "net.");
    for (const auto& p : model->named_parameters()) CHECK(p.value().scalar_type() == dtype);
    // Converting on load: a bf16/fp32 file into the other dtype.
    o.dtype = dtype == at::kFloat ? at::kBFloat16 : at::kFloat;
    AnimaModel converted = load_anima(path, o);
    check_equal_to_file(converted, file, "net.");
  }
}

TEST_CASE("checkpoint loader: loaded weights are owned copies, not views of the file") {
  Scratch s;
  const std::string path = s.path("tiny.safetensors");
  write_random_checkpoint(preset("anima-tiny"), 5, at::kFloat, path);
  const auto f = st::File::open(path);
  AnimaModel model(preset("anima-tiny"), BuildOptions{});
  const int64_t before = sluice::host_memory_stats().current_bytes();
  load_weights(*model, *f, "net.");
  // Every weight is one copy in sluice's host memory (runtime/host_memory.h).
  int64_t bytes = 0;
  for (const auto& p : model->named_parameters()) bytes += p.value().nbytes();
  CHECK(sluice::host_memory_stats().current_bytes() - before == bytes);
  const at::Tensor view = f->tensor("net.blocks.0.mlp.layer1.weight");
  const at::Tensor param = model->named_parameters()["blocks.0.mlp.layer1.weight"];
  CHECK(at::equal(param, view));
  CHECK(param.data_ptr() != view.data_ptr());
  CHECK(param.is_contiguous());
}

TEST_CASE("checkpoint loader: generator is deterministic per seed and records its config") {
  Scratch s;
  const AnimaConfig c = preset("anima-tiny");
  write_random_checkpoint(c, 7, at::kBFloat16, s.path("a.safetensors"));
  write_random_checkpoint(c, 7, at::kBFloat16, s.path("b.safetensors"));
  write_random_checkpoint(c, 8, at::kBFloat16, s.path("c.safetensors"));
  auto bytes = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  CHECK(bytes(s.path("a.safetensors")) == bytes(s.path("b.safetensors")));
  const Tensors a = read_all(s.path("a.safetensors")), cc = read_all(s.path("c.safetensors"));
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    CHECK_FALSE(at::equal(a[i].second, cc[i].second));
  }
  const auto f = st::File::open(s.path("a.safetensors"));
  REQUIRE(f->metadata().count(kMetaConfig) == 1);
  CHECK(nlohmann::json::parse(f->metadata().at(kMetaConfig)) == config_to_json(c));
  CHECK(f->metadata().at(kMetaSeed) == "7");
  // Init scales (Note [random checkpoint init]): norms around 1, biases small, linears ~1/sqrt(fan_in).
  std::map<std::string, at::Tensor> t(a.begin(), a.end());
  const at::Tensor norm = t.at("net.blocks.0.self_attn.q_norm.weight").to(at::kFloat);
  CHECK(norm.mean().item<float>() == Approx(1.0).margin(0.1));
  CHECK(norm.std().item<float>() > 0.02);
  CHECK(t.at("net.llm_adapter.out_proj.bias").to(at::kFloat).abs().max().item<float>() < 0.2);
  const at::Tensor w = t.at("net.blocks.0.mlp.layer2.weight").to(at::kFloat);  // fan_in 256
  CHECK(w.std().item<float>() == Approx(1.0 / 16.0).epsilon(0.1));
}

TEST_CASE("checkpoint loader: generated weights keep activations finite at anima-2b depth") {
  // anima-2b's depth (28 blocks, 6 adapter blocks) and head sizes at a narrow width.
  AnimaConfig c = preset("anima-2b");
  c.model_channels = 128;
  c.num_heads = 1;  // head_dim 128 as on the real model
  c.crossattn_emb_channels = 128;
  c.adaln_lora_dim = 32;
  c.adapter.vocab_size = 300;
  c.adapter.model_dim = 128;
  c.adapter.source_dim = 128;
  c.adapter.num_heads = 2;  // head_dim 64
  c.adapter.output_tokens = 32;
  AnimaModel model(c, BuildOptions{});
  auto params = model->named_parameters();
  for (const auto& [k, v] : random_weights(c, 99, at::kFloat)) params[k].set_data(v);
  at::manual_seed(9);
  const at::Tensor ctx = model->encode_text(at::randn({1, 20, 128}), at::randint(0, 300, {1, 12}, at::kLong));
  CHECK(at::isfinite(ctx).all().item<bool>());
  const at::Tensor x = at::randn({1, 16, 1, 8, 8});
  const at::Tensor y = model->forward(x, at::full({1}, 0.5), ctx);
  CHECK(at::isfinite(y).all().item<bool>());
  const float rms = y.pow(2).mean().sqrt().item<float>();
  CHECK(rms > 0.05f);
  CHECK(rms < 50.0f);
  model->set_compute_dtype(at::kHalf);
  const at::Tensor y16 = model->forward(x.to(at::kHalf), at::full({1}, 0.5), ctx);
  CHECK(at::isfinite(y16).all().item<bool>());
}

TEST_CASE("checkpoint loader: prefixes: net., model.diffusion_model. with foreign keys, none") {
  Scratch s;
  const AnimaConfig c = preset("anima-tiny");
  write_random_checkpoint(c, 1, at::kFloat, s.path("net.safetensors"));
  const Tensors net = read_all(s.path("net.safetensors"));

  const auto fnet = st::File::open(s.path("net.safetensors"));
  CheckpointProbe p = probe_checkpoint(*fnet);
  CHECK(p.is_anima);
  CHECK(p.prefix == "net.");
  CHECK(p.tensors == static_cast<int64_t>(net.size()));
  CHECK(p.dropped_foreign == 0);
  CHECK(p.tensors_by_dtype.at("Float") == p.tensors);

  Tensors comfy = renamed(net, "net.", "model.diffusion_model.");
  comfy.emplace_back("first_stage_model.decoder.conv_in.weight", at::ones({4, 4}));
  comfy.emplace_back("model.model_sampling.sigmas", at::ones({10}));
  comfy.emplace_back("text_encoders.qwen3_06b.transformer.model.norm.weight", at::ones({8}));
  st::save(s.path("comfy.safetensors"), comfy);
  p = probe_checkpoint(*st::File::open(s.path("comfy.safetensors")));
  CHECK(p.is_anima);
  CHECK(p.prefix == "model.diffusion_model.");
  CHECK(p.dropped_foreign == 3);
  CHECK(p.tensors == static_cast<int64_t>(net.size()));
  AnimaModel m1 = load_anima(s.path("comfy.safetensors"));
  check_equal_to_file(m1, comfy, "model.diffusion_model.");

  const Tensors bare = renamed(net, "net.", "");
  st::save(s.path("bare.safetensors"), bare);
  p = probe_checkpoint(*st::File::open(s.path("bare.safetensors")));
  CHECK(p.is_anima);
  CHECK(p.prefix.empty());
  AnimaModel m2 = load_anima(s.path("bare.safetensors"));
  check_equal_to_file(m2, bare, "");
}

TEST_CASE("checkpoint loader: non-model keys are dropped") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 2, at::kFloat, s.path("a.safetensors"));
  Tensors t = read_all(s.path("a.safetensors"));
  t.emplace_back("net.pos_embedder.dim_spatial_range", at::arange(2, at::kFloat));
  t.emplace_back("net.pos_embedder.dim_temporal_range", at::arange(4, at::kFloat));
  t.emplace_back("net.llm_adapter.rotary_emb.inv_freq", at::ones({4}));
  st::save(s.path("b.safetensors"), t);
  const CheckpointProbe p = probe_checkpoint(*st::File::open(s.path("b.safetensors")));
  CHECK(p.dropped_non_model == 3);
  CHECK(p.tensors == static_cast<int64_t>(t.size()) - 3);
  AnimaModel m = load_anima(s.path("b.safetensors"));
  check_equal_to_file(m, t, "net.");
}

TEST_CASE("checkpoint loader: config inference from shapes (tiny, small, no adaLN-LoRA)") {
  Scratch s;
  AnimaConfig nolora = preset("anima-tiny");
  nolora.use_adaln_lora = false;
  nolora.name = "nolora";
  for (const AnimaConfig& c : {preset("anima-tiny"), preset("anima-small"), nolora}) {
    INFO(c.name);
    write_random_checkpoint(c, 3, at::kBFloat16, s.path("m.safetensors"));
    // Without the generator's metadata only the shapes speak.
    st::save(s.path("plain.safetensors"), read_all(s.path("m.safetensors")));
    const CheckpointProbe p = probe_checkpoint(*st::File::open(s.path("plain.safetensors")));
    CHECK_FALSE(p.config_from_metadata);
    const AnimaConfig& g = p.inferred;
    CHECK(g.name == s.path("plain.safetensors"));
    CHECK(g.in_channels == c.in_channels);
    CHECK(g.out_channels == c.out_channels);
    CHECK(g.model_channels == c.model_channels);
    CHECK(g.num_blocks == c.num_blocks);
    CHECK(g.num_heads == c.num_heads);
    CHECK(g.mlp_ratio == c.mlp_ratio);
    CHECK(g.crossattn_emb_channels == c.crossattn_emb_channels);
    CHECK(g.use_adaln_lora == c.use_adaln_lora);
    if (c.use_adaln_lora) CHECK(g.adaln_lora_dim == c.adaln_lora_dim);
    CHECK(g.adapter.enabled);
    CHECK(g.adapter.vocab_size == c.adapter.vocab_size);
    CHECK(g.adapter.model_dim == c.adapter.model_dim);
    CHECK(g.adapter.source_dim == c.adapter.source_dim);
    CHECK(g.adapter.num_blocks == c.adapter.num_blocks);
    CHECK(g.adapter.num_heads == c.adapter.num_heads);
    CHECK(g.adapter.mlp_ratio == c.adapter.mlp_ratio);
    // Not in the shapes: anima-2b's values.
    const AnimaConfig d = preset("anima-2b");
    CHECK(g.rope_h_extrapolation_ratio == d.rope_h_extrapolation_ratio);
    CHECK(g.rope_t_extrapolation_ratio == d.rope_t_extrapolation_ratio);
    CHECK(g.adapter.output_tokens == d.adapter.output_tokens);
    CHECK_NOTHROW(load_anima(s.path("plain.safetensors")));

    // With the metadata, the whole config comes back.
    const CheckpointProbe pm = probe_checkpoint(*st::File::open(s.path("m.safetensors")));
    CHECK(pm.config_from_metadata);
    nlohmann::json got = config_to_json(pm.inferred), want = config_to_json(c);
    got.erase("name");
    want.erase("name");
    CHECK(got == want);
  }
}

TEST_CASE("checkpoint loader: missing, unexpected and mismatched keys are CheckpointErrors naming them") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 4, at::kFloat, s.path("good.safetensors"));
  const Tensors good = read_all(s.path("good.safetensors"));

  st::save(s.path("missing.safetensors"), without(good, "net.blocks.1.mlp.layer2.weight"));
  std::string m = load_error(s.path("missing.safetensors"));
  CHECK(has(m, s.path("missing.safetensors")));
  CHECK(has(m, "1 missing key: net.blocks.1.mlp.layer2.weight"));

  Tensors extra = good;
  extra.emplace_back("net.blocks.0.extra_proj.weight", at::ones({2, 2}));
  st::save(s.path("extra.safetensors"), extra);
  m = load_error(s.path("extra.safetensors"));
  CHECK(has(m, "1 unexpected key: net.blocks.0.extra_proj.weight"));
  CHECK_FALSE(has(m, "missing"));

  Tensors bad = good;
  find(bad, "net.blocks.1.cross_attn.v_proj.weight") = at::zeros({64, 16});
  st::save(s.path("bad.safetensors"), bad);
  m = load_error(s.path("bad.safetensors"));
  INFO(m);
  CHECK(has(m, "1 shape mismatch: net.blocks.1.cross_attn.v_proj.weight file [64, 16] vs model [64, 32]"));
  CHECK_FALSE(has(m, "missing"));

  // Many (block 0 gone; the shapes are read from block 1): the first ten, then a count.
  st::save(s.path("many.safetensors"), without(good, "net.blocks.0."));
  m = load_error(s.path("many.safetensors"));
  INFO(m);
  CHECK(has(m, "20 missing keys: net.blocks.0."));
  CHECK(has(m, " and 10 more"));

  // All three kinds in one message.
  Tensors all3 = without(bad, "net.final_layer.linear.weight");
  all3.emplace_back("net.extra", at::ones({1}));
  st::save(s.path("all3.safetensors"), all3);
  m = load_error(s.path("all3.safetensors"));
  INFO(m);
  CHECK(has(m, "1 missing key: net.final_layer.linear.weight; 1 unexpected key: net.extra; 1 shape mismatch: "));
}

TEST_CASE("checkpoint loader: non-Anima files are rejected") {
  Scratch s;
  st::save(s.path("vae.safetensors"), {{"encoder.conv_in.weight", at::ones({4, 3})}, {"decoder.norm.bias", at::ones({4})}});
  const CheckpointProbe p = probe_checkpoint(*st::File::open(s.path("vae.safetensors")));
  CHECK_FALSE(p.has_dit);
  CHECK_FALSE(p.is_anima);
  CHECK_FALSE(p.reason.empty());
  const std::string m = load_error(s.path("vae.safetensors"));
  CHECK(has(m, "is not an Anima checkpoint"));
  CHECK(has(m, s.path("vae.safetensors")));
  CHECK_THROWS_AS(load_anima(s.path("does-not-exist.safetensors")), sluice::FileError);
}

TEST_CASE("checkpoint loader: a DiT-only file loads without adapter") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 6, at::kFloat, s.path("a.safetensors"));
  const Tensors dit = without(read_all(s.path("a.safetensors")), "net.llm_adapter.");
  st::save(s.path("dit.safetensors"), dit);
  const CheckpointProbe p = probe_checkpoint(*st::File::open(s.path("dit.safetensors")));
  CHECK(p.has_dit);
  CHECK_FALSE(p.has_adapter);
  CHECK_FALSE(p.is_anima);
  CHECK_FALSE(p.inferred.adapter.enabled);
  AnimaModel m = load_anima(s.path("dit.safetensors"));
  CHECK_FALSE(m->has_adapter());
  check_equal_to_file(m, dit, "net.");
  CHECK_THROWS_AS(m->encode_text(at::zeros({1, 2, 32}), at::zeros({1, 2}, at::kLong)), sluice::InvalidArgument);
  // Asking for the adapter explicitly reports what is missing.
  LoadOptions o;
  o.config = preset("anima-tiny");
  CHECK(has(load_error(s.path("dit.safetensors"), o), "missing keys: net.llm_adapter."));
}

TEST_CASE("checkpoint loader: a --config override must match the file") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 9, at::kFloat, s.path("tiny.safetensors"));
  LoadOptions o;
  o.config = preset("anima-small");
  const std::string m = load_error(s.path("tiny.safetensors"), o);
  CHECK(has(m, "does not match model config 'anima-small'"));
  CHECK(has(m, "shape mismatches: net.x_embedder.proj.1.weight file [64, 68] vs model [256, 68]"));
  CHECK(has(m, "missing keys"));  // small has 8 blocks, the file 2

  // Fields the shapes do not fix may be overridden.
  AnimaConfig c = preset("anima-tiny");
  c.rope_h_extrapolation_ratio = 2.0;
  c.adapter.output_tokens = 40;
  o.config = c;
  AnimaModel model = load_anima(s.path("tiny.safetensors"), o);
  CHECK(model->config().rope_h_extrapolation_ratio == 2.0);
  CHECK(model->encode_text(at::randn({1, 3, 32}), at::zeros({1, 3}, at::kLong)).size(1) == 40);
}

TEST_CASE("checkpoint loader: scaled fp8 weights are dequantized, quantization markers rejected") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 10, at::kFloat, s.path("a.safetensors"));
  Tensors t = read_all(s.path("a.safetensors"));
  const at::Tensor w = find(t, "net.blocks.0.mlp.layer1.weight").clone();  // [256, 64]
  const at::Tensor q_tensor = (w / 0.01).to(at::kFloat8_e4m3fn);
  find(t, "net.blocks.0.mlp.layer1.weight") = q_tensor;
  t.emplace_back("net.blocks.0.mlp.layer1.weight_scale", at::full({}, 0.01, at::kFloat));
  const at::Tensor w2 = find(t, "net.blocks.1.self_attn.q_proj.weight").clone();  // [64, 64], per row
  const at::Tensor row_scale = w2.abs().amax(1) / 400.0;
  const at::Tensor q_row = (w2 / row_scale.unsqueeze(1)).to(at::kFloat8_e4m3fn);
  find(t, "net.blocks.1.self_attn.q_proj.weight") = q_row;
  t.emplace_back("net.blocks.1.self_attn.q_proj.weight_scale", row_scale);
  t.emplace_back("net.blocks.0.mlp.layer1.input_scale", at::ones({}));
  t.emplace_back("net.scaled_fp8", at::empty({0}, at::kFloat8_e4m3fn));
  st::save(s.path("fp8.safetensors"), t);

  const CheckpointProbe p = probe_checkpoint(*st::File::open(s.path("fp8.safetensors")));
  CHECK(p.scaled_weights == 2);
  CHECK(p.dropped_non_model == 2);
  CHECK(p.tensors_by_dtype.at("Float8_e4m3fn") == 2);
  AnimaModel m = load_anima(s.path("fp8.safetensors"));
  auto params = m->named_parameters();
  const at::Tensor got = params["blocks.0.mlp.layer1.weight"];
  CHECK(at::equal(got, q_tensor.to(at::kFloat) * 0.01f));
  CHECK(at::allclose(got, w, 0.07, 1e-3));  // e4m3 keeps ~3 mantissa bits
  CHECK(at::equal(params["blocks.1.self_attn.q_proj.weight"], q_row.to(at::kFloat) * row_scale.unsqueeze(1)));

  // The old layout: ".scale_weight" (and ".scale_input") instead of ".weight_scale".
  Tensors old = t;
  for (auto& [k, v] : old) {
    if (k == "net.blocks.0.mlp.layer1.weight_scale") k = "net.blocks.0.mlp.layer1.scale_weight";
    if (k == "net.blocks.0.mlp.layer1.input_scale") k = "net.blocks.0.mlp.layer1.scale_input";
  }
  st::save(s.path("old.safetensors"), old);
  AnimaModel m_old = load_anima(s.path("old.safetensors"));
  CHECK(at::equal(m_old->named_parameters()["blocks.0.mlp.layer1.weight"], got));
  // A scale [out, 1] is one per row, like [out].
  Tensors col = t;
  find(col, "net.blocks.1.self_attn.q_proj.weight_scale") = row_scale.unsqueeze(1).clone();
  st::save(s.path("col.safetensors"), col);
  CHECK(at::equal(load_anima(s.path("col.safetensors"))->named_parameters()["blocks.1.self_attn.q_proj.weight"],
                  params["blocks.1.self_attn.q_proj.weight"]));
  // A scale that is not positive and finite is refused, naming it.
  Tensors bad_scale = t;
  find(bad_scale, "net.blocks.0.mlp.layer1.weight_scale") = at::full({}, -1.0, at::kFloat);
  st::save(s.path("bad_scale.safetensors"), bad_scale);
  CHECK(has(load_error(s.path("bad_scale.safetensors")), "net.blocks.0.mlp.layer1.weight_scale"));

  // ComfyUI's markers: per-layer ".comfy_quant" (JSON in uint8) and the header entry. fp8
  // formats load; any other is refused naming it; a marker that is not JSON too.
  const auto marker = [](const std::string& json) {
    at::Tensor b = at::empty({static_cast<int64_t>(json.size())}, at::kByte);
    std::memcpy(b.data_ptr(), json.data(), json.size());
    return b;
  };
  Tensors quant = t;
  quant.emplace_back("net.blocks.0.mlp.layer1.comfy_quant", marker(R"({"format": "float8_e4m3fn"})"));
  st::save(s.path("comfy_fp8.safetensors"), quant, {{"_quantization_metadata",
      R"({"format_version": "1.0", "layers": {"net.blocks.0.mlp.layer1": {"format": "float8_e4m3fn"}}})"}});
  CHECK(at::equal(load_anima(s.path("comfy_fp8.safetensors"))->named_parameters()["blocks.0.mlp.layer1.weight"], got));
  Tensors int8 = t;
  int8.emplace_back("net.blocks.0.mlp.layer2.comfy_quant", marker(R"({"format": "int8_tensorwise"})"));
  st::save(s.path("comfy_int8.safetensors"), int8);
  const std::string e_int8 = load_error(s.path("comfy_int8.safetensors"));
  CHECK(has(e_int8, "net.blocks.0.mlp.layer2.comfy_quant"));
  CHECK(has(e_int8, "'int8_tensorwise'"));
  st::save(s.path("meta_nvfp4.safetensors"), t, {{"_quantization_metadata",
      R"({"format_version": "1.0", "layers": {"net.blocks.0.mlp.layer2": {"format": "nvfp4"}}})"}});
  const std::string e_meta = load_error(s.path("meta_nvfp4.safetensors"));
  CHECK(has(e_meta, "net.blocks.0.mlp.layer2"));
  CHECK(has(e_meta, "'nvfp4'"));
  t.emplace_back("net.blocks.0.mlp.layer2.comfy_quant", at::zeros({4}, at::kByte));
  st::save(s.path("comfy_quant.safetensors"), t);
  CHECK(has(load_error(s.path("comfy_quant.safetensors")), "is not a quantization marker"));
}

namespace {

// fp8 storage options as `sluice convert` and a load with --storage use them.
sluice::Fp8Options fp8(sluice::ScaleMode mode) {
  sluice::Fp8Options o;
  o.scale_mode = mode;
  return o;
}

LoadOptions with_storage(const sluice::Fp8Options& o) {
  LoadOptions lo;
  lo.storage = o;
  return lo;
}

// Every parameter and weight scale of `a` equals `b`'s bit for bit, dtype included.
void check_same_storage(AnimaModel& a, AnimaModel& b) {
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  REQUIRE(pa.size() == pb.size());
  for (const auto& p : pa) {
    INFO(p.key());
    const at::Tensor& other = pb[p.key()];
    CHECK(p.value().scalar_type() == other.scalar_type());
    CHECK(at::equal(p.value().view(at::kByte), other.view(at::kByte)));
  }
  const auto la = sluice::offload::managed_layers(*a), lb = sluice::offload::managed_layers(*b);
  REQUIRE(la.size() == lb.size());
  for (size_t i = 0; i < la.size(); ++i) {
    INFO(la[i].first);
    const at::Tensor& sa = la[i].second->weight_scale();
    const at::Tensor& sb = lb[i].second->weight_scale();
    REQUIRE(sa.defined() == sb.defined());
    if (sa.defined()) CHECK(at::equal(sa, sb));
  }
}

}  // namespace

TEST_CASE("checkpoint loader: convert: a converted checkpoint holds the stored bytes of a load-time conversion and loads with no cast") {
  Scratch s;
  write_random_checkpoint(preset("anima-small"), 3, at::kBFloat16, s.path("src.safetensors"));
  for (const sluice::ScaleMode mode :
       {sluice::ScaleMode::none, sluice::ScaleMode::per_tensor, sluice::ScaleMode::per_channel}) {
    INFO("scale " << sluice::to_string(mode));
    const sluice::Fp8Options o = fp8(mode);
    const ConvertReport r = convert_checkpoint(s.path("src.safetensors"), s.path("fp8.safetensors"), o);
    CHECK(r.model_name == "anima-small");
    CHECK(r.fp8_tensors > 0);
    CHECK(r.skipped_layers > 0);  // t_embedder, x_embedder, final_layer
    CHECK(r.out_bytes < r.in_bytes * 6 / 10);  // about half of bf16 (plus norms, skips and scales)

    AnimaModel at_load = load_anima(s.path("src.safetensors"), with_storage(o));
    sluice::offload::StorageReport kept;
    LoadOptions lo = with_storage(o);
    lo.report = &kept;
    AnimaModel converted = load_anima(s.path("fp8.safetensors"), lo);
    check_same_storage(at_load, converted);
    // No cast: every fp8 layer was kept as read.
    CHECK(kept.cast_layers > 0);
    CHECK(kept.kept_layers == kept.cast_layers);
    CHECK(kept.clipped == 0);
    // The same stored bytes give the same forward, bit for bit.
    at::manual_seed(0);
    const at::Tensor x = at::randn({1, 16, 1, 8, 8}).to(at::kBFloat16);
    const at::Tensor ctx = at::randn({1, 6, 128}).to(at::kBFloat16);
    const at::Tensor ts = at::full({1}, 0.5);
    CHECK(at::equal(at_load->forward(x, ts, ctx), converted->forward(x, ts, ctx)));

    // The layout (Note [convert layout]): net. keys, fp8 weights, scales, metadata.
    const auto f = st::File::open(s.path("fp8.safetensors"));
    CHECK(f->find("net.blocks.0.mlp.layer1.weight")->dtype == at::kFloat8_e4m3fn);
    CHECK(f->find("net.t_embedder.1.linear_1.weight")->dtype == at::kBFloat16);  // a declared skip
    CHECK(f->metadata().at("sluice.storage") == "float8_e4m3fn");
    CHECK(f->metadata().at("sluice.compute") == "bfloat16");
    CHECK(f->metadata().at("sluice.scale") == sluice::to_string(mode));
    CHECK(has(f->metadata().at("sluice.skips"), "t_embedder"));
    const auto* scale = f->find("net.blocks.0.mlp.layer1.weight_scale");
    if (mode == sluice::ScaleMode::none) {
      CHECK(scale == nullptr);
      CHECK(f->metadata().count("_quantization_metadata") == 0);
      CHECK(r.scales == 0);
    } else {
      REQUIRE(scale != nullptr);
      CHECK(scale->dtype == at::kFloat);
      CHECK(scale->shape == (mode == sluice::ScaleMode::per_tensor ? std::vector<int64_t>{}
                                                                    : std::vector<int64_t>{1024, 1}));
      const auto q = nlohmann::json::parse(f->metadata().at("_quantization_metadata"));
      CHECK(q.at("format_version") == "1.0");
      CHECK(static_cast<int64_t>(q.at("layers").size()) == r.scales);
      CHECK(q.at("layers").at("net.blocks.0.mlp.layer1").at("format") == "float8_e4m3fn");
      CHECK(q.at("layers").at("net.blocks.0.mlp.layer1").at("full_precision_matrix_mult") == true);
    }
  }
  // Loaded unscaled, a scaled file keeps its scales (more exact than a recast); asked for
  // another scale layout, it is converted from the dequantized values.
  convert_checkpoint(s.path("src.safetensors"), s.path("tensor.safetensors"), fp8(sluice::ScaleMode::per_tensor));
  sluice::offload::StorageReport rep;
  LoadOptions lo = with_storage(fp8(sluice::ScaleMode::none));
  lo.report = &rep;
  AnimaModel plain = load_anima(s.path("tensor.safetensors"), lo);
  CHECK(rep.kept_layers == rep.cast_layers);
  lo = with_storage(fp8(sluice::ScaleMode::per_channel));
  AnimaModel per_row = load_anima(s.path("tensor.safetensors"), lo);
  CHECK(rep.kept_layers == rep.cast_layers);  // (rep belongs to the first load)
  for (const auto& [name, layer] : sluice::offload::managed_layers(*per_row)) {
    if (!sluice::is_fp8(layer->stored_weight().scalar_type())) continue;
    CHECK(layer->weight_scale().dim() == 1);
  }
}

TEST_CASE("checkpoint loader: fused load: casting as read stores the bytes of a cast after a plain load, for any thread count") {
  Scratch s;
  write_random_checkpoint(preset("anima-small"), 5, at::kBFloat16, s.path("src.safetensors"));
  for (const sluice::ScaleMode mode :
       {sluice::ScaleMode::none, sluice::ScaleMode::per_tensor, sluice::ScaleMode::per_channel}) {
    INFO("scale " << sluice::to_string(mode));
    const sluice::Fp8Options o = fp8(mode);
    // The reference: read in bf16, then offload::apply_storage casts each layer (cast_to_storage).
    LoadOptions plain;
    plain.dtype = at::kBFloat16;
    AnimaModel ref = load_anima(s.path("src.safetensors"), plain);
    sluice::offload::apply_storage(*ref, "ref", o, declared_fp8_skips());
    for (const int threads : {1, 3}) {
      INFO("threads " << threads);
      sluice::offload::StorageReport rep;
      LoadOptions lo = with_storage(o);
      lo.threads = threads;
      lo.report = &rep;
      AnimaModel fused = load_anima(s.path("src.safetensors"), lo);
      check_same_storage(ref, fused);
      CHECK(rep.cast_layers > 0);
      CHECK(rep.kept_layers == 0);  // cast as read, not stored as in the file
      CHECK(rep.skipped.size() > 0);
    }
  }
  // load_weights reports what it did.
  AnimaModel m(preset("anima-small"), BuildOptions{at::kBFloat16, at::kCPU});
  const auto f = st::File::open(s.path("src.safetensors"));
  const sluice::Fp8Options o = fp8(sluice::ScaleMode::none);
  WeightReadOptions wo;
  wo.storage = &o;
  wo.threads = 2;
  const WeightReadReport r = load_weights(*m, *f, "net.", wo);
  CHECK(r.threads == 2);
  CHECK(r.fused == static_cast<int64_t>(m->named_parameters().size()));
  CHECK(r.other == 0);
  CHECK(r.cast > 0);
  CHECK(static_cast<int64_t>(r.casts.cast.size()) <= r.cast);  // layers; r.cast counts weights and biases
  CHECK(r.file_bytes > 0);
  CHECK(m->named_parameters()["blocks.0.mlp.layer1.weight"].scalar_type() == at::kFloat8_e4m3fn);
  CHECK(m->named_parameters()["t_embedder.1.linear_1.weight"].scalar_type() == at::kBFloat16);  // a skip
}

TEST_CASE("checkpoint loader: convert: refuses its input as output and a non-fp8 storage, and an fp8 NaN in a file is refused on load") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 4, at::kBFloat16, s.path("src.safetensors"));
  CHECK_THROWS_AS(convert_checkpoint(s.path("src.safetensors"), s.path("src.safetensors"), fp8(sluice::ScaleMode::none)),
                  sluice::InvalidArgument);
  CHECK(::access(s.path("src.safetensors").c_str(), F_OK) == 0);
  sluice::Fp8Options bf16;
  bf16.storage = at::kBFloat16;
  CHECK_THROWS_WITH(convert_checkpoint(s.path("src.safetensors"), s.path("out.safetensors"), bf16),
                    Catch::Contains("not an fp8 dtype"));

  convert_checkpoint(s.path("src.safetensors"), s.path("fp8.safetensors"), fp8(sluice::ScaleMode::none));
  Tensors t = read_all(s.path("fp8.safetensors"));
  at::Tensor& w = find(t, "net.blocks.0.mlp.layer1.weight");
  w.view(at::kByte).view(-1)[5] = 0x7F;  // e4m3fn NaN
  st::save(s.path("nan.safetensors"), t);
  CHECK_THROWS_WITH(load_anima(s.path("nan.safetensors"), with_storage(fp8(sluice::ScaleMode::none))),
                    Catch::Contains("blocks.0.mlp.layer1.weight") && Catch::Contains("NaN"));
}

TEST_CASE("checkpoint loader: load: NaN and Inf weights are refused naming the file and the tensor for every storage and read path") {
  // Issue 29, item 3: fp8 storage refused a NaN weight, bf16 storage (and a load with no
  // storage) kept it. Each file dtype, each storage dtype and each way a tensor is read
  // (cast as read, read as stored, converted to the compute dtype, a skipped layer, a norm).
  Scratch s;
  const AnimaConfig c = preset("anima-tiny");
  for (const auto file_dtype : {at::kBFloat16, at::kFloat}) {
    write_random_checkpoint(c, 5, file_dtype, s.path("ok.safetensors"));
    for (const std::string key : {"net.blocks.0.mlp.layer1.weight", "net.blocks.1.self_attn.q_norm.weight",
                                  "net.t_embedder.1.linear_1.weight", "net.x_embedder.proj.1.weight"}) {
      for (const double bad : {std::nan(""), -static_cast<double>(INFINITY)}) {
        Tensors t = read_all(s.path("ok.safetensors"));
        find(t, key).view({-1}).index_put_({3}, bad);
        const std::string path = s.path("bad.safetensors");
        st::save(path, t);
        std::vector<LoadOptions> options(1);  // no storage: every weight in options.dtype
        options[0].dtype = at::kBFloat16;
        for (const at::ScalarType storage : {at::kFloat8_e4m3fn, at::kFloat8_e5m2, at::kBFloat16, at::kHalf, at::kFloat}) {
          sluice::Fp8Options o;
          o.storage = storage;
          for (const at::ScalarType compute : {at::kBFloat16, at::kFloat}) {
            o.compute = compute;
            options.push_back(with_storage(o));
          }
        }
        for (const LoadOptions& o : options) {
          CAPTURE(file_dtype, key, bad, o.storage ? sluice::dtype_name(o.storage->storage) : "none");
          try {
            load_anima(path, o);
            FAIL("no throw");
          } catch (const sluice::InvalidArgument& e) {
            const std::string what = e.what();
            CHECK(has(what, "'" + path + "'"));
            CHECK(has(what, "'" + key + "'"));
            CHECK(has(what, std::isnan(bad) ? "1 NaN and 0 inf" : "0 NaN and 1 inf"));
          }
        }
      }
    }
  }
  // fp8 files: a NaN byte, read as stored or upcast into bf16/fp32 storage.
  write_random_checkpoint(c, 5, at::kBFloat16, s.path("ok.safetensors"));
  convert_checkpoint(s.path("ok.safetensors"), s.path("fp8.safetensors"), fp8(sluice::ScaleMode::none));
  Tensors t = read_all(s.path("fp8.safetensors"));
  find(t, "net.blocks.1.mlp.layer2.weight").view(at::kByte).view({-1}).index_put_({9}, 0xFF);  // e4m3fn -NaN
  st::save(s.path("nan8.safetensors"), t);
  for (const at::ScalarType storage : {at::kFloat8_e4m3fn, at::kBFloat16, at::kFloat}) {
    sluice::Fp8Options o;
    o.storage = storage;
    CAPTURE(storage);
    CHECK_THROWS_WITH(load_anima(s.path("nan8.safetensors"), with_storage(o)),
                      Catch::Contains("'" + s.path("nan8.safetensors") + "'") &&
                          Catch::Contains("'net.blocks.1.mlp.layer2.weight'") && Catch::Contains("1 NaN"));
  }
}

TEST_CASE("checkpoint loader: load: an integer or bool tensor where a weight belongs is a CheckpointError naming its dtype") {
  Scratch s;
  write_random_checkpoint(preset("anima-tiny"), 5, at::kBFloat16, s.path("ok.safetensors"));
  for (const at::ScalarType dtype : {at::kChar, at::kByte, at::kInt, at::kBool}) {
    Tensors t = read_all(s.path("ok.safetensors"));
    at::Tensor& w = find(t, "net.blocks.0.mlp.layer1.weight");
    w = at::ones_like(w, dtype);
    st::save(s.path("int.safetensors"), t);
    CAPTURE(dtype);
    for (const bool storage : {false, true}) {
      const std::string what = load_error(s.path("int.safetensors"), storage ? with_storage(fp8(sluice::ScaleMode::none))
                                                                             : LoadOptions{});
      CHECK(has(what, "'" + s.path("int.safetensors") + "'"));
      CHECK(has(what, "'net.blocks.0.mlp.layer1.weight'"));
      CHECK(has(what, "has dtype " + sluice::dtype_name(dtype)));
      CHECK(has(what, "expected a floating-point dtype"));
    }
  }
}
