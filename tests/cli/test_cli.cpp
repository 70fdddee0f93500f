// The `sluice` command as scripts see it: run the built binary, check stdout, the exit
// status and that every error is exactly one stderr line naming what is at fault.
#include <ATen/ATen.h>
#include <ATen/Context.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fcntl.h>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <spawn.h>
#include <string>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "runtime/safetensors.h"

#include "tests/support/cli_runner.h"
#include "tests/support/overflow_checkpoint.h"

using namespace sluice::testing;

namespace {

nlohmann::json inspect_json(const std::vector<std::string>& args) {
  std::vector<std::string> full{"inspect"};
  full.insert(full.end(), args.begin(), args.end());
  full.push_back("--json");
  return nlohmann::json::parse(run_ok(full).out);
}

int64_t group_params(const nlohmann::json& j, const std::string& name) {
  for (const auto& g : j.at("groups"))
    if (g.at("name") == name) return g.at("parameters").get<int64_t>();
  FAIL("no group " << name);
  return -1;
}

// Parameter count of an Anima model derived from its config by hand (the published
// checkpoint's module table), independently of the model code. Checked against anima-2b's published
// total below before it is trusted for the small presets.
int64_t expected_parameters(const nlohmann::json& c) {
  const int64_t D = c["model_channels"], nb = c["num_blocks"], heads = c["num_heads"], r = c["mlp_ratio"];
  const int64_t Dc = c["crossattn_emb_channels"], L = c["adaln_lora_dim"], hd = D / heads;
  const int64_t in = c["in_channels"].get<int64_t>() + (c["concat_padding_mask"].get<bool>() ? 1 : 0);
  const int64_t ps = c["patch_spatial"], pt = c["patch_temporal"], out = c["out_channels"];
  const int64_t attn_norms = 2 * hd;
  const int64_t self_attn = 4 * D * D + attn_norms;
  const int64_t cross_attn = 2 * D * D + 2 * D * Dc + attn_norms;
  const int64_t mlp = 2 * D * r * D;
  const int64_t adaln = 3 * (D * L + L * 3 * D);
  const int64_t block = self_attn + cross_attn + mlp + adaln;
  const int64_t dit = in * ps * ps * pt * D               // x_embedder
                      + D * D + D * 3 * D                 // t_embedder linear_1, linear_2
                      + D                                 // t_embedding_norm
                      + nb * block                        // blocks
                      + D * ps * ps * pt * out            // final_layer.linear
                      + D * L + L * 2 * D;                // final_layer.adaln_modulation
  const auto& a = c["adapter"];
  if (!a["enabled"].get<bool>()) return dit;
  const int64_t A = a["model_dim"], S = a["source_dim"], ah = A / a["num_heads"].get<int64_t>();
  const int64_t ar = a["mlp_ratio"], V = a["vocab_size"], anb = a["num_blocks"];
  const int64_t ablock = 3 * A                                   // three pre-norms
                         + 4 * A * A + 2 * ah                    // self-attention + q/k norms
                         + 2 * A * A + 2 * A * S + 2 * ah        // cross-attention + q/k norms
                         + (A * ar * A + ar * A) + (ar * A * A + A);  // MLP with biases
  return dit + V * A + anb * ablock + (A * A + A) + A;  // embed, blocks, out_proj, norm
}

}  // namespace

TEST_CASE("cli: the version flag prints the version and exits 0") {
  const Result r = run_ok({"--version"});
  CHECK(r.out.rfind("sluice ", 0) == 0);
  CHECK(r.err.empty());
}

TEST_CASE("cli: inspect --config anima-2b --json reports the real model's published totals") {
  const auto j = inspect_json({"--config", "anima-2b"});
  CHECK(j.at("model") == "anima");
  CHECK(j.at("tensors").get<int64_t>() == 685);
  const int64_t params = 2091068928;  // the published anima-2b checkpoint's parameter count
  CHECK(j.at("parameters").get<int64_t>() == params);
  // A bf16 build stores every tensor in bf16: 2 bytes per parameter, 3988.40 MiB.
  CHECK(j.at("bytes").get<int64_t>() == 2 * params);
  CHECK(j.at("bytes_by_dtype").size() == 1);
  CHECK(j.at("bytes_by_dtype").at("BF16").get<int64_t>() == 2 * params);
  CHECK(std::llround(j.at("bytes").get<double>() / (1024.0 * 1024.0) * 100.0) == 398840);
  // The published group totals.
  CHECK(group_params(j, "t_embedder") == 16777216);
  CHECK(group_params(j, "x_embedder") == 139264);
  CHECK(group_params(j, "final_layer") == 1703936);
  CHECK(group_params(j, "blocks.*.adaln_modulation") == 176160768);
  CHECK(group_params(j, "llm_adapter") == 134663680);
  int64_t in_blocks = 0;
  for (const auto& g : j.at("groups"))
    if (g.at("name").get<std::string>().rfind("blocks.*.", 0) == 0) in_blocks += g.at("parameters").get<int64_t>();
  CHECK(in_blocks == 28 * 69206528);
  CHECK(j.at("blocks").get<int64_t>() == 28);
  // The hand-derived formula agrees with the published total, so it can vouch for presets.
  CHECK(expected_parameters(j.at("config")) == params);
}

TEST_CASE("cli: inspect --config --dtype float32 doubles the bytes and the text output has the totals") {
  const auto j = inspect_json({"--config", "anima-small", "--dtype", "float32"});
  CHECK(j.at("parameters").get<int64_t>() == expected_parameters(j.at("config")));
  CHECK(j.at("bytes").get<int64_t>() == 4 * j.at("parameters").get<int64_t>());
  CHECK(j.at("bytes_by_dtype").at("F32").get<int64_t>() == j.at("bytes").get<int64_t>());
  const Result r = run_ok({"inspect", "--config", "anima-small"});
  CHECK(r.out.find(std::to_string(j.at("parameters").get<int64_t>())) != std::string::npos);
  CHECK(r.out.find("anima") != std::string::npos);
}

