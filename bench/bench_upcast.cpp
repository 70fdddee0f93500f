// CPU fp8 -> bf16 upcast throughput against std::memcpy of the same bytes moved.
//
// "Bytes moved" counts reads plus writes: the upcast reads 1 byte and writes 2 per element
// (3 B/element); a memcpy of B bytes reads B and writes B (2B). The memcpy baseline copies
// 1.5 bytes per upcast element so both move the same number of bytes, and runs in the same
// process on the same buffers, single-threaded like std::memcpy. Counters report bytes
// moved per second; BM_upcast_vs_memcpy prints the ratio directly (goal >= 0.5).
// Threaded variants show what at::parallel_for adds; the ATen .to() row is the baseline the
// table replaces.
#include <benchmark/benchmark.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <cstring>
#include <vector>

#include "bench/benchmark_main.h"
#include "runtime/fp8.h"

namespace {

constexpr int64_t kMiB = 1024 * 1024;

struct Buffers {
  at::Tensor fp8;    // n fp8 values
  at::Tensor out;    // n bf16 values
  std::vector<uint8_t> src, dst;  // memcpy buffers of 1.5 n bytes
};

Buffers& buffers(int64_t n) {
  static std::map<int64_t, Buffers> cache;
  auto it = cache.find(n);
  if (it != cache.end()) return it->second;
  Buffers b;
  b.fp8 = at::randint(0, 256, {n}, at::kInt).to(at::kByte).view(at::kFloat8_e4m3fn);
  b.out = at::empty({n}, at::kBFloat16);
  b.out.zero_();  // touch every page before timing
  b.src.assign(static_cast<size_t>(n + n / 2), 1);
  b.dst.assign(static_cast<size_t>(n + n / 2), 0);
  return cache.emplace(n, std::move(b)).first->second;
}

// CPU time of the calling thread: unlike wall time it does not count the time this thread
// spends preempted, which dominates on a shared machine. Valid here because both sides run
// on this thread alone (at::set_num_threads(1) runs parallel_for inline).
double thread_cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void set_moved(benchmark::State& state, int64_t n) {
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 3 * n);
}

void BM_memcpy(benchmark::State& state) {
  const int64_t n = state.range(0) * kMiB;
  Buffers& b = buffers(n);
  for (auto _ : state) {
    std::memcpy(b.dst.data(), b.src.data(), b.src.size());
    benchmark::ClobberMemory();
  }
  set_moved(state, n);
}

void BM_upcast_table(benchmark::State& state) {
  const int64_t n = state.range(0) * kMiB;
  const int threads = static_cast<int>(state.range(1));
  Buffers& b = buffers(n);
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  for (auto _ : state) {
    sluice::upcast_into(b.fp8, at::Tensor(), b.out);
    benchmark::ClobberMemory();
  }
  at::set_num_threads(before);
  set_moved(state, n);
}

void BM_upcast_aten(benchmark::State& state) {
  const int64_t n = state.range(0) * kMiB;
  const int threads = static_cast<int>(state.range(1));
  Buffers& b = buffers(n);
  const int before = at::get_num_threads();
  at::set_num_threads(threads);
  for (auto _ : state) {
    b.out.copy_(b.fp8);  // ATen's fp8 -> bf16 conversion into the same buffer
    benchmark::ClobberMemory();
  }
  at::set_num_threads(before);
  set_moved(state, n);
}

void BM_upcast_scaled(benchmark::State& state) {
  const int64_t n = state.range(0) * kMiB;
  Buffers& b = buffers(n);
  const at::Tensor fp8 = b.fp8.view({4096, -1});
  const at::Tensor scale = at::rand({4096}) + 0.5;
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  for (auto _ : state) {
    sluice::upcast_into(fp8, scale, b.out);
    benchmark::ClobberMemory();
  }
  at::set_num_threads(before);
  set_moved(state, n);
}

// Times both in alternation in one loop and reports upcast bandwidth / memcpy bandwidth,
// single-threaded: the ratio the goal is stated in.
void BM_upcast_vs_memcpy(benchmark::State& state) {
  const int64_t n = state.range(0) * kMiB;
  Buffers& b = buffers(n);
  const int before = at::get_num_threads();
  at::set_num_threads(1);
  double t_upcast = 0, t_memcpy = 0, best_upcast = 1e30, best_memcpy = 1e30, cpu_upcast = 0, cpu_memcpy = 0;
  using clock = std::chrono::steady_clock;
  for (auto _ : state) {
    const double c0 = thread_cpu_seconds();
    auto t0 = clock::now();
    sluice::upcast_into(b.fp8, at::Tensor(), b.out);
    benchmark::ClobberMemory();
    auto t1 = clock::now();
    const double c1 = thread_cpu_seconds();
    std::memcpy(b.dst.data(), b.src.data(), b.src.size());
    benchmark::ClobberMemory();
    auto t2 = clock::now();
    const double c2 = thread_cpu_seconds();
    cpu_upcast += c1 - c0;
    cpu_memcpy += c2 - c1;
    const double u = std::chrono::duration<double>(t1 - t0).count();
    const double m = std::chrono::duration<double>(t2 - t1).count();
    t_upcast += u;
    t_memcpy += m;
    best_upcast = std::min(best_upcast, u);
    best_memcpy = std::min(best_memcpy, m);
  }
  at::set_num_threads(before);
  const double moved = 3.0 * static_cast<double>(n) * static_cast<double>(state.iterations());
  state.counters["upcast_GBps"] = moved / t_upcast / 1e9;
  state.counters["memcpy_GBps"] = moved / t_memcpy / 1e9;
  state.counters["ratio_mean"] = t_memcpy / t_upcast;
  state.counters["ratio_cpu"] = cpu_memcpy / cpu_upcast;
  // Best-of ratio: on a shared machine preemption inflates the means, not the minima.
  state.counters["ratio"] = best_memcpy / best_upcast;
}

}  // namespace

// range(0): MiB of fp8 input; range(1): threads.
BENCHMARK(BM_memcpy)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_upcast_table)->Args({64, 1})->Args({64, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_upcast_scaled)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_upcast_aten)->Args({64, 1})->Args({64, 2})->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_upcast_vs_memcpy)->Arg(64)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);

int main(int argc, char** argv) {
  return sluice::bench::run_benchmarks(argc, argv, at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
}
