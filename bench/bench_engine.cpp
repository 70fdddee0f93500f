// sluice_bench_engine: the streaming engine's overhead, and its pipeline on the CPU device.
//   forward/plain              the toy model with no provider (the baseline)
//   forward/engine_resident    the same model through the engine, every layer resident
//   pipeline/<pct>/<policy>    CPU device with a slowed copy, max_resident = pct %
// After the runs it prints engine_resident / plain (goal <= 1.03) and, for the pipeline,
// each step time against the floor max(compute, streamed bytes / copy rate).
//
// The copy rate is set from the measured compute time so that streaming every block
// layer takes twice as long as computing the whole model: the floor then moves from
// copy-bound (0 % resident) to compute-bound (>= 50 %).
//
// One intra-op thread: the CPU device's copy worker needs the other core (see
// offload/device/cpu_device.h), and a single thread makes the plain/engine ratio steadier.
//   sluice_bench_engine [--benchmark_filter=...] [--benchmark_min_time=...]
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <string>

#include "offload/device/cpu_device.h"
#include "offload/engine/engine.h"
#include "runtime/hardware.h"
#include "runtime/logging.h"
#include "tests/support/toy_model.h"

using namespace sluice::offload;
using sluice::testing::ToyModel;
using sluice::testing::ToyOptions;

namespace {

ToyOptions model_options() {
  ToyOptions o;
  o.blocks = 8;
  o.dim = 512;
  o.hidden = 1024;
  return o;
}

at::Tensor model_input() {
  at::Generator gen = at::detail::createCPUGenerator(1);
  return at::randn({32, model_options().dim}, gen);
}

struct PipelineResult {
  double streamed_bytes = 0;
  double stall_ms = 0;
  double h2d_gbps = 0;
  std::string map;
};

std::map<std::string, double> g_ms;                 // mean real time per run, ms
std::map<std::string, PipelineResult> g_pipeline;   // engine stats per pipeline run
double g_copy_rate = 0;                             // bytes per second of the slowed copy

class CaptureReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (!r.error_occurred && r.run_type == Run::RT_Iteration) {
        std::string name = r.benchmark_name();
        const std::string suffix = "/real_time";
        if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
          name.resize(name.size() - suffix.size());
        }
        g_ms[name] = r.GetAdjustedRealTime() * benchmark::GetTimeUnitMultiplier(benchmark::kMillisecond) /
                                   benchmark::GetTimeUnitMultiplier(r.time_unit);
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

void BM_Plain(benchmark::State& state) {
  c10::InferenceMode guard;
  ToyModel model(model_options());
  const at::Tensor x = model_input();
  for (auto _ : state) benchmark::DoNotOptimize(model->forward(x));
}

void BM_EngineResident(benchmark::State& state) {
  c10::InferenceMode guard;
  ToyModel model(model_options());
  const at::Tensor x = model_input();
  EngineOptions o;
  o.budget_bytes = 4ull << 30;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  if (engine.plan().streamed_count() != 0) state.SkipWithError("not fully resident");
  for (auto _ : state) {
    ForwardScope scope(engine);
    benchmark::DoNotOptimize(model->forward(x));
  }
}

void BM_Pipeline(benchmark::State& state, std::string name, double max_resident, ResidencyPolicy policy) {
  c10::InferenceMode guard;
  ToyModel model(model_options());
  const at::Tensor x = model_input();
  CpuDeviceOptions dev;
  dev.copy_bytes_per_second = g_copy_rate;
  EngineOptions o;
  o.device = std::shared_ptr<DeviceBackend>(make_cpu_device(dev));
  o.budget_bytes = 4ull << 30;
  o.max_resident = max_resident;
  o.policy = policy;
  StreamingEngine engine(o);
  engine.attach(*model, "toy");
  {
    ForwardScope warm(engine);  // records the order
    model->forward(x);
  }
  for (auto _ : state) {
    ForwardScope scope(engine);
    benchmark::DoNotOptimize(model->forward(x));
  }
  const EngineStats s = engine.stats();
  PipelineResult r;
  r.streamed_bytes = static_cast<double>(engine.plan().streamed_bytes);
  double stall = 0, gbps = 0;
  for (const auto& f : s.forward_records) {
    stall += f.stall_ms;
    gbps += f.h2d_gbps;
  }
  if (!s.forward_records.empty()) {
    r.stall_ms = stall / static_cast<double>(s.forward_records.size());
    r.h2d_gbps = gbps / static_cast<double>(s.forward_records.size());
  }
  r.map = engine.plan().residency_map();
  g_pipeline[name] = r;
}

double time_plain_ms() {
  c10::InferenceMode guard;
  ToyModel model(model_options());
  const at::Tensor x = model_input();
  for (int i = 0; i < 3; ++i) model->forward(x);
  const int n = 10;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) model->forward(x);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / n;
}

uint64_t streamable_bytes() {
  ToyModel model(model_options());
  uint64_t n = 0;
  for (auto& [name, l] : managed_layers(*model)) {
    if (name.rfind("blocks.", 0) == 0) n += static_cast<uint64_t>(l->stored_bytes());
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  at::set_num_threads(1);
  sluice::log::set_level(sluice::log::Level::warn);
  const double compute_ms = time_plain_ms();
  g_copy_rate = static_cast<double>(streamable_bytes()) / (2.0 * compute_ms / 1000.0);

  benchmark::RegisterBenchmark("forward/plain", BM_Plain)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("forward/engine_resident", BM_EngineResident)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  for (int pct : {0, 25, 50, 75, 100}) {
    for (auto policy : {ResidencyPolicy::spread, ResidencyPolicy::front_first}) {
      const std::string name = "pipeline/" + std::to_string(pct) + "/" + residency_policy_name(policy);
      benchmark::RegisterBenchmark(name.c_str(), BM_Pipeline, name, pct / 100.0, policy)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  benchmark::AddCustomContext("hardware", sluice::hardware_summary(at::kCPU));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  CaptureReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  std::printf("\n");
  if (g_ms.count("forward/plain") && g_ms.count("forward/engine_resident")) {
    std::printf("engine_resident / plain = %.3f  (goal <= 1.03)\n",
                g_ms["forward/engine_resident"] / g_ms["forward/plain"]);
  }
  const double compute = g_ms.count("forward/plain") ? g_ms["forward/plain"] : compute_ms;
  std::printf("copy rate %.1f MB/s (streaming all %.1f MB of block layers takes 2x compute)\n", g_copy_rate / 1e6,
              static_cast<double>(streamable_bytes()) / 1e6);
  std::printf("%-28s %9s %9s %7s %9s %8s  %s\n", "pipeline", "step ms", "floor ms", "ratio", "stall ms", "GB/s",
              "residency");
  for (const auto& [name, r] : g_pipeline) {
    if (!g_ms.count(name)) continue;
    const double floor = std::max(compute, r.streamed_bytes / g_copy_rate * 1000.0);
    std::printf("%-28s %9.2f %9.2f %7.2f %9.2f %8.3f  %s\n", name.c_str(), g_ms[name], floor, g_ms[name] / floor,
                r.stall_ms, r.h2d_gbps, r.map.c_str());
  }
  return 0;
}