// anima-2b's storage sizes (bf16, fp8 with skips), from the CLI on the shape-only anima-2b build.
TEST_CASE("cli: inspect --storage reproduces the anima-2b fp8 size table exactly") {
  auto size = [](std::vector<std::string> extra) {
    std::vector<std::string> args{"--config", "anima-2b"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto j = inspect_json(args);
    INFO(j.dump());
    return std::llround(j.at("param_size_mib").get<double>() * 10.0);
  };
  CHECK(size({}) == 39884);
  CHECK(size({"--storage", "bfloat16"}) == 39884);
  CHECK(size({"--storage", "float8_e4m3fn", "--no-default-skips", "--no-model-skips"}) == 19942);
  CHECK(size({"--storage", "float8_e4m3fn", "--no-default-skips", "--no-model-skips", "--skip", "t_embedder"}) == 20102);
  CHECK(size({"--storage", "float8_e4m3fn"}) == 20120);
  CHECK(size({"--storage", "float8_e4m3fn", "--no-default-skips"}) == 20120);  // defaults match nothing on anima-2b
  // The in-block modules are adaln_modulation_{self_attn,cross_attn,mlp}: a whole-component
  // plain name would not reach them, so the table's "+ adaln_modulation" row is the regex.
  CHECK(size({"--storage", "float8_e4m3fn", "--skip", "adaln_modulation\\w*"}) == 21800);
  CHECK(size({"--storage", "float8_e4m3fn", "--skip", "adaln_modulation"}) == 20120);
  // The text output carries the same figure.
  const Result r = run_ok({"inspect", "--config", "anima-2b", "--storage", "float8_e4m3fn"});
  CHECK(r.out.find("param_size  2012.0 MiB") != std::string::npos);
}

TEST_CASE("cli: inspect --storage lists exactly the 6 modules Anima's declared skips keep on anima-2b") {
  const auto j = inspect_json({"--config", "anima-2b", "--storage", "float8_e4m3fn"});
  const auto& f = j.at("fp8");
  CHECK(f.at("storage") == "float8_e4m3fn");
  CHECK(f.at("compute") == "bfloat16");
  std::vector<std::string> skipped;
  for (const auto& k : f.at("skipped")) skipped.push_back(k.at("module").get<std::string>());
  std::sort(skipped.begin(), skipped.end());
  const std::vector<std::string> expected{"final_layer.adaln_modulation.1", "final_layer.adaln_modulation.2",
                                          "final_layer.linear",             "t_embedder.1.linear_1",
                                          "t_embedder.1.linear_2",          "x_embedder.proj.1"};
  CHECK(skipped == expected);
  // --no-model-skips keeps nothing (the defaults match no anima-2b Linear).
  const auto none = inspect_json({"--config", "anima-2b", "--storage", "float8_e4m3fn", "--no-model-skips"});
  CHECK(none.at("fp8").at("skipped").empty());
  CHECK(none.at("fp8").at("cast_layers").get<int64_t>() == f.at("cast_layers").get<int64_t>() + 6);
}

TEST_CASE("cli: inspect --storage on a checkpoint file reports the what-if size of its config") {
  TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "3", "--out", ckpt});
  const auto file = inspect_json({ckpt, "--storage", "float8_e4m3fn"});
  const auto config = inspect_json({"--config", "anima-tiny", "--storage", "float8_e4m3fn"});
  CHECK(file.at("fp8").at("param_bytes") == config.at("fp8").at("param_bytes"));
  CHECK(file.at("fp8").at("skipped") == config.at("fp8").at("skipped"));
  // fp8 halves every cast parameter's two bf16 bytes.
  const int64_t bf16 = file.at("bytes").get<int64_t>();
  CHECK(file.at("fp8").at("param_bytes").get<int64_t>() == bf16 - file.at("fp8").at("cast_parameters").get<int64_t>());
  expect_error({"inspect", "--config", "anima-tiny", "--storage", "float8_e4m3fn", "--skip", "("}, 1, {"("});
  expect_error({"inspect", "--config", "anima-tiny", "--storage", "int4"}, 2, {"int4"});
  expect_error({"inspect", "--config", "anima-tiny", "--skip", "t_embedder"}, 2, {"--storage"});
}

TEST_CASE("cli: fp8-report runs on a generated checkpoint: groups candidates and forward errors") {
  TempDir dir;
  const std::string ckpt = dir / "small.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "5", "--out", ckpt});
  const auto j = nlohmann::json::parse(run_ok({"fp8-report", ckpt, "--forward", "--latent", "8", "--json"}).out);
  INFO(j.dump());
  std::vector<std::string> groups;
  for (const auto& g : j.at("groups")) {
    groups.push_back(g.at("group").get<std::string>());
    CHECK(g.at("parameters").get<int64_t>() > 0);
    const double err = g.at("roundtrip_rel_error").get<double>();
    CHECK(err > 0.0);
    CHECK(err < 0.1);  // e4m3 keeps 3 mantissa bits: about 2-4% relative error on normal values
  }
  for (const char* g : {"t_embedder", "x_embedder", "final_layer", "adaln_modulation", "self_attn", "cross_attn", "mlp",
                        "llm_adapter"})
    CHECK(std::find(groups.begin(), groups.end(), g) != groups.end());
  REQUIRE(j.at("candidates").size() == 4);
  double previous_size = 0;
  int64_t previous_skipped = -1;
  for (const auto& c : j.at("candidates")) {
    // Each candidate keeps more in bf16 than the one before (sizes are rounded to 0.1 MiB,
    // too coarse to grow at every step on anima-tiny); forward errors are set.
    CHECK(c.at("skipped_modules").get<int64_t>() > previous_skipped);
    CHECK(c.at("param_size_mib").get<double>() >= previous_size);
    previous_skipped = c.at("skipped_modules").get<int64_t>();
    previous_size = c.at("param_size_mib").get<double>();
    CHECK(c.at("velocity_rel_l2").get<double>() > 0.0);
  }
  CHECK(j.at("candidates").back().at("param_size_mib").get<double>() > j.at("candidates").front().at("param_size_mib").get<double>());
  const Result text = run_ok({"fp8-report", ckpt, "--storage", "float8_e5m2"});
  CHECK(text.out.find("llm_adapter") != std::string::npos);
  CHECK(text.out.find("float8_e5m2") != std::string::npos);
  expect_error({"fp8-report", dir / "missing.safetensors"}, 1, {"missing.safetensors"});
  expect_error({"fp8-report", ckpt, "--storage", "bfloat16"}, 2, {"bfloat16"});
}

