// sluice_bench_pipeline: the streaming pipeline on a real model (Anima presets), swept
// over residency, on the CPU device (with a slowed copy standing in for the bus) or on a
// GPU (bench/gpu/device_all.sh runs it there for anima-2b).
//
// First it measures the copy rates the floor is computed from: host->device from pinned
// and from pageable memory, and device->device. Then, for each preset and resolution: a
// random-weight model, one guided sampling step (a DiT forward on a batch of 2, as
// `sluice run` makes it) through the StreamingEngine for
//   bf16 resident    bf16 storage, every layer on the device
//   fp8 resident     fp8 storage (bf16 compute), every layer on the device: the baseline
//   max_resident F   fp8, at most F of the streamable bytes resident, the rest streamed
// with F in 0.75, 0.5, 0.25, 0, and for each --budgets B (none by default; e.g. 8GiB for
//   budget B         an 8 GB card) fp8 under a device budget of B bytes, working memory
//                    included (sized for the resolution as `sluice run` sizes it), no cap:
//                    the residency the budget allows.
// With --storages bfloat16 the same rows run on bf16 storage: the streamed bytes are the
// bf16 weights themselves (no upcast), over the same bus, and compute is the bf16 resident
// step.
// Each row prints the step time (the mean of --reps forwards run back to back), bytes
// streamed per step, the H2D rate the copy stream achieved, the compute time spent waiting
// on copies (stall), the peak device bytes the engine held, and these ratios:
//   /base:  step time / the resident step of the same storage in the same run;
//   /floor: step time / max(compute, streamed bytes / H2D rate), compute being that
//           resident step: the best any overlap could do;
//   pred ms, pred/meas: the plan's predicted step (Note [cost model], from the first
//           forward's measurements) and its ratio to the measured step; "R" marks a plan
//           made again because the check forward was more than 15% off.
// Warm-up forwards (4 by default) cover the plan's calibration: the first forward is
// measured, the plan is made, the next warms the ring and the one after is checked.
//
// Note [back-to-back forwards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The forwards of a row run back to back, with one synchronize after the warm-ups and one
// after the last measured forward, and the step is their mean. A synchronize after every
// forward (as this bench did up to commit 30b3651) is not what a sampling loop does, and
// it costs a streamed plan time no real loop loses: the copy stream drains the prefetches
// of the next forward, the ring is then full, and the next forward's first resident layers
// compute while the copy stream idles. Where copies decide the step that idle time is added
// to it: anima-small with bf16 storage at max_resident 0.5 (block 0 resident) ran 1.107-1.112x
// its floor in three runs, and its check forward missed the plan's prediction by 10%.
//
// On the CPU device the copy rate is set from the measured fp8 resident step so that
// streaming every streamable byte takes --copy-ratio times the compute (default 1.5:
// anima-2b at 1024^2 on an H200 over PCIe Gen5 is about 38 ms of copy against 25 ms of
// compute, from published bus and compute figures). The CPU device uses one intra-op
// thread, because its copy worker needs the other core (offload/device/cpu_device.h).
//
//   sluice_bench_pipeline [--device cpu|cuda[:N]] [--presets anima-small,anima-medium]
//                         [--resolutions 256,...] [--reps N] [--warmup N] [--copy-ratio R]
//                         [--prefetch auto|N] [--policy balanced|spread|front_first]
//                         [--fractions F,F] [--budgets SIZE,SIZE] [--storages float8_e4m3fn,bfloat16]
//                         [--no-bf16] [--markdown]
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "cache/model_cache.h"
#include "models/anima/anima.h"
#include "models/anima/generator.h"
#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "offload/layer/storage.h"
#include "runtime/dtype_policy.h"
#include "runtime/error.h"
#include "runtime/hardware.h"
#include "runtime/logging.h"
#include "runtime/size_parse.h"

