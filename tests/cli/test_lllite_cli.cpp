// ControlNet-LLLite on the command line (README, "ControlNet-LLLite"): `sluice forward --lllite
// FILE[:WEIGHT]` with lllite_cond in the inputs file, `sluice run --lllite FILE[:WEIGHT[:BEGIN:END]]
// --control-image PNG [--control-mask PNG]` (an inpaint adapter), and the refusals of bad specs
// and files, each one line.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "runtime/safetensors.h"
#include "tests/support/cli_runner.h"
#include "tests/support/lllite_file.h"

using sluice::testing::run_cli;
using sluice::testing::TempDir;

namespace {

uint32_t crc32(const std::string& s) {
  uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
  }
  return c ^ 0xFFFFFFFFu;
}

std::string be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

// An 8-bit RGB PNG of `rgb` [H, W, 3] uint8: zlib stored blocks (no compression library needed).
void write_png(const std::string& path, const at::Tensor& rgb) {
  const int64_t h = rgb.size(0), w = rgb.size(1);
  std::string raw;
  const uint8_t* p = rgb.contiguous().data_ptr<uint8_t>();
  for (int64_t y = 0; y < h; ++y) {
    raw.push_back('\0');  // filter: none
    raw.append(reinterpret_cast<const char*>(p + y * w * 3), static_cast<size_t>(w * 3));
  }
  std::string z = "\x78\x01";
  uint32_t a = 1, b = 0;
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  for (size_t i = 0; i < raw.size(); i += 65535) {
    const size_t n = std::min<size_t>(65535, raw.size() - i);
    z.push_back(i + n == raw.size() ? '\x01' : '\x00');
    z.push_back(static_cast<char>(n & 0xFF));
    z.push_back(static_cast<char>(n >> 8));
    z.push_back(static_cast<char>(~n & 0xFF));
    z.push_back(static_cast<char>((~n >> 8) & 0xFF));
    z.append(raw, i, n);
  }
  z += be32((b << 16) | a);
  auto chunk = [](const std::string& type, const std::string& data) {
    return be32(static_cast<uint32_t>(data.size())) + type + data + be32(crc32(type + data));
  };
  const std::string ihdr = be32(static_cast<uint32_t>(w)) + be32(static_cast<uint32_t>(h)) + std::string("\x08\x02\x00\x00\x00", 5);
  std::ofstream(path, std::ios::binary) << std::string("\x89PNG\r\n\x1a\n", 8) << chunk("IHDR", ihdr) << chunk("IDAT", z)
                                        << chunk("IEND", "");
}

sluice::testing::Result ok(const std::vector<std::string>& args) {
  const auto r = run_cli(args);
  INFO(r.err);
  REQUIRE(r.status == 0);
  return r;
}

// `sluice run` of anima-tiny, `steps` steps at 64 px in fp32, with `more` flags: its latent
// and its stdout.
std::pair<at::Tensor, std::string> run_tiny(int steps, const std::string& out, const std::vector<std::string>& more) {
  std::vector<std::string> args = {"run", "--synthetic", "anima-tiny", "--steps", std::to_string(steps),
                                   "--resolution", "64", "--compute", "float32", "--output", out};
  args.insert(args.end(), more.begin(), more.end());
  const auto r = ok(args);
  return {sluice::safetensors::File::open(out)->read("latent"), r.out};
}

}  // namespace

