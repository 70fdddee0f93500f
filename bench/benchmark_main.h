#pragma once
// The main of the Google Benchmark programs: BENCHMARK_MAIN's, with the hardware named in
// the context header (Google Benchmark prints only the clock and the caches), because a
// number without its CPU and vector extensions means little (runtime/hardware.h).
#include <c10/core/Device.h>

#include <benchmark/benchmark.h>

#include "runtime/hardware.h"

namespace sluice::bench {

inline int run_benchmarks(int argc, char** argv, c10::Device device) {
  benchmark::AddCustomContext("hardware", hardware_summary(device));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace sluice::bench
