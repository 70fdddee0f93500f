// The step-time cost of a ControlNet-LLLite adapter (models/anima/lllite.h): one DiT forward of
// anima-small through the public API (fp8 storage, compute auto) with and without an adapter
// on every target of every block, fully resident and at 0.5 residency on the CPU device. Each
// iteration runs the plain forward and the adapter's back to back (the adapter's weight set to
// 0 and back: an exact passthrough, so the same bound model gives both), and the counters are
// the ratio adapter / plain: best-of (preemption inflates means, not minima) and of the means.
// The trunk runs once per image and grid, so a step pays only the modules.
//
//   sluice_bench_lllite [--benchmark_filter=...]
#include <ATen/ATen.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

#include "bench/benchmark_main.h"
#include "runtime/safetensors.h"
#include "sluice/sluice.hpp"
#include "tests/support/lllite_file.h"

namespace {

constexpr const char* kPreset = "anima-small";  // width 256, 8 blocks

// The adapter file, written once per run and removed at exit (POSIX calls: the torch
// wheel's exported std::filesystem symbols crash when called from here).
const std::string& adapter_file() {
  struct File {
    std::string path;
    ~File() {
      if (!path.empty()) ::unlink(path.c_str());
    }
  };
  static File f;
  if (f.path.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    f.path = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/lllite_bench_" + std::to_string(getpid()) +
             ".safetensors";
    sluice::testing::LLLiteFileSpec s;
    s.dim = 256;
    s.blocks = 8;
    s.cond_dim = 64;
    s.emb = 128;
    s.mlp = 64;
    s.resblocks = 2;
    s.aspp = true;
    sluice::safetensors::save(f.path, sluice::testing::lllite_file(s), {});
  }
  return f.path;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Args: {latent H = W, resident percent}.
void BM_LLLiteStep(benchmark::State& state) {
  const int64_t hw = state.range(0);
  const double resident = static_cast<double>(state.range(1)) / 100.0;
  sluice::RuntimeOptions ro;
  ro.device = "cpu";
  ro.ram_limit = "0";
  sluice::ModelCache cache(ro);
  sluice::LoadOptions lo;
  if (resident < 1.0) lo.max_resident = resident;
  sluice::Model model = cache.load(kPreset, lo);
  sluice::LockedModel m = model.lock();
  const sluice::ModelInfo info = m.info();
  at::manual_seed(0);
  const at::Tensor x = at::randn({1, info.in_channels, 1, hw, hw});
  const at::Tensor t = at::full({1}, 0.5);
  const at::Tensor ctx = at::randn({1, 64, info.context_dim});
  const at::Tensor image = at::rand({3, hw * 8, hw * 8});
  sluice::LLLiteHandle ll = m.apply_lllite(adapter_file(), image, 1.0);
  for (int w = 0; w < 2; ++w) {  // warm-up: allocator, kernels, the trunk's embedding
    ll.set_weight(0.0);
    m(x, t, ctx);
    ll.set_weight(1.0);
    m(x, t, ctx);
  }
  double best_plain = 1e30, best_ll = 1e30, sum_plain = 0, sum_ll = 0;
  for (auto _ : state) {
    ll.set_weight(0.0);
    auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(m(x, t, ctx));
    const double p = ms_since(t0);
    ll.set_weight(1.0);
    t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(m(x, t, ctx));
    const double l = ms_since(t0);
    best_plain = std::min(best_plain, p);
    best_ll = std::min(best_ll, l);
    sum_plain += p;
    sum_ll += l;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["plain_ms"] = best_plain;
  state.counters["lllite_ms"] = best_ll;
  state.counters["ratio"] = best_ll / best_plain;
  state.counters["ratio_mean"] = (sum_ll / n) / (sum_plain / n);
  state.counters["adapter_MiB"] = static_cast<double>(ll.device_bytes()) / (1 << 20);
  state.counters["streamed_layers"] = static_cast<double>(model.stats().streamed_layers);
  state.SetLabel(std::string(kPreset) + " " + info.storage_dtype + "/" + info.compute_dtype + ", " +
                 std::to_string(ll.bound_layers()) + " layers bound, resident " + std::to_string(state.range(1)) + "%");
}

BENCHMARK(BM_LLLiteStep)
    ->ArgNames({"hw", "resident_pct"})
    ->ArgsProduct({{32, 64}, {100, 50}})
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return sluice::bench::run_benchmarks(argc, argv, at::Device(at::kCPU)); }
