// sluice_bench_compute: what each compute dtype costs and how far it lands from fp32, on
// this machine, for Anima (issue 28). Baseline: the fp32 forward of the same weights and
// inputs in the same run.
//
// For each configuration it builds one random-weight model in fp32 (anima::random_weights),
// copies it to bfloat16 and float16, runs one DiT forward of each on the same inputs (noise,
// a timestep, a random context of unit variance) and prints:
//   - the time of a forward (best of --reps) and its ratio to fp32's;
//   - the velocity's error against fp32: relative L2 (||v - v32|| / ||v32||), the largest
//     absolute difference, and non-finite values;
//   - the largest |output| of any module computing in the compute dtype in the fp32
//     forward (Note [layer output observer]), against fp16's largest finite 65504;
//   - fp16's headroom: the smallest power-of-two factor on every Linear weight (up to
//     --sweep-max) at which the fp16 velocity goes non-finite (activations past 65504);
//   - what `compute auto` picks here, and why.
// fp16 on a CPU without fp16 matrix instructions runs at ~1 GFLOP/s: its time is printed
// but the point is its error. --no-fp16-time skips the fp16 timing reps.
//
//   sluice_bench_compute [--configs anima-tiny:32,anima-small:32,anima-medium:64] [--reps 3]
//                        [--sigma 1.0] [--weight-scale 1]
//
// --weight-scale multiplies every Linear weight (a stand-in for trained weights whose
// activations run larger than random ones).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "models/anima/anima.h"
#include "models/anima/config.h"
#include "models/anima/generator.h"
#include "offload/layer/output_observer.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/hardware.h"