using namespace sluice;
using namespace sluice::offload;

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string device = "cpu";                  // cpu (CPU-as-device, slowed copy) or cuda[:N]
  std::vector<std::string> presets;            // default: anima-small,anima-medium (cpu), anima-2b (gpu)
  std::vector<int64_t> resolutions;            // pixels (latent = px / 8); default 256 (cpu), 1024,512 (gpu)
  int reps = 5;                                // timed steps per row
  int warmup = 4;                              // untimed steps per row (order, calibration, ring warm-up, check)
  double copy_ratio = 1.5;                     // CPU device: streaming all streamable fp8 bytes = this many computes
  uint32_t prefetch = kPrefetchAuto;           // engine prefetch bound
  ResidencyPolicy policy = ResidencyPolicy::balanced;
  std::vector<std::string> storages = {"float8_e4m3fn"};  // streamed storage dtypes
  std::vector<double> fractions = {0.75, 0.5, 0.25, 0.0};  // max_resident rows
  std::vector<uint64_t> budgets;               // byte-budget rows (device bytes, working memory included)
  bool bf16_row = true;                        // include the bf16 resident row
  bool markdown = false;                       // print tables as markdown
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr, "sluice_bench_pipeline: %s\n", why.c_str());
  std::fprintf(stderr,
               "usage: sluice_bench_pipeline [--device cpu|cuda[:N]] [--presets a,b] [--resolutions px,px] "
               "[--reps N] [--warmup N] [--copy-ratio R] [--prefetch auto|N] [--policy balanced|spread|front_first] "
               "[--fractions F,F] [--budgets SIZE,SIZE] [--storages float8_e4m3fn,bfloat16] [--no-bf16] [--markdown]\n");
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) out.push_back(p);
  return out;
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
      if (k == "--device") {
        a.device = value();
      } else if (k == "--presets") {
        a.presets = split(value());
      } else if (k == "--resolutions") {
        a.resolutions.clear();
        for (const auto& r : split(value())) a.resolutions.push_back(std::stoll(r));
      } else if (k == "--reps") {
        a.reps = std::stoi(value());
      } else if (k == "--warmup") {
        a.warmup = std::stoi(value());
      } else if (k == "--copy-ratio") {
        a.copy_ratio = std::stod(value());
      } else if (k == "--prefetch") {
        a.prefetch = parse_prefetch(value(), "--prefetch");
      } else if (k == "--policy") {
        a.policy = parse_residency_policy(value(), "--policy");
      } else if (k == "--fractions") {
        a.fractions.clear();
        for (const auto& f : split(value())) a.fractions.push_back(std::stod(f));
      } else if (k == "--budgets") {
        a.budgets.clear();
        for (const auto& b : split(value())) a.budgets.push_back(parse_size(b, std::nullopt, "--budgets"));
      } else if (k == "--storages") {
        a.storages = split(value());
        for (const auto& s : a.storages)
          if (s != "float8_e4m3fn" && s != "bfloat16") usage("--storages: float8_e4m3fn or bfloat16, got " + s);
      } else if (k == "--no-bf16") {
        a.bf16_row = false;
      } else if (k == "--markdown") {
        a.markdown = true;
      } else {
        usage("unknown argument " + k);
      }
    } catch (const std::exception& e) {
      usage("bad value for " + k + ": " + e.what());
    }
  }
  const bool cpu = a.device == "cpu";
  if (a.presets.empty()) a.presets = cpu ? std::vector<std::string>{"anima-small", "anima-medium"} : std::vector<std::string>{"anima-2b"};
  if (a.resolutions.empty()) a.resolutions = cpu ? std::vector<int64_t>{256} : std::vector<int64_t>{1024, 512};
  for (int64_t r : a.resolutions)
    if (r < 16 || r % 16 != 0) usage("resolutions must be positive multiples of 16");
  for (double f : a.fractions)
    if (!(f >= 0.0 && f <= 1.0)) usage("--fractions must be between 0 and 1");
  if (a.reps < 1 || a.warmup < 1 || !(a.copy_ratio > 0)) usage("--reps and --warmup must be >= 1, --copy-ratio > 0");
  return a;
}

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// --- Copy rates --------------------------------------------------------------------

struct Bandwidth {
  double pinned = 0;    // host->device from page-locked memory, bytes/s
  double pageable = 0;  // host->device from pageable memory, bytes/s
  double d2d = 0;       // device->device copy, bytes moved (read + written) / s
};

// Best of `reps` copies of `bytes` through the backend's copy stream (what the engine uses).
double h2d_rate(DeviceBackend& dev, const at::Tensor& host, int reps) {
  at::Tensor dst = dev.allocate({host.numel()}, at::kByte, MemoryKind::scratch, "bandwidth probe");
  dev.copy_to_device(dst, host);  // warm-up (first-touch, driver staging buffers)
  dev.synchronize();
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    dev.copy_to_device(dst, host);
    dev.synchronize();
    best = std::min(best, ms_since(t0));
  }
  return static_cast<double>(host.nbytes()) / (best / 1000.0);
}

