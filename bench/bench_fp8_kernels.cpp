// The fused read's byte loops (runtime/fp8_kernels.h, Note [vectorized fp8 loops]) per
// variant, one thread: GB/s of input per core for every variant this CPU runs.
//
//   BM_cast/ISA/INPUT/SIZE   cast_bf16_e4m3fn; GB/s of bf16 read (2 bytes per element)
//   BM_stats/ISA/SIZE        stats_16 (the range check of the table path); GB/s of 16-bit input
//   BM_count/ISA/SIZE        count_masked (the NaN check of fp8 -> fp8 reads); GB/s of bytes
// INPUT is "dit" (randn * 0.02, as generated DiT weights: 56% below 2^-6, the e4m3fn
// denormals) or "wide" (randn * 10: 99.9% normal in e4m3fn, none beyond 448).
// SIZE is "1MiB" (one fused-read chunk, as a load casts it: in L2 on most CPUs) or "64MiB"
// (from memory). The CPU line and the variant picked by default are printed first (Google
// Benchmark's context), so every number names its CPU and vector extensions.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "runtime/fp8_kernels.h"
#include "runtime/hardware.h"

namespace k = sluice::fp8_kernels;

namespace {

uint16_t bf16_bits(float f) {  // truncation is fine for test data
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(u >> 16);
}

constexpr uint16_t kMax448 = 0x43E0;  // 448 as bf16

const std::vector<uint16_t>& input(const std::string& kind, int64_t n) {
  static std::vector<uint16_t> dit, wide;
  std::vector<uint16_t>& v = kind == "dit" ? dit : wide;
  if (static_cast<int64_t>(v.size()) < n) {
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, kind == "dit" ? 0.02f : 10.0f);
    v.resize(static_cast<size_t>(n));
    for (auto& x : v) x = bf16_bits(normal(rng));
  }
  return v;
}

// GB of input per second ("GB=24.0/s"), 10^9 bytes: SetBytesProcessed would print GiB/s.
void rate(benchmark::State& state, int64_t bytes_per_iteration) {
  const double gb = static_cast<double>(state.iterations()) * static_cast<double>(bytes_per_iteration) / 1e9;
  state.counters["GB"] = benchmark::Counter(gb, benchmark::Counter::kIsRate);
}

void bm_cast(benchmark::State& state, k::Isa isa, std::string kind, int64_t n) {
  const auto& in = input(kind, n);
  std::vector<uint8_t> out(static_cast<size_t>(n), 1);
  const k::Kernels& kern = k::kernels(isa);
  for (auto _ : state) {
    benchmark::DoNotOptimize(kern.cast_bf16_e4m3fn(in.data(), out.data(), n, kMax448));
    benchmark::ClobberMemory();
  }
  rate(state, 2 * n);
}

void bm_stats(benchmark::State& state, k::Isa isa, int64_t n) {
  const auto& in = input("dit", n);
  const k::Kernels& kern = k::kernels(isa);
  for (auto _ : state) benchmark::DoNotOptimize(kern.stats_16(in.data(), n, kMax448));
  rate(state, 2 * n);
}

void bm_count(benchmark::State& state, k::Isa isa, int64_t n) {
  static std::vector<uint8_t> bytes;
  if (static_cast<int64_t>(bytes.size()) < n) {
    std::mt19937 rng(2);
    bytes.resize(static_cast<size_t>(n));
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  }
  const k::Kernels& kern = k::kernels(isa);
  for (auto _ : state) benchmark::DoNotOptimize(kern.count_masked(bytes.data(), n, 0x7F, 0x7F));
  rate(state, n);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("cpu", sluice::cpu_summary());
  std::string variants;
  for (const k::Isa isa : k::available_isas()) variants += std::string(variants.empty() ? "" : " ") + k::isa_name(isa);
  benchmark::AddCustomContext("fp8 kernel variants", variants + " (default " + k::isa_name(k::active_isa()) + ")");
  const std::pair<const char*, int64_t> sizes[] = {{"1MiB", int64_t{1} << 20}, {"64MiB", int64_t{64} << 20}};
  for (const k::Isa isa : k::available_isas()) {
    const std::string name = k::isa_name(isa);
    for (const auto& [size_name, bytes] : sizes) {
      for (const char* kind : {"dit", "wide"}) {
        benchmark::RegisterBenchmark(("BM_cast/" + name + "/" + kind + "/" + size_name).c_str(), bm_cast, isa,
                                     std::string(kind), bytes / 2);
      }
      benchmark::RegisterBenchmark(("BM_stats/" + name + "/" + size_name).c_str(), bm_stats, isa, bytes / 2);
      benchmark::RegisterBenchmark(("BM_count/" + name + "/" + size_name).c_str(), bm_count, isa, bytes);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
