#pragma once
// A DiT step with and without one feature, timed back to back in every iteration on the same
// locked model, so that each ratio compares two forwards of the same moment of the machine
// (bench_lllite: an adapter, bench_regional: a cross-attention mask). The model is an Anima
// preset on the CPU device (random weights, fp8 storage, compute auto) under a residency.
#include <ATen/ATen.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "sluice/sluice.hpp"

namespace sluice::bench {

// Seeded inputs of one step: latent x [1, C, 1, hw, hw], t [1] = 0.5, context [1, tokens, D].
struct StepInputs {
  at::Tensor x, t, ctx;
};

// `preset` in a cache on the CPU device (no host-memory limit) with max_resident `resident`
// (1.0: as much as the budget holds), locked, and the inputs of one step.
struct StepModel {
  sluice::ModelCache cache;
  sluice::Model model;
  sluice::LockedModel locked;
  sluice::ModelInfo info;
  StepInputs in;

  StepModel(const std::string& preset, double resident, int64_t hw, int64_t context_tokens)
      : cache(cpu_runtime()), model(load(cache, preset, resident)), locked(model.lock()), info(locked.info()) {
    at::manual_seed(0);
    in = {at::randn({1, info.in_channels, 1, hw, hw}), at::full({1}, 0.5),
          at::randn({1, context_tokens, info.context_dim})};
  }

 private:
  static sluice::RuntimeOptions cpu_runtime() {
    sluice::RuntimeOptions ro;
    ro.device = "cpu";
    ro.ram_limit = "0";
    return ro;
  }
  static sluice::Model load(sluice::ModelCache& cache, const std::string& preset, double resident) {
    sluice::LoadOptions lo;
    if (resident < 1.0) lo.max_resident = resident;
    return cache.load(preset, lo);
  }
};

// Best-of and mean milliseconds of the plain step and the variant's, and their ratios as
// counters: best-of (preemption inflates means, not minima) and of the means.
class PairedTimes {
 public:
  // Two warm-up runs of each (allocator, kernels, caches), then one timed pair per iteration,
  // and the counters.
  template <class Plain, class Variant>
  static void run(benchmark::State& state, Plain&& plain, Variant&& variant, const std::string& variant_name) {
    for (int w = 0; w < 2; ++w) {
      plain();
      variant();
    }
    PairedTimes times;
    for (auto _ : state) times.time(plain, variant);
    times.report(state, variant_name);
  }

  template <class Plain, class Variant>
  void time(Plain&& plain, Variant&& variant) {
    const double p = ms(plain), v = ms(variant);
    best_plain_ = std::min(best_plain_, p);
    best_variant_ = std::min(best_variant_, v);
    sum_plain_ += p;
    sum_variant_ += v;
  }
  // Counters "plain_ms", "<variant>_ms", "ratio" (best-of) and "ratio_mean".
  void report(benchmark::State& state, const std::string& variant) const {
    state.counters["plain_ms"] = best_plain_;
    state.counters[variant + "_ms"] = best_variant_;
    state.counters["ratio"] = best_variant_ / best_plain_;
    state.counters["ratio_mean"] = sum_variant_ / sum_plain_;  // the same count of each
  }

 private:
  template <class F>
  static double ms(F&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(f());
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  double best_plain_ = 1e30, best_variant_ = 1e30, sum_plain_ = 0, sum_variant_ = 0;
};

// The grid of both benchmarks, `BENCHMARK(BM_X)->Apply(sluice::bench::step_grid)`: latents
// 32x32 and 64x64, fully resident and at 0.5, 5 iterations, wall-clock milliseconds.
inline void step_grid(benchmark::internal::Benchmark* b) {
  b->ArgNames({"hw", "resident_pct"})
      ->ArgsProduct({{32, 64}, {100, 50}})
      ->Iterations(5)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

}  // namespace sluice::bench
