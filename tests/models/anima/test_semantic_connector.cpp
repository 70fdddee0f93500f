// Anima-3.8B v1.1's semantic connector (models/anima/semantic_connector.h): its module tree
// against the real checkpoint's key count, shapes, the invariants its math promises (a fully
// masked row contributes nothing, padding is ignored, the output follows the timestep), its
// layers managed like the adapter's (fp8 storage, streaming), metadata and input refusals,
// and checkpoints that carry it.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>
#include <vector>

#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"
#include "models/anima/semantic_connector.h"
#include "offload/engine/engine.h"
#include "offload/layer/layer.h"
#include "offload/layer/storage.h"
#include "runtime/error.h"
#include "runtime/fp8.h"
#include "runtime/logging.h"
#include "runtime/safetensors.h"
#include "tests/support/temp_dir.h"
#include "tests/support/device_env.h"
#include "tests/support/engine_options.h"

using namespace sluice;
using namespace sluice::anima;

namespace {

// anima-tiny (adapter 32 wide, 4 heads, 2 blocks) with a small connector reading 24-wide layers.
AnimaConfig connector_config() {
  AnimaConfig c = preset("anima-tiny");
  c.name = "anima-tiny-connector";
  c.connector.enabled = true;
  c.connector.num_queries = 8;
  c.connector.resampler_blocks = 2;
  c.connector.resampler_dim = 32;
  c.connector.resampler_heads = 4;
  c.connector.mlp_hidden_dim = 48;
  c.connector.source_dim = 24;
  return c;
}

AnimaModel random_model(const AnimaConfig& config, uint64_t seed = 1, at::ScalarType dtype = at::kFloat) {
  AnimaModel model(config, BuildOptions{dtype, at::kCPU});
  auto params = model->named_parameters();
  const auto weights = random_weights(config, seed, dtype);
  REQUIRE(weights.size() == params.size());
  for (const auto& [name, t] : weights) params[name].set_data(t);
  return model;
}

struct Text {
  at::Tensor qwen, ids;
  ConnectorInputs semantic;
};

// B rows: Qwen3 states of 7 tokens, 5 T5 ids, four Qwen3.5 layers of S' tokens, all valid, at t.
Text text(int64_t B = 2, int64_t S = 6, double t = 0.4, at::ScalarType dtype = at::kFloat, uint64_t seed = 9) {
  at::manual_seed(static_cast<int64_t>(seed));
  Text x;
  x.qwen = at::randn({B, 7, 32}).to(dtype);
  x.ids = at::randint(0, 128, {B, 5}, at::kLong);
  for (int l = 0; l < 4; ++l) x.semantic.hidden.push_back(at::randn({B, S, 24}).to(dtype));
  x.semantic.mask = at::ones({B, S}, at::kBool);
  x.semantic.timesteps = at::full({B}, t);
  return x;
}

at::Tensor encode(AnimaModelImpl& m, const Text& x, c10::Device d = c10::kCPU) {
  ConnectorInputs in = x.semantic;
  for (auto& h : in.hidden) h = h.to(d);
  if (in.mask.defined()) in.mask = in.mask.to(d);
  in.timesteps = in.timesteps.to(d);
  return m.encode_text(x.qwen.to(d), x.ids.to(d), std::nullopt, &in).cpu();
}

std::string invalid_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument>";
}

std::string checkpoint_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const CheckpointError& e) {
    return e.what();
  }
  return "<no CheckpointError>";
}

using sluice::testing::TempDir;  // tests/support/temp_dir.h

}  // namespace

