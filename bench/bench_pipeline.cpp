// sluice_bench_pipeline: the streaming pipeline on a real model (Anima presets) in
// CPU-as-device mode, with a slowed copy standing in for the bus.
//
// For each preset: a random-weight model in fp8 storage (bf16 compute), one guided
// sampling step (a DiT forward on a batch of 2, as `sluice run` does) timed through the
// StreamingEngine at max_resident 1, 0.75, 0.5, 0.25 and 0. Each row prints the step
// time (median), bytes streamed per step, the copy rate achieved, the compute time spent
// waiting on copies (stall), and two ratios:
//   vs resident: step time / the fully resident step of the same run (the baseline);
//   vs floor:    step time / max(compute, streamed bytes / copy rate), the best any
//                overlap could do (DESIGN.md §4), compute being the resident step.
// A "plain" row runs the same model with no engine (leases upcast in place) to show the
// engine's own overhead.
//
// The copy rate is set from the measured resident step so that streaming every
// streamable byte takes --copy-ratio times the compute (default 1.5: anima-2b at 1024^2
// on an H200 over PCIe Gen5, DESIGN.md §4, is about 38 ms of copy against 25 ms of
// compute). Rows then move from compute-bound to copy-bound as residency falls.
//
// One intra-op thread: the CPU device's copy worker needs the other core
// (offload/cpu_device.h).
//
//   sluice_bench_pipeline [--presets anima-small,anima-medium] [--latent PX] [--reps N]
//                         [--copy-ratio R] [--prefetch N] [--policy spread|front_first]
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "models/anima/anima.h"
#include "models/anima/generator.h"
#include "offload/cpu_device.h"
#include "offload/engine.h"
#include "offload/storage.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/logging.h"

using namespace sluice;
using namespace sluice::offload;

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<std::string> presets = {"anima-small", "anima-medium"};
  int64_t latent = 32;       // latent H = W (pixels / 8)
  int reps = 5;              // timed steps per row (after 2 warm-up steps)
  double copy_ratio = 1.5;   // streaming all streamable bytes takes this many computes
  uint32_t prefetch = 2;     // engine prefetch depth
  ResidencyPolicy policy = ResidencyPolicy::spread;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "sluice_bench_pipeline: %s\n", why.c_str());
  std::fprintf(stderr,
               "usage: sluice_bench_pipeline [--presets a,b] [--latent N] [--reps N] [--copy-ratio R] "
               "[--prefetch N] [--policy spread|front_first]\n");
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value for " + k);
      return argv[++i];
    };
    try {
      if (k == "--presets") {
        a.presets.clear();
        std::stringstream ss(value());
        for (std::string p; std::getline(ss, p, ',');)
          if (!p.empty()) a.presets.push_back(p);
      } else if (k == "--latent") {
        a.latent = std::stoll(value());
      } else if (k == "--reps") {
        a.reps = std::stoi(value());
      } else if (k == "--copy-ratio") {
        a.copy_ratio = std::stod(value());
      } else if (k == "--prefetch") {
        a.prefetch = static_cast<uint32_t>(std::stoul(value()));
      } else if (k == "--policy") {
        a.policy = parse_residency_policy(value(), "--policy");
      } else {
        usage("unknown argument " + k);
      }
    } catch (const std::exception& e) {
      usage("bad value for " + k + ": " + e.what());
    }
  }
  if (a.presets.empty() || a.latent < 2 || a.reps < 1 || !(a.copy_ratio > 0)) usage("bad arguments");
  return a;
}

// A random-weight model of `name` in fp8 storage, bf16 compute, on the host.
anima::AnimaModel make_model(const std::string& name) {
  const anima::AnimaConfig c = anima::preset(name);
  anima::AnimaModel m(c, anima::BuildOptions{at::kBFloat16, at::kCPU});
  auto params = m->named_parameters();
  for (const auto& [key, t] : anima::random_weights(c, /*seed=*/1, at::kBFloat16)) params[key].set_data(t);
  Fp8Options o;
  o.storage = at::kFloat8_e4m3fn;
  o.compute = at::kBFloat16;
  apply_storage(*m, c.name, o, anima::declared_fp8_skips());
  return m;
}

struct Inputs {
  at::Tensor x, t, ctx;
};

