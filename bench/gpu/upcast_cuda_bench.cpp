// CUDA fp8 -> bf16 upcast kernel against a device-to-device copy of the same bytes moved.
//
// Bytes moved = reads + writes: the upcast reads 1 and writes 2 bytes per element; the copy
// baseline copies 1.5 bytes per element (reads 1.5, writes 1.5). Both are timed with CUDA
// events on the current stream, so host overhead is excluded. BM_gpu_upcast_vs_copy prints
// the ratio (goal >= 0.8). ATen's own fp8 .to() is shown for comparison.
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>

#include <functional>

#include "bench/benchmark_main.h"
#include "offload/device/upcast_registry.h"
#include "runtime/fp8.h"

namespace {

constexpr int64_t kMiB = 1024 * 1024;

bool ready(benchmark::State& state) {
  if (!at::hasCUDA()) {
    state.SkipWithError("no CUDA device");
    return false;
  }
  sluice::offload::register_cuda_kernels();
  return true;
}

// Milliseconds of `fn` on the current stream, measured with events.
double time_ms(const std::function<void()>& fn) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start, stream);
  fn();
  cudaEventRecord(stop, stream);
  cudaEventSynchronize(stop);
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms;
}

struct Buffers {
  at::Tensor fp8, out, src, dst, scale;
  explicit Buffers(int64_t n) {
    const auto cuda = at::TensorOptions().device(at::kCUDA);
    fp8 = at::randint(0, 256, {n}, cuda.dtype(at::kInt)).to(at::kByte).view(at::kFloat8_e4m3fn);
    out = at::empty({n}, cuda.dtype(at::kBFloat16));
    src = at::ones({n + n / 2}, cuda.dtype(at::kByte));
    dst = at::empty({n + n / 2}, cuda.dtype(at::kByte));
    scale = at::rand({4096}, cuda.dtype(at::kFloat)) + 0.5;
  }
  void copy() const {
    cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.numel(), cudaMemcpyDeviceToDevice,
                    at::cuda::getCurrentCUDAStream().stream());
  }
};

void run(benchmark::State& state, const std::function<void(const Buffers&)>& fn) {
  if (!ready(state)) return;
  const int64_t n = state.range(0) * kMiB;
  const Buffers b(n);
  fn(b);  // warm-up
  for (auto _ : state) state.SetIterationTime(time_ms([&] { fn(b); }) / 1e3);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 3 * n);
}

void BM_gpu_d2d_copy(benchmark::State& state) {
  run(state, [](const Buffers& b) { b.copy(); });
}
void BM_gpu_upcast(benchmark::State& state) {
  run(state, [](const Buffers& b) { sluice::upcast_into(b.fp8, at::Tensor(), b.out); });
}
void BM_gpu_upcast_scaled_rows(benchmark::State& state) {
  run(state, [](const Buffers& b) { sluice::upcast_into(b.fp8.view({4096, -1}), b.scale, b.out); });
}
void BM_gpu_aten_to(benchmark::State& state) {
  run(state, [](const Buffers& b) { b.out.copy_(b.fp8); });
}

void BM_gpu_upcast_vs_copy(benchmark::State& state) {
  if (!ready(state)) return;
  const int64_t n = state.range(0) * kMiB;
  const Buffers b(n);
  sluice::upcast_into(b.fp8, at::Tensor(), b.out);
  b.copy();
  double up = 0, cp = 0;
  for (auto _ : state) {
    const double u = time_ms([&] { sluice::upcast_into(b.fp8, at::Tensor(), b.out); });
    const double c = time_ms([&] { b.copy(); });
    up += u;
    cp += c;
    state.SetIterationTime((u + c) / 1e3);
  }
  const double moved = 3.0 * static_cast<double>(n) * static_cast<double>(state.iterations());
  state.counters["upcast_GBps"] = moved / (up / 1e3) / 1e9;
  state.counters["copy_GBps"] = moved / (cp / 1e3) / 1e9;
  state.counters["ratio"] = cp / up;
}

}  // namespace

// range(0): MiB of fp8 input.
BENCHMARK(BM_gpu_d2d_copy)->Arg(64)->Arg(256)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_gpu_upcast)->Arg(64)->Arg(256)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_gpu_upcast_scaled_rows)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_gpu_aten_to)->Arg(64)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_gpu_upcast_vs_copy)->Arg(64)->Arg(256)->UseManualTime()->Unit(benchmark::kMicrosecond);

int main(int argc, char** argv) { return sluice::bench::run_benchmarks(argc, argv, at::Device(at::kCUDA, 0)); }