Bandwidth measure_bandwidth(DeviceBackend& dev, uint64_t bytes) {
  Bandwidth b;
  const at::Tensor pageable = at::ones({static_cast<int64_t>(bytes)}, at::kByte);
  b.pageable = h2d_rate(dev, pageable, 5);
  at::Tensor pinned = dev.pin(pageable);
  b.pinned = pinned.defined() ? h2d_rate(dev, pinned, 5) : b.pageable;
  at::Tensor src = dev.allocate({static_cast<int64_t>(bytes)}, at::kByte, MemoryKind::scratch, "d2d probe");
  at::Tensor dst = dev.allocate({static_cast<int64_t>(bytes)}, at::kByte, MemoryKind::scratch, "d2d probe");
  src.fill_(1);
  dst.copy_(src);
  dev.synchronize();
  double best = 1e300;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = Clock::now();
    dst.copy_(src);
    dev.synchronize();
    best = std::min(best, ms_since(t0));
  }
  b.d2d = 2.0 * static_cast<double>(bytes) / (best / 1000.0);
  return b;
}

// --- Model and rows ----------------------------------------------------------------

// A random-weight model of `name` in bf16, on the host.
anima::AnimaModel make_model(const std::string& name) {
  const anima::AnimaConfig c = anima::preset(name);
  anima::AnimaModel m(c, anima::BuildOptions{at::kBFloat16, at::kCPU});
  auto params = m->named_parameters();
  for (auto& [key, t] : anima::random_weights(c, /*seed=*/1, at::kBFloat16)) params[key].set_data(t);
  return m;
}

// A copy of `src` with its own parameter storage.
anima::AnimaModel clone_model(anima::AnimaModel& src) {
  anima::AnimaModel m(src->config(), anima::BuildOptions{at::kBFloat16, at::kCPU});
  auto dst = m->named_parameters();
  for (const auto& p : src->named_parameters()) dst[p.key()].set_data(p.value().clone());
  return m;
}

void to_fp8(anima::AnimaModel& m) {
  Fp8Options o;
  o.storage = at::kFloat8_e4m3fn;
  o.compute = at::kBFloat16;
  apply_storage(*m, m->config().name, o, anima::declared_fp8_skips());
}

struct Inputs {
  at::Tensor x, t, ctx;
};

// One guided step's model call: a batch of 2 (uncond, cond), as the sampler makes it.
Inputs make_inputs(const anima::AnimaConfig& c, int64_t px, at::Device device) {
  at::Generator gen = at::detail::createCPUGenerator(7);
  const int64_t lat = px / 8;
  Inputs in;
  in.x = at::randn({2, c.in_channels, 1, lat, lat}, gen).to(device, at::kBFloat16);
  in.t = at::full({2}, 0.5f).to(device);
  in.ctx = at::randn({2, c.adapter.output_tokens, c.crossattn_emb_channels}, gen).to(device, at::kBFloat16);
  return in;
}

struct Row {
  std::string label;
  double step_ms = 0;
  double bytes = 0;     // streamed per step
  double gbps = 0;      // achieved H2D, 1e9 B/s
  double stall_ms = 0;  // per step
  double peak_mb = 0;   // engine's device bytes
  std::string map;
  double predicted_ms = 0;  // the plan's prediction (0: none)
  bool recomputed = false;
  double ring_mb = 0;
};