TEST_CASE("cli: make-checkpoint writes a checkpoint that inspect describes") {
  TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "7", "--out", ckpt, "--dtype", "float32"});
  const auto from_file = inspect_json({ckpt});
  const auto from_config = inspect_json({"--config", "anima-tiny", "--dtype", "float32"});
  CHECK(from_file.at("model") == "anima");
  CHECK(from_file.at("parameters").get<int64_t>() == expected_parameters(from_config.at("config")));
  CHECK(from_file.at("tensors") == from_config.at("tensors"));
  CHECK(from_file.at("bytes") == from_config.at("bytes"));
  CHECK(from_file.at("bytes_by_dtype") == from_config.at("bytes_by_dtype"));
  CHECK(from_file.at("groups") == from_config.at("groups"));
  // The config inferred from the file's shapes is the preset's.
  auto inferred = from_file.at("config"), preset = from_config.at("config");
  inferred.erase("name");
  preset.erase("name");
  CHECK(inferred == preset);
  // Every tensor is stored in the requested dtype, with the official "net." prefix.
  const auto f = sluice::safetensors::File::open(ckpt);
  CHECK(static_cast<int64_t>(f->tensors().size()) == from_file.at("tensors").get<int64_t>());
  for (const auto& t : f->tensors()) {
    CHECK(t.dtype == at::kFloat);
    CHECK(t.name.rfind("net.", 0) == 0);
  }
}

TEST_CASE("cli: make-checkpoint is deterministic per seed") {
  TempDir dir;
  const std::string a = dir / "a.safetensors", b = dir / "b.safetensors", c = dir / "c.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "42", "--out", a});
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "42", "--out", b});
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "43", "--out", c});
  const std::string bytes_a = slurp(a), bytes_b = slurp(b), bytes_c = slurp(c);
  REQUIRE(!bytes_a.empty());
  CHECK(bytes_a == bytes_b);
  CHECK(bytes_a.size() == bytes_c.size());
  CHECK(bytes_a != bytes_c);
  // Default dtype is bfloat16.
  // (The File must outlive the loop: ranging over a temporary's tensors() dangles; ASan.)
  const auto file = sluice::safetensors::File::open(a);
  for (const auto& t : file->tensors()) CHECK(t.dtype == at::kBFloat16);
}

TEST_CASE("cli: convert writes an fp8 checkpoint that run streams to the latent of a load-time conversion") {
  TempDir dir;
  const std::string src = dir / "src.safetensors", fp8 = dir / "fp8.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "9", "--out", src});
  const Result r = run_ok({"convert", src, "--out", fp8});
  CHECK(r.out.rfind("wrote " + fp8 + ": anima-tiny, ", 0) == 0);
  CHECK(r.out.find(" float8_e4m3fn, 0 weight scales, ") != std::string::npos);
  CHECK(r.err.empty());
  const auto f = sluice::safetensors::File::open(fp8);
  CHECK(f->find("net.blocks.0.self_attn.q_proj.weight")->dtype == at::kFloat8_e4m3fn);
  CHECK(f->metadata().at("sluice.storage") == "float8_e4m3fn");
  // The same latent from the converted file as from converting the source at load time.
  const std::string a = dir / "a.safetensors", b = dir / "b.safetensors";
  const std::vector<std::string> common{"run", "--device", "cpu", "--steps", "2", "--resolution", "64", "--max-resident", "0.5"};
  std::vector<std::string> from_src = common, from_fp8 = common;
  for (const std::string& s : {std::string("--checkpoint"), src, std::string("--output"), a}) from_src.push_back(s);
  for (const std::string& s : {std::string("--checkpoint"), fp8, std::string("--output"), b}) from_fp8.push_back(s);
  run_ok(from_src);
  run_ok(from_fp8);
  CHECK(at::equal(sluice::safetensors::File::open(a)->tensor("latent"), sluice::safetensors::File::open(b)->tensor("latent")));
  // Scaled: one fp32 scale per converted layer.
  const Result scaled = run_ok({"convert", src, "--scaled", "--scale", "per_channel", "--out", dir / "s.safetensors"});
  CHECK(scaled.out.find(" 0 weight scales") == std::string::npos);
  // Bad input: the input as output, a missing input (exit 1); a bad flag value (exit 2).
  expect_error({"convert", src, "--out", src}, 2, {"--out", src, "input"});
  expect_error({"convert", dir / "missing.safetensors", "--out", dir / "x.safetensors"}, 1, {"missing.safetensors"});
  expect_error({"convert", src, "--out", fp8, "--storage", "bfloat16"}, 2, {"--storage", "bfloat16"});
  expect_error({"convert", src, "--out", fp8, "--scale", "per_row"}, 2, {"--scale", "per_row"});
  expect_error({"convert", src, "--out", dir / "no-such-dir/x.safetensors"}, 2, {"--out"});
}