TEST_CASE("lllite cli: sluice forward --lllite reads lllite_cond, weight 0 is the plain output, bad specs are one line",
          "[strict]") {
  TempDir dir;
  const std::string ck = dir / "ck.safetensors", ll = dir / "ll.safetensors", in = dir / "in.safetensors";
  ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "3", "--out", ck, "--dtype", "float32"});
  sluice::safetensors::save(ll, sluice::testing::lllite_file({}), {});
  at::manual_seed(4);
  sluice::safetensors::save(in, {{"x", at::randn({1, 16, 1, 8, 8})}, {"timesteps", at::full({1}, 0.5)},
                                 {"context", at::randn({1, 6, 32})}, {"lllite_cond", at::rand({3, 50, 41})}},
                            {});
  const std::vector<std::string> base = {"forward", "--checkpoint", ck, "--inputs", in, "--compute", "float32"};
  auto forward = [&](const std::string& out, const std::vector<std::string>& more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), {"--output", out});
    args.insert(args.end(), more.begin(), more.end());
    ok(args);
    return sluice::safetensors::File::open(out)->read("velocity");
  };
  const at::Tensor off = forward(dir / "off.safetensors", {"--lllite", ll + ":0"});
  const at::Tensor on = forward(dir / "on.safetensors", {"--lllite", ll + ":0.8"});
  CHECK_FALSE(at::equal(on, off));
  // Without --lllite the file's lllite_cond is refused, by name; with it the plain output is weight 0's.
  auto r = run_cli({"forward", "--checkpoint", ck, "--inputs", in, "--output", dir / "x.safetensors"});
  CHECK(r.status == 1);
  CHECK(r.err == "sluice: error: inputs file '" + in + "' has LLLite inputs (lllite_cond/lllite_mask) but no --lllite\n");
  r = run_cli({"forward", "--checkpoint", ck, "--inputs", in, "--output", dir / "x.safetensors", "--lllite", ll + ":abc"});
  CHECK(r.status == 2);
  CHECK(r.err.find("--lllite '" + ll + ":abc': weight 'abc' is not a number (want FILE[:WEIGHT])") != std::string::npos);
  r = run_cli({"forward", "--checkpoint", ck, "--inputs", in, "--output", dir / "x.safetensors", "--lllite", ll + ":11"});
  CHECK(r.status == 2);
  CHECK(r.err.find("weight 11 is outside -10..10") != std::string::npos);
  r = run_cli({"forward", "--checkpoint", ck, "--inputs", in, "--output", dir / "x.safetensors", "--lllite", ll + ":1:0:1"});
  CHECK(r.status == 2);
  CHECK(r.err.find("3 values after the file (want FILE[:WEIGHT])") != std::string::npos);
  for (const auto& e : {r.err}) CHECK(std::count(e.begin(), e.end(), '\n') == 1);
}

