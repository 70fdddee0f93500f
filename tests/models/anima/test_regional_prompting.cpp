// Regional prompting (Note [cross-attention mask] in models/anima/anima.h): the model's
// forward with a boolean cross-attention mask on chosen blocks, and the public API's
// ForwardOptions carrying it through resident and streamed forwards, and `sluice forward`'s
// cross_attn_mask input. Parity with InvokeAI's patch is tests/python/test_regional_parity.py.
#include <sluice/sluice.hpp>

#include <ATen/ATen.h>

#include <catch2/catch.hpp>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "models/anima/anima.h"
#include "models/anima/generator.h"
#include "runtime/error.h"
#include "runtime/safetensors.h"
#include "tests/support/cli_runner.h"  // sluice forward
#include "tests/support/device_env.h"  // SLUICE_TEST_DEVICE

using namespace sluice::anima;

namespace {

// anima-tiny with `blocks` blocks and the generator's random weights (seeded).
AnimaModel random_model(int64_t blocks, uint64_t seed = 1) {
  AnimaConfig config = preset("anima-tiny");
  config.num_blocks = blocks;
  AnimaModel model(config, BuildOptions{at::kFloat, at::kCPU});
  const auto weights = random_weights(config, seed, at::kFloat);
  auto params = model->named_parameters();
  REQUIRE(weights.size() == params.size());
  for (const auto& [name, t] : weights) params[name].set_data(t);
  return model;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const sluice::InvalidArgument& e) {
    return e.what();
  }
  return "<no InvalidArgument thrown>";
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// x [1, 16, 1, 7, 6]: padded to 8 x 6, so L = 1 * 4 * 3 = 12 image tokens; S = 5.
struct Inputs {
  at::Tensor x = at::randn({1, 16, 1, 7, 6}, at::detail::createCPUGenerator(3));
  at::Tensor t = at::full({1}, 0.6);
  at::Tensor ctx = at::randn({1, 5, 32}, at::detail::createCPUGenerator(4));
  static constexpr int64_t L = 12, S = 5;
};

// A random boolean [L, S] mask whose every row has at least one True.
at::Tensor random_mask(int64_t L, int64_t S, uint64_t seed) {
  at::Tensor m = at::rand({L, S}, at::detail::createCPUGenerator(seed)) > 0.5;
  m.select(1, 0).copy_(m.select(1, 0).logical_or(m.logical_not().all(1)));
  return m;
}

CrossAttnMask on(const at::Tensor& mask, std::vector<int64_t> blocks = {}) { return CrossAttnMask{mask, std::move(blocks)}; }

}  // namespace

TEST_CASE("regional prompting: an all-True mask on every block gives the unmasked output", "[strict]") {
  AnimaModel model = random_model(4);
  const Inputs in;
  const at::Tensor plain = model->forward(in.x, in.t, in.ctx);
  const at::Tensor all_true = at::ones({Inputs::L, Inputs::S}, at::kBool);
  const at::Tensor y = model->forward(in.x, in.t, in.ctx, on(all_true, {0, 1, 2, 3}));
  CHECK(max_diff(y, plain) <= 1e-6);
  // An undefined mask is the plain forward, whatever the blocks.
  CHECK(at::equal(model->forward(in.x, in.t, in.ctx, on(at::Tensor(), {1})), plain));
}

TEST_CASE("regional prompting: the mask changes the output, on the even blocks by default", "[strict]") {
  AnimaModel model = random_model(4);
  const Inputs in;
  const at::Tensor plain = model->forward(in.x, in.t, in.ctx);
  const at::Tensor mask = random_mask(Inputs::L, Inputs::S, 7);
  const at::Tensor by_default = model->forward(in.x, in.t, in.ctx, on(mask));
  CHECK(max_diff(by_default, plain) > 1e-3);
  CHECK(at::equal(by_default, model->forward(in.x, in.t, in.ctx, on(mask, {0, 2}))));
  CHECK(at::equal(by_default, model->forward(in.x, in.t, in.ctx, on(mask, {2, 0, 2}))));  // a set
  CHECK(max_diff(by_default, model->forward(in.x, in.t, in.ctx, on(mask, {1, 3}))) > 1e-4);
  CHECK(max_diff(by_default, model->forward(in.x, in.t, in.ctx, on(mask, {0, 1, 2, 3}))) > 1e-4);
  // [B, L, S] with B = 1 is the same mask; a batch of two takes one mask per item.
  CHECK(at::equal(by_default, model->forward(in.x, in.t, in.ctx, on(mask.unsqueeze(0)))));
  const at::Tensor other = random_mask(Inputs::L, Inputs::S, 8);
  const at::Tensor y2 = model->forward(at::cat({in.x, in.x}), at::cat({in.t, in.t}), at::cat({in.ctx, in.ctx}),
                                       on(at::stack({mask, other})));
  CHECK(max_diff(y2.narrow(0, 0, 1), by_default) <= 1e-5);  // batched matmuls round differently
  CHECK(max_diff(y2.narrow(0, 1, 1), model->forward(in.x, in.t, in.ctx, on(other))) <= 1e-5);
}

