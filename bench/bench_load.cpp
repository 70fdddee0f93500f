// Checkpoint load speed against a raw read() of the same file.
//
// Generates a ~1 GiB safetensors file of bf16 tensors shaped like a DiT checkpoint
// (per block: four 2048x2048 attention projections, 8192x2048 and 2048x8192 MLP weights,
// two 2048 norm scales), then times, with the file already in the page cache:
//   BM_RawRead        read() of the whole file into one reused, pre-touched buffer
//   BM_RawReadFresh   read() into fresh host_empty() memory: adds the first-touch faults
//   BM_Load           File::open + to_host_owned(every tensor, its own dtype) + unmap
//   BM_LoadToFloat32  the same with a bf16 -> float32 conversion into the owned copy
// and prints each time / raw read time. All start from a warm page cache, so the ratios
// compare memory work (mapping faults, first touch of new host memory, copies), not disk
// speed. Freeing the loaded weights is outside the timed region.
//
// Measured while writing this (2-core shared VM): BM_Load costs about what
// BM_RawReadFresh does, i.e. the ~260k first-touch page faults of 1 GiB of new memory
// dominate a load; the mapping and ATen's copy add little. Two things tried and dropped:
// MADV_POPULATE_READ on the mapping (slower) and MADV_HUGEPAGE on the new blocks (2-3x
// slower here: THP "madvise" defrag compacts synchronously on a busy host).
//
// Environment (read once here): SLUICE_BENCH_LOAD_MB (file size, default 1024),
// SLUICE_BENCH_DIR (where the file goes, default /tmp). The file is deleted at exit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "runtime/host_memory.h"
#include "runtime/safetensors.h"

namespace st = sluice::safetensors;

namespace {

std::string g_path;   // the generated checkpoint
uint64_t g_size = 0;  // its size in bytes
char g_path_c[4096];  // a copy the signal handler can unlink without allocating

void remove_file() {
  if (g_path_c[0] != 0) {
    ::unlink(g_path_c);
    g_path_c[0] = 0;
  }
}

void on_signal(int sig) {
  if (g_path_c[0] != 0) {
    ::unlink(g_path_c);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void generate(const std::string& path, uint64_t target_bytes) {
  constexpr int64_t kDim = 2048, kMlp = 8192;
  // One source tensor per shape, saved under many names: memory stays small.
  const at::Tensor square = at::full({kDim, kDim}, 0.5, at::kBFloat16);
  const at::Tensor up = at::full({kMlp, kDim}, -1.25, at::kBFloat16);
  const at::Tensor down = at::full({kDim, kMlp}, 2.0, at::kBFloat16);
  const at::Tensor norm = at::ones({kDim}, at::kBFloat16);
  const uint64_t per_block = 4 * square.nbytes() + up.nbytes() + down.nbytes() + 2 * norm.nbytes();
  const uint64_t blocks = std::max<uint64_t>(1, (target_bytes + per_block - 1) / per_block);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (uint64_t b = 0; b < blocks; ++b) {
    const std::string p = "blocks." + std::to_string(b) + ".";
    for (const char* n : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.output_proj"}) {
      tensors.emplace_back(p + n + ".weight", square);
    }
    tensors.emplace_back(p + "mlp.layer1.weight", up);
    tensors.emplace_back(p + "mlp.layer2.weight", down);
    tensors.emplace_back(p + "norm1.weight", norm);
    tensors.emplace_back(p + "norm2.weight", norm);
  }
  st::save(path, tensors, {{"format", "pt"}});
}

// read() of the whole file into `buf`; returns the bytes read.
uint64_t read_whole(const std::string& path, char* buf, uint64_t cap) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return 0;
  }
  uint64_t got = 0;
  while (got < cap) {
    const ssize_t r = ::read(fd, buf + got, std::min<uint64_t>(cap - got, uint64_t{1} << 30));
    if (r <= 0) {
      break;
    }
    got += static_cast<uint64_t>(r);
  }
  ::close(fd);
  return got;
}

int64_t minor_faults() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

void BM_RawRead(benchmark::State& state) {
  std::vector<char> buf(g_size);  // zero-filled: every page is touched before timing
  const int64_t faults0 = minor_faults();
  for (auto _ : state) {
    const uint64_t got = read_whole(g_path, buf.data(), g_size);
    if (got != g_size) {
      state.SkipWithError("short read");
      break;
    }
    benchmark::DoNotOptimize(buf.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_size));
  state.counters["minflt"] = benchmark::Counter(static_cast<double>(minor_faults() - faults0),
                                                benchmark::Counter::kAvgIterations);
}

// Like BM_RawRead, but into fresh host memory each time: the first-touch page faults a
// real load cannot avoid, without any mapping or conversion.
void BM_RawReadFresh(benchmark::State& state) {
  int64_t faults = 0;
  for (auto _ : state) {
    const int64_t f0 = minor_faults();
    at::Tensor buf = sluice::host_empty({static_cast<int64_t>(g_size)}, at::kByte);
    const uint64_t got = read_whole(g_path, static_cast<char*>(buf.data_ptr()), g_size);
    if (got != g_size) {
      state.SkipWithError("short read");
      break;
    }
    benchmark::DoNotOptimize(buf.data_ptr());
    faults += minor_faults() - f0;
    state.PauseTiming();
    buf.reset();
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_size));
  state.counters["minflt"] = benchmark::Counter(static_cast<double>(faults), benchmark::Counter::kAvgIterations);
}