TEST_CASE("semantic connector: the real model's connector has the checkpoint's 190 tensors under anima_v2_connector",
          "[strict]") {
  AnimaConfig c;  // anima-2b's adapter (1024 wide, 16 heads, 6 blocks) with the default connector
  c.connector.enabled = true;
  AnimaModel m(c, BuildOptions{at::kFloat, at::kMeta});
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : m->named_parameters()) {
    if (p.key().rfind("anima_v2_connector.", 0) == 0) shapes[p.key()] = p.value().sizes().vec();
  }
  CHECK(shapes.size() == 190);
  const std::string r = "anima_v2_connector.semantic_resampler.";
  CHECK(shapes.at(r + "query_tokens") == std::vector<int64_t>{1, 64, 2048});
  CHECK(shapes.at(r + "layer_embeddings") == std::vector<int64_t>{4, 1, 2560});
  CHECK(shapes.at(r + "time_mlp.0.weight") == std::vector<int64_t>{2048, 2048});
  CHECK(shapes.at(r + "time_mlp.2.bias") == std::vector<int64_t>{2048});
  CHECK(shapes.at(r + "blocks.5.cross_attention.k_proj.weight") == std::vector<int64_t>{2048, 2560});
  CHECK(shapes.at(r + "blocks.5.source_norm.bias") == std::vector<int64_t>{2560});
  CHECK(shapes.at(r + "blocks.0.mlp_in.weight") == std::vector<int64_t>{2 * 5632, 2048});
  CHECK(shapes.at(r + "blocks.0.mlp_out.weight") == std::vector<int64_t>{2048, 5632});
  CHECK(shapes.at(r + "blocks.0.time_modulation.weight") == std::vector<int64_t>{6 * 2048, 2048});
  CHECK(shapes.at(r + "output_norm.weight") == std::vector<int64_t>{2048});
  CHECK(shapes.at(r + "output_projection.weight") == std::vector<int64_t>{1024, 2048});
  const std::string q = "anima_v2_connector.quality_anchor.";
  CHECK(shapes.at(q + "layer_mix_logits") == std::vector<int64_t>{6, 4});
  CHECK(shapes.at(q + "source_norms.5.weight") == std::vector<int64_t>{2560});
  CHECK(shapes.at(q + "semantic_attentions.0.k_proj.weight") == std::vector<int64_t>{1024, 2560});
  CHECK(shapes.at(q + "semantic_attentions.0.q_norm.weight") == std::vector<int64_t>{64});
  CHECK(shapes.at("anima_v2_connector.v2_attentions.5.v_proj.weight") == std::vector<int64_t>{1024, 1024});
  CHECK(shapes.at("anima_v2_connector.v2_semantic_norms.0.weight") == std::vector<int64_t>{1024});
  // Every Linear of the connector is a managed layer.
  int64_t linears = 0;
  for (const auto& [name, layer] : offload::managed_layers(*m)) {
    if (name.rfind("anima_v2_connector.", 0) == 0) ++linears;
  }
  // Resampler blocks: 8 attention projections, mlp_in/out, time_modulation; then time_mlp's two and
  // output_projection; the anchor's and the v2 attentions: 4 projections each per adapter block.
  CHECK(linears == 6 * 11 + 3 + 6 * 4 * 2);
}

TEST_CASE("semantic connector: output and bank shapes, padded like the native adapter", "[strict]") {
  AnimaModel m = random_model(connector_config());
  const Text x = text();
  const at::Tensor out = encode(*m, x);
  CHECK(out.sizes().vec() == std::vector<int64_t>{2, 24, 32});
  CHECK(at::isfinite(out).all().item<bool>());
  CHECK(out.narrow(1, 5, 19).abs().max().item<float>() == 0.0f);
  // The connector changes the context: it differs from the native adapter's alone.
  const at::Tensor native = m->encode_text(x.qwen, x.ids);
  CHECK_FALSE(at::allclose(out, native, 1e-3, 1e-3));
  auto& connector = dynamic_cast<SemanticConnectorImpl&>(*m->named_children()["anima_v2_connector"]);
  const ConnectorInputs in = check_connector_inputs(x.semantic, connector.config(), 2, at::kFloat, at::kCPU);
  CHECK(connector.bank(in).sizes().vec() == std::vector<int64_t>{2, 8, 32});
  // One stacked [layers, B, S', width] tensor is the same input as four.
  ConnectorInputs stacked = x.semantic;
  stacked.hidden = {at::stack(x.semantic.hidden)};
  CHECK(at::equal(m->encode_text(x.qwen, x.ids, std::nullopt, &stacked), out));
}