TEST_CASE("lllite cli: sluice run --lllite with a PNG control image and a step range", "[strict]") {
  TempDir dir;
  const std::string ll = dir / "ll.safetensors", png = dir / "edges.png";
  sluice::safetensors::save(ll, sluice::testing::lllite_file({}), {});
  at::manual_seed(5);
  write_png(png, at::randint(0, 256, {37, 29, 3}).to(at::kByte));
  auto run = [&](const std::string& out, const std::vector<std::string>& more) { return run_tiny(4, out, more); };
  const at::Tensor plain = run(dir / "plain.safetensors", {}).first;
  const auto [zero, zero_out] = run(dir / "zero.safetensors", {"--lllite", ll + ":0", "--control-image", png});
  CHECK(at::equal(zero, plain));
  CHECK(zero_out.find("lllite: " + ll + ", weight 0 for steps 0..1 of the run, 10 modules on 10 layers") !=
        std::string::npos);
  const at::Tensor all = run(dir / "all.safetensors", {"--lllite", ll + ":1", "--control-image", png}).first;
  const at::Tensor late = run(dir / "late.safetensors", {"--lllite", ll + ":1:0.75:1", "--control-image", png}).first;
  CHECK_FALSE(at::equal(all, plain));
  CHECK_FALSE(at::equal(late, plain));
  CHECK_FALSE(at::equal(late, all));
  // begin > end, a missing image, an unreadable PNG: one line each.
  auto r = run_cli({"run", "--synthetic", "anima-tiny", "--steps", "1", "--resolution", "64", "--lllite", ll + ":1:0.6:0.5",
                    "--control-image", png});
  CHECK(r.status == 2);
  CHECK(r.err.find("begin 0.6 and end 0.5 must satisfy 0 <= begin <= end <= 1") != std::string::npos);
  r = run_cli({"run", "--synthetic", "anima-tiny", "--steps", "1", "--resolution", "64", "--lllite", ll});
  CHECK(r.status == 2);
  r = run_cli({"run", "--synthetic", "anima-tiny", "--steps", "1", "--resolution", "64", "--lllite", ll,
               "--control-image", ll});
  CHECK(r.status == 1);
  CHECK(r.err.rfind("sluice: error: cannot read PNG '" + ll + "'", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
}

TEST_CASE("lllite cli: sluice run with an inpaint adapter takes --control-mask, and refuses it missing or superfluous",
          "[strict]") {
  TempDir dir;
  const std::string ll = dir / "inpaint.safetensors", rgb_ll = dir / "rgb.safetensors", png = dir / "image.png";
  const std::string left = dir / "left.png", right = dir / "right.png";
  sluice::testing::LLLiteFileSpec spec;
  spec.in_channels = 4;  // RGB + the inpaint mask
  sluice::safetensors::save(ll, sluice::testing::lllite_file(spec), {});
  sluice::safetensors::save(rgb_ll, sluice::testing::lllite_file({}), {});
  at::manual_seed(6);
  write_png(png, at::randint(0, 256, {40, 32, 3}).to(at::kByte));
  // Two masks of the same size: the left half to inpaint, or the right half (white = 1 = inpaint).
  at::Tensor l = at::zeros({40, 32, 3}, at::kByte);
  l.narrow(1, 0, 16).fill_(255);
  write_png(left, l);
  write_png(right, at::full({40, 32, 3}, 255, at::kByte) - l);
  auto run = [&](const std::string& out, const std::vector<std::string>& more) { return run_tiny(3, out, more); };
  const at::Tensor plain = run(dir / "plain.safetensors", {}).first;
  const auto [on_left, out] =
      run(dir / "left.safetensors", {"--lllite", ll, "--control-image", png, "--control-mask", left});
  CHECK(out.find("lllite: " + ll + ", weight 1 for steps 0..1 of the run, 10 modules on 10 layers") != std::string::npos);
  CHECK(out.find(", control image " + png + ", mask " + left + "\n") != std::string::npos);
  const at::Tensor on_right =
      run(dir / "right.safetensors", {"--lllite", ll, "--control-image", png, "--control-mask", right}).first;
  CHECK(at::isfinite(on_left).all().item<bool>());
  CHECK_FALSE(at::equal(on_left, plain));
  CHECK_FALSE(at::equal(on_left, on_right));  // the mask reaches the adapter's trunk
  // The mask is the adapter's 4th channel: missing for an inpaint adapter, superfluous for an
  // RGB one; and a mask without --control-image is a flag error naming it.
  auto r = run_cli({"run", "--synthetic", "anima-tiny", "--steps", "1", "--resolution", "64", "--lllite", ll,
                    "--control-image", png});
  CHECK(r.status == 1);
  CHECK(r.err == "sluice: error: LLLite '" + ll +
                     "' is an inpaint adapter (4 input channels): it needs a mask (1 = inpaint, 0 = keep)\n");
  r = run_cli({"run", "--synthetic", "anima-tiny", "--steps", "1", "--resolution", "64", "--lllite", rgb_ll,
               "--control-image", png, "--control-mask", left});
  CHECK(r.status == 1);
  CHECK(r.err == "sluice: error: LLLite '" + rgb_ll + "' takes an RGB image only (3 input channels): it takes no mask\n");
  r = run_cli({"run", "--synthetic", "anima-tiny", "--steps", "1", "--resolution", "64", "--lllite", ll,
               "--control-mask", left});
  CHECK(r.status == 2);
  CHECK(r.err == "sluice: error: --lllite requires --control-image; run 'sluice run --help'\n");
}