TEST_CASE("cli: run: an e5m2 checkpoint runs as stored and a --storage that casts it says so once") {
  // Issue 29, item 7: `run --storage` took only float8_e4m3fn and bfloat16, and an e5m2 file
  // from `convert --storage float8_e5m2` was re-cast to e4m3fn with no word.
  TempDir dir;
  const std::string src = dir / "src.safetensors", e5 = dir / "e5.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "9", "--out", src});
  run_ok({"convert", src, "--out", e5, "--storage", "float8_e5m2"});
  auto count = [](const std::string& text, const std::string& what) {
    size_t n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  auto run = [&](const std::string& checkpoint, const std::vector<std::string>& extra, const std::string& out) {
    std::vector<std::string> args{"run", "--device", "cpu", "--checkpoint", checkpoint, "--steps", "2",
                                  "--resolution", "64", "--max-resident", "0.5", "--output", out};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_ok(args);
  };
  // By default an fp8 file keeps its own fp8 dtype: nothing is cast, nothing to say.
  const std::string a = dir / "a.safetensors", b = dir / "b.safetensors", c = dir / "c.safetensors";
  const Result stored = run(e5, {}, a);
  CHECK(stored.out.find(", storage float8_e5m2, ") != std::string::npos);
  CHECK(stored.out.find("cast to") == std::string::npos);
  CHECK(stored.err.empty());
  // Bit for bit the latent of converting the bf16 source to e5m2 at load time, which says
  // once that the file's bf16 weights are cast.
  const Result from_src = run(src, {"--storage", "float8_e5m2"}, b);
  CHECK(at::equal(sluice::safetensors::File::open(a)->tensor("latent"),
                  sluice::safetensors::File::open(b)->tensor("latent")));
  CHECK(count(from_src.out, "'" + src + "' stores its weights as bfloat16; cast to float8_e5m2 storage") == 1);
  // Every storage dtype the runtime supports is taken; a cast of the file's dtype is said once.
  for (const std::string storage : {"float8_e4m3fn", "bfloat16", "float16", "float32"}) {
    INFO("storage " << storage);
    const Result r = run(e5, {"--storage", storage}, c);
    CHECK(r.out.find(", storage " + storage + ", ") != std::string::npos);
    CHECK(count(r.out, "'" + e5 + "' stores its weights as float8_e5m2; cast to " + storage + " storage") == 1);
    CHECK(r.err.empty());
  }
  const Result gen = run_ok({"run", "--device", "cpu", "--synthetic", "anima-tiny", "--steps", "1", "--resolution",
                             "64", "--storage", "float16"});
  CHECK(gen.out.find(", storage float16, ") != std::string::npos);
  expect_error({"run", "--synthetic", "anima-tiny", "--storage", "int8"}, 2, {"--storage", "int8"});
}

TEST_CASE("cli: convert --scale without --scaled stores the scales it names") {
  TempDir dir;
  const std::string src = dir / "src.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "9", "--out", src});
  const Result implied = run_ok({"convert", src, "--scale", "per_channel", "--out", dir / "implied.safetensors"});
  const Result both = run_ok({"convert", src, "--scaled", "--scale", "per_channel", "--out", dir / "both.safetensors"});
  CHECK(implied.out.find(" 0 weight scales") == std::string::npos);
  CHECK(slurp(dir / "implied.safetensors") == slurp(dir / "both.safetensors"));
  // Neither flag: no scales, as before.
  const Result plain = run_ok({"convert", src, "--out", dir / "plain.safetensors"});
  CHECK(plain.out.find(" 0 weight scales") != std::string::npos);
}

TEST_CASE("cli: forward stores weights in float8_e4m3fn by default like run and --storage overrides it") {
  TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors", in = dir / "in.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", ckpt});
  at::manual_seed(0);
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})}, {"timesteps", at::tensor({0.5f})},
                                 {"context", at::randn({1, 3, 32})}});
  const std::string dflt = dir / "default.safetensors", fp8 = dir / "fp8.safetensors", f32 = dir / "f32.safetensors";
  run_ok({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", dflt});
  run_ok({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", fp8, "--storage", "float8_e4m3fn"});
  run_ok({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", f32, "--storage", "float32"});
  CHECK(sluice::safetensors::File::open(dflt)->metadata().at("storage") == "float8_e4m3fn");
  CHECK(sluice::safetensors::File::open(f32)->metadata().at("storage") == "float32");
  const at::Tensor v = sluice::safetensors::File::open(dflt)->tensor("velocity");
  CHECK(at::equal(v, sluice::safetensors::File::open(fp8)->tensor("velocity")));
  CHECK_FALSE(at::equal(v, sluice::safetensors::File::open(f32)->tensor("velocity")));
}

TEST_CASE("cli: forward and convert and make-checkpoint check their output paths before any work") {
  TempDir dir;
  const std::string bad = "/nonexistent-sluice-dir/out.safetensors";
  const std::string ckpt = dir / "tiny.safetensors", in = dir / "in.safetensors";
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", bad}, 2, {"--out", bad, "does not exist"});
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", dir.path}, 2, {"--out", dir.path, "folder"});
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", ckpt});
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})}, {"timesteps", at::tensor({0.5f})},
                                 {"context", at::randn({1, 3, 32})}});
  const std::string ckpt_bytes = slurp(ckpt), in_bytes = slurp(in);
  expect_error({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", bad}, 2, {"--output", bad, "does not exist"});
  expect_error({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", dir.path}, 2, {"--output", dir.path, "folder"});
  expect_error({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", in}, 2, {"--output", "--inputs", in});
  expect_error({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", dir / "./tiny.safetensors"}, 2,
               {"--output", "--checkpoint", "tiny.safetensors"});
  expect_error({"convert", ckpt, "--out", bad}, 2, {"--out", bad});
  expect_error({"convert", ckpt, "--out", dir.path + "//tiny.safetensors"}, 2, {"--out", "tiny.safetensors", "input"});
  CHECK(slurp(ckpt) == ckpt_bytes);
  CHECK(slurp(in) == in_bytes);
  // A read-only output folder (unless we are root, who may write anyway).
  if (::geteuid() != 0) {
    const std::string ro = dir / "ro";
    REQUIRE(::mkdir(ro.c_str(), 0555) == 0);
    expect_error({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", ro + "/o.safetensors"}, 2,
                 {"--output", "not writable"});
    ::rmdir(ro.c_str());
  }
}

TEST_CASE("cli: make-checkpoint and fp8-report refuse a seed out of range") {
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed=-1", "--out", "/tmp/x.safetensors"}, 2,
               {"--seed: expected a whole number from 0 to 18446744073709551615, got '-1'"});
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed", "18446744073709551616", "--out",
                "/tmp/x.safetensors"},
               2, {"--seed", "'18446744073709551616'"});
  expect_error({"fp8-report", "x.safetensors", "--seed=-1"}, 2, {"--seed", "'-1'"});
}

TEST_CASE("cli: forward writes a velocity shaped like x and the adapter context") {
  TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", ckpt, "--dtype", "float32"});
  const auto cfg = inspect_json({"--config", "anima-tiny"}).at("config");
  const int64_t C = cfg["in_channels"], Dc = cfg["crossattn_emb_channels"];
  const int64_t Dq = cfg["adapter"]["source_dim"], V = cfg["adapter"]["vocab_size"];
  const int64_t out_tokens = cfg["adapter"]["output_tokens"];
  at::manual_seed(0);

  SECTION("context given") {
    const std::string in = dir / "in.safetensors", out = dir / "out.safetensors";
    sluice::safetensors::save(in, {{"x", at::randn({2, C, 1, 15, 17})},
                                   {"timesteps", at::tensor({0.3f, 0.8f})},
                                   {"context", at::randn({2, 5, Dc})}});
    const Result r = run_ok({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out});
    CHECK(r.err.empty());
    const auto f = sluice::safetensors::File::open(out);
    REQUIRE(f->contains("velocity"));
    CHECK(!f->contains("context"));
    const at::Tensor v = f->tensor("velocity");
    CHECK(v.sizes() == at::IntArrayRef({2, C, 1, 15, 17}));
    CHECK(v.scalar_type() == at::kFloat);
    CHECK(at::isfinite(v).all().item<bool>());
    CHECK(v.abs().sum().item<double>() > 0);
    // The two batch elements have different timesteps and inputs: different outputs.
    CHECK(!at::allclose(v[0], v[1]));

    // bf16 run: output in bf16 and close to the fp32 one.
    const std::string out16 = dir / "out16.safetensors";
    run_ok({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out16, "--compute", "bfloat16"});
    const at::Tensor v16 = sluice::safetensors::File::open(out16)->tensor("velocity");
    CHECK(v16.scalar_type() == at::kBFloat16);
    const double rel = ((v16.to(at::kFloat) - v).norm() / v.norm()).item<double>();
    CHECK(rel < 0.05);
  }

  SECTION("adapter inputs") {
    const std::string in = dir / "in.safetensors", out = dir / "out.safetensors";
    sluice::safetensors::save(in, {{"x", at::randn({1, C, 1, 8, 8})},
                                   {"timesteps", at::tensor({0.5f})},
                                   {"qwen_hidden", at::randn({1, 7, Dq})},
                                   {"t5_ids", at::randint(0, V, {1, 9}, at::kLong)},
                                   {"t5_weights", at::rand({1, 9})}});
    run_ok({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out, "--config", "anima-tiny"});
    const auto f = sluice::safetensors::File::open(out);
    REQUIRE(f->contains("context"));
    REQUIRE(f->contains("velocity"));
    const at::Tensor ctx = f->tensor("context");
    CHECK(ctx.sizes() == at::IntArrayRef({1, out_tokens, Dc}));
    // Tokens past the 9 real ones are zero padding; the real ones are not.
    CHECK(ctx.slice(1, 9).abs().sum().item<double>() == 0.0);
    CHECK(ctx.slice(1, 0, 9).abs().sum().item<double>() > 0.0);
    CHECK(f->tensor("velocity").sizes() == at::IntArrayRef({1, C, 1, 8, 8}));
  }
}

TEST_CASE("cli: forward: --compute names the compute dtype as run does, and --dtype is its alias that says so") {
  TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors", in = dir / "in.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", ckpt, "--dtype", "float32"});
  at::manual_seed(0);
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})}, {"timesteps", at::tensor({0.5f})},
                                 {"context", at::randn({1, 3, 32})}});
  auto forward = [&](const std::string& out, const std::vector<std::string>& extra) {
    std::vector<std::string> args{"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out};
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  const std::string by_compute = dir / "compute.safetensors", by_dtype = dir / "dtype.safetensors";
  const Result compute = run_ok(forward(by_compute, {"--compute", "bfloat16"}));
  CHECK(compute.err.empty());
  CHECK(compute.out.find(" (bfloat16, cpu)") != std::string::npos);

  // The alias runs the same forward and says, in one warning line, what it stands for.
  const Result alias = run_ok(forward(by_dtype, {"--dtype", "bfloat16"}));
  CHECK(alias.out.find(" (bfloat16, cpu)") != std::string::npos);
  CHECK(std::count(alias.err.begin(), alias.err.end(), '\n') == 1);
  CHECK(alias.err.find("[warning] sluice forward: --dtype is an alias of --compute") != std::string::npos);
  CHECK(alias.err.find("running as --compute bfloat16") != std::string::npos);
  const at::Tensor v = sluice::safetensors::File::open(by_compute)->tensor("velocity");
  CHECK(v.scalar_type() == at::kBFloat16);
  CHECK(at::equal(v, sluice::safetensors::File::open(by_dtype)->tensor("velocity")));

  // It is a log line: --log-level error leaves stderr to errors.
  CHECK(run_ok(forward(by_dtype, {"--dtype", "bfloat16", "--log-level", "error"})).err.empty());
  // One dtype, one flag: both at once is a usage error.
  expect_error(forward(dir / "both.safetensors", {"--compute", "bfloat16", "--dtype", "float32"}), 2,
               {"--dtype", "--compute", "sluice forward --help"});
}

TEST_CASE("cli: errors: missing or corrupt files exit 1 with one line naming the file") {
  TempDir dir;
  const std::string missing = dir / "does_not_exist.safetensors";
  expect_error({"inspect", missing}, 1, {missing});

  const std::string ckpt = dir / "tiny.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "3", "--out", ckpt});
  const std::string bytes = slurp(ckpt);
  const std::string truncated = dir / "truncated.safetensors";
  {
    std::ofstream o(truncated, std::ios::binary);
    o.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  expect_error({"inspect", truncated}, 1, {truncated});
  const std::string garbage = dir / "garbage.safetensors";
  {
    std::ofstream o(garbage, std::ios::binary);
    o << "this is not a safetensors file at all";
  }
  expect_error({"inspect", garbage}, 1, {garbage});

  const std::string in = dir / "in.safetensors";
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})},
                                 {"timesteps", at::tensor({0.5f})},
                                 {"context", at::randn({1, 3, 32})}});
  expect_error({"forward", "--checkpoint", missing, "--inputs", in, "--output", dir / "o.safetensors"}, 1, {missing});
  expect_error({"forward", "--checkpoint", truncated, "--inputs", in, "--output", dir / "o.safetensors"}, 1,
               {truncated});
  expect_error({"forward", "--checkpoint", ckpt, "--inputs", truncated, "--output", dir / "o.safetensors"}, 1,
               {truncated});
  expect_error({"forward", "--checkpoint", ckpt, "--inputs", missing, "--output", dir / "o.safetensors"}, 1, {missing});

  const std::string bad_json = dir / "bad.json";
  {
    std::ofstream o(bad_json);
    o << "{ not json";
  }
  expect_error({"inspect", "--config", bad_json}, 1, {bad_json});
  expect_error({"inspect", "--config", dir / "absent.json"}, 1, {"absent.json"});
}