TEST_CASE("semantic connector: a fully masked row's Qwen3.5 states contribute nothing, and its row stays finite",
          "[strict]") {
  AnimaModel m = random_model(connector_config());
  Text x = text();
  x.semantic.mask[1].fill_(false);
  const at::Tensor out = encode(*m, x);
  CHECK(at::isfinite(out).all().item<bool>());
  // Other values in the masked row: the same output, bit for bit, in both rows.
  Text y = x;
  y.semantic.hidden.clear();
  for (const auto& h : x.semantic.hidden) {
    at::Tensor g = h.clone();
    g[1].normal_(0.0, 3.0);
    y.semantic.hidden.push_back(g);
  }
  const at::Tensor other = encode(*m, y);
  CHECK(at::equal(other, out));
  // The row itself is not the native adapter's: the bank (learned queries at this timestep)
  // still enters through the v2 attentions; the Qwen3.5 states do not.
  CHECK_FALSE(at::allclose(out[1], m->encode_text(x.qwen, x.ids)[1], 1e-3, 1e-3));
  // Row 0 is unaffected by row 1's mask.
  Text all_valid = x;
  all_valid.semantic.mask = at::ones({2, 6}, at::kBool);
  CHECK(at::allclose(encode(*m, all_valid)[0], out[0], 1e-5, 1e-6));
}

TEST_CASE("semantic connector: masked padding tokens are ignored (equal to the unpadded sequence)", "[strict]") {
  AnimaModel m = random_model(connector_config());
  Text padded = text(1, 6);
  padded.semantic.mask.narrow(1, 4, 2).fill_(false);
  Text cut = padded;
  cut.semantic.hidden.clear();
  for (const auto& h : padded.semantic.hidden) cut.semantic.hidden.push_back(h.narrow(1, 0, 4).contiguous());
  cut.semantic.mask = at::ones({1, 4}, at::kBool);
  const at::Tensor a = encode(*m, padded), b = encode(*m, cut);
  CHECK(at::allclose(a, b, 1e-5, 1e-6));
  // Without a mask every token counts: the padding then changes the output.
  Text unmasked = padded;
  unmasked.semantic.mask = at::Tensor();
  CHECK_FALSE(at::allclose(encode(*m, unmasked), b, 1e-4, 1e-4));
}

TEST_CASE("semantic connector: the context follows the timestep: equal t equal output, different t different",
          "[strict]") {
  AnimaModel m = random_model(connector_config());
  const at::Tensor a = encode(*m, text(2, 6, 0.3));
  CHECK(at::equal(encode(*m, text(2, 6, 0.3)), a));
  const at::Tensor b = encode(*m, text(2, 6, 0.7));
  CHECK_FALSE(at::allclose(a, b, 1e-4, 1e-4));
  // Per row: a batch at t = [0.3, 0.7] is the two single-t batches' rows.
  Text mixed = text(2, 6, 0.3);
  mixed.semantic.timesteps = at::tensor({0.3, 0.7});
  const at::Tensor c = encode(*m, mixed);
  CHECK(at::allclose(c[0], a[0], 1e-5, 1e-6));
  CHECK(at::allclose(c[1], b[1], 1e-5, 1e-6));
}

TEST_CASE("semantic connector: timestep embedding is [cos | sin] of t * 1000 * exp(-ln(1e4) k / half)", "[strict]") {
  const at::Tensor e = connector_timestep_embedding(at::tensor({0.25f, 1.0f}), 6);
  REQUIRE(e.sizes().vec() == std::vector<int64_t>{2, 6});
  for (int b = 0; b < 2; ++b) {
    const double t = b == 0 ? 0.25 : 1.0;
    for (int k = 0; k < 3; ++k) {
      const double angle = t * 1000.0 * std::exp(-std::log(10000.0) * k / 3.0);
      CHECK(e[b][k].item<double>() == Approx(std::cos(angle)).margin(2e-4));
      CHECK(e[b][k + 3].item<double>() == Approx(std::sin(angle)).margin(2e-4));
    }
  }
  const at::Tensor odd = connector_timestep_embedding(at::tensor({0.5f}), 7);
  CHECK(odd.sizes().vec() == std::vector<int64_t>{1, 7});
  CHECK(odd[0][6].item<float>() == 0.0f);
}