// One guided step's model call: a batch of 2 (uncond, cond), as the sampler makes it.
Inputs make_inputs(const anima::AnimaConfig& c, int64_t latent) {
  at::Generator gen = at::detail::createCPUGenerator(7);
  Inputs in;
  in.x = at::randn({2, c.in_channels, 1, latent, latent}, gen).to(at::kBFloat16);
  in.t = at::full({2}, 0.5f);
  in.ctx = at::randn({2, c.adapter.output_tokens, c.crossattn_emb_channels}, gen).to(at::kBFloat16);
  return in;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Row {
  std::string label;
  double step_ms = 0;
  double bytes = 0;  // streamed per step
  double gbps = 0;
  double stall_ms = 0;
  std::string map;
};

// Times `reps` steps after 2 warm-ups (the first records the layer order).
Row run_engine(anima::AnimaModel& model, const Inputs& in, const Args& a, std::optional<double> max_resident,
               double copy_rate) {
  CpuDeviceOptions d;
  d.copy_bytes_per_second = copy_rate;
  EngineOptions o;
  o.device = std::shared_ptr<DeviceBackend>(make_cpu_device(d));
  o.max_resident = max_resident;
  o.prefetch_depth = a.prefetch;
  o.policy = a.policy;
  StreamingEngine engine(o);
  engine.attach(*model, model->config().name);
  std::vector<double> ms;
  for (int i = 0; i < a.reps + 2; ++i) {
    const auto t0 = Clock::now();
    {
      ForwardScope scope(engine, "dit");
      model->forward(in.x, in.t, in.ctx);
    }
    if (i >= 2) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  const EngineStats s = engine.stats();
  Row r;
  r.step_ms = median(ms);
  const size_t n = std::min(s.forward_records.size(), static_cast<size_t>(a.reps));
  for (size_t i = s.forward_records.size() - n; i < s.forward_records.size(); ++i) {
    const auto& f = s.forward_records[i];
    r.bytes += static_cast<double>(f.bytes_streamed) / static_cast<double>(n);
    r.gbps += f.h2d_gbps / static_cast<double>(n);
    r.stall_ms += f.stall_ms / static_cast<double>(n);
  }
  r.map = engine.plan().residency_map();
  if (s.slot_violations != 0) std::fprintf(stderr, "warning: %llu slot violations\n", (unsigned long long)s.slot_violations);
  engine.detach();
  return r;
}

Row run_plain(anima::AnimaModel& model, const Inputs& in, const Args& a) {
  std::vector<double> ms;
  for (int i = 0; i < a.reps + 2; ++i) {
    const auto t0 = Clock::now();
    model->forward(in.x, in.t, in.ctx);
    if (i >= 2) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  Row r;
  r.label = "plain (no engine)";
  r.step_ms = median(ms);
  r.map = "-";
  return r;
}

uint64_t streamable_bytes(anima::AnimaModel& model) {
  EngineOptions o;
  o.max_resident = 0.0;
  o.timing = false;
  StreamingEngine e(o);
  e.attach(*model, model->config().name);
  const uint64_t b = e.plan().streamed_bytes;
  e.detach();
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  at::set_num_threads(1);
  log::set_level(log::Level::warn);
  c10::InferenceMode guard;

  for (const auto& name : a.presets) {
    anima::AnimaModel model = make_model(name);
    const Inputs in = make_inputs(model->config(), a.latent);
    const uint64_t streamable = streamable_bytes(model);

    std::vector<Row> rows;
    rows.push_back(run_plain(model, in, a));
    Row resident = run_engine(model, in, a, 1.0, 0);
    const double compute_ms = resident.step_ms;
    const double rate = static_cast<double>(streamable) / (a.copy_ratio * compute_ms / 1000.0);
    resident.label = "max_resident 1.00";
    rows.push_back(resident);
    for (double f : {0.75, 0.5, 0.25, 0.0}) {
      Row r = run_engine(model, in, a, f, rate);
      char label[64];
      std::snprintf(label, sizeof label, "max_resident %.2f", f);
      r.label = label;
      rows.push_back(r);
    }

    std::printf("\n%s, latent %lldx%lld (%lld px), batch 2 (cfg), fp8 storage, bf16 compute, prefetch %u, %s\n",
                name.c_str(), (long long)a.latent, (long long)a.latent, (long long)(a.latent * 8), a.prefetch,
                residency_policy_name(a.policy));
    std::printf("streamable %.1f MB; copy rate %.1f MB/s (all streamable bytes = %.2fx the resident step of %.1f ms)\n",
                static_cast<double>(streamable) / 1e6, rate / 1e6, a.copy_ratio, compute_ms);
    std::printf("%-18s %9s %10s %8s %9s %9s %8s %8s  %s\n", "config", "step ms", "MB/step", "MB/s", "stall ms",
                "floor ms", "/resid", "/floor", "residency");
    for (const Row& r : rows) {
      const double floor = std::max(compute_ms, r.bytes / rate * 1000.0);
      std::printf("%-18s %9.1f %10.2f %8.1f %9.1f %9.1f %8.3f %8.3f  %s\n", r.label.c_str(), r.step_ms, r.bytes / 1e6,
                  r.gbps * 1e3, r.stall_ms, floor, r.step_ms / compute_ms, r.step_ms / floor, r.map.c_str());
    }
    std::fflush(stdout);
  }
  return 0;
}
