#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "runtime/skip_patterns.h"

using sluice::SkipList;

namespace {

// One parameter tensor of anima-2b, as the published checkpoint's module tree has it.
struct Param {
  std::string module;
  int64_t numel;
  bool castable;  // belongs to a Linear/Embedding (else an RMSNorm weight, never cast)
};

std::vector<Param> anima_2b_params() {
  std::vector<Param> p;
  auto linear = [&](const std::string& m, int64_t out, int64_t in, bool bias = false) {
    p.push_back({m, out * in, true});
    if (bias) p.push_back({m, out, true});
  };
  auto norm = [&](const std::string& m, int64_t d) { p.push_back({m, d, false}); };
  linear("x_embedder.proj.1", 2048, 68);
  linear("t_embedder.1.linear_1", 2048, 2048);
  linear("t_embedder.1.linear_2", 6144, 2048);
  norm("t_embedding_norm", 2048);
  for (int b = 0; b < 28; ++b) {
    const std::string pre = "blocks." + std::to_string(b) + ".";
    for (const char* x : {"q", "k", "v", "output"}) linear(pre + "self_attn." + x + "_proj", 2048, 2048);
    norm(pre + "self_attn.q_norm", 128);
    norm(pre + "self_attn.k_norm", 128);
    linear(pre + "cross_attn.q_proj", 2048, 2048);
    linear(pre + "cross_attn.k_proj", 2048, 1024);
    linear(pre + "cross_attn.v_proj", 2048, 1024);
    linear(pre + "cross_attn.output_proj", 2048, 2048);
    norm(pre + "cross_attn.q_norm", 128);
    norm(pre + "cross_attn.k_norm", 128);
    linear(pre + "mlp.layer1", 8192, 2048);
    linear(pre + "mlp.layer2", 2048, 8192);
    for (const char* a : {"self_attn", "cross_attn", "mlp"}) {
      linear(pre + "adaln_modulation_" + a + ".1", 256, 2048);
      linear(pre + "adaln_modulation_" + a + ".2", 6144, 256);
    }
  }
  linear("final_layer.linear", 64, 2048);
  linear("final_layer.adaln_modulation.1", 256, 2048);
  linear("final_layer.adaln_modulation.2", 4096, 256);
  linear("llm_adapter.embed", 32128, 1024);  // Embedding
  for (int b = 0; b < 6; ++b) {
    const std::string pre = "llm_adapter.blocks." + std::to_string(b) + ".";
    for (const char* n : {"self_attn", "cross_attn", "mlp"}) norm(pre + "norm_" + n, 1024);
    for (const char* a : {"self_attn", "cross_attn"}) {
      for (const char* x : {"q", "k", "v", "o"}) linear(pre + a + "." + x + "_proj", 1024, 1024);
      norm(pre + a + ".q_norm", 64);
      norm(pre + a + ".k_norm", 64);
    }
    linear(pre + "mlp.0", 4096, 1024, true);
    linear(pre + "mlp.2", 1024, 4096, true);
  }
  linear("llm_adapter.out_proj", 1024, 1024, true);
  norm("llm_adapter.norm", 1024);
  return p;
}

// Names of anima-2b's Linear/Embedding modules, in order, without duplicates.
std::vector<std::string> anima_2b_layers() {
  std::vector<std::string> names;
  for (const auto& p : anima_2b_params()) {
    if (p.castable && (names.empty() || names.back() != p.module)) names.push_back(p.module);
  }
  return names;
}

// Storage size by the skip list: castable parameters matched by no pattern take 1 byte (fp8),
// everything else 2 (bf16). MiB.
double param_size_mib(const SkipList& skips) {
  int64_t bytes = 0;
  for (const auto& p : anima_2b_params()) {
    const bool fp8 = p.castable && !skips.matches(p.module);
    bytes += p.numel * (fp8 ? 1 : 2);
  }
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

const std::vector<std::string> kAnimaDeclared = {"t_embedder", "x_embedder", "final_layer"};

std::vector<std::string> matched(const SkipList& skips, const std::vector<std::string>& names) {
  std::vector<std::string> out;
  for (const auto& n : names) {
    if (skips.matches(n)) out.push_back(n);
  }
  return out;
}

}  // namespace

TEST_CASE("skip patterns: the anima-2b fixture has the published checkpoint's 685 tensors and 2,091,068,928 parameters") {
  const auto params = anima_2b_params();
  int64_t total = 0;
  for (const auto& p : params) total += p.numel;
  CHECK(params.size() == 685);
  CHECK(total == 2091068928);
}

TEST_CASE("skip patterns: Anima's declared patterns match exactly its 6 embedder/final-layer modules") {
  sluice::Fp8Options opts;  // defaults on, model list on
  const SkipList skips = SkipList::from_options(opts, kAnimaDeclared);
  const std::vector<std::string> expect = {"x_embedder.proj.1",          "t_embedder.1.linear_1",
                                           "t_embedder.1.linear_2",      "final_layer.linear",
                                           "final_layer.adaln_modulation.1", "final_layer.adaln_modulation.2"};
  CHECK(matched(skips, anima_2b_layers()) == expect);
  CHECK(*skips.matches("t_embedder.1.linear_2") == "t_embedder");
  CHECK(*skips.matches("final_layer.adaln_modulation.1") == "final_layer");
}

TEST_CASE("skip patterns: the default patterns match no Linear or Embedding of anima-2b") {
  const SkipList defaults(sluice::default_skip_patterns());
  CHECK(matched(defaults, anima_2b_layers()).empty());
}

TEST_CASE("skip patterns: param_size of anima-2b under each skip list equals its known size table") {
  sluice::Fp8Options none;
  none.use_default_skips = false;
  none.use_model_skips = false;
  CHECK(std::abs(param_size_mib(SkipList{}) - 1994.2) < 0.05);
  CHECK(std::abs(param_size_mib(SkipList({"t_embedder"})) - 2010.2) < 0.05);
  CHECK(std::abs(param_size_mib(SkipList::from_options(sluice::Fp8Options{}, kAnimaDeclared)) - 2012.0) < 0.05);
  // The reference's "+ adaln_modulation" row is a regex search that also hits the in-block
  // adaln_modulation_{self_attn,cross_attn,mlp}; as a plain pattern it only names
  // final_layer's (see Note [skip pattern matching]), so the regex spelling reproduces 2180.0.
  auto with = [&](const std::string& extra) {
    sluice::Fp8Options o;
    o.extra_skip_patterns = {extra};
    return SkipList::from_options(o, kAnimaDeclared);
  };
  CHECK(std::abs(param_size_mib(with("adaln_modulation\\w*")) - 2180.0) < 0.05);
  CHECK(std::abs(param_size_mib(with("adaln_modulation")) - 2012.0) < 0.05);
  // Without any list, everything castable is fp8.
  CHECK(std::abs(param_size_mib(SkipList::from_options(none, kAnimaDeclared)) - 1994.2) < 0.05);
}

TEST_CASE("skip patterns: plain patterns match whole dotted components, not substrings") {
  const SkipList skips({"t_embedder"});
  CHECK(skips.matches("t_embedder.1.linear_1"));
  CHECK(skips.matches("net.t_embedder"));
  CHECK_FALSE(skips.matches("text_embedder.linear"));
  CHECK_FALSE(skips.matches("t_embedder_2.proj"));
  CHECK_FALSE(skips.matches("blocks.0.t_embedder2"));

  const SkipList blocks({"blocks.1"});
  CHECK(blocks.matches("blocks.1.mlp.layer1"));
  CHECK_FALSE(blocks.matches("blocks.10.mlp.layer1"));
  CHECK_FALSE(blocks.matches("llm_adapter.blocks.0.mlp.1"));

  const SkipList run({"final_layer.linear"});
  CHECK(run.matches("final_layer.linear"));
  CHECK(run.matches("net.final_layer.linear.lora"));
  CHECK_FALSE(run.matches("final_layer.adaln_modulation.1"));
  CHECK_FALSE(run.matches("final_layer"));

  // A user's plain `norm` names a component called norm, nothing else.
  const SkipList norm({"norm"});
  CHECK(norm.matches("llm_adapter.norm"));
  CHECK_FALSE(norm.matches("t_embedding_norm"));
  CHECK_FALSE(norm.matches("transformer_blocks.0.norm1.linear"));
}

TEST_CASE("skip patterns: regex patterns are searched in the full dotted name") {
  CHECK(sluice::is_regex_pattern("^proj_in$"));
  CHECK(sluice::is_regex_pattern("\\w*norm\\w*"));
  CHECK_FALSE(sluice::is_regex_pattern("final_layer.linear"));
  CHECK_FALSE(sluice::is_regex_pattern("pos_embed"));

  const SkipList defaults(sluice::default_skip_patterns());
  CHECK(*defaults.matches("proj_in") == "^proj_in$");
  CHECK_FALSE(defaults.matches("blocks.0.proj_in"));
  CHECK(*defaults.matches("proj_out") == "^proj_out$");
  CHECK(*defaults.matches("pos_embed.proj") == "pos_embed");
  CHECK(*defaults.matches("patch_embed.proj") == "patch_embed");
  CHECK_FALSE(defaults.matches("pos_embedder.x"));
  // The default `norm` keeps the reference's unanchored reach: norm-owned Linears.
  CHECK(*defaults.matches("transformer_blocks.0.norm1.linear") == "\\w*norm\\w*");
  CHECK(defaults.matches("norm_out.linear"));
  CHECK(defaults.matches("t_embedding_norm"));
  CHECK_FALSE(defaults.matches("blocks.0.mlp.layer1"));

  const SkipList anchored({"^blocks\\.0\\."});
  CHECK(anchored.matches("blocks.0.mlp.layer1"));
  CHECK_FALSE(anchored.matches("llm_adapter.blocks.0.mlp.0"));
}

TEST_CASE("skip patterns: matches reports the first matching pattern in list order") {
  const SkipList skips({"mlp", "layer1", "blocks"});
  CHECK(*skips.matches("blocks.3.mlp.layer1") == "mlp");
  CHECK(*skips.matches("blocks.3.self_attn.q_proj") == "blocks");
  CHECK_FALSE(skips.matches("final_layer.linear"));
}

TEST_CASE("skip patterns: from_options orders defaults, model list and extras, drops what is turned off, dedups") {
  sluice::Fp8Options o;
  o.extra_skip_patterns = {"adaln_modulation\\w*", "t_embedder"};
  auto all = SkipList::from_options(o, kAnimaDeclared).patterns();
  std::vector<std::string> expect = sluice::default_skip_patterns();
  expect.insert(expect.end(), {"t_embedder", "x_embedder", "final_layer", "adaln_modulation\\w*"});
  CHECK(all == expect);

  o.use_default_skips = false;
  CHECK(SkipList::from_options(o, kAnimaDeclared).patterns() ==
        std::vector<std::string>{"t_embedder", "x_embedder", "final_layer", "adaln_modulation\\w*"});
  o.use_model_skips = false;
  const SkipList extras_only = SkipList::from_options(o, kAnimaDeclared);
  CHECK(extras_only.patterns() == std::vector<std::string>{"adaln_modulation\\w*", "t_embedder"});
  CHECK_FALSE(extras_only.matches("x_embedder.proj.1"));
  CHECK(extras_only.matches("blocks.0.adaln_modulation_mlp.1"));
}

TEST_CASE("skip patterns: bad patterns are refused with their text in the message") {
  auto message_of = [](const std::vector<std::string>& patterns) -> std::string {
    try {
      SkipList s(patterns);
    } catch (const sluice::InvalidArgument& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message_of({"blocks.(0"}).find("'blocks.(0'") != std::string::npos);
  CHECK(message_of({""}).find("empty") != std::string::npos);
  CHECK(message_of({"blocks..mlp"}).find("'blocks..mlp'") != std::string::npos);
  CHECK(message_of({"ok_pattern"}).empty());
}