// max_resident set: at most that fraction resident, no budget; unset: `budget` bytes
// (working memory `working` included) decide.
Row run_engine(anima::AnimaModel& model, const Inputs& in, const Args& a, const std::shared_ptr<DeviceBackend>& dev,
               std::optional<double> max_resident, uint64_t budget = 0, uint64_t working = 0) {
  EngineOptions o;
  o.device = dev;
  o.max_resident = max_resident;
  o.budget_bytes = budget;
  o.working_memory_bytes = working;
  o.prefetch_depth = a.prefetch;
  o.policy = a.policy;
  StreamingEngine engine(o);
  engine.attach(*model, model->config().name);
  auto forward = [&] {
    ForwardScope scope(engine, "dit");
    model->forward(in.x, in.t, in.ctx);
  };
  // Back to back, as a sampling loop runs its steps (Note [back-to-back forwards]).
  for (int i = 0; i < a.warmup; ++i) forward();
  dev->synchronize();
  const auto t0 = Clock::now();
  for (int i = 0; i < a.reps; ++i) forward();
  dev->synchronize();
  const EngineStats s = engine.stats();
  Row r;
  r.step_ms = ms_since(t0) / a.reps;
  const size_t n = std::min(s.forward_records.size(), static_cast<size_t>(a.reps));
  for (size_t i = s.forward_records.size() - n; i < s.forward_records.size(); ++i) {
    const auto& f = s.forward_records[i];
    r.bytes += static_cast<double>(f.bytes_streamed) / static_cast<double>(n);
    r.gbps += f.h2d_gbps / static_cast<double>(n);
    r.stall_ms += f.stall_ms / static_cast<double>(n);
  }
  r.peak_mb = static_cast<double>(s.device_memory.total.peak) / 1e6;
  r.map = engine.plan().residency_map();
  if (const PlanKindStats* k = s.plan.step()) r.predicted_ms = k->predicted_step_ms;
  r.recomputed = s.plan.recomputed;
  r.ring_mb = static_cast<double>(s.ring_capacity_bytes) / 1e6;
  if (s.slot_violations != 0)
    std::fprintf(stderr, "warning: %llu staging slot violations\n", static_cast<unsigned long long>(s.slot_violations));
  engine.detach();
  return r;
}

// Bytes a DiT forward streams with nothing resident: the streamable layers outside the
// LLM adapter (which a DiT forward does not run).
uint64_t streamable_bytes(anima::AnimaModel& model) {
  EngineOptions o;
  o.max_resident = 0.0;
  o.timing = false;
  StreamingEngine e(o);
  e.attach(*model, model->config().name);
  uint64_t b = 0;
  const ResidencyPlan& plan = e.plan();
  for (size_t i = 0; i < plan.layers.size(); ++i)
    if (!plan.resident[i] && plan.layers[i].name.rfind("llm_adapter.", 0) != 0) b += plan.layers[i].stored_bytes;
  e.detach();
  return b;
}