TEST_CASE("regional prompting: an image token whose row has no True gets no cross-attention, not NaN", "[strict]") {
  AnimaModel model = random_model(2);
  const Inputs in;
  // A mask that is all False on every block: cross-attention contributes nothing anywhere,
  // so the output is finite and the context no longer matters.
  const at::Tensor none = at::zeros({Inputs::L, Inputs::S}, at::kBool);
  const at::Tensor y = model->forward(in.x, in.t, in.ctx, on(none, {0, 1}));
  CHECK(at::isfinite(y).all().item<bool>());
  const at::Tensor other_ctx = at::randn({1, Inputs::S, 32}, at::detail::createCPUGenerator(9));
  CHECK(at::equal(y, model->forward(in.x, in.t, other_ctx, on(none, {0, 1}))));
  CHECK_FALSE(at::allclose(model->forward(in.x, in.t, in.ctx), model->forward(in.x, in.t, other_ctx)));
  // One empty row among attending ones: finite, and different from the all-True output.
  at::Tensor one_empty = at::ones({Inputs::L, Inputs::S}, at::kBool);
  one_empty[5].fill_(false);
  const at::Tensor y1 = model->forward(in.x, in.t, in.ctx, on(one_empty));
  CHECK(at::isfinite(y1).all().item<bool>());
  CHECK(max_diff(y1, model->forward(in.x, in.t, in.ctx)) > 1e-4);
}

TEST_CASE("regional prompting: a mask of the wrong dtype or shape, or a block out of range, is refused in one line",
          "[strict]") {
  AnimaModel model = random_model(2);
  const Inputs in;
  const at::Tensor good = at::ones({Inputs::L, Inputs::S}, at::kBool);
  const std::string dtype = message_of([&] { model->forward(in.x, in.t, in.ctx, on(good.to(at::kFloat))); });
  CHECK(dtype == "cross_attn_mask has dtype Float, expected Bool (True: the image token attends to the context token)");
  const std::string shape = message_of([&] { model->forward(in.x, in.t, in.ctx, on(good.narrow(0, 0, 10))); });
  CHECK(shape ==
        "cross_attn_mask has shape [10, 5], expected [L, S] = [12, 5] or [1, 12, 5] (L = image tokens 1*4*3 of x "
        "[1, 16, 1, 7, 6], padded to the patch grid, S = context tokens)");
  CHECK(message_of([&] { model->forward(in.x, in.t, in.ctx, on(at::ones({2, 12, 5}, at::kBool))); })
            .find("has shape [2, 12, 5], expected [L, S] = [12, 5]") != std::string::npos);
  CHECK(message_of([&] { model->forward(in.x, in.t, in.ctx, on(at::ones({12, 6}, at::kBool))); })
            .find("= [12, 5]") != std::string::npos);
  const std::string block = message_of([&] { model->forward(in.x, in.t, in.ctx, on(good, {0, 2})); });
  CHECK(block == "mask_blocks has block 2, the model has 2 blocks (0..1)");
  CHECK(message_of([&] { model->forward(in.x, in.t, in.ctx, on(good, {-1})); }) ==
        "mask_blocks has block -1, the model has 2 blocks (0..1)");
  for (const std::string& m : {dtype, shape, block}) CHECK(m.find('\n') == std::string::npos);
}

// ---------------------------------------------------------------------------------------
// Through the public API.

namespace {

sluice::RuntimeOptions api_options() {
  sluice::RuntimeOptions o;
  o.device = sluice::testing::test_device_spec();  // "cpu" unless SLUICE_TEST_DEVICE names another
  o.vram_budget = "512MiB";
  o.working_memory = "1MiB";
  o.ram_limit = "0";
  return o;
}

}  // namespace

