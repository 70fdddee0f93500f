// The fp8 report (models/anima/fp8_report.h) on generated tiny checkpoints: grouping,
// flush/round-trip statistics against planted values, candidate sizes against an
// independent count, the forward comparison and the JSON shape.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <unistd.h>

#include "models/anima/anima.h"
#include "models/anima/fp8_report.h"
#include "models/anima/generator.h"
#include "offload/layer/layer.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tests/support/temp_dir.h"

using namespace sluice;
using namespace sluice::anima;

namespace {

using sluice::testing::TempDir;  // tests/support/temp_dir.h

// A tiny bf16 checkpoint whose t_embedder weights are all below e4m3fn's flush threshold
// (2^-10) but far from zero relative to each other, so an unscaled cast zeroes them and a
// per-row scaled cast keeps them.
// With `saturating`, t_embedder.1.linear_1 is instead far beyond +-448 (|w| in [600, 1500]),
// so the unscaled cast clips it to +-448 and the t_embedder path dominates the forward.
std::string planted_checkpoint(const TempDir& tmp, bool saturating = false) {
  const AnimaConfig c = preset("anima-tiny");
  auto w = random_weights(c, 4, at::kBFloat16);
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::manual_seed(1);
  for (auto& [name, t] : w) {
    if (!saturating && name.rfind("t_embedder.", 0) == 0) {
      t = (at::rand(t.sizes()) * 4e-4 + 1e-4).to(at::kBFloat16);  // in [1e-4, 5e-4]
    }
    if (saturating && name == "t_embedder.1.linear_1.weight") {
      t = ((at::rand(t.sizes()) * 900 + 600) * at::sign(at::randn(t.sizes()))).to(at::kBFloat16);
    }
    out.emplace_back("net." + name, t);
  }
  const std::string path = tmp / (saturating ? "saturating.safetensors" : "planted.safetensors");
  safetensors::save(path, out, {{kMetaConfig, config_to_json(c).dump()}});
  return path;
}

const Fp8GroupStats& group(const Fp8Report& r, const std::string& g) {
  for (const auto& s : r.groups) {
    if (s.group == g) return s;
  }
  FAIL("no group " << g);
  throw;
}

}  // namespace

TEST_CASE("fp8 report: groups follow the module tree") {
  CHECK(fp8_report_group("t_embedder.1.linear_1") == "t_embedder");
  CHECK(fp8_report_group("x_embedder.proj.1") == "x_embedder");
  CHECK(fp8_report_group("final_layer.adaln_modulation.1") == "final_layer");
  CHECK(fp8_report_group("blocks.3.adaln_modulation_cross_attn.2") == "adaln_modulation");
  CHECK(fp8_report_group("blocks.3.self_attn.q_proj") == "self_attn");
  CHECK(fp8_report_group("blocks.3.cross_attn.k_proj") == "cross_attn");
  CHECK(fp8_report_group("blocks.3.mlp.layer2") == "mlp");
  CHECK(fp8_report_group("llm_adapter.blocks.0.self_attn.q_proj") == "llm_adapter");
  CHECK(fp8_report_group("llm_adapter.embed") == "llm_adapter");
  CHECK(fp8_report_group("text_embedder.linear") == "other");
}

