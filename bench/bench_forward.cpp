// Forward time of a small Anima preset on the CPU (and on CUDA when present): the cost
// of one DiT step at a fixed latent size, per run dtype. Weights come from a generated
// checkpoint loaded the way `sluice forward` loads it.
//
//   sluice_bench_forward [--benchmark_filter=...]
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/InferenceMode.h>

#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <unistd.h>

#include "bench/benchmark_main.h"
#include "models/anima/anima.h"
#include "models/anima/checkpoint.h"
#include "models/anima/generator.h"

namespace {

// One generated checkpoint per preset for the whole run, removed at exit. (POSIX calls:
// the torch wheel's exported std::filesystem symbols crash when called from here.)
struct Fixture {
  std::string path;
  ~Fixture() {
    if (!path.empty()) ::unlink(path.c_str());
  }
};

std::string checkpoint_for(const std::string& preset) {
  static std::map<std::string, Fixture> fixtures;
  auto it = fixtures.find(preset);
  if (it == fixtures.end()) {
    const char* tmp = std::getenv("TMPDIR");
    const std::string path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/" + preset + "_bench_" +
                             std::to_string(getpid()) + ".safetensors";
    sluice::anima::write_random_checkpoint(sluice::anima::preset(preset), /*seed=*/1, at::kFloat, path);
    it = fixtures.emplace(preset, Fixture{}).first;
    it->second.path = path;
  }
  return it->second.path;
}

// The runner calls a benchmark function several times while it sizes the iteration
// count: load each (preset, dtype, device) once.
sluice::anima::AnimaModel model_for(const std::string& preset, at::ScalarType dtype, at::Device device) {
  static std::map<std::string, sluice::anima::AnimaModel> models;
  const std::string key = preset + "/" + std::string(c10::toString(dtype)) + "/" + device.str();
  auto it = models.find(key);
  if (it == models.end()) {
    sluice::anima::LoadOptions opts;
    opts.dtype = dtype;
    opts.device = device;
    it = models.emplace(key, sluice::anima::load_anima(checkpoint_for(preset), opts)).first;
  }
  return it->second;
}

// Args: {latent H = W, dtype (0 fp32, 1 bf16), device (0 cpu, 1 cuda)}.
void BM_Forward(benchmark::State& state, const std::string& preset) {
  const int64_t hw = state.range(0);
  const at::ScalarType dtype = state.range(1) == 0 ? at::kFloat : at::kBFloat16;
  const bool cuda = state.range(2) == 1;
  if (cuda && !at::hasCUDA()) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  c10::InferenceMode guard;
  auto model = model_for(preset, dtype, device);
  const auto& cfg = model->config();
  const int64_t B = 1, S = 64;
  at::manual_seed(0);
  const auto fopts = at::TensorOptions().device(device).dtype(dtype);
  const at::Tensor x = at::randn({B, cfg.in_channels, 1, hw, hw}, fopts);
  const at::Tensor t = at::full({B}, 0.5f, at::TensorOptions().device(device));
  const at::Tensor ctx = at::randn({B, S, cfg.crossattn_emb_channels}, fopts);
  model->forward(x, t, ctx);  // warm-up (allocator, kernels)
  for (auto _ : state) {
    at::Tensor v = model->forward(x, t, ctx);
    if (cuda) v.cpu();  // synchronizes
    benchmark::DoNotOptimize(v);
  }
  const int64_t tokens = B * (hw / cfg.patch_spatial) * (hw / cfg.patch_spatial);
  state.counters["tokens"] = static_cast<double>(tokens);
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(tokens * state.iterations()),
                                                  benchmark::Counter::kIsRate);
  state.SetLabel(std::string(preset) + (dtype == at::kFloat ? " fp32" : " bf16") + (cuda ? " cuda" : " cpu"));
}

BENCHMARK_CAPTURE(BM_Forward, anima_small, std::string("anima-small"))
    ->ArgNames({"hw", "bf16", "cuda"})
    ->ArgsProduct({{32}, {0, 1}, {0}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(BM_Forward, anima_small_cuda, std::string("anima-small"))
    ->ArgNames({"hw", "bf16", "cuda"})
    ->ArgsProduct({{32, 128}, {0, 1}, {1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  return sluice::bench::run_benchmarks(argc, argv, at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
}