TEST_CASE("cli: errors: unknown presets and bad flags or values exit 2 with one line and a hint") {
  expect_error({"inspect", "--config", "anima-huge"}, 2, {"anima-huge", "sluice inspect --help"});
  expect_error({"make-checkpoint", "--config", "nope", "--seed", "1", "--out", "/tmp/x.safetensors"}, 2,
               {"nope", "sluice make-checkpoint --help"});
  expect_error({"inspect", "--bogus"}, 2, {"--bogus", "sluice inspect --help"});
  expect_error({"forward", "--checkpoint", "a", "--inputs", "b", "--output", "c", "--frobnicate"}, 2, {"--frobnicate"});
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed", "1"}, 2, {"--out"});
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed", "abc", "--out", "/tmp/x.safetensors"}, 2,
               {"--seed"});
  expect_error({"forward", "--checkpoint", "a", "--inputs", "b", "--output", "c", "--compute", "float8"}, 2,
               {"--compute", "float8", "sluice forward --help"});
  expect_error({"forward", "--checkpoint", "a", "--inputs", "b", "--output", "c", "--dtype", "float8"}, 2,
               {"--dtype", "float8", "sluice forward --help"});
  expect_error({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", "x", "--dtype", "int8"}, 2,
               {"int8"});
  expect_error({"forward", "--checkpoint", "a", "--inputs", "b", "--output", "c", "--device", "tpu"}, 2, {"tpu"});
  expect_error({"forward", "--checkpoint", "a", "--inputs", "b", "--output", "c", "--device", "cuda:x"}, 2, {"cuda:x"});
  expect_error({"inspect"}, 2, {"--config"});
  expect_error({"inspect", "f.safetensors", "--config", "anima-tiny"}, 2, {"--config"});
  expect_error({"frobnicate"}, 2, {"frobnicate"});
  expect_error({}, 2, {"subcommand"});
  expect_error({"--log-level", "loud", "inspect", "--config", "anima-tiny"}, 2, {"loud"});
}