void print_table(const std::vector<Row>& rows, double compute_ms, double rate, bool markdown) {
  auto floor_of = [&](const Row& r) { return std::max(compute_ms, r.bytes / rate * 1000.0); };
  auto pred = [](const Row& r, char* buf, size_t n) {
    if (r.predicted_ms > 0) {
      std::snprintf(buf, n, "%.1f%s", r.predicted_ms, r.recomputed ? " R" : "");
    } else {
      std::snprintf(buf, n, "-");
    }
  };
  auto pred_ratio = [](const Row& r) { return r.predicted_ms > 0 ? r.predicted_ms / r.step_ms : 0.0; };
  char p[32];
  if (markdown) {
    std::printf("| config | step ms | MB streamed | H2D GB/s | stall ms | peak dev MB | ring MB | floor ms | /base | /floor "
                "| pred ms | pred/meas |\n");
    std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (const Row& r : rows) {
      pred(r, p, sizeof p);
      std::printf("| %s | %.1f | %.1f | %.2f | %.1f | %.0f | %.1f | %.1f | %.3f | %.3f | %s | %.3f |\n", r.label.c_str(),
                  r.step_ms, r.bytes / 1e6, r.gbps, r.stall_ms, r.peak_mb, r.ring_mb, floor_of(r),
                  r.step_ms / compute_ms, r.step_ms / floor_of(r), p, pred_ratio(r));
    }
    return;
  }
  std::printf("%-18s %9s %11s %9s %9s %11s %8s %9s %7s %7s %10s %9s  %s\n", "config", "step ms", "MB streamed",
              "H2D GB/s", "stall ms", "peak dev MB", "ring MB", "floor ms", "/base", "/floor", "pred ms", "pred/meas",
              "residency");
  for (const Row& r : rows) {
    pred(r, p, sizeof p);
    std::printf("%-18s %9.1f %11.1f %9.2f %9.1f %11.0f %8.1f %9.1f %7.3f %7.3f %10s %9.3f  %s\n", r.label.c_str(),
                r.step_ms, r.bytes / 1e6, r.gbps, r.stall_ms, r.peak_mb, r.ring_mb, floor_of(r), r.step_ms / compute_ms,
                r.step_ms / floor_of(r), p, pred_ratio(r), r.map.c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  const bool cpu = a.device == "cpu";
  if (cpu) at::set_num_threads(1);
  log::set_level(log::Level::warn);
  c10::InferenceMode guard;
  try {
    // Real device: one backend for the whole run. CPU device: one per copy rate, below.
    std::shared_ptr<DeviceBackend> gpu;
    double pinned_rate = 0;
    {
      if (!cpu) gpu = std::shared_ptr<DeviceBackend>(make_device(a.device));
      std::unique_ptr<DeviceBackend> plain_cpu = cpu ? make_cpu_device() : nullptr;
      DeviceBackend& dev = cpu ? *plain_cpu : *gpu;
      std::printf("hardware: %s\n", hardware_summary(dev.device()).c_str());
      const Bandwidth bw = measure_bandwidth(dev, 256ull << 20);
      std::printf("device %s: H2D pinned %.2f GB/s, H2D pageable %.2f GB/s, D2D %.1f GB/s (read + write)%s\n",
                  dev.name().c_str(), bw.pinned / 1e9, bw.pageable / 1e9, bw.d2d / 1e9,
                  cpu ? " [CPU device, unslowed: memcpy; pinning is a no-op]" : "");
      pinned_rate = bw.pinned;
    }

    for (const auto& name : a.presets) {
     for (const auto& storage : a.storages) {
      const bool fp8 = storage == "float8_e4m3fn";
      anima::AnimaModel bf16 = make_model(name);
      anima::AnimaModel model = fp8 ? clone_model(bf16) : bf16;
      if (fp8) to_fp8(model);
      if (!a.bf16_row || !fp8) bf16 = nullptr;
      for (const int64_t px : a.resolutions) {
        const Inputs in = make_inputs(model->config(), px, gpu ? gpu->device() : at::Device(at::kCPU));
        std::vector<Row> rows;
        const auto unslowed = cpu ? std::shared_ptr<DeviceBackend>(make_cpu_device()) : gpu;
        if (bf16) {
          Row r = run_engine(bf16, in, a, unslowed, 1.0);
          r.label = "bf16 resident";
          rows.push_back(r);
        }
        const uint64_t streamable = streamable_bytes(model);
        Row base = run_engine(model, in, a, unslowed, 1.0);
        base.label = fp8 ? "fp8 resident" : "bf16 resident";
        rows.push_back(base);
        const double compute_ms = base.step_ms;
        double rate = pinned_rate;
        std::shared_ptr<DeviceBackend> dev = gpu;
        if (cpu) {
          // The bus: all streamable fp8 bytes in copy-ratio x the fp8 compute. bf16 storage
          // rides the same bus with twice the bytes (measured here from its own compute, so
          // the fp8 run's rate is reproduced only approximately: fp8 and bf16 compute match
          // closely on the CPU, upcast aside).
          const double fp8_bytes = fp8 ? static_cast<double>(streamable) : static_cast<double>(streamable) / 2.0;
          rate = fp8_bytes / (a.copy_ratio * compute_ms / 1000.0);
          CpuDeviceOptions d;
          d.copy_bytes_per_second = rate;
          dev = std::shared_ptr<DeviceBackend>(make_cpu_device(d));
        }
        for (double f : a.fractions) {
          Row r = run_engine(model, in, a, dev, f);
          char label[64];
          std::snprintf(label, sizeof label, "%s max_res %.2f", fp8 ? "fp8" : "bf16", f);
          r.label = label;
          rows.push_back(r);
        }
        for (uint64_t b : a.budgets) {
          const std::string label = "budget " + format_bytes(b);
          try {
            Row r = run_engine(model, in, a, dev, std::nullopt, b, cache::default_working_memory(b, px));
            r.label = label;
            rows.push_back(r);
          } catch (const ResourceError& e) {
            std::printf("%s: does not fit: %s\n", label.c_str(), e.what());
          }
        }
        std::printf("\n%s at %lldx%lld px (latent %lld), %s storage, batch 2 (cfg), bf16 compute, prefetch %s, %s policy, %s\n",
                    name.c_str(), static_cast<long long>(px), static_cast<long long>(px),
                    static_cast<long long>(px / 8), storage.c_str(), prefetch_name(a.prefetch).c_str(),
                    residency_policy_name(a.policy), a.device.c_str());
        std::printf("streamable (DiT) %.1f MB %s; H2D rate for the floor %.2f GB/s%s; compute (resident) %.1f ms\n",
                    static_cast<double>(streamable) / 1e6, storage.c_str(), rate / 1e9,
                    cpu ? " (slowed copy: all streamable fp8 bytes = copy-ratio x compute)" : " (pinned, measured)",
                    compute_ms);
        print_table(rows, compute_ms, rate, a.markdown);
        std::fflush(stdout);
      }
     }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sluice_bench_pipeline: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