namespace {

using sluice::anima::AnimaModel;

AnimaModel build(const sluice::anima::AnimaConfig& cfg, at::ScalarType dtype, uint64_t seed, double weight_scale) {
  AnimaModel m(cfg, sluice::anima::BuildOptions{dtype, at::kCPU});
  const auto weights = sluice::anima::random_weights(cfg, seed, at::kFloat);
  auto params = m->named_parameters(true);
  auto buffers = m->named_buffers(true);
  for (const auto& [name, t] : weights) {
    at::Tensor w = t;
    if (weight_scale != 1.0 && name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0 && t.dim() == 2)
      w = t * weight_scale;
    if (auto* p = params.find(name)) {
      p->set_data(w.to(p->scalar_type()).contiguous());
    } else if (auto* b = buffers.find(name)) {
      b->set_data(w.to(b->scalar_type()).contiguous());
    }
  }
  return m;
}

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Row {
  std::string dtype;
  double ms = 0;
  double rel_l2 = 0, max_abs = 0;
  int64_t nonfinite = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sluice_bench_compute: time and error of bf16/fp16 against fp32 for Anima"};
  std::string configs = "anima-tiny:32,anima-small:32,anima-medium:64";
  int reps = 3;
  double sigma = 1.0, weight_scale = 1.0;
  bool no_fp16_time = false;
  double sweep_max = 64;
  app.add_option("--configs", configs, "preset:latent_side,... (latent side = pixels / 8)");
  app.add_option("--reps", reps, "Timed forwards per dtype (best is printed)")->check(CLI::Range(1, 100));
  app.add_option("--sigma", sigma, "Timestep of the forward (flow-matching sigma)");
  app.add_option("--weight-scale", weight_scale, "Multiply every Linear weight by this");
  app.add_option("--sweep-max", sweep_max, "Largest weight factor of the fp16 overflow sweep (below 2: no sweep)");
  app.add_flag("--no-fp16-time", no_fp16_time, "Run fp16 once (for its error) without timing reps");
  CLI11_PARSE(app, argc, argv);
  try {
    sluice::apply_cpu_onednn_env();
    c10::InferenceMode guard;
    std::printf("hardware: %s\n", sluice::hardware_summary(at::kCPU).c_str());
    std::printf("torch %s threads, oneDNN %s\n", std::to_string(at::get_num_threads()).c_str(),
                at::globalContext().userEnabledMkldnn() ? "on" : "off");
    const sluice::ComputeChoice c = sluice::choose_compute_dtype("auto", at::kCPU, sluice::anima::fp16_verdict());
    std::printf("compute auto here: %s (%s)\n", sluice::dtype_name(c.dtype).c_str(), c.reason.c_str());
    std::printf("weight scale %g, sigma %g\n\n", weight_scale, sigma);

    std::stringstream cs(configs);
    for (std::string item; std::getline(cs, item, ',');) {
      const auto colon = item.find(':');
      if (colon == std::string::npos) throw sluice::InvalidArgument("--configs: '" + item + "' is not preset:side");
      const auto cfg = sluice::anima::preset(item.substr(0, colon));
      const int64_t side = std::stoll(item.substr(colon + 1));
      at::Generator gen = at::detail::createCPUGenerator(7);
      const at::Tensor x = at::randn({1, cfg.in_channels, 1, side, side}, gen);
      const at::Tensor t = at::full({1}, sigma, at::kFloat);
      const at::Tensor ctx = at::randn({1, 128, cfg.crossattn_emb_channels}, gen);

      AnimaModel m32 = build(cfg, at::kFloat, 1, weight_scale);
      // The largest |output| of any module that computes in the compute dtype (every Linear,
      // the timestep norm, the final layer; not the DiT blocks, whose residual stream stays
      // fp32 under fp16), seen through the layer output observer: what fp16 must hold.
      std::map<const torch::nn::Module*, std::string> names;
      for (const auto& item : m32->named_modules()) names[item.value().get()] = item.key();
      const std::regex block(R"(blocks\.\d+)");
      double peak = 0;
      std::string peak_module;
      at::Tensor v32;
      {
        sluice::offload::ObserveOutputs observe([&](const torch::nn::Module& mod, const at::Tensor& out) {
          const auto it = names.find(&mod);
          const std::string name = it == names.end() ? std::string("?") : it->second;
          if (std::regex_match(name, block)) return;
          const double a = out.abs().max().item<double>();
          if (a > peak) peak = a, peak_module = name;
        });
        v32 = m32->forward(x, t, ctx);
      }
      std::vector<Row> rows;
      double ms32 = std::numeric_limits<double>::infinity();
      for (int r = 0; r < reps; ++r) ms32 = std::min(ms32, 1e3 * seconds_of([&] { (void)m32->forward(x, t, ctx); }));
      rows.push_back({"float32", ms32, 0, 0, 0});
      for (const at::ScalarType dt : {at::kBFloat16, at::kHalf}) {
        AnimaModel m = build(cfg, dt, 1, weight_scale);
        const at::Tensor xd = x.to(dt), cd = ctx.to(dt);
        at::Tensor v;
        double ms = 1e3 * seconds_of([&] { v = m->forward(xd, t, cd); });
        const int timed = (dt == at::kHalf && no_fp16_time) ? 0 : reps;
        for (int r = 0; r < timed; ++r) ms = std::min(ms, 1e3 * seconds_of([&] { (void)m->forward(xd, t, cd); }));
        const at::Tensor vf = v.to(at::kFloat);
        const at::Tensor finite = at::isfinite(vf);
        Row row;
        row.dtype = sluice::dtype_name(dt);
        row.ms = ms;
        row.nonfinite = vf.numel() - finite.sum().item<int64_t>();
        const at::Tensor diff = at::where(finite, vf - v32, at::zeros_like(vf));
        row.rel_l2 = (diff.norm() / v32.norm()).item<double>();
        row.max_abs = diff.abs().max().item<double>();
        rows.push_back(row);
      }
      // How far the weights can grow before fp16 overflows: the smallest power-of-two
      // factor on every Linear weight whose fp16 velocity is non-finite.
      double overflow_scale = 0;
      for (double f = 2; f <= sweep_max && overflow_scale == 0; f *= 2) {
        AnimaModel m = build(cfg, at::kHalf, 1, weight_scale * f);
        const at::Tensor v = m->forward(x.to(at::kHalf), t, ctx.to(at::kHalf));
        if (!at::isfinite(v).all().item<bool>()) overflow_scale = f;
      }
      std::printf("%s: largest |output| in fp32 %.4g at %s, %.2g of fp16's 65504 (attention logits inside SDPA "
                  "not seen)\n",
                  cfg.name.c_str(), peak, peak_module.c_str(), peak / 65504.0);
      std::printf("%s, latent %lldx%lld (%lld tokens), %lld blocks, width %lld; |v| fp32 max %.3g; fp16 %s\n",
                  cfg.name.c_str(), static_cast<long long>(side), static_cast<long long>(side),
                  static_cast<long long>((side / cfg.patch_spatial) * (side / cfg.patch_spatial)),
                  static_cast<long long>(cfg.num_blocks), static_cast<long long>(cfg.model_channels),
                  v32.abs().max().item<double>(),
                  sweep_max < 2 ? "overflow sweep skipped"
                  : overflow_scale > 0
                      ? ("overflows with weights x" + std::to_string(static_cast<int>(overflow_scale))).c_str()
                      : ("finite up to weights x" + std::to_string(static_cast<int>(sweep_max))).c_str());
      std::printf("  %-9s %12s %12s %14s %12s %10s\n", "dtype", "ms/forward", "vs fp32", "rel L2 error", "max |err|",
                  "nonfinite");
      for (const Row& r : rows)
        std::printf("  %-9s %12.1f %11.2fx %14.3e %12.3e %10lld\n", r.dtype.c_str(), r.ms, r.ms / ms32, r.rel_l2,
                    r.max_abs, static_cast<long long>(r.nonfinite));
      std::printf("\n");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sluice_bench_compute: %s\n", e.what());
    return 1;
  }
}