TEST_CASE("semantic connector: without Qwen3.5 inputs the native adapter runs alone, said once per model",
          "[strict]") {
  AnimaModel m = random_model(connector_config());
  AnimaConfig plain_config = connector_config();
  plain_config.connector.enabled = false;
  AnimaModel plain = random_model(plain_config);
  // The same seed draws the same adapter weights whether or not a connector follows them.
  for (const auto& p : plain->named_parameters()) {
    plain->named_parameters()[p.key()].set_data(m->named_parameters()[p.key()].clone());
  }
  const Text x = text();
  std::vector<std::string> lines;
  // The line is INFO; ctest runs at SLUICE_LOG_LEVEL=warn, so the level is raised for the capture.
  const log::Level before = log::level();
  log::set_level(log::Level::info);
  log::set_sink([&](log::Level, const std::string& line) { lines.push_back(line); });
  at::Tensor a, b;
  try {
    a = m->encode_text(x.qwen, x.ids);
    b = m->encode_text(x.qwen, x.ids);
  } catch (...) {
    log::set_sink({});
    log::set_level(before);
    throw;
  }
  log::set_sink({});
  log::set_level(before);
  CHECK(at::equal(a, plain->encode_text(x.qwen, x.ids)));
  CHECK(at::equal(a, b));
  int said = 0;
  for (const auto& l : lines) said += l.find("semantic connector is skipped") != std::string::npos;
  CHECK(said == 1);
}

TEST_CASE("semantic connector: bad inputs are refused with one line naming them", "[strict]") {
  AnimaModel m = random_model(connector_config());
  const Text x = text();
  auto run = [&](const ConnectorInputs& in) { return invalid_of([&] { m->encode_text(x.qwen, x.ids, std::nullopt, &in); }); };
  ConnectorInputs three = x.semantic;
  three.hidden.pop_back();
  CHECK(run(three) == "semantic connector: got 3 Qwen3.5 hidden-state layers, the connector reads 4");
  ConnectorInputs wide = x.semantic;
  wide.hidden[2] = at::randn({2, 6, 25});
  CHECK(run(wide) == "semantic connector: Qwen3.5 hidden layer 2 has width 25, the connector reads 24");
  ConnectorInputs longer = x.semantic;
  longer.hidden[1] = at::randn({2, 7, 24});
  CHECK(run(longer).find("Qwen3.5 hidden layer 1 has shape [2, 7, 24]") != std::string::npos);
  ConnectorInputs mask = x.semantic;
  mask.mask = at::ones({2, 5}, at::kBool);
  CHECK(run(mask) == "semantic connector: qwen35_mask has shape [2, 5], expected [2, 6] like the hidden states");
  ConnectorInputs no_t = x.semantic;
  no_t.timesteps = at::Tensor();
  CHECK(run(no_t).find("the timestep is missing") != std::string::npos);
  ConnectorInputs bad_t = x.semantic;
  bad_t.timesteps = at::full({3}, 0.5);
  CHECK(run(bad_t).find("timesteps has shape [3]") != std::string::npos);
  ConnectorInputs none = x.semantic;
  none.hidden.clear();
  CHECK(run(none).find("hidden states are missing") != std::string::npos);
  // A model without a connector refuses its inputs.
  AnimaModel tiny = random_model(preset("anima-tiny"));
  at::manual_seed(1);
  const at::Tensor q = at::randn({2, 7, 32});
  CHECK(invalid_of([&] { tiny->encode_text(q, x.ids, std::nullopt, &x.semantic); }) ==
        "model 'anima-tiny' has no semantic connector (no anima_v2_connector.* weights); its Qwen3.5 inputs cannot "
        "be used");
  // A numeric mask counts non-zero as valid.
  ConnectorInputs numeric = x.semantic;
  numeric.mask = at::ones({2, 6}, at::kFloat);
  CHECK(at::equal(m->encode_text(x.qwen, x.ids, std::nullopt, &numeric), encode(*m, x)));
}