TEST_CASE("fp8 report: statistics against planted values, sizes against an independent count") {
  TempDir tmp;
  const std::string path = planted_checkpoint(tmp);
  const Fp8Report r = fp8_report(path);
  REQUIRE(r.groups.size() == 8);  // every group but "other"

  // Element counts: every Linear/Embedding parameter, per group.
  AnimaModel m(preset("anima-tiny"), BuildOptions{at::kBFloat16, at::kMeta});
  std::map<std::string, int64_t> want;
  for (const auto& [name, layer] : offload::managed_layers(*m)) {
    want[fp8_report_group(name)] += layer->stored_weight().numel() + (layer->has_bias() ? layer->stored_bias().numel() : 0);
  }
  for (const auto& g : r.groups) {
    INFO(g.group);
    CHECK(g.parameters == want.at(g.group));
    CHECK(g.flush_fraction >= 0.0);
    CHECK(g.flush_fraction <= 1.0);
    CHECK(g.scaled_flush_fraction >= 0.0);
    CHECK(g.scaled_flush_fraction <= 1.0);
    CHECK(std::isfinite(g.roundtrip_rel_error));
    CHECK(std::isfinite(g.scaled_roundtrip_rel_error));
  }
  // Planted: t_embedder flushes completely unscaled (error 1), not at all when scaled.
  const auto& t = group(r, "t_embedder");
  CHECK(t.flush_fraction == 1.0);
  CHECK(t.roundtrip_rel_error == Approx(1.0));
  CHECK(t.scaled_flush_fraction == 0.0);
  CHECK(t.scaled_roundtrip_rel_error < 0.1);
  // Ordinary random weights: e4m3's 3 mantissa bits give a few percent error.
  for (const char* g : {"self_attn", "cross_attn", "mlp", "adaln_modulation"}) {
    INFO(g);
    CHECK(group(r, g).roundtrip_rel_error > 0.005);
    CHECK(group(r, g).roundtrip_rel_error < 0.1);
    CHECK(group(r, g).flush_fraction < 0.2);
  }

  // Candidate sizes: counted here from the module names (cast = 1 byte, else 2).
  REQUIRE(r.candidates.size() == 4);
  CHECK(r.candidates[0].name == "none");
  CHECK(r.candidates[2].name == "declared");
  auto size_mib = [&](const std::function<bool(const std::string&)>& skip) {
    int64_t bytes = 0;
    std::map<std::string, bool> cast;
    for (const auto& [name, layer] : offload::managed_layers(*m)) {
      cast[name + ".weight"] = !skip(name);
      cast[name + ".bias"] = !skip(name);
    }
    for (const auto& p : m->named_parameters()) bytes += p.value().numel() * (cast.count(p.key()) && cast[p.key()] ? 1 : 2);
    return std::round(bytes / 1048576.0 * 10.0) / 10.0;
  };
  auto starts = [](const std::string& n, const char* p) { return n.rfind(p, 0) == 0; };
  const double none = size_mib([](const std::string&) { return false; });
  const double t_only = size_mib([&](const std::string& n) { return starts(n, "t_embedder"); });
  const double declared = size_mib([&](const std::string& n) {
    return starts(n, "t_embedder") || starts(n, "x_embedder") || starts(n, "final_layer");
  });
  const double plus = size_mib([&](const std::string& n) {
    return starts(n, "t_embedder") || starts(n, "x_embedder") || starts(n, "final_layer") ||
           n.find("adaln_modulation") != std::string::npos;
  });
  CHECK(std::round(r.candidates[0].param_size_mib * 10) / 10 == none);
  CHECK(std::round(r.candidates[1].param_size_mib * 10) / 10 == t_only);
  CHECK(std::round(r.candidates[2].param_size_mib * 10) / 10 == declared);
  CHECK(std::round(r.candidates[3].param_size_mib * 10) / 10 == plus);
  CHECK(r.candidates[0].param_size_mib < r.candidates[1].param_size_mib);
  CHECK(r.candidates[1].param_size_mib < r.candidates[2].param_size_mib);
  CHECK(r.candidates[2].param_size_mib < r.candidates[3].param_size_mib);
  CHECK(r.candidates[0].skipped_modules == 0);
  CHECK(r.candidates[2].skipped_modules == 6);
  for (const auto& c : r.candidates) CHECK_FALSE(c.velocity_rel_l2.has_value());

  // Chunking does not change the result (counts exactly, sums up to rounding).
  Fp8ReportOptions small;
  small.chunk_elements = 7;
  const Fp8Report r7 = fp8_report(path, small);
  for (size_t i = 0; i < r.groups.size(); ++i) {
    INFO(r.groups[i].group);
    CHECK(r7.groups[i].flush_fraction == r.groups[i].flush_fraction);
    CHECK(r7.groups[i].scaled_flush_fraction == r.groups[i].scaled_flush_fraction);
    CHECK(r7.groups[i].roundtrip_rel_error == Approx(r.groups[i].roundtrip_rel_error).epsilon(1e-9));
    CHECK(r7.groups[i].scaled_roundtrip_rel_error == Approx(r.groups[i].scaled_roundtrip_rel_error).epsilon(1e-9));
  }

  // e5m2 has 2 mantissa bits: larger round-trip error on ordinary weights.
  Fp8ReportOptions e5;
  e5.storage = at::kFloat8_e5m2;
  const Fp8Report r5 = fp8_report(path, e5);
  CHECK(group(r5, "mlp").roundtrip_rel_error > 1.5 * group(r, "mlp").roundtrip_rel_error);
}

TEST_CASE("fp8 report: --forward gives one velocity error per candidate, planted t_embedder dominates") {
  TempDir tmp;
  const std::string path = planted_checkpoint(tmp, /*saturating=*/true);
  Fp8ReportOptions o;
  o.forward = true;
  const Fp8Report r = fp8_report(path, o);
  REQUIRE(r.forward);
  for (const auto& c : r.candidates) {
    INFO(c.name);
    REQUIRE(c.velocity_rel_l2.has_value());
    CHECK(std::isfinite(*c.velocity_rel_l2));
    CHECK(*c.velocity_rel_l2 >= 0.0);
  }
  // With t_embedder clipped to +-448, keeping it in bf16 must help a lot.
  CHECK(*r.candidates[0].velocity_rel_l2 > 2 * *r.candidates[1].velocity_rel_l2);
  CHECK(*r.candidates[1].velocity_rel_l2 > 0.0);
  CHECK(group(r, "t_embedder").roundtrip_rel_error > 0.2);
  // Deterministic for a seed.
  CHECK(*fp8_report(path, o).candidates[2].velocity_rel_l2 == *r.candidates[2].velocity_rel_l2);

  const nlohmann::json j = fp8_report_to_json(r);
  CHECK(j.at("storage") == "float8_e4m3fn");
  CHECK(j.at("groups").size() == 8);
  for (const auto& g : j.at("groups")) {
    for (const char* f : {"group", "parameters", "flush_fraction", "roundtrip_rel_error", "scaled_flush_fraction",
                          "scaled_roundtrip_rel_error"}) {
      CHECK(g.contains(f));
    }
  }
  REQUIRE(j.at("candidates").size() == 4);
  CHECK(j.at("candidates")[3].at("name") == "declared+adaln_modulation");
  CHECK(j.at("candidates")[3].at("velocity_rel_l2").is_number());
  CHECK(j.at("forward").at("latent_size") == 16);
  CHECK(fp8_report_to_text(r).find("declared+adaln_modulation") != std::string::npos);
}

TEST_CASE("fp8 report: refuses non-fp8 storage and non-Anima files") {
  TempDir tmp;
  Fp8ReportOptions o;
  o.storage = at::kBFloat16;
  CHECK_THROWS_AS(fp8_report(tmp / "x.safetensors", o), InvalidArgument);
  safetensors::save(tmp / "other.safetensors", {{"foo.weight", at::zeros({2})}});
  CHECK_THROWS_AS(fp8_report(tmp / "other.safetensors"), CheckpointError);
  CHECK_THROWS_AS(fp8_report(tmp / "missing.safetensors"), FileError);
}