TEST_CASE("regional prompting: api: resident and half-resident forwards with a mask agree bit for bit",
          "[strict][accel]") {
  sluice::ModelCache cache(api_options());
  sluice::Model model = cache.load("anima-small");  // 8 blocks, context_dim 128
  const sluice::ModelInfo info = model.info();
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor x = at::randn({2, info.in_channels, 1, 8, 6}, gen);
  const at::Tensor t = at::rand({2}, gen);
  const at::Tensor ctx = at::randn({2, 6, info.context_dim}, gen);
  const int64_t L = 4 * 3;  // T' * ceil(8 / 2) * ceil(6 / 2)
  at::Tensor mask = at::rand({2, L, 6}, gen) > 0.4;
  mask.select(2, 0).fill_(true);

  sluice::ForwardOptions fo;
  fo.cross_attn_mask = mask;
  int64_t calls = 0;
  fo.progress = [&](int64_t, int64_t) { ++calls; };
  sluice::LockedModel m = model.lock();
  const at::Tensor plain = m(x, t, ctx);
  const at::Tensor resident = m.forward(x, t, ctx, fo);
  CHECK(calls > 0);
  CHECK((resident - plain).abs().max().item<double>() > 1e-4);
  // Every block masked is another output; an all-True mask is the plain one.
  sluice::ForwardOptions all = fo;
  all.mask_blocks = {0, 1, 2, 3, 4, 5, 6, 7};
  CHECK_FALSE(at::equal(m.forward(x, t, ctx, all), resident));
  all.cross_attn_mask = at::ones({L, 6}, at::kBool);
  CHECK((m.forward(x, t, ctx, all) - plain).abs().max().item<double>() <= 1e-6);
  CHECK_FALSE(m.locate_nonfinite(x, t, ctx, fo).has_value());
  m.unlock();

  model.set_max_resident(0.5);
  sluice::LockedModel half = model.lock();
  REQUIRE(model.stats().streamed_dit_bytes > 0);
  CHECK(at::equal(half.forward(x, t, ctx, fo), resident));

  // The refusals reach the caller as they are.
  sluice::ForwardOptions bad;
  bad.cross_attn_mask = mask.to(at::kByte);
  CHECK_THROWS_WITH(half.forward(x, t, ctx, bad), Catch::Contains("cross_attn_mask has dtype Byte, expected Bool"));
  bad.cross_attn_mask = mask;
  bad.mask_blocks = {8};
  CHECK_THROWS_WITH(half.forward(x, t, ctx, bad), "mask_blocks has block 8, the model has 8 blocks (0..7)");
  bad.cross_attn_mask = at::Tensor();
  CHECK_THROWS_WITH(half.forward(x, t, ctx, bad), "input 'cross_attn_mask' is undefined");
  CHECK(at::equal(half.forward(x, t, ctx, fo), resident));  // still fine afterwards
}

// ---------------------------------------------------------------------------------------
// `sluice forward`: cross_attn_mask from the inputs file, --mask-blocks.