TEST_CASE("semantic connector: its layers are managed: fp8 storage, and streamed under a small budget equals resident",
          "[strict][accel]") {
  const AnimaConfig c = connector_config();
  AnimaModel m = random_model(c, 3, at::kBFloat16);
  Fp8Options o8;
  o8.storage = at::kFloat8_e4m3fn;
  o8.compute = at::kBFloat16;
  offload::apply_storage(*m, c.name, o8, declared_fp8_skips());
  const Text x = text(2, 6, 0.4, at::kBFloat16);
  const at::Tensor plain = encode(*m, x);
  CHECK(at::isfinite(plain.to(at::kFloat)).all().item<bool>());
  int64_t connector_layers = 0;
  for (const auto& [name, layer] : offload::managed_layers(*m)) {
    if (name.rfind("anima_v2_connector.", 0) != 0) continue;
    ++connector_layers;
    INFO(name);
    CHECK(layer->stored_weight().scalar_type() == at::kFloat8_e4m3fn);
  }
  CHECK(connector_layers == 2 * 11 + 3 + 2 * 4 * 2);

  auto dev = sluice::testing::test_device_or_cpu();
  const offload::EngineOptions o = sluice::testing::engine_options(dev);
  const offload::WeightNeeds n = offload::StreamingEngine::needs(*m, o);
  const auto run = [&](offload::StreamingEngine& engine) {
    offload::ForwardScope scope(engine, "adapter");
    return encode(*m, x, dev->device());
  };
  at::Tensor resident;
  {
    offload::StreamingEngine engine(o);
    engine.attach(*m, "connector", n.full + o.working_memory_bytes);
    REQUIRE(engine.plan().streamed_count() == 0);
    resident = run(engine);
    engine.detach();
  }
  offload::StreamingEngine engine(o);
  engine.attach(*m, "connector", n.minimum + o.working_memory_bytes);
  size_t streamed_connector = 0;
  const auto& plan = engine.plan();
  for (size_t i = 0; i < plan.layers.size(); ++i) {
    if (!plan.resident[i] && plan.layers[i].name.rfind("anima_v2_connector.", 0) == 0) ++streamed_connector;
  }
  CHECK(streamed_connector > 0);
  for (int f = 0; f < 2; ++f) CHECK(at::equal(run(engine), resident));
  engine.detach();
  CHECK(at::allclose(resident.to(at::kFloat), plain.to(at::kFloat), 2e-2, 2e-2));
}

TEST_CASE("semantic connector: metadata gives the hyper-parameters with defaults, an unknown architecture is refused",
          "[strict]") {
  const ConnectorConfig d = connector_config_from_metadata({}, ConnectorConfig{}, "f.safetensors");
  CHECK(d.enabled);
  CHECK(d.num_queries == 64);
  CHECK(d.resampler_blocks == 6);
  CHECK(d.resampler_dim == 2048);
  CHECK(d.resampler_heads == 16);
  CHECK(d.mlp_hidden_dim == 5632);
  CHECK(d.layer_indices == std::vector<int64_t>{7, 15, 23, 31});
  const std::map<std::string, std::string> meta = {
      {"anima_v2_adapter_architecture", kConnectorArchitecture},
      {"anima_v2_adapter_semantic_query_tokens", "32"},
      {"anima_v2_adapter_semantic_resampler_blocks", "3"},
      {"anima_v2_adapter_semantic_resampler_dim", "512"},
      {"anima_v2_adapter_semantic_resampler_heads", "8"},
      {"anima_v2_adapter_semantic_resampler_mlp_hidden_dim", "1024"},
      {"anima_v2_adapter_layer_indices", "[3, 9,12]"}};
  const ConnectorConfig c = connector_config_from_metadata(meta, ConnectorConfig{}, "f.safetensors");
  CHECK(c.num_queries == 32);
  CHECK(c.resampler_blocks == 3);
  CHECK(c.resampler_dim == 512);
  CHECK(c.resampler_heads == 8);
  CHECK(c.mlp_hidden_dim == 1024);
  CHECK(c.layer_indices == std::vector<int64_t>{3, 9, 12});
  // What make-checkpoint writes reads back as the same config.
  ConnectorConfig back = connector_config_from_metadata(connector_metadata(c), ConnectorConfig{}, "g");
  CHECK(back.layer_indices == c.layer_indices);
  CHECK(back.mlp_hidden_dim == c.mlp_hidden_dim);

  CHECK(checkpoint_error_of([] {
          connector_config_from_metadata({{"anima_v2_adapter_architecture", "anima_semantic_connector_v9"}},
                                         ConnectorConfig{}, "f.safetensors");
        }) == "checkpoint 'f.safetensors': unknown semantic connector architecture 'anima_semantic_connector_v9' "
              "(anima_v2_adapter_architecture; sluice runs anima_qwen35_quality_anchored_semantic_connector_v2)");
  CHECK(checkpoint_error_of([] {
          connector_config_from_metadata({{"anima_v2_adapter_semantic_resampler_dim", "wide"}}, ConnectorConfig{},
                                         "f.safetensors");
        }) == "checkpoint 'f.safetensors': metadata anima_v2_adapter_semantic_resampler_dim = 'wide' is not a "
              "positive integer");
  CHECK(checkpoint_error_of([] {
          connector_config_from_metadata({{"anima_v2_adapter_layer_indices", "[7, x]"}}, ConnectorConfig{}, "f");
        }).find("is not a list of layer indices") != std::string::npos);
}