TEST_CASE("cli: errors: wrong input tensors exit 1 with one line naming the tensor") {
  TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "5", "--out", ckpt, "--dtype", "float32"});
  const std::string out = dir / "out.safetensors";
  auto forward_error = [&](const std::vector<std::pair<std::string, at::Tensor>>& inputs,
                           const std::vector<std::string>& names) {
    const std::string in = dir / "in.safetensors";
    sluice::safetensors::save(in, inputs);
    expect_error({"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out}, 1, names);
    CHECK(!exists(out));  // nothing written on failure
  };
  const at::Tensor x = at::randn({1, 16, 1, 4, 4}), ts = at::tensor({0.5f}), ctx = at::randn({1, 3, 32});
  forward_error({{"x", at::randn({1, 15, 1, 4, 4})}, {"timesteps", ts}, {"context", ctx}}, {"'x'", "[1, 15, 1, 4, 4]"});
  forward_error({{"x", at::randn({1, 16, 4, 4})}, {"timesteps", ts}, {"context", ctx}}, {"'x'"});
  forward_error({{"x", x}, {"timesteps", at::tensor({0.5f, 0.2f})}, {"context", ctx}}, {"'timesteps'"});
  forward_error({{"x", x}, {"timesteps", ts}, {"context", at::randn({1, 3, 31})}}, {"'context'"});
  forward_error({{"x", x}, {"timesteps", ts}}, {"context"});
  forward_error({{"x", x}, {"context", ctx}}, {"'timesteps'"});
  forward_error({{"x", x}, {"timesteps", ts}, {"context", ctx}, {"extra", ctx}}, {"'extra'"});
  forward_error({{"x", x}, {"timesteps", ts}, {"qwen_hidden", at::randn({1, 5, 32})},
                 {"t5_ids", at::randint(0, 128, {1, 4}, at::kLong)}, {"t5_weights", at::rand({1, 5})}},
                {"'t5_weights'"});
  forward_error({{"x", x}, {"timesteps", ts}, {"qwen_hidden", at::randn({1, 5, 32})},
                 {"t5_ids", at::full({1, 4}, 100000, at::kLong)}},
                {"'t5_ids'"});
  forward_error({{"x", x}, {"timesteps", ts}, {"qwen_hidden", at::randn({1, 5, 32})},
                 {"t5_ids", at::rand({1, 4})}},
                {"'t5_ids'"});
  // Note [non-finite values]: NaN and Inf inputs, named as read from the file.
  at::Tensor nan_x = x.clone();
  nan_x.index_put_({0, 2, 0, 1, 3}, std::nan(""));
  nan_x.index_put_({0, 9, 0, 0, 0}, INFINITY);
  forward_error({{"x", nan_x}, {"timesteps", ts}, {"context", ctx}},
                {"input 'x' in '" + dir / "in.safetensors" + "' has 2 non-finite values (first at [0, 2, 0, 1, 3]: nan)"});
  forward_error({{"x", x}, {"timesteps", at::tensor({INFINITY})}, {"context", ctx}},
                {"'timesteps'", "1 non-finite value (first at [0]: inf)"});
  at::Tensor inf_ctx = ctx.clone();
  inf_ctx.index_put_({0, 1, 7}, -INFINITY);
  forward_error({{"x", x}, {"timesteps", ts}, {"context", inf_ctx}}, {"'context'", "(first at [0, 1, 7]: -inf)"});
  at::Tensor nan_qwen = at::randn({1, 5, 32});
  nan_qwen.index_put_({0, 4, 0}, std::nan(""));
  forward_error({{"x", x}, {"timesteps", ts}, {"qwen_hidden", nan_qwen}, {"t5_ids", at::randint(0, 128, {1, 4}, at::kLong)}},
                {"'qwen_hidden'", "(first at [0, 4, 0]: nan)"});
}

TEST_CASE("cli: forward: a layer made to overflow exits 1 naming the forward and the first non-finite layer") {
  TempDir dir;
  const std::string good = dir / "tiny.safetensors", in = dir / "in.safetensors", out = dir / "out.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "5", "--out", good, "--dtype", "float32"});
  at::manual_seed(0);
  SECTION("the DiT") {
    const std::string bad = dir / "bad.safetensors";
    sluice::testing::write_overflow_checkpoint(good, bad, "blocks.1.mlp.layer2.weight", 3e38);
    sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})}, {"timesteps", at::tensor({0.5f})},
                                   {"context", at::randn({1, 3, 32})}});
    run_ok({"forward", "--checkpoint", good, "--inputs", in, "--output", out});
    ::unlink(out.c_str());
    for (const char* dtype : {"float32", "bfloat16"}) {
      INFO(dtype);
      // Stored in the run dtype: fp8 storage (the default) would saturate the weight to +-448.
      expect_error({"forward", "--checkpoint", bad, "--inputs", in, "--output", out, "--compute", dtype, "--storage", dtype}, 1,
                   {"sluice forward: the dit forward's velocity is non-finite (",
                    " of 256 values); first non-finite output: blocks.1.mlp.layer2 (re-run with a per-layer check)"});
      CHECK(!exists(out));
    }
  }
  SECTION("the LLM adapter") {
    const std::string bad = dir / "bad.safetensors";
    sluice::testing::write_overflow_checkpoint(good, bad, "llm_adapter.blocks.1.mlp.2.weight", 3e38);
    sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})}, {"timesteps", at::tensor({0.5f})},
                                   {"qwen_hidden", at::randn({1, 5, 32})},
                                   {"t5_ids", at::randint(0, 128, {1, 4}, at::kLong)}});
    expect_error({"forward", "--checkpoint", bad, "--inputs", in, "--output", out, "--storage", "float32"}, 1,
                 {"sluice forward: the adapter forward's context is non-finite (",
                  "first non-finite output: llm_adapter.blocks.1.mlp.2 (re-run with a per-layer check)"});
    CHECK(!exists(out));
  }
}