TEST_CASE("regional prompting: sluice forward reads cross_attn_mask from its inputs and --mask-blocks") {
  using sluice::testing::expect_error;
  using sluice::testing::run_ok;
  sluice::testing::TempDir dir;
  const std::string ckpt = dir / "tiny.safetensors";
  run_ok({"make-checkpoint", "--config", "anima-tiny", "--seed", "1", "--out", ckpt});  // 2 blocks
  at::Generator gen = at::detail::createCPUGenerator(6);
  const at::Tensor x = at::randn({1, 16, 1, 8, 8}, gen), t = at::full({1}, 0.5), ctx = at::randn({1, 5, 32}, gen);
  const at::Tensor mask = random_mask(16, 5, 10);  // L = 1 * 4 * 4
  const auto inputs = [&](const std::string& name, std::optional<at::Tensor> m) {
    std::vector<std::pair<std::string, at::Tensor>> in = {{"x", x}, {"timesteps", t}, {"context", ctx}};
    if (m) in.emplace_back("cross_attn_mask", *m);
    sluice::safetensors::save(dir / name, in);
    return dir / name;
  };
  const std::string plain_in = inputs("plain_in.safetensors", std::nullopt);
  const std::string bool_in = inputs("bool_in.safetensors", mask);
  const std::string byte_in = inputs("byte_in.safetensors", mask.to(at::kByte));
  const auto forward = [&](const std::string& in, const std::vector<std::string>& extra) {
    const std::string out = dir / "out.safetensors";
    std::vector<std::string> args{"forward", "--checkpoint", ckpt, "--inputs", in, "--output", out,
                                  "--storage", "float32", "--compute", "float32"};
    args.insert(args.end(), extra.begin(), extra.end());
    run_ok(args);
    return sluice::safetensors::File::open(out)->tensor("velocity").clone();
  };
  const at::Tensor plain = forward(plain_in, {});
  const at::Tensor even = forward(bool_in, {});
  CHECK(max_diff(even, plain) > 1e-4);
  CHECK(at::equal(forward(byte_in, {"--mask-blocks", "even"}), even));
  CHECK(at::equal(forward(bool_in, {"--mask-blocks", "0"}), even));
  const at::Tensor all = forward(byte_in, {"--mask-blocks", "all"});
  CHECK(at::equal(forward(bool_in, {"--mask-blocks", "0,1"}), all));
  CHECK_FALSE(at::equal(all, even));
  CHECK_FALSE(at::equal(forward(bool_in, {"--mask-blocks", "odd"}), even));

  const std::string out = dir / "bad.safetensors";
  const std::vector<std::string> base{"forward", "--checkpoint", ckpt, "--output", out, "--inputs"};
  auto with = [&](const std::string& in, const std::vector<std::string>& extra) {
    std::vector<std::string> a = base;
    a.push_back(in);
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  expect_error(with(bool_in, {"--mask-blocks", "2"}), 1, {"--mask-blocks has block 2, the model has 2 blocks (0..1)"});
  expect_error(with(bool_in, {"--mask-blocks", "0,x"}), 1,
               {"--mask-blocks '0,x' is not even, odd, all or comma-separated block indices"});
  expect_error(with(plain_in, {"--mask-blocks", "odd"}), 1, {"--mask-blocks needs a 'cross_attn_mask'", plain_in});
  const std::string float_in = inputs("float_in.safetensors", mask.to(at::kFloat));
  expect_error(with(float_in, {}), 1, {"input 'cross_attn_mask'", float_in, "has dtype Float, expected bool or uint8"});
  const std::string short_in = inputs("short_in.safetensors", mask.narrow(0, 0, 15));
  expect_error(with(short_in, {}), 1, {"cross_attn_mask has shape [15, 5], expected [L, S] = [16, 5]"});
}

TEST_CASE("regional prompting: sluice run takes --cross-attn-mask for its conditional forwards") {
  using sluice::testing::run_ok;
  sluice::testing::TempDir dir;
  at::Generator gen = at::detail::createCPUGenerator(12);
  const std::string ctx = dir / "ctx.safetensors";
  sluice::safetensors::save(ctx, {{"context", at::randn({1, 5, 32}, gen)}});
  const at::Tensor mask = random_mask(16, 5, 13);  // 64 px: latent 8 x 8, L = 4 * 4
  const auto save_mask = [&](const std::string& name, const at::Tensor& m) {
    sluice::safetensors::save(dir / name, {{"cross_attn_mask", m}});
    return dir / name;
  };
  const std::string bool_mask = save_mask("bool.safetensors", mask), byte_mask = save_mask("byte.safetensors", mask.to(at::kByte));
  const auto run = [&](const std::vector<std::string>& extra) {
    const std::string out = dir / "latent.safetensors";
    std::vector<std::string> args{"run", "--device", "cpu", "--synthetic", "anima-tiny", "--steps", "2",
                                  "--resolution", "64", "--compute", "float32", "--context", ctx, "--output", out};
    args.insert(args.end(), extra.begin(), extra.end());
    const sluice::testing::Result r = run_ok(args);
    return std::make_pair(sluice::safetensors::File::open(out)->tensor("latent").clone(), r.out);
  };
  const auto [plain, plain_out] = run({});
  const auto [masked, masked_out] = run({"--cross-attn-mask", bool_mask});
  CHECK(masked_out.find("regional prompting: cross_attn_mask [1, 16, 5] from " + bool_mask + ", blocks even") !=
        std::string::npos);
  CHECK(plain_out.find("regional prompting") == std::string::npos);
  CHECK(max_diff(masked, plain) > 1e-5);
  CHECK(at::equal(run({"--cross-attn-mask", byte_mask, "--mask-blocks", "0"}).first, masked));
  CHECK_FALSE(at::equal(run({"--cross-attn-mask", bool_mask, "--mask-blocks", "all"}).first, masked));

  const std::vector<std::string> base{"run", "--device", "cpu", "--synthetic", "anima-tiny", "--steps", "1",
                                      "--resolution", "64", "--context", ctx};
  auto with = [&](const std::vector<std::string>& extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  // sluice run has printed its load lines by then: one error line, exit status 1.
  const auto expect_run_error = [&](const std::vector<std::string>& extra, const std::string& line) {
    const sluice::testing::Result r = sluice::testing::run_cli(with(extra));
    INFO(sluice::testing::describe(with(extra), r));
    CHECK(r.status == 1);
    CHECK(r.err == "sluice: error: " + line + "\n");
  };
  const std::string short_mask = save_mask("short.safetensors", mask.narrow(1, 0, 4));
  expect_run_error({"--cross-attn-mask", short_mask},
                   "tensor 'cross_attn_mask' in '" + short_mask + "' has shape [16, 4], expected [L, S] = [16, 5] or "
                   "[1, 16, 5] (L = image tokens 4*4 of the 8x8 latent, S = context tokens)");
  const std::string float_mask = save_mask("float.safetensors", mask.to(at::kFloat));
  expect_run_error({"--cross-attn-mask", float_mask},
                   "tensor 'cross_attn_mask' in '" + float_mask + "' has dtype Float, expected bool or uint8");
  expect_run_error({"--mask-blocks", "odd"}, "--mask-blocks needs --cross-attn-mask");
  expect_run_error({"--cross-attn-mask", bool_mask, "--mask-blocks", "9"},
                   "--mask-blocks has block 9, the model has 2 blocks (0..1)");
}