void load(benchmark::State& state, bool to_float) {
  int64_t faults = 0;
  for (auto _ : state) {
    const int64_t f0 = minor_faults();
    std::vector<at::Tensor> owned;
    {
      auto file = st::File::open(g_path);
      owned.reserve(file->tensors().size());
      for (const auto& info : file->tensors()) {
        owned.push_back(sluice::to_host_owned(file->tensor(info.name), to_float ? at::kFloat : info.dtype));
      }
    }  // the File and its views die here: the mapping is gone, the owned copies stay
    benchmark::DoNotOptimize(owned.data());
    faults += minor_faults() - f0;
    state.PauseTiming();
    owned.clear();
    state.ResumeTiming();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * g_size));
  state.counters["minflt"] = benchmark::Counter(static_cast<double>(faults), benchmark::Counter::kAvgIterations);
  state.counters["peakGB"] = static_cast<double>(sluice::host_memory_stats().peak_bytes()) / 1e9;
}

void BM_Load(benchmark::State& state) { load(state, false); }
void BM_LoadToFloat32(benchmark::State& state) { load(state, true); }

BENCHMARK(BM_RawRead)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
BENCHMARK(BM_RawReadFresh)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
BENCHMARK(BM_Load)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
BENCHMARK(BM_LoadToFloat32)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);

// Prints as usual and keeps each benchmark's real time per iteration (seconds).
class RecordingReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> seconds;
  void ReportRuns(const std::vector<Run>& runs) override {
    for (const auto& r : runs) {
      if (!r.error_occurred && r.iterations > 0 && r.run_type == Run::RT_Iteration) {
        const std::string key = r.run_name.function_name + (r.run_name.args.empty() ? "" : "/" + r.run_name.args);
        seconds[key] = r.real_accumulated_time / static_cast<double>(r.iterations);
      }
    }
    ConsoleReporter::ReportRuns(runs);
  }
};

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != 0 ? std::strtoull(v, nullptr, 10) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) {
    return 1;
  }
  const uint64_t mb = env_u64("SLUICE_BENCH_LOAD_MB", 1024);
  const char* dir_env = std::getenv("SLUICE_BENCH_DIR");
  const std::string dir = dir_env != nullptr && *dir_env != 0 ? dir_env : "/tmp";
  g_path = dir + "/sluice_bench_load_" + std::to_string(::getpid()) + ".safetensors";
  std::snprintf(g_path_c, sizeof g_path_c, "%s", g_path.c_str());
  std::atexit(remove_file);
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);

  try {
    generate(g_path, mb << 20);
    g_size = static_cast<uint64_t>(st::File::open(g_path)->file_size());
    // Warm the page cache so every timed pass reads from memory.
    std::vector<char> warm(g_size);
    if (read_whole(g_path, warm.data(), g_size) != g_size) {
      std::cerr << "cannot read back " << g_path << "\n";
      return 1;
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_load: " << e.what() << "\n";
    return 1;
  }
  std::cout << "checkpoint: " << g_path << ", " << g_size / (1 << 20) << " MiB of bf16 tensors; "
            << "page cache warmed before timing, so load/raw compares memory work, not disk. "
            << "ATen intra-op threads: " << at::get_num_threads() << "\n";

  RecordingReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();

  const auto& s = reporter.seconds;
  if (s.count("BM_RawRead") != 0) {
    std::printf("ratios are time per pass over the same %.2f GB; >1 means slower than read()\n",
                static_cast<double>(g_size) / 1e9);
    const double raw = s.at("BM_RawRead");
    std::printf("raw read: %.1f ms (%.2f GB/s)\n", raw * 1e3, static_cast<double>(g_size) / raw / 1e9);
    for (const auto& [name, sec] : s) {
      if (name != "BM_RawRead") {
        std::printf("%-24s / raw read = %5.2f (%.1f ms, %.2f GB/s of checkpoint)\n", name.c_str(), sec / raw,
                    sec * 1e3, static_cast<double>(g_size) / sec / 1e9);
      }
    }
  }
  remove_file();
  return 0;
}