TEST_CASE("cli: errors: a CUDA device that is not there exits 1 naming it") {
  if (at::hasCUDA()) {
    WARN("a CUDA device is present; the missing-device case needs a machine without one");
    const std::string idx = std::to_string(at::getNumGPUs() + 3);
    expect_error({"forward", "--checkpoint", "a", "--inputs", "b", "--output", "c", "--device", "cuda:" + idx}, 1,
                 {"cuda:" + idx});
    return;
  }
  TempDir dir;
  const std::string in = dir / "in.safetensors";
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 4, 4})}, {"timesteps", at::tensor({0.5f})},
                                 {"context", at::randn({1, 3, 32})}});
  expect_error({"forward", "--checkpoint", dir / "c.safetensors", "--inputs", in, "--output", dir / "o.safetensors",
                "--device", "cuda"},
               1, {"cuda"});
}

// The depth-expanded presets (README, "The depth-expanded Anima-2.9B and Anima-3.8B, and
// adapters trained on a shallower model"): anima-2b's shapes at 40 and 52 blocks, counted by
// the hand formula above.
TEST_CASE("cli: inspect --config anima-2.9b / anima-3.8b: anima-2b's shapes at 40 and 52 blocks") {
  const auto base = inspect_json({"--config", "anima-2b"});
  const int64_t per_block = 69206528;  // anima-2b's published block
  for (const auto& [name, blocks] : {std::pair<std::string, int64_t>{"anima-2.9b", 40}, {"anima-3.8b", 52}}) {
    INFO(name);
    const auto j = inspect_json({"--config", name});
    CHECK(j.at("blocks").get<int64_t>() == blocks);
    CHECK(j.at("config").at("num_blocks").get<int64_t>() == blocks);
    CHECK(j.at("config").at("model_channels") == base.at("config").at("model_channels"));
    CHECK(j.at("config").at("adapter") == base.at("config").at("adapter"));
    const int64_t params = j.at("parameters").get<int64_t>();
    CHECK(params == expected_parameters(j.at("config")));
    CHECK(params == base.at("parameters").get<int64_t>() + (blocks - 28) * per_block);
    CHECK(j.at("bytes").get<int64_t>() == 2 * params);  // bf16
  }
}

