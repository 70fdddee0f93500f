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

#include <string>

#include "bench/benchmark_main.h"
#include "bench/paired_step.h"
#include "sluice/sluice.hpp"

namespace {

constexpr const char* kPreset = "anima-small";  // width 256, 8 blocks
constexpr int64_t kContextTokens = 64;

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
  sluice::bench::StepModel s(kPreset, static_cast<double>(state.range(1)) / 100.0, hw, kContextTokens);
  sluice::ForwardOptions options;
  options.cross_attn_mask = two_region_mask(hw, s.info.patch_spatial);
  auto plain = [&] { return s.locked(s.in.x, s.in.t, s.in.ctx); };
  auto masked = [&] { return s.locked.forward(s.in.x, s.in.t, s.in.ctx, options); };
  // A mask that changed nothing would time the plain forward twice.
  if (at::allclose(plain().to(at::kFloat), masked().to(at::kFloat))) {
    state.SkipWithError("the masked forward equals the plain one: the mask is not applied");
    return;
  }
  sluice::bench::PairedTimes::run(state, plain, masked, "masked");
  state.counters["streamed_layers"] = static_cast<double>(s.model.stats().streamed_layers);
  state.SetLabel(std::string(kPreset) + " " + s.info.storage_dtype + "/" + s.info.compute_dtype + ", mask [" +
                 std::to_string(options.cross_attn_mask->size(0)) + ", " + std::to_string(kContextTokens) +
                 "] on the even blocks, resident " + std::to_string(state.range(1)) + "%");
}

BENCHMARK(BM_RegionalStep)->Apply(sluice::bench::step_grid);

}  // namespace

int main(int argc, char** argv) { return sluice::bench::run_benchmarks(argc, argv, at::Device(at::kCPU)); }