TEST_CASE("semantic connector: a generated checkpoint carries it under net.anima_v2_connector with its metadata, and loads",
          "[strict]") {
  TempDir dir;
  const AnimaConfig c = connector_config();
  const std::string path = dir / "connector.safetensors";
  write_random_checkpoint(c, 5, at::kFloat, path);
  const auto file = safetensors::File::open(path);
  CHECK(file->metadata().at("anima_v2_adapter_architecture") == kConnectorArchitecture);
  CHECK(file->metadata().at("anima_v2_adapter_semantic_query_tokens") == "8");
  CHECK(file->metadata().at("anima_v2_adapter_layer_indices") == "[7, 15, 23, 31]");
  CHECK(file->find("net.anima_v2_connector.quality_anchor.layer_mix_logits") != nullptr);
  const CheckpointProbe probe = probe_checkpoint(*file);
  CHECK(probe.inferred.connector.enabled);
  CHECK(probe.inferred.connector.source_dim == 24);
  CHECK(probe.inferred.connector.resampler_dim == 32);

  AnimaModel loaded = load_anima(path);
  REQUIRE(loaded->has_connector());
  AnimaModel generated = random_model(c, 5);
  const Text x = text();
  CHECK(at::equal(encode(*loaded, x), encode(*generated, x)));

  // The hyper-parameters come from the anima_v2_adapter_* metadata, not from sluice's own
  // config: without sluice.config the file still loads, with the defaults for what is absent.
  auto tensors = random_weights(c, 5, at::kFloat);
  for (auto& [name, t] : tensors) name = "net." + name;
  std::map<std::string, std::string> meta = connector_metadata(c.connector);
  meta["sluice.config"] = config_to_json(c).dump();
  meta["anima_v2_adapter_architecture"] = "anima_semantic_connector_v9";
  const std::string unknown = dir / "unknown.safetensors";
  safetensors::save(unknown, tensors, meta);
  CHECK(checkpoint_error_of([&] { load_anima(unknown); }) ==
        "checkpoint '" + unknown +
            "': unknown semantic connector architecture 'anima_semantic_connector_v9' (anima_v2_adapter_architecture; "
            "sluice runs anima_qwen35_quality_anchored_semantic_connector_v2)");
  // Metadata that disagrees with the tensors: the strict check names the keys.
  meta = connector_metadata(c.connector);
  meta["sluice.config"] = config_to_json(c).dump();
  meta["anima_v2_adapter_semantic_query_tokens"] = "16";
  const std::string wrong = dir / "wrong.safetensors";
  safetensors::save(wrong, tensors, meta);
  const std::string error = checkpoint_error_of([&] { load_anima(wrong); });
  CHECK(error.find("net.anima_v2_connector.semantic_resampler.query_tokens file [1, 8, 32] vs model [1, 16, 32]") !=
        std::string::npos);
}