TEST_CASE("cli: a checkpoint's depth (40, 52 blocks) is inferred, and forward --lora remaps a base LoRA onto it") {
  TempDir dir;
  at::manual_seed(0);
  const std::string in = dir / "in.safetensors";
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 8, 8})},
                                 {"timesteps", at::tensor({0.4f})},
                                 {"context", at::randn({1, 5, 32})}});
  // A rank-2 pair on self_attn.q_proj (anima-tiny: 64 wide) of each block of `blocks`, the
  // values of block i the same wherever it is written (kohya's flattened keys).
  auto write_lora = [&](const std::string& path, const std::vector<int64_t>& blocks) {
    std::vector<std::pair<std::string, at::Tensor>> t;
    for (size_t i = 0; i < blocks.size(); ++i) {
      at::manual_seed(100 + i);
      const std::string k = "lora_unet_blocks_" + std::to_string(blocks[i]) + "_self_attn_q_proj";
      t.emplace_back(k + ".lora_down.weight", at::randn({2, 64}) * 0.5);
      t.emplace_back(k + ".lora_up.weight", at::randn({64, 2}) * 0.5);
    }
    sluice::safetensors::save(path, t);
  };
  std::vector<int64_t> base_blocks(28);
  for (int64_t i = 0; i < 28; ++i) base_blocks[static_cast<size_t>(i)] = i;
  const std::string base_lora = dir / "base28.safetensors";
  write_lora(base_lora, base_blocks);
  // Where Anima-2.9B and 3.8B keep the base blocks (the new-block lists, not the tables).
  auto kept = [](int64_t depth, const std::vector<int64_t>& added) {
    std::vector<int64_t> v;
    for (int64_t b = 0; b < depth; ++b)
      if (std::find(added.begin(), added.end(), b) == added.end()) v.push_back(b);
    return v;
  };
  const std::vector<int64_t> new_in_2p9 = {2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36};
  std::vector<int64_t> new_in_3p8;
  for (int64_t b = 3; b <= 47; b += 4) new_in_3p8.push_back(b);
  const std::vector<int64_t> in_2p9 = kept(40, new_in_2p9), p29_in_3p8 = kept(52, new_in_3p8);
  std::vector<int64_t> in_3p8;
  for (int64_t b : in_2p9) in_3p8.push_back(p29_in_3p8[static_cast<size_t>(b)]);

  for (const auto& [depth, positions] : {std::pair<int64_t, std::vector<int64_t>>{40, in_2p9}, {52, in_3p8}}) {
    INFO("depth " << depth);
    REQUIRE(positions.size() == 28);
    const std::string config = dir / ("tiny" + std::to_string(depth) + ".json");
    std::ofstream(config) << "{\"preset\": \"anima-tiny\", \"num_blocks\": " << depth << "}";
    const std::string ckpt = dir / ("tiny" + std::to_string(depth) + ".safetensors");
    run_ok({"make-checkpoint", "--config", config, "--seed", "4", "--out", ckpt});
    CHECK(inspect_json({ckpt}).at("blocks").get<int64_t>() == depth);  // inferred, no config given

    const std::string placed_lora = dir / ("placed" + std::to_string(depth) + ".safetensors");
    write_lora(placed_lora, positions);
    auto forward = [&](const std::vector<std::string>& extra, const std::string& out) {
      std::vector<std::string> args{"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out};
      args.insert(args.end(), extra.begin(), extra.end());
      const Result r = run_ok(args);
      return std::make_pair(sluice::safetensors::File::open(out)->tensor("velocity"), r.err);
    };
    const auto [plain, plain_err] = forward({}, dir / "plain.safetensors");
    const auto [remapped, remap_err] =
        forward({"--lora", base_lora + ":0.8", "--log-level", "info"}, dir / "remapped.safetensors");
    const auto [placed, placed_err] = forward({"--lora", placed_lora + ":0.8"}, dir / "placed.safetensors");
    const auto [as_is, as_is_err] =
        forward({"--lora", base_lora + ":0.8", "--adapter-blocks", "as-is"}, dir / "as_is.safetensors");
    CHECK(at::equal(remapped, placed));
    CHECK_FALSE(at::equal(remapped, plain));
    CHECK_FALSE(at::equal(as_is, remapped));
    const std::string line = "LoRA '" + base_lora + "' was trained on a 28-block Anima: its blocks go to their "
                             "measured positions in this " + std::to_string(depth) + "-block model";
    size_t count = 0;
    for (size_t p = remap_err.find(line); p != std::string::npos; p = remap_err.find(line, p + 1)) ++count;
    CHECK(count == 1);
  }

  // A 40-block LoRA on a 28-block model: exit 1, one line naming it.
  const std::string config28 = dir / "tiny28.json";
  std::ofstream(config28) << "{\"preset\": \"anima-tiny\", \"num_blocks\": 28}";
  const std::string ckpt28 = dir / "tiny28.safetensors";
  run_ok({"make-checkpoint", "--config", config28, "--seed", "4", "--out", ckpt28});
  const std::string deep_lora = dir / "deep40.safetensors";
  write_lora(deep_lora, {0, 39});
  expect_error({"forward", "--checkpoint", ckpt28, "--inputs", in, "--output", dir / "o.safetensors", "--lora",
                deep_lora},
               1, {"LoRA '" + deep_lora + "' addresses block 39 (trained on a 40-block Anima), but this model has 28 blocks"});
  // Bad flag values: exit 2 naming the flag.
  expect_error({"forward", "--checkpoint", ckpt28, "--inputs", in, "--output", dir / "o.safetensors",
                "--adapter-blocks", "sideways"},
               2, {"--adapter-blocks", "sideways"});
  expect_error({"forward", "--checkpoint", ckpt28, "--inputs", in, "--output", dir / "o.safetensors", "--lora",
                deep_lora + ":abc"},
               2, {"--lora", "scale 'abc' is not a finite number"});
}
