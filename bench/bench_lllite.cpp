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

#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>

#include "bench/benchmark_main.h"
#include "bench/paired_step.h"
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

// Args: {latent H = W, resident percent}.
void BM_LLLiteStep(benchmark::State& state) {
  const int64_t hw = state.range(0);
  sluice::bench::StepModel s(kPreset, static_cast<double>(state.range(1)) / 100.0, hw, 64);
  sluice::LLLiteHandle ll = s.locked.apply_lllite(adapter_file(), at::rand({3, hw * 8, hw * 8}), 1.0);
  auto plain = [&] {
    ll.set_weight(0.0);  // an exact passthrough: the same bound model gives the plain step
    return s.locked(s.in.x, s.in.t, s.in.ctx);
  };
  auto adapted = [&] {
    ll.set_weight(1.0);
    return s.locked(s.in.x, s.in.t, s.in.ctx);
  };
  sluice::bench::PairedTimes::run(state, plain, adapted, "lllite");  // the warm-up embeds the image once
  state.counters["adapter_MiB"] = static_cast<double>(ll.device_bytes()) / (1 << 20);
  state.counters["streamed_layers"] = static_cast<double>(s.model.stats().streamed_layers);
  state.SetLabel(std::string(kPreset) + " " + s.info.storage_dtype + "/" + s.info.compute_dtype + ", " +
                 std::to_string(ll.bound_layers()) + " layers bound, resident " + std::to_string(state.range(1)) + "%");
}

BENCHMARK(BM_LLLiteStep)->Apply(sluice::bench::step_grid);

}  // namespace

int main(int argc, char** argv) { return sluice::bench::run_benchmarks(argc, argv, at::Device(at::kCPU)); }
