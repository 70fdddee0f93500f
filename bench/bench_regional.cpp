// The step-time cost of regional prompting (README "Regional prompting"): one DiT forward of
// anima-small through the public API (fp8 storage, compute auto) with and without a
// cross-attention mask on the even blocks (the default), fully resident and at 0.5 residency
// on the CPU device. The mask splits the image into a left and a right region, each attending
// to its own half of the context tokens, as two regional prompts do. Each iteration runs the
// plain forward and the masked one back to back on the same locked model; the counters are
// the ratio masked / plain: best-of (preemption inflates means, not minima) and of the means.
//
//   sluice_bench_regional [--benchmark_filter=...]
#include <ATen/ATen.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <string>

#include "bench/benchmark_main.h"
#include "sluice/sluice.hpp"

namespace {

constexpr const char* kPreset = "anima-small";  // width 256, 8 blocks
constexpr int64_t kContextTokens = 64;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// [L, S] for a latent hw x hw: image tokens in the left half of the token grid attend to the
// first half of the context, the others to the second half.
at::Tensor two_region_mask(int64_t hw, int64_t patch) {
  const int64_t side = (hw + patch - 1) / patch;
  const at::Tensor column = at::arange(side).repeat({side});  // token l's column, row-major grid
  const at::Tensor left = column.lt(side / 2).unsqueeze(1);   // [L, 1]
  const at::Tensor first_half = at::arange(kContextTokens).lt(kContextTokens / 2).unsqueeze(0);  // [1, S]
  return left.eq(first_half);
}

// Args: {latent H = W, resident percent}.
void BM_RegionalStep(benchmark::State& state) {
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
  const at::Tensor ctx = at::randn({1, kContextTokens, info.context_dim});
  sluice::ForwardOptions masked;
  masked.cross_attn_mask = two_region_mask(hw, info.patch_spatial);
  for (int w = 0; w < 2; ++w) {  // warm-up: allocator, kernels
    m(x, t, ctx);
    m.forward(x, t, ctx, masked);
  }
  // A mask that changed nothing would time the plain forward twice.
  if (at::allclose(m(x, t, ctx).to(at::kFloat), m.forward(x, t, ctx, masked).to(at::kFloat))) {
    state.SkipWithError("the masked forward equals the plain one: the mask is not applied");
    return;
  }
  double best_plain = 1e30, best_masked = 1e30, sum_plain = 0, sum_masked = 0;
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(m(x, t, ctx));
    const double p = ms_since(t0);
    t0 = std::chrono::steady_clock::now();
    benchmark::DoNotOptimize(m.forward(x, t, ctx, masked));
    const double r = ms_since(t0);
    best_plain = std::min(best_plain, p);
    best_masked = std::min(best_masked, r);
    sum_plain += p;
    sum_masked += r;
  }
  const double n = static_cast<double>(state.iterations());
  state.counters["plain_ms"] = best_plain;
  state.counters["masked_ms"] = best_masked;
  state.counters["ratio"] = best_masked / best_plain;
  state.counters["ratio_mean"] = (sum_masked / n) / (sum_plain / n);
  state.counters["streamed_layers"] = static_cast<double>(model.stats().streamed_layers);
  state.SetLabel(std::string(kPreset) + " " + info.storage_dtype + "/" + info.compute_dtype + ", mask [" +
                 std::to_string(masked.cross_attn_mask->size(0)) + ", " + std::to_string(kContextTokens) +
                 "] on the even blocks, resident " + std::to_string(state.range(1)) + "%");
}

BENCHMARK(BM_RegionalStep)
    ->ArgNames({"hw", "resident_pct"})
    ->ArgsProduct({{32, 64}, {100, 50}})
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) { return sluice::bench::run_benchmarks(argc, argv, at::Device(at::kCPU)); }
